"""The random generators' states of one rank, saved with every step and restored by ``load_latest``.

Why by default: a model with dropout (or any random op in the step) resumes bit for bit only if the step after the
restore draws what the step after the save drew. The parameters, optimizer and data position alone resumed every
value right but the masks: every step after a restore differed, silently. Accelerate's ``save_state`` restores
the same generators by default.

What is saved (each rank its own, in its ``rank-<r>.extra`` record, field ``rng``): Python's ``random``, NumPy's
global generator (only when ``numpy.random`` is already imported: nothing here imports it), torch's CPU generator, and the
generator of every CUDA device when CUDA is initialized (``torch.cuda.get_rng_state_all``). The states are
packed as bytes: a few KiB a save, encoded in microseconds by one C++ call (:func:`capture_record`).

Restored only where they mean the same thing: a step saved at another world size (a reshard) restores none (an
INFO line on the "ettkit" logger: a reshard's data order differs from the saved run's anyway); CUDA states restore onto as many devices as were saved, or none with a warning.
"""

from __future__ import annotations

import array
import logging
import random
import warnings
from typing import Any, Optional

import torch

from .. import _C
from ..errors import CorruptDataError
from ._skeleton_codec import _Decoder

__all__ = ["capture", "capture_record", "check", "restore"]

_MT_WORDS = 625  # Python's Mersenne Twister: 624 words and the index


def capture_record() -> bytes:
    """This process's generator states, encoded as the record's ``rng`` field, in one C++ call
    (``_C.checkpoint.rng_record``, the field's only encoder: python/csrc/bind_rng_record.cpp). Per save on the
    training thread: the Python capture and encoding it replaced cost 130-220 us of CPU after a wait on the
    2-vCPU VM (#65). CUDA's generators are taken (``torch.cuda.get_rng_state_all``) only once CUDA is
    initialized: a process that never touched CUDA has nothing there to save, and asking initializes it."""
    if torch.cuda.is_initialized():
        return _C.checkpoint.rng_record(torch.cuda.get_rng_state_all())
    return _C.checkpoint.rng_record()


def capture() -> dict:
    """This process's generator states, as plain values and bytes (the record's ``rng`` field as
    :func:`restore` and :func:`check` take it): :func:`capture_record`'s bytes, decoded by the record's
    decoder. Python's ``random`` as ``[version, 625 words as uint32 bytes, gauss_next]``, torch's CPU state,
    NumPy's global generator only when ``numpy.random`` is already imported (touching ``np.random`` imported
    it inside the first save of every process: 40 ms, #65; a generator whose module was never imported was
    never drawn from), and ``cuda``: one state per device."""
    return _Decoder(capture_record(), 0, False).value(1)


def check(state: Any, where: str) -> None:
    """Raises :class:`CorruptDataError` naming ``where`` and the field when ``state`` is not a record of
    :func:`capture` (before any tensor of the step is copied, so the step falls back like any corrupt one)."""

    def bad(field: str, why: str) -> CorruptDataError:
        return CorruptDataError(f"{where}: the generator state's field '{field}' {why}")

    if not isinstance(state, dict) or not set(state) <= {"python", "torch", "numpy", "cuda"}:
        raise bad("rng", f"is not a dict of 'python', 'torch', 'numpy', 'cuda' (got {type(state).__name__})")
    py = state.get("python")
    if not (isinstance(py, list) and len(py) == 3 and type(py[0]) is int and isinstance(py[1], bytes)
            and len(py[1]) == 4 * _MT_WORDS and (py[2] is None or type(py[2]) is float)):
        raise bad("python", f"is not [version, {4 * _MT_WORDS} bytes, gauss]")
    expected = torch.get_rng_state().numel()
    if not isinstance(state.get("torch"), bytes) or len(state["torch"]) != expected:
        raise bad("torch", f"is not {expected} bytes (torch's CPU generator state)")
    npy = state.get("numpy")
    if npy is not None and not (isinstance(npy, list) and len(npy) == 5 and isinstance(npy[0], str)
                                and isinstance(npy[1], bytes) and len(npy[1]) == 4 * 624
                                and all(type(v) is int for v in npy[2:4]) and type(npy[4]) is float
                                # NumPy takes any pos, and reads its key past the end with one over 624
                                and 0 <= npy[2] <= 624 and npy[3] in (0, 1)):
        raise bad("numpy", "is not [name, 2496 bytes, pos in [0, 624], has_gauss 0 or 1, cached_gaussian]")
    cuda = state.get("cuda")
    if cuda is not None and not (isinstance(cuda, list) and all(isinstance(s, bytes) and 0 < len(s) <= 1 << 16
                                                                  for s in cuda)):
        raise bad("cuda", "is not a list of byte strings, one per device")
    # The right shape is not yet a state the setters take (an index past 624, a pos out of range, a torch state
    # whose seed fields are out of range): each is set once on a scratch generator of its kind, so that a
    # hostile one is refused here, before any tensor is copied, instead of raising after the tensors loaded.
    for field, trial in (("python", lambda: random.Random().setstate((py[0], tuple(array.array("I", py[1])),
                                                                       py[2]))),
                         ("torch", lambda: torch.Generator().set_state(_state_tensor(state["torch"]))),
                         ("numpy", lambda: _numpy_trial(npy))):
        try:
            trial()
        except (ValueError, TypeError, RuntimeError, OverflowError) as e:
            raise bad(field, f"is not a state its generator takes: {type(e).__name__}: {e}") from None


def _state_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _numpy_trial(npy: Optional[list]) -> None:
    if npy is None:
        return
    import numpy as np

    name, keys, pos, has_gauss, cached = npy
    np.random.RandomState().set_state((name, np.frombuffer(keys, dtype="<u4").astype(np.uint32), pos, has_gauss,
                                       cached))


def restore(state: Optional[dict], *, world_changed: bool, step: int) -> None:
    """Sets this process's generators to ``state`` (checked by :func:`check`); warns and changes nothing where
    the saved states cannot mean the same thing here."""
    if state is None:
        return
    if world_changed:
        # Not a warning: a reshard is asked for, and its data order differs from the saved run's anyway.
        logging.getLogger("ettkit").info(
            "ettkit.checkpoint: step %d was saved at another world size: the random generators are per rank and "
            "were not restored", step)
        return
    version, words, gauss = state["python"]
    random.setstate((version, tuple(array.array("I", words)), gauss))
    torch.set_rng_state(_state_tensor(state["torch"]))
    npy = state.get("numpy")
    if npy is not None:
        import numpy as np  # saved only where NumPy was imported: the trainer uses it

        name, keys, pos, has_gauss, cached = npy
        np.random.set_state((name, np.frombuffer(keys, dtype="<u4").astype(np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda):
            have = torch.cuda.device_count() if torch.cuda.is_available() else 0
            warnings.warn(f"ettkit.checkpoint: step {step} saved the generators of {len(cuda)} CUDA devices and "
                          f"this process sees {have}: the CUDA generators were not restored", RuntimeWarning,
                          stacklevel=3)
            return
        for device, s in enumerate(cuda):
            try:  # no scratch CUDA generator to try it on at check(): a state this device refuses warns
                torch.cuda.set_rng_state(_state_tensor(s), device)
            except RuntimeError as e:
                warnings.warn(f"ettkit.checkpoint: step {step}'s generator state of CUDA device {device} was "
                              f"refused ({e}); that device's generator was not restored", RuntimeWarning,
                              stacklevel=3)

