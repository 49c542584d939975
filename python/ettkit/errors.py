"""ettkit's exception classes. C++ errors are translated into these by the ``ettkit._C`` module, which
defines them.

Each subclasses the builtin a Python user would catch for that kind of problem, so
``except ValueError`` still works for bad arguments: ``Error`` is a ``RuntimeError``;
``InvalidArgumentError`` and ``CorruptDataError`` are ``ValueError``s; ``IoError`` an ``OSError``;
``TimeoutError`` the builtin ``TimeoutError``; ``CorruptCheckpointError`` is a ``CorruptDataError`` and a
``CheckpointError`` (the base of ``PeerLostError``, ``CheckpointLockedError``, ``TornSnapshotError``);
``BatchMismatchError`` an ``InvalidArgumentError``.
"""


# The exception classes live in the compiled module, which raises them (python/csrc/bind_errors.cpp: their
# bases and docstrings); they are named ettkit.errors.<Name>, so reprs and pickles point here.
from ._C import (  # noqa: E402  (re-exported)
    BatchMismatchError,
    CancelledError,
    CheckpointError,
    CheckpointLockedError,
    CorruptCheckpointError,
    CorruptDataError,
    Error,
    InvalidArgumentError,
    IoError,
    PeerLostError,
    StageError,
    TimeoutError,  # noqa: A004 - deliberately shadows the builtin inside ettkit
    TornSnapshotError,
    UnsupportedError,
)

__all__ = [
    "BatchMismatchError", "CancelledError", "CheckpointError", "CheckpointLockedError", "CorruptCheckpointError",
    "CorruptDataError", "Error", "InvalidArgumentError", "IoError", "NoRecorderWarning", "PeerLostError",
    "StageError", "TimeoutError", "TornSnapshotError", "UnsupportedError",
]


class NoRecorderWarning(UserWarning):
    """A component (``AsyncCheckpointer``, ``StageGraph``, ``overlapped_start``) was created with no ETT
    recorder open, so its phases are not recorded. Open one first (``with ett.Recorder(run_dir):`` or
    ``ett.init(run_dir)``), pass ``recorder=``, or pass ``recorder=None`` to record nothing."""
