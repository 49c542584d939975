"""The start-up stage graph with Python callables (C++ scheduler: ``ettkit._C.startup.StageGraph``).

What this layer adds to the C++ graph:

- **The caller's configuration reaches every stage.** Since torch 2.12, ``torch._dynamo.config``,
  ``torch._inductor.config`` etc. keep user overrides in ``ContextVar``s: a plain thread sees the defaults,
  not what the training script set. :meth:`StageGraph.run` copies the calling thread's ``contextvars``
  context once per stage (a ``Context`` can be entered by one thread at a time) and runs each stage
  inside its copy. It also carries the thread-local torch state that Dynamo guards on: grad mode, autocast
  and the number of intra-op threads (and the current CUDA device).
- **Results and errors as Python objects.** A stage's return value lands in ``graph.results[name]``; a
  stage's exception is re-raised from ``run()`` as :class:`ettkit.errors.StageError` naming the stage, with the
  original exception as ``__cause__``.
- **Imports that cannot deadlock.** ``run()`` opens :func:`ettkit.startup.serialized_imports` around the
  stages: first-time imports of every thread run one at a time, so a stage that imports part of torch's
  compile stack while another compiles cannot hit CPython's ``_DeadlockError`` (see ``import_gate.py``).
- **A watchdog report.** When a deadline passes, the :class:`ettkit.TimeoutError` lists the Python stack
  of every other thread, so the stuck stage shows where it is stuck.

The GIL is released while ``run()`` waits and taken by a worker only while a Python stage runs. ``run()``
and ``join()`` check for signals every 50 ms while they wait: Ctrl-C cancels the graph and raises
``KeyboardInterrupt`` at once. A stage still running after a deadline or an interrupt never delays
interpreter exit: the graph's destruction leaves its thread to finish on its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import sys
import threading
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .. import _C, errors
from ..ett import recorder as _ett_recorder
from .import_gate import serialized_imports

_CURRENT = "current"


#: One stage of a :class:`StageReport` (bound from C++ ``startup::StageRecord``; read-only): ``name``,
#: ``phase``, ``status`` (succeeded | failed | cancelled | timed_out | not_run), ``started``, ``begin_s``,
#: ``end_s``, ``duration_s`` (seconds from the start of ``run()``), ``begin_epoch_us``, ``end_epoch_us``,
#: ``worker`` (-1: the calling thread), ``error``, ``after``, ``runs_dynamo``, ``forks``,
#: ``collective_group``; ``to_dict()``.
StageRecord = _C.startup.StageRecord

#: What a run achieved (bound from C++ ``startup::StageReport``; read-only): ``stages`` (name ->
#: :data:`StageRecord`, in the order the stages were added), ``critical_path``, ``critical_path_s``,
#: ``serial_sum_s``, ``makespan_s``, ``saved_s``, ``workers``, ``table`` (also ``str()``), ``to_dict()``.
StageReport = _C.startup.StageReport


@dataclasses.dataclass(frozen=True)
class _ThreadState:
    """The thread-local torch state of the calling thread that Dynamo guards on."""

    grad_enabled: bool
    num_threads: int
    autocast: tuple  # ((device_type, dtype), ...) for the device types with autocast enabled
    cuda_device: int | None

    @classmethod
    def capture(cls) -> _ThreadState:
        autocast = []
        for device_type in ("cpu", "cuda"):
            try:
                if torch.is_autocast_enabled(device_type):
                    autocast.append((device_type, torch.get_autocast_dtype(device_type)))
            except (RuntimeError, TypeError):  # device type unknown to this build
                pass
        cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        return cls(torch.is_grad_enabled(), torch.get_num_threads(), tuple(autocast), cuda_device)

    @contextlib.contextmanager
    def applied(self):
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)  # guarded by Dynamo's global-state guard
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type, dtype in self.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            if self.cuda_device is not None:
                stack.enter_context(torch.cuda.device(self.cuda_device))
            yield


class _RunState:
    """What the stage trampolines share with ``run()``. Kept apart from :class:`StageGraph` so the C++
    graph (which owns the trampolines) holds no reference back to its own Python wrapper."""

    def __init__(self):
        self.contexts: dict[str, contextvars.Context] = {}
        self.thread_state: _ThreadState | None = None
        self.results: dict[str, Any] = {}
        self.errors: dict[str, BaseException] = {}


def _call(state: _ThreadState, fn: Callable[[], Any]) -> Any:
    with state.applied():
        return fn()


def _trampoline(run_state: _RunState, name: str, fn: Callable[[], Any]) -> Callable[[], None]:
    def stage() -> None:
        ctx = run_state.contexts.pop(name)
        try:
            run_state.results[name] = ctx.run(_call, run_state.thread_state, fn)
        except BaseException as exc:
            run_state.errors[name] = exc
            raise

    return stage


def _thread_stacks(limit: int = 12) -> str:
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        stack = "".join(traceback.format_stack(frame, limit=limit))
        parts.append(f"--- thread {names.get(ident, ident)} ---\n{stack}")
    return "\n".join(parts)


class StageGraph:
    """Start-up stages with dependencies, run concurrently on a small pool of C++ threads.

    Each stage is a callable taking no arguments; its return value is kept in :attr:`results`. Flags:

    - ``forks=True``: the stage forks processes (e.g. ``iter(loader)`` with worker processes); it runs on
      the calling thread before any pool thread starts, and may only depend on other forking stages.
    - ``runs_dynamo=True``: the stage compiles or runs compiled code; at most one such stage runs at a
      time (PT2 is not thread-safe).
    - ``collectives="<group>"``: the stage issues collectives on that process group; such stages never
      overlap and run in the same order on every rank.
    - ``timeout_s``: the stage's deadline; ``phase``: the ETT phase it is recorded under (default: name).

    ``recorder`` (default ``"current"``: the process's :func:`ettkit.ett.current` recorder, with a
    :class:`ettkit.NoRecorderWarning` when none is open; ``None``: record nothing) receives one phase per
    stage. A graph runs once. ``run()`` raises :class:`ettkit.errors.StageError` (a stage failed; its
    dependents were cancelled), :class:`ettkit.TimeoutError` (a deadline passed),
    :class:`ettkit.InvalidArgumentError` (a cycle or an unknown dependency, before anything ran) or
    ``KeyboardInterrupt`` (Ctrl-C; every stage was cancelled, :attr:`report` says which were running).
    """

    def __init__(
        self,
        *,
        max_workers: int = 4,
        timeout_s: float | None = None,
        fail_fast: bool = False,
        recorder: Any = _CURRENT,
    ):
        recorder = _ett_recorder.resolve(recorder, "StageGraph", stacklevel=2)
        self._graph = _C.startup.StageGraph(
            max_workers=max_workers, timeout_s=float(timeout_s or 0.0), fail_fast=fail_fast, recorder=recorder
        )
        self.recorder = recorder  # where the stages' phases go (None: nowhere); stages may add sub-phases
        self._state = _RunState()
        self._names: list[str] = []
        self.report: StageReport | None = None

    @property
    def results(self) -> dict:
        """Return values of the stages that succeeded, by stage name."""
        return self._state.results

    def add(
        self,
        name: str,
        fn: Callable[[], Any],
        *,
        after: Iterable[str] = (),
        runs_dynamo: bool = False,
        collectives: str | None = None,
        forks: bool = False,
        timeout_s: float | None = None,
        phase: str | None = None,
    ) -> StageGraph:
        """Adds a stage; returns the graph so calls can be chained."""
        if isinstance(after, str):
            after = [after]
        if not callable(fn):
            raise errors.InvalidArgumentError(f"stage '{name}': fn must be callable, got {type(fn).__name__}")
        self._graph.add(
            name,
            _trampoline(self._state, name, fn),
            after=list(after),
            runs_dynamo=runs_dynamo,
            collective_group=collectives or "",
            forks=forks,
            timeout_s=float(timeout_s or 0.0),
            phase=phase or "",
        )
        self._names.append(name)
        return self

    def stage(self, name: str | None = None, **options) -> Callable:
        """Decorator form of :meth:`add`: ``@graph.stage(after=["device_init"])``."""

        def register(fn):
            self.add(name or fn.__name__, fn, **options)
            return fn

        return register

    def validate(self) -> None:
        """Raises InvalidArgumentError for unknown dependencies, cycles and misplaced forking stages."""
        self._graph.validate()

    def topological_order(self) -> list[str]:
        return self._graph.topological_order()

    def run(self) -> StageReport:
        """Runs every stage; returns the report or raises (the report is then in :attr:`report`)."""
        # Captured here, on the calling thread, after the caller configured torch.
        self._state.thread_state = _ThreadState.capture()
        self._state.contexts = {name: contextvars.copy_context() for name in self._names}
        try:
            with serialized_imports():  # stages that import parts of one import cycle cannot deadlock
                raw = self._graph.run()
        except errors.StageError as exc:
            self.report = self._graph.report()
            cause = self._state.errors.get(exc.stage)
            self._note_failure(exc.stage, cause)
            err = errors.StageError(str(exc))
            err.stage = exc.stage
            raise err from cause
        except KeyboardInterrupt:
            # Ctrl-C while the graph ran (or a stage raised KeyboardInterrupt): nothing more starts and the
            # running stages were asked to cancel; they keep their threads until they return (join()).
            self.report = self._graph.report()
            raise
        except errors.TimeoutError as exc:
            self.report = self._graph.report()
            running = [s.name for s in self.report.stages.values() if s.status == "timed_out"]
            stacks = _thread_stacks()
            raise errors.TimeoutError(
                f"{exc}\nstages that timed out: {running}; Python stacks of the other threads:\n{stacks}"
            ) from None
        finally:
            self._state.contexts = {}
        self.report = raw
        return self.report

    def _note_failure(self, stage: str, cause: BaseException | None) -> None:
        """The failed stage and its exception in the ETT ledger (the report's ``attempts[].notes["start_failed"]``),
        so that a failed start names its stage after the fact even where the process's own exception text is
        lost (a launcher's log rotated, a rank that only its peer's timeout shows)."""
        if self.recorder is None:
            return
        what = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}" if cause else "failed"
        text = f"stage '{stage}': {what}"
        limit = self.recorder.MAX_NOTE_BYTES  # bytes of UTF-8, not characters
        try:
            self.recorder.set_note("start_failed", text.encode()[:limit].decode(errors="ignore"))
        except Exception:  # noqa: BLE001 - a closed recorder must not hide the stage's own error
            pass

    def join(self, timeout_s: float | None = None) -> bool:
        """Waits for stages that outlived a deadline to return; True when every worker thread is joined."""
        return self._graph.join(float("inf") if timeout_s is None else float(timeout_s))

    def wait_held_for_testing(self, name: str, timeout_s: float) -> bool:
        """Test hook: blocks until stage ``name`` was ready but held back by a scheduling rule."""
        return self._graph.wait_held_for_testing(name, timeout_s)

    def __len__(self) -> int:
        return len(self._names)
