"""The ETT side of a framework callback: the recorder it records into, and the one phase it has running."""

from __future__ import annotations

import os
from typing import Any, Optional

from .. import ett


class PhaseTrack:
    """Records a framework's phases one at a time: :meth:`begin` ends the phase running and starts the next,
    :meth:`end` ends it. Every call is a no-op while there is no recorder. :meth:`open` takes the current
    recorder, or makes one in ``run_dir`` (which :meth:`close` then closes: a recorder someone else opened
    is theirs to close)."""

    def __init__(self) -> None:
        self.recorder: Optional[Any] = None
        self._owned: Optional[ett.Recorder] = None
        self._phase: Optional[Any] = None

    def open(self, run_dir: Optional[str | os.PathLike], **options: Any) -> None:
        self.recorder = ett.current()
        if self.recorder is None and run_dir is not None:
            self._owned = self.recorder = ett.Recorder(run_dir, **options)

    @property
    def owns_recorder(self) -> bool:
        return self._owned is not None

    def begin(self, name: str) -> None:
        self.end()
        if self.recorder is not None:
            self._phase = self.recorder.phase(name)

    def end(self) -> None:
        if self._phase is not None:
            self._phase.end()
            self._phase = None

    def step(self, n: int) -> None:
        if self.recorder is not None:
            self.recorder.step(n)

    def close(self, status: str = "clean", detail: str = "") -> None:
        """Ends the running phase and closes the recorder if :meth:`open` made it."""
        self.end()
        if self._owned is not None:
            self._owned.close(status, detail)
            self._owned = self.recorder = None
