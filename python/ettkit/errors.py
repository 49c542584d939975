"""ettkit's exception classes. C++ errors are translated into these by the ``ettkit._C`` module.

Each subclasses the builtin a Python user would catch for that kind of problem, so
``except ValueError`` still works for bad arguments.
"""


class Error(RuntimeError):
    """Base class of every error ettkit raises."""


class InvalidArgumentError(Error, ValueError):
    """A value passed to ettkit is outside what is valid; the message names the field."""


class CorruptDataError(Error, ValueError):
    """Data read from disk is malformed; the message names the file and record."""


class CheckpointError(Error):
    """Base class of the checkpoint-specific errors."""


class CorruptCheckpointError(CorruptDataError, CheckpointError):
    """No committed checkpoint passes verification."""


class PeerLostError(CheckpointError):
    """A rank that a checkpoint commit needs is gone (its heartbeat stopped, it closed without taking part,
    or the c10d Store is unreachable). Every queued save fails with it at once; the job should exit."""


class CheckpointLockedError(CheckpointError):
    """Another checkpointer (another job, or an unclosed ``AsyncCheckpointer`` of this process) holds the
    checkpoint directory's lock; the message names the holder (pid, host, job). Open the directory with
    ``read_only=True`` to only load from it."""


class TornSnapshotError(CheckpointError):
    """A save was refused, not committed: saved tensors changed while they were being copied, so the
    snapshot could mix two steps. The message names the tensors and how to protect them; the previous
    committed step stays the latest."""


class IoError(Error, OSError):
    """A file-system call failed; the message names the path."""


class TimeoutError(Error, TimeoutError):  # noqa: A001 - deliberately shadows the builtin inside ettkit
    """A bounded wait ran out."""


class UnsupportedError(Error):
    """The input needs a newer ettkit (e.g. a ledger written by a newer format version)."""


class StageError(Error):
    """A start-up stage failed. ``stage`` names it; the stage's own exception is the ``__cause__``."""

    stage: str = ""


class CancelledError(Error):
    """Work was cancelled before it finished (e.g. a start-up stage whose deadline passed)."""


class BatchMismatchError(InvalidArgumentError):
    """A batch does not match its :class:`ettkit.startup.BatchSpec`; the message names the field and what
    the spec (and the graph compiled for it) expects."""


class NoRecorderWarning(UserWarning):
    """A component (``AsyncCheckpointer``, ``StageGraph``, ``overlapped_start``) was created with no ETT
    recorder open, so its phases are not recorded. Open one first (``with ett.Recorder(run_dir):`` or
    ``ett.init(run_dir)``), pass ``recorder=``, or pass ``recorder=None`` to record nothing."""
