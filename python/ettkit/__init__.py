"""ettkit: raise a training job's Effective Training Time (ETT%).

Components: :mod:`ettkit.ett` (phase timers, ledger, report, interval advisor), :mod:`ettkit.sharding`
(local shard-metadata builder), :mod:`ettkit.startup` (compile-overlap scheduler). The C++ core is
``libettkit.so``; C++ trainers use it through ``find_package(ettkit)`` with
``CMAKE_PREFIX_PATH=ettkit.cmake_prefix_path``.
"""

import os as _os

# torch must be imported first: libettkit.so links libtorch, and importing torch loads it (and the CUDA
# runtime libraries from its wheels) so the dynamic loader reuses them for ettkit._C.
import torch as _torch  # noqa: F401

from . import _logging, errors
from ._C import WITH_CUDA, __version__
from .distributed import init_process_group
from .errors import (
    BatchMismatchError,
    CancelledError,
    CheckpointError,
    CheckpointLockedError,
    PeerLostError,
    CorruptCheckpointError,
    CorruptDataError,
    Error,
    InvalidArgumentError,
    IoError,
    NoRecorderWarning,
    StageError,
    TimeoutError,
    TornSnapshotError,
    UnsupportedError,
)

_logging.install()  # the C++ core's log messages go to logging.getLogger("ettkit") (ettkit/_logging.py)

#: Directory to add to CMAKE_PREFIX_PATH so that ``find_package(ettkit)`` finds the installed package.
cmake_prefix_path = _os.path.dirname(__file__)

__all__ = [
    "WITH_CUDA",
    "__version__",
    "cmake_prefix_path",
    "errors",
    "Error",
    "InvalidArgumentError",
    "NoRecorderWarning",
    "CorruptDataError",
    "CheckpointError",
    "CheckpointLockedError",
    "PeerLostError",
    "CorruptCheckpointError",
    "TornSnapshotError",
    "IoError",
    "TimeoutError",
    "UnsupportedError",
    "StageError",
    "CancelledError",
    "BatchMismatchError",
]
