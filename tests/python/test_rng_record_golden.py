"""#64: the generator-state record (the ``rng`` field of ``rank-<r>.extra``) has one encoder, C++
``_C.checkpoint.rng_record`` (python/csrc/bind_rng_record.cpp); its bytes are pinned here to those the Python
encoder (``rng_state.capture()`` through the record's generic encoder, deleted in #64) wrote for the same
generator states, so that records written before and after read alike (the decoder did not change).

The hashes were computed by that Python encoder, before it was deleted, for the states GOLDEN builds: Python's
random seeded (gauss_next None, then a float), torch's CPU generator seeded, NumPy's global generator seeded
with its cached gaussian set, and two fake CUDA generator states (the encoder took any bytes there).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ettkit import _C
from ettkit.checkpoint import rng_state
from ettkit.checkpoint._extra_encode import encode_extra
from ettkit.checkpoint._skeleton_codec import decode_extra, encode_skeleton

GOLDEN = r"""
import hashlib, random, sys, torch
from ettkit import _C

def seed(with_numpy):
    random.seed(7); random.gauss(0, 1)
    torch.manual_seed(3); torch.rand(5)
    if with_numpy:
        import numpy.random
        numpy.random.seed(11); numpy.random.standard_normal()

CUDA = [bytes(range(256)) * 3 + b"\x01" * 16, bytes(reversed(range(256))) * 3 + b"\x02" * 16]
assert "numpy.random" not in sys.modules  # the field has no "numpy" entry until NumPy's random is imported
seed(False); random.seed(5)  # gauss_next None
print("nonp", hashlib.sha256(_C.checkpoint.rng_record()).hexdigest())
seed(True)
print("np", hashlib.sha256(_C.checkpoint.rng_record()).hexdigest())
seed(True)
print("cuda", hashlib.sha256(_C.checkpoint.rng_record([torch.frombuffer(bytearray(c), dtype=torch.uint8)
                                                          for c in CUDA])).hexdigest())
"""

# Written by the Python encoder before #64 (torch's CPU generator state is 5056 bytes in the torch this builds
# against; a torch whose state differs in size changes them, as it would change the old encoder's).
EXPECTED = {
    "nonp": "eb4213af9e46075a3d70a0eb4e4083a572d082fe89903c7d082745be035454f1",
    "np": "e40841d2502713eab04b80d99841ec80006b9825bd5d73b1e911cac9c0054833",
    "cuda": "3023f66a1b873679508676144c1591ea2941774dddafa5f0bca495ef55ff1da8",
}


def test_the_rng_record_is_byte_for_byte_what_the_python_encoder_wrote():
    if torch.get_rng_state().numel() != 5056:
        pytest.skip("this torch's CPU generator state is not the size the golden bytes were written with")
    out = subprocess.run([sys.executable, "-c", GOLDEN], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert dict(line.split() for line in out.stdout.split("\n") if line) == EXPECTED


def _record(rng: bytes):
    code = encode_skeleton({"a": 1}, allow_pickle=False)
    return decode_extra(encode_extra(code, None, 1, allow_pickle=False, rng=rng), "x", allow_pickle=False)


def test_capture_is_the_record_decoded_and_restores_what_it_captured():
    state = rng_state.capture()
    assert _record(rng_state.capture_record()).rng == state  # the loader reads what capture() gives
    rng_state.check(state, "x")
    expected = (torch.rand(3), torch.get_rng_state())
    rng_state.restore(state, world_changed=False, step=1)
    assert torch.equal(torch.rand(3), expected[0]) and torch.equal(torch.get_rng_state(), expected[1])


def test_cuda_generators_go_through_the_one_encoder(monkeypatch):
    states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 40, dtype=torch.uint8)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: states)
    state = rng_state.capture()
    assert state["cuda"] == [s.numpy().tobytes() for s in states]
    assert list(state)[-1] == "cuda"  # the field's entries in the order the Python encoder wrote them
    with pytest.raises(ValueError, match="contiguous CPU uint8"):
        _C.checkpoint.rng_record([torch.zeros(4, dtype=torch.int32)])


def test_the_record_takes_only_the_encoded_field():
    code = encode_skeleton({"a": 1}, allow_pickle=False)
    with pytest.raises(TypeError, match="rng= takes the encoded field"):
        encode_extra(code, None, 1, allow_pickle=False, rng={"torch": b""})
