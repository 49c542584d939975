"""Each rule of a step's files exists once, in C++ (include/ettkit/checkpoint/step_format.h), and both Python
readers (the DCP StorageReader and export's StepTensors) apply it through ettkit._C.checkpoint: a hostile file
is refused by both with the same message, the C++ loader's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ettkit import _C
from ettkit.checkpoint import EttkitStorageReader
from ettkit.checkpoint._restore import MAX_NAMED
from ettkit.errors import CorruptDataError
from ettkit.integrations import step_reader
from ettkit.integrations.step_reader import StepTensors


def _safetensors(header: dict, data_bytes: int) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return len(text).to_bytes(8, "little") + text + bytes(data_bytes)


def _step(tmp_path: Path, rank0: bytes, world_size: object = 1) -> Path:
    """A step directory of one rank file whose manifest's checksums match it (what StepTensors verifies)."""
    step = tmp_path / "step-1"
    step.mkdir()
    (step / "rank-0.safetensors").write_bytes(rank0)
    cb = 1 << 20
    chunks = [_C.xxh3_hex(rank0[i:i + cb]) for i in range(0, max(len(rank0), 1), cb)]
    manifest = {"format": "ettkit-checkpoint", "version": 1, "step": 1, "world_size": world_size,
                "files": {"rank-0.safetensors": {"size": len(rank0), "xxh3": _C.xxh3_hex(rank0),
                                                 "chunk_bytes": cb, "chunks": chunks}}}
    (step / "manifest.json").write_text(json.dumps(manifest))
    return step


def _refusals(step: Path) -> tuple[str, str]:
    """What each reader says of ``step``: both must refuse it."""
    with pytest.raises(CorruptDataError) as dcp:
        EttkitStorageReader(step).read_metadata()
    with pytest.raises(CorruptDataError) as export:
        StepTensors(step).close()
    return str(dcp.value), str(export.value)


def test_a_header_with_overlapping_entries_is_refused_by_both_readers_with_one_message(tmp_path):
    # Two entries of the right size each whose byte ranges overlap: each would read the other's bytes. The Python
    # readers took this before they parsed through C++.
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    step = _step(tmp_path, _safetensors(header, 12))
    dcp, export = _refusals(step)
    assert dcp == export
    assert f"safetensors file '{step / 'rank-0.safetensors'}' has overlapping tensors" in dcp
    assert "[0, 8] and [4, 12]" in dcp


def test_a_header_entry_outside_the_data_is_refused_by_both_readers_with_one_message(tmp_path):
    header = {"w": {"dtype": "F32", "shape": [64], "data_offsets": [0, 1 << 40]}}
    dcp, export = _refusals(_step(tmp_path, _safetensors(header, 256)))
    assert dcp == export and "'w' has data_offsets [0, 1099511627776], not a range" in dcp


@pytest.mark.parametrize("world_size", [0, (1 << 24) + 1, 1 << 31, 2.0, "4", None])
def test_a_world_size_out_of_range_is_refused_by_both_readers_with_one_message(tmp_path, world_size):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    step = _step(tmp_path, _safetensors(header, 8), world_size)
    dcp, export = _refusals(step)
    assert dcp == export
    assert f"manifest '{step / 'manifest.json'}': field 'world_size' is {json.dumps(world_size)}; expected " in dcp


def test_the_limits_are_the_cpp_ones_and_a_good_step_reads_through_both(tmp_path):
    assert _C.checkpoint.MAX_WORLD_SIZE == 1 << 24 == step_reader.MAX_WORLD_SIZE
    assert MAX_NAMED == _C.checkpoint.MAX_LISTED_IN_MESSAGE == 12
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b@0": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
    step = _step(tmp_path, _safetensors(header, 12))
    md = EttkitStorageReader(step).read_metadata().state_dict_metadata
    assert list(md["a"].size) == [2] and list(md["b"].size) == [1]
    with StepTensors(step) as t:
        assert t.tensors["a"].shape == (2,) and t.tensors["b"].sharded
