"""The checkpoint's one dtype table crosses the binding (python/csrc/bind_dtype.cpp): the DCP reader maps a
step's dtype strings through the C++ table the writer uses, not a copy of its own."""

from __future__ import annotations

import importlib

import pytest
import torch

from ettkit import CorruptDataError, _C
from ettkit.checkpoint import _dcp_reader

# What ettkit's checkpoints hold (the safetensors dtype strings and their torch dtypes): the format itself.
_EXPECTED = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
             "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "C64": torch.complex64}


def test_the_bound_table_is_the_format_s_dtypes_in_order() -> None:
    pairs = _C.checkpoint.safetensors_dtypes()
    assert [name for name, _ in pairs] == list(_EXPECTED)
    assert dict(pairs) == _EXPECTED
    assert all(isinstance(dtype, torch.dtype) for _, dtype in pairs)


def test_the_dcp_reader_reads_through_the_bound_table() -> None:
    assert _dcp_reader._DTYPES == dict(_C.checkpoint.safetensors_dtypes())
    # An entry of every dtype decodes to that dtype, with the byte count its element size gives.
    for name, dtype in _EXPECTED.items():
        size = torch.empty((), dtype=dtype).element_size()
        got = _dcp_reader._entry("x.safetensors", "t", {"dtype": name, "shape": [3], "data_offsets": [0, 3 * size]},
                                 3 * size)
        assert got == (dtype, [3], 0, 3 * size), name


def test_a_dtype_the_table_drops_is_one_the_dcp_reader_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reader has no table of its own: given a C++ table without C64, it refuses C64 (a private copy in the
    # reader would still take it).
    without_c64 = [(n, d) for n, d in _C.checkpoint.safetensors_dtypes() if n != "C64"]
    monkeypatch.setattr(_C.checkpoint, "safetensors_dtypes", lambda: without_c64)
    try:
        reader = importlib.reload(_dcp_reader)
        assert "C64" not in reader._DTYPES and reader._DTYPES["BF16"] is torch.bfloat16
        with pytest.raises(CorruptDataError, match="has dtype 'C64', which DCP cannot read"):
            reader._entry("x.safetensors", "t", {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}, 8)
    finally:
        monkeypatch.undo()
        importlib.reload(_dcp_reader)
    assert "C64" in _dcp_reader._DTYPES
