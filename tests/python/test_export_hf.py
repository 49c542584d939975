"""``ettkit export STEP --format hf OUT`` (#67): a GPT-2 step saved by 2 FSDP2 ranks (gloo) becomes a Hugging
Face model directory that ``GPT2LMHeadModel.from_pretrained`` loads with logits equal, bit for bit, to the
trained model's; sharded into an index past ``--max-shard-size``; the tied ``lm_head.weight`` written once;
names mapped; a corrupt byte, a missing manifest, a wrong prefix and an earlier export refused naming the file
or field. The processes are tests/python/export_hf_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2LMHeadModel

from ettkit.errors import CorruptCheckpointError, CorruptDataError, InvalidArgumentError
from ettkit.integrations.hf_export import export_hf

WORKER = os.path.join(os.path.dirname(__file__), "export_hf_worker.py")


def save_gpt2(tmp, world: int):
    """``world`` ranks of export_hf_worker.py train and save; returns (step dir, dir with logits.pt and
    config.json)."""
    ckpt, out = tmp / f"ckpt-{world}", tmp / f"ref-{world}"
    init = f"file://{tmp / f'rdv-{world}'}"
    procs = [subprocess.Popen([sys.executable, WORKER, "fsdp2", str(r), str(world), init, str(ckpt), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    errs = [p.communicate(timeout=300)[1][-3000:] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, errs
    return ckpt / "step-2", out


@pytest.fixture(scope="module")
def fsdp2_step(tmp_path_factory):
    return save_gpt2(tmp_path_factory.mktemp("export-fsdp2"), 2)


def logits_of(model_dir) -> torch.Tensor:
    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    tokens = torch.randint(0, model.config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_a_two_rank_fsdp2_step_exported_on_the_command_line_loads_with_equal_logits(fsdp2_step, tmp_path):
    step, ref = fsdp2_step
    assert sorted(p for p in os.listdir(step) if p.endswith(".safetensors")) == ["rank-0.safetensors",
                                                                                 "rank-1.safetensors"]
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "ettkit", "export", str(step), "--format", "hf", str(out),
                        "--config", str(ref / "config.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "lm_head.weight tied to transformer.wte.weight" in r.stdout
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names  # the tied weight once
    assert not any(n.startswith(("model.", "optim.")) for n in names)
    assert torch.equal(logits_of(out), torch.load(ref / "logits.pt"))


def test_an_export_past_the_shard_size_is_an_index_that_loads_the_same(fsdp2_step, tmp_path):
    step, ref = fsdp2_step
    r = export_hf(step, tmp_path / "hf", config=ref / "config.json", max_shard_size="100KB")
    shards = [f for f in r.files if f.startswith("model-")]
    assert len(shards) >= 3 and r.files[-1] == "model.safetensors.index.json"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(r.weight_map) and set(index["weight_map"].values()) == set(shards)
    for f in shards:  # each file within the limit unless one tensor alone is larger
        with safe_open(str(tmp_path / "hf" / f), "pt") as sf:
            tensors = list(sf.keys())
        assert len(tensors) == 1 or os.path.getsize(tmp_path / "hf" / f) <= 100_000 + 4096
    assert index["metadata"]["total_size"] == r.total_bytes
    assert r.bytes_verified >= r.total_bytes  # every byte written was verified first
    assert torch.equal(logits_of(tmp_path / "hf"), torch.load(ref / "logits.pt"))


def test_a_one_process_step_exports_the_same_way(tmp_path):
    step, ref = save_gpt2(tmp_path, 1)
    export_hf(step.parent, tmp_path / "hf", config=ref / "config.json")  # the checkpoint dir: its newest step
    assert torch.equal(logits_of(tmp_path / "hf"), torch.load(ref / "logits.pt"))


def test_prefixes_are_mapped_and_tied_weights_can_be_kept(fsdp2_step, tmp_path):
    step, ref = fsdp2_step
    r = export_hf(step, tmp_path / "a", strip_prefix="model.transformer.", add_prefix="gpt.", tied={})
    assert r.tied == {} and "gpt.wte.weight" in r.weight_map and "gpt.h.0.attn.c_attn.weight" in r.weight_map
    assert not any(n.startswith("gpt.lm_head") or "lm_head" in n for n in r.weight_map)  # outside the prefix
    r = export_hf(step, tmp_path / "b", tied={})  # no config: every tensor, the tied one too
    assert "lm_head.weight" in r.weight_map and r.tied == {}
    with pytest.raises(InvalidArgumentError, match="'nothing.'"):
        export_hf(step, tmp_path / "c", strip_prefix="nothing.")
    with pytest.raises(InvalidArgumentError, match="'lm_head.weight' is not the same tensor"):
        export_hf(step, tmp_path / "d", tied={"lm_head.weight": "transformer.wpe.weight"})


def test_bad_input_is_refused_naming_the_file_or_field(fsdp2_step, tmp_path):
    step, ref = fsdp2_step
    bad = tmp_path / "step-2"
    bad.mkdir()
    for f in os.listdir(step):
        (bad / f).write_bytes((step / f).read_bytes())
    data = bytearray((bad / "rank-1.safetensors").read_bytes())
    data[-5] ^= 0x40  # one bit of the last tensor's data
    (bad / "rank-1.safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="rank-1.safetensors': checksum chunk 0"):
        export_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()  # nothing half-written in place
    r = subprocess.run([sys.executable, "-m", "ettkit", "export", str(bad), "--format", "hf", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "rank-1.safetensors" in r.stderr and "Traceback" not in r.stderr

    manifest = json.loads((step / "manifest.json").read_text())
    manifest["files"]["rank-0.safetensors"]["chunks"] = ["zz"]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptDataError, match=r"files\['rank-0.safetensors'\].chunks"):
        export_hf(bad, tmp_path / "out")
    (bad / "manifest.json").unlink()
    with pytest.raises(InvalidArgumentError, match="no manifest.json"):
        export_hf(bad, tmp_path / "out")

    export_hf(step, tmp_path / "twice")
    with pytest.raises(InvalidArgumentError, match="already holds model files"):
        export_hf(step, tmp_path / "twice")
    export_hf(step, tmp_path / "twice", overwrite=True)
    with pytest.raises(InvalidArgumentError, match="max_shard_size='lots'"):
        export_hf(step, tmp_path / "x", max_shard_size="lots")


def hand_made_step(tmp_path, pieces: dict[int, dict[str, torch.Tensor]]):
    """A committed step written by hand: ``{rank: {name: tensor}}`` as each rank's safetensors file, and a
    manifest with the chunk checksums a save computes (XXH3-64 per 4 MiB chunk)."""
    from safetensors.torch import save_file

    from ettkit import _C

    step = tmp_path / "ckpt" / "step-1"
    step.mkdir(parents=True)
    files = {}
    for rank, tensors in pieces.items():
        save_file(tensors, str(step / f"rank-{rank}.safetensors"))
        data = (step / f"rank-{rank}.safetensors").read_bytes()
        chunks = [_C.xxh3_hex(data[i:i + (4 << 20)]) for i in range(0, len(data), 4 << 20)]
        files[f"rank-{rank}.safetensors"] = {"size": len(data), "chunk_bytes": 4 << 20, "chunks": chunks,
                                             "xxh3": chunks[0]}
    (step / "manifest.json").write_text(json.dumps({"format": "ettkit-checkpoint", "version": 1, "step": 1,
                                                    "world_size": len(pieces), "files": files}))
    return step


def test_pieces_that_are_not_rows_are_put_together_and_overlaps_refused(tmp_path):
    # A column split (Shard(1)) over 2 ranks, and a 2 x 2 grid of a 2-D mesh's (Shard(0), Shard(1)) pieces
    # with rank 3 repeating rank 0's box (a replica): the export is each whole tensor, bit for bit.
    whole = torch.arange(20.0).reshape(4, 5)
    grid = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    step = hand_made_step(tmp_path, {
        0: {"model.w@0,0": whole[:, :2].contiguous(), "model.g@0,0": grid[:2, :3].contiguous()},
        1: {"model.w@0,2": whole[:, 2:].contiguous(), "model.g@0,3": grid[:2, 3:].contiguous(),
            "model.g@2,0": grid[2:, :3].contiguous()},
        2: {"model.g@2,3": grid[2:, 3:].contiguous()},
        3: {"model.g@0,0": grid[:2, :3].contiguous()},
    })
    r = export_hf(step, tmp_path / "out")
    from safetensors.torch import load_file

    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert torch.equal(out["w"], whole) and torch.equal(out["g"], grid) and out["g"].dtype == torch.bfloat16
    assert r.total_bytes == whole.nbytes + grid.nbytes

    overlap = hand_made_step(tmp_path / "o", {0: {"model.w@0,0": whole[:3].contiguous()},
                                              1: {"model.w@2,0": whole[2:].contiguous()}})
    with pytest.raises(CorruptDataError, match="pieces of 'model.w' hold 25 elements of its \\[4, 5\\]"):
        export_hf(overlap, tmp_path / "o" / "out")
