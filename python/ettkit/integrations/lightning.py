"""PyTorch Lightning: checkpoints through ettkit's ``AsyncCheckpointer`` and ETT phases of a Lightning run.

::

    from ettkit.integrations.lightning import EttkitCheckpointIO, EttCallback
    io = EttkitCheckpointIO("run/ckpt", keep_last=3)
    trainer = L.Trainer(plugins=[io], callbacks=[EttCallback("run"), ModelCheckpoint(every_n_epochs=1)])
    trainer.fit(model, ckpt_path=io.resume_path())   # None on the first attempt: starts fresh

:class:`EttkitCheckpointIO` promises: every ``save_checkpoint`` of Lightning's checkpoint dict is an
``AsyncCheckpointer.save`` of it as step ``global_step`` (tensors into ``rank-<r>.safetensors``, Lightning's
plain values into the non-tensor record, no pickle unless ``allow_pickle=True``); ``save_checkpoint`` returns
once the copies are taken, before anything is written; ``teardown`` waits until every save is durable;
``load_checkpoint`` returns the newest committed step's dict, verified, resharded when the world size
changed (the checkpointer's rules, docs/checkpoint.md). Lightning's file name is not used: a step lives in
the checkpointer's directory, its retention is ``keep_last``, and ``remove_checkpoint`` deletes nothing.
Options of ``AsyncCheckpointer`` (``keep_last``, ``memory_tier``, ``every``, ...) are passed through.

:class:`EttCallback` promises: an ETT recorder open from Lightning's ``setup`` to its ``teardown`` (made
here unless one is open already), Lightning's own phases recorded in it (``pre_train`` from setup to fit
start, ``eval/sanity_check``, ``eval`` for validation, ``shutdown`` from fit end to teardown) and each
optimizer step as an ETT step (``global_step``), so that ``ettkit report RUN_DIR`` reports the run.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO

from ..checkpoint import AsyncCheckpointer, latest_step
from ..errors import InvalidArgumentError
from ._captured_state import CapturedState
from ._phase_track import PhaseTrack

__all__ = ["EttCallback", "EttkitCheckpointIO"]

# The key Lightning's checkpoint dict is saved under in the step's state.
_STATE_KEY = "lightning"


class EttkitCheckpointIO(CheckpointIO):
    """Lightning's checkpoint IO through an ``AsyncCheckpointer`` on ``directory`` (see the module docstring).
    The checkpointer is created at the first save or load, once Lightning has set up the process group."""

    def __init__(self, directory: str | os.PathLike, **checkpointer_options: Any):
        super().__init__()
        self.directory = os.fspath(directory)
        self._options = checkpointer_options
        self._checkpointer: Optional[AsyncCheckpointer] = None
        self._last_saved: Optional[int] = None

    @property
    def checkpointer(self) -> AsyncCheckpointer:
        """The ``AsyncCheckpointer`` the saves go through (created on first use)."""
        if self._checkpointer is None:
            self._checkpointer = AsyncCheckpointer(self.directory, **self._options)
        return self._checkpointer

    def resume_path(self) -> Optional[str]:
        """The newest committed step's directory, for ``trainer.fit(ckpt_path=...)``; ``None`` when there is
        none yet (Lightning then starts fresh)."""
        step = latest_step(self.directory)
        return None if step is None else os.path.join(self.directory, f"step-{step}")

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise InvalidArgumentError(f"EttkitCheckpointIO takes no storage_options (got {storage_options!r}): "
                                       f"give AsyncCheckpointer's options to EttkitCheckpointIO(...)")
        step = checkpoint.get("global_step")
        if type(step) is not int:
            raise InvalidArgumentError(f"Lightning's checkpoint has global_step {step!r}, not an int: ettkit "
                                       f"numbers its steps by it")
        # ModelCheckpoint saves twice at the same step when both a top-k and the "last" file are due: the
        # state is the same, so the step saved first stands.
        if step == self._last_saved:
            return
        self.checkpointer.save(step, {_STATE_KEY: checkpoint})
        self._last_saved = step

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        wanted = os.path.abspath(os.fspath(path))
        newest = self.resume_path()
        if newest is None or wanted not in (os.path.abspath(newest), os.path.abspath(self.directory)):
            raise InvalidArgumentError(f"ckpt_path '{path}' is not the newest committed step of '{self.directory}' "
                                       f"({newest or 'none yet'}): EttkitCheckpointIO resumes from its newest step "
                                       f"(pass io.resume_path())")
        captured = CapturedState()
        restored = self.checkpointer.load_latest({_STATE_KEY: captured})
        if restored is None or not isinstance(captured.value, dict):
            raise InvalidArgumentError(f"'{self.directory}' holds no loadable step with a Lightning checkpoint")
        self._last_saved = restored[0]
        return captured.value

    def remove_checkpoint(self, path: Any) -> None:
        """Deletes nothing: the checkpointer's ``keep_last`` decides which steps stay."""

    def teardown(self) -> None:
        """Waits until every save is durable and closes the checkpointer (a later use opens a new one)."""
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None


class EttCallback(Callback):
    """Records a Lightning run's phases and steps into an ETT recorder (see the module docstring).
    ``run_dir``: where to open one (``run_dir/ett/rank-<r>.jsonl``) unless one is open already; ``None``
    uses the current recorder only."""

    def __init__(self, run_dir: Optional[str | os.PathLike] = None, **recorder_options: Any):
        super().__init__()
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self._options = recorder_options
        self._track = PhaseTrack()

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        options = dict(self._options)
        options.setdefault("rank", trainer.global_rank)
        options.setdefault("world_size", trainer.world_size)
        self._track.open(self.run_dir, **options)
        self._track.begin("pre_train")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._track.end()

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self._track.begin("eval/sanity_check")

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        self._track.end()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._track.begin("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._track.end()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._track.step(trainer.global_step)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._track.begin("shutdown")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._track.close("exception", type(exception).__name__)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._track.end()
        # The checkpoint IO's own teardown (waiting for the last saves) may come after this one, and records
        # into the recorder: a recorder this callback made is closed only after it, here.
        if self._track.owns_recorder and stage == "fit":
            trainer.strategy.checkpoint_io.teardown()
            self._track.close("clean")
