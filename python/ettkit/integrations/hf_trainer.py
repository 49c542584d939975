"""The Hugging Face ``Trainer``: async saves through ettkit and ETT phases, with resume from ettkit's newest step.

::

    from ettkit.integrations.hf_trainer import EttkitTrainerCallback
    cb = EttkitTrainerCallback("run/ckpt", every=100, run_dir="run")     # TrainingArguments(save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_dir())                # None on the first attempt

:class:`EttkitTrainerCallback` promises: at every optimizer step that ``every`` makes due (``should_save``), the
model, optimizer and LR scheduler are saved as ``{"model", "optimizer", "scheduler"}`` by an
``AsyncCheckpointer`` (the call returns once the copies are taken; the write goes on beside training), with
the ``TrainerState`` as JSON in ``extra``; ``on_train_end`` waits until every save is durable. ``resume_dir()``
turns the newest committed step into the directory the Trainer resumes from: the model's weights exported
(:func:`ettkit.integrations.hf_export.export_hf`, every byte verified) and ``trainer_state.json`` (so the
Trainer skips the batches already trained on); the optimizer's and scheduler's state, and the random
generators, are then loaded from the same step, verified, at ``on_train_begin`` (the Trainer reads no pickle).
With ``run_dir``, an ETT recorder is open from the Trainer's construction to the end of training (unless one is
open already), recording ``pre_train``, ``checkpoint_restore``, each optimizer step and ``shutdown``, so that
``ettkit report RUN_DIR`` reports the run. The Trainer's own ``save_strategy`` can stay on beside it.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Optional

from transformers import TrainerCallback

from ..checkpoint import AsyncCheckpointer, latest_step
from ..errors import InvalidArgumentError
from ._phase_track import PhaseTrack
from .hf_export import export_hf

__all__ = ["EttkitTrainerCallback"]

TRAINER_STATE = "trainer_state.json"  # the Trainer's file name for its state (transformers.trainer)


def _state_json(state: Any) -> str:
    """The ``TrainerState`` as the Trainer's own ``trainer_state.json`` holds it (its ``save_to_json``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, TRAINER_STATE)
        state.save_to_json(path)
        with open(path) as f:
            return f.read()


class EttkitTrainerCallback(TrainerCallback):
    """Saves and resumes a ``Trainer`` through an ``AsyncCheckpointer`` on ``directory`` and records its ETT
    phases (see the module docstring). ``every``: as ``AsyncCheckpointer(every=...)`` (steps, a duration or
    ``"auto"``); other ``AsyncCheckpointer`` options are passed through."""

    def __init__(self, directory: str | os.PathLike, *, every: Any = 100, run_dir: Optional[str | os.PathLike] = None,
                 **checkpointer_options: Any):
        self.directory = os.fspath(directory)
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self._every = every
        self._options = checkpointer_options
        self._checkpointer: Optional[AsyncCheckpointer] = None
        self._track = PhaseTrack()
        self._resume_step: Optional[int] = None

    @property
    def checkpointer(self) -> AsyncCheckpointer:
        """The ``AsyncCheckpointer`` the saves go through (created on first use, in the recorder's scope)."""
        if self._checkpointer is None:
            self._checkpointer = AsyncCheckpointer(self.directory, every=self._every, **self._options)
        return self._checkpointer

    def resume_dir(self) -> Optional[str]:
        """The directory to pass as ``trainer.train(resume_from_checkpoint=...)``, made from the newest
        committed step (``DIRECTORY/hf-resume-<step>``); ``None`` when no step is committed yet."""
        step = latest_step(self.directory)
        if step is None:
            return None
        recorder = self._track.recorder
        scope = recorder.phase("checkpoint_restore") if recorder is not None else None
        try:
            step_dir = os.path.join(self.directory, f"step-{step}")
            restored = self.checkpointer.load_latest({}, partial=True)  # reads the step's extra only
            if restored is None or restored[0] != step or not isinstance(restored[1], dict) \
                    or not isinstance(restored[1].get("trainer_state"), str):
                raise InvalidArgumentError(f"'{step_dir}' is not a step saved by EttkitTrainerCallback (its extra "
                                           f"has no trainer_state)")
            out = os.path.join(self.directory, f"hf-resume-{step}")
            # Every tensor as saved (tied ones too): the Trainer loads the file with strict names.
            export_hf(step_dir, out, strip_prefix="model.", tied={}, overwrite=True)
            json.loads(restored[1]["trainer_state"])  # refuse a malformed state here, naming the step
            with open(os.path.join(out, TRAINER_STATE), "w") as f:
                f.write(restored[1]["trainer_state"])
        finally:
            if scope is not None:
                scope.end()
        self._resume_step = step
        return out

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._track.open(self.run_dir, rank=args.process_index, world_size=args.world_size)
        self._track.begin("pre_train")

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       lr_scheduler: Any = None, **kwargs: Any) -> None:
        self._track.end()
        if self._resume_step is not None:
            restored = self.checkpointer.load_latest({"optimizer": optimizer, "scheduler": lr_scheduler},
                                                     partial=True)
            if restored is None or restored[0] != self._resume_step:
                raise InvalidArgumentError(f"'{self.directory}': step {self._resume_step} was exported for the "
                                           f"Trainer, but the optimizer's state loaded from "
                                           f"{'no step' if restored is None else f'step {restored[0]}'}")

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                    lr_scheduler: Any = None, **kwargs: Any) -> None:
        step = state.global_step
        if self.checkpointer.should_save(step):
            self.checkpointer.save(step, {"model": model, "optimizer": optimizer, "scheduler": lr_scheduler},
                                   extra={"trainer_state": _state_json(state)})
        self._track.step(step)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._track.begin("shutdown")
        if self._checkpointer is not None:
            self._checkpointer.close()  # waits until the last save is durable
            self._checkpointer = None
        self._track.close("clean")
