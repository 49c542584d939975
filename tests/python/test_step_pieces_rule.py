"""The replica rule and the pieces of a step have one owner (#64): C++'s step_tensors
(include/ettkit/checkpoint/step_pieces.h), which the C++ loader's resharding plan, the DCP StorageReader and
export's StepTensors all read a step through. Both Python readers take what it decides (which old rank's copy,
which boxes) and refuse what it refuses, with its message; neither keeps a rule of its own, so a different
decision of the bound function is followed by both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ettkit import _C
from ettkit.checkpoint import EttkitStorageReader
from ettkit.errors import CorruptDataError
from ettkit.integrations.step_reader import StepTensors

_DIGEST = _C.checkpoint.WHOLE_TENSOR_DIGEST_PREFIX


def _step(tmp_path: Path, ranks: dict[int, dict[str, torch.Tensor]], digests: bool = True) -> Path:
    """A committed step written by hand: each rank's safetensors file (with the whole tensors' digests a save
    records, keyed as C++ reads them) and a manifest with its chunk checksums."""
    from safetensors.torch import save_file

    step = tmp_path / "ckpt" / "step-1"
    step.mkdir(parents=True)
    files = {}
    for rank, tensors in ranks.items():
        meta = {_DIGEST + n: _C.xxh3_hex(t.numpy().tobytes()) for n, t in tensors.items() if "@" not in n}
        path = step / f"rank-{rank}.safetensors"
        save_file(tensors, str(path), metadata=meta if digests else None)
        data = path.read_bytes()
        chunks = [_C.xxh3_hex(data[i:i + (4 << 20)]) for i in range(0, len(data), 4 << 20)]
        files[path.name] = {"size": len(data), "chunk_bytes": 4 << 20, "chunks": chunks, "xxh3": chunks[0]}
    (step / "manifest.json").write_text(json.dumps({"format": "ettkit-checkpoint", "version": 1, "step": 1,
                                                    "world_size": len(ranks), "files": files}))
    return step


def _bound(step: Path) -> dict:
    """What the bound C++ function decides for ``step``."""
    headers = []
    for rank in range(len(list(step.glob("rank-*.safetensors")))):
        data = (step / f"rank-{rank}.safetensors").read_bytes()
        n = int.from_bytes(data[:8], "little")
        headers.append((str(step / f"rank-{rank}.safetensors"), data[8:8 + n], len(data)))
    return _C.checkpoint.step_tensors(headers, str(step))


def _replicated(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    # A 2 x 2 mesh's (Replicate, Shard(1)) pieces: ranks 2 and 3 repeat ranks 0 and 1's boxes (rank 3's bytes
    # made different, so that whose copy is read shows); a bias every rank saved whole with the same bytes.
    w = torch.arange(12.0).reshape(3, 4)
    left, right = w[:, :2].contiguous(), w[:, 2:].contiguous()
    bias = torch.tensor([1.0, 2.0])
    ranks = {0: {"w@0,0": left, "bias": bias}, 1: {"w@0,2": right, "bias": bias},
             2: {"w@0,0": left.clone(), "bias": bias}, 3: {"w@0,2": right + 100}}
    return _step(tmp_path, ranks), w


def test_both_readers_read_the_boxes_and_copies_the_bound_rule_chose(tmp_path):
    step, w = _replicated(tmp_path)
    bound = _bound(step)
    dtype, shape, sharded, pieces, differs, unproven = bound["w"]
    assert (dtype, shape, sharded, differs, unproven) == ("F32", [3, 4], True, None, False)
    assert [(p[0], p[1]) for p in pieces] == [(0, [0, 0]), (1, [0, 2])]  # one copy of each box, the lowest rank's
    assert [p[0] for p in bound["bias"][3]] == [0]
    with StepTensors(step) as t:
        assert [(p.rank, list(p.offsets), list(p.shape), p.begin, p.end) for p in t.tensors["w"].pieces] == [
            tuple(p) for p in pieces]
        got = b"".join(t.stream(t.tensors["w"]))
    assert torch.equal(torch.frombuffer(bytearray(got), dtype=torch.float32).reshape(3, 4), w)
    md = EttkitStorageReader(step).read_metadata()
    assert [(list(c.offsets), list(c.sizes)) for c in md.state_dict_metadata["w"].chunks] == [
        (p[1], p[2]) for p in pieces]
    assert list(md.state_dict_metadata["w"].size) == shape
    # Each chunk is read from the file of the rank the rule chose, at the bytes it gave.
    assert sorted((path.rsplit("/", 1)[1], begin) for path, begin, *_ in md.storage_data.values()) == sorted(
        (f"rank-{p[0]}.safetensors", p[3]) for p in pieces + bound["bias"][3])


def test_a_different_decision_of_the_bound_rule_is_followed_by_both_readers(tmp_path, monkeypatch):
    # Neither reader has a replica rule of its own: told to read rank 3's copies, both read rank 3's bytes.
    step, w = _replicated(tmp_path)
    real = _C.checkpoint.step_tensors
    calls = []

    def from_rank3(files, source):
        calls.append(source)
        out = real(files, source)
        dtype, shape, sharded, pieces, differs, unproven = out["w"]
        path, text, size = files[3]
        data_offset, entries, _ = _C.checkpoint.parse_safetensors_header(path, text, size)
        _, sizes, begin, end = entries["w@0,2"]
        mine = (3, [0, 2], sizes, data_offset + begin, data_offset + end)
        out["w"] = (dtype, shape, sharded, [pieces[0], mine], differs, unproven)
        return out

    monkeypatch.setattr(_C.checkpoint, "step_tensors", from_rank3)
    with StepTensors(step) as t:
        assert [p.rank for p in t.tensors["w"].pieces] == [0, 3]
        got = torch.frombuffer(bytearray(b"".join(t.stream(t.tensors["w"]))), dtype=torch.float32).reshape(3, 4)
    assert torch.equal(got[:, :2], w[:, :2]) and torch.equal(got[:, 2:], w[:, 2:] + 100)
    md = EttkitStorageReader(step).read_metadata()
    assert sorted(path.rsplit("/", 1)[1] for path, *_ in md.storage_data.values() if path.endswith("3.safetensors")) \
        == ["rank-3.safetensors"]
    assert calls == [str(step), str(step)]


@pytest.mark.parametrize("case,message", [
    ("overlap", "the saved pieces of 'w' hold 15 elements of its [3, 4] (12): pieces overlap or are missing"),
    ("hole", "the saved pieces of 'w' hold 6 elements of its [3, 4] (12): pieces overlap or are missing"),
    ("replica", "'w@0,2' is [3, 1] in old rank 1's file and [3, 2] in old rank 0's: two boxes at the same "
                "offsets must be the same box"),
    ("both", "'w' is saved whole in old rank 1's file ('w') and in pieces in old rank 0's"),
])
def test_a_hostile_layout_is_refused_by_both_readers_with_the_cpp_message(tmp_path, case, message):
    w = torch.arange(12.0).reshape(3, 4)
    ranks = {
        "overlap": {0: {"w@0,0": w[:, :3].contiguous()}, 1: {"w@0,2": w[:, 2:].contiguous()}},
        "hole": {0: {"w@0,0": w[:, :1].contiguous()}, 1: {"w@0,3": w[:, 3:].contiguous()}},
        "replica": {0: {"w@0,0": w[:, :2].contiguous(), "w@0,2": w[:, 2:].contiguous()},
                    1: {"w@0,2": w[:, 2:3].contiguous()}},
        "both": {0: {"w@0,0": w[:, :2].contiguous()}, 1: {"w": w}},
    }[case]
    step = _step(tmp_path, ranks)
    with pytest.raises(CorruptDataError) as dcp:
        EttkitStorageReader(step).read_metadata()
    with pytest.raises(CorruptDataError) as export:
        StepTensors(step).close()
    with pytest.raises(CorruptDataError) as bound:
        _bound(step)
    assert str(dcp.value) == str(export.value) == str(bound.value)
    assert f"step '{step}': {message}" in str(dcp.value), str(dcp.value)
