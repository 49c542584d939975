"""Elastic restore (#20 item 2): a step saved by one number of gloo ranks loads at another. Each rank reads
only the byte ranges of the old files its new shards need (row-wise, column-wise and table-wise
ShardedTensors; DTensors with Shard(0), Shard(1) and Replicate() on a 1-D mesh), replicated plain tensors (a Linear and its Adam state) come from one copy, the values are
the global tensor's, byte for byte; a corrupt range that a rank needs sends every rank to the previous step
together; a state whose tables do not match the checkpoint is refused naming them."""

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "reshard_worker.py")


def run(tmp_path, name, world, ckpt, mode, step=None):
    out = tmp_path / f"out-{name}"
    out.mkdir(exist_ok=True)
    init = f"file://{tmp_path / ('rendezvous-' + name)}"
    extra = [str(step)] if step is not None else []
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(world), init, str(ckpt), mode, str(out), *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = [p.communicate(timeout=300) for p in procs]
    return [p.returncode for p in procs], [e for _, e in results], out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Step 5 saved by 4 ranks and by 3 ranks (two checkpoint directories)."""
    tmp = tmp_path_factory.mktemp("reshard")
    dirs = {}
    for world in (4, 3):
        codes, errs, _ = run(tmp, f"save{world}", world, tmp / f"ckpt-{world}", "save")
        assert codes == [0] * world, errs
        dirs[world] = tmp / f"ckpt-{world}"
    return dirs


@pytest.mark.parametrize("saved_by,load_at", [(4, 2), (4, 3), (4, 5), (4, 1), (3, 2), (3, 3)],
                         ids=lambda v: str(v))
def test_a_step_loads_at_another_world_size_reading_only_what_each_rank_needs(tmp_path, saved, saved_by, load_at):
    codes, errs, out = run(tmp_path, "load", load_at, saved[saved_by], "load")
    assert codes == [0] * load_at, errs
    for r in range(load_at):
        got = json.loads((out / f"load-{r}.json").read_text())
        assert got["step"] == 5 and got["extra"] == {"step": 5, "saved_by": saved_by}
        assert got["ok"] == {"row": True, "col": True, "tab": True, "dt_row": True, "dt_col": True, "dt_rep": True,
                             "model": True, "optim": True}, (r, got)
        assert got["warnings"] == []
        if saved_by == load_at:  # the same layout: each rank reads its own file, as always
            assert got["resharded_from"] is None and got["bytes"] is None
            continue
        assert got["resharded_from"] == saved_by
        # Exactly the bytes of this rank's new shards and of one copy of the replicated tensors.
        assert got["bytes"]["read"] == got["needed_bytes"], (r, got)
        assert got["bytes"]["verified"] > 0


@pytest.mark.parametrize("load_at", [2, 3])
def test_dcp_loads_an_ettkit_step_at_another_world_size(tmp_path, saved, load_at):
    # ettkit saved at 4 ranks -> dcp.load at 2 or 3 with EttkitStorageReader (#20 item 3).
    codes, errs, out = run(tmp_path, "dcp", load_at, saved[4], "dcp")
    assert codes == [0] * load_at, errs
    for r in range(load_at):
        got = json.loads((out / f"dcp-{r}.json").read_text())
        assert got == {"row": True, "col": True, "tab": True, "dt_row": True, "dt_col": True, "dt_rep": True,
                       "model": True}, (r, got)


def test_a_corrupt_range_a_rank_needs_sends_every_rank_to_the_previous_step(tmp_path):
    ckpt = tmp_path / "ckpt"
    for step in (3, 5):
        codes, errs, _ = run(tmp_path, f"save{step}", 4, ckpt, "save", step)
        assert codes == [0] * 4, errs
    # Old rank 2 held rows 6-8 of the row-wise table; at 2 ranks they are rank 1's.
    data = ckpt / "step-5" / "rank-2.safetensors"
    raw = bytearray(data.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    raw[header + 4] ^= 0x20
    data.write_bytes(bytes(raw))
    codes, errs, out = run(tmp_path, "load", 2, ckpt, "load")
    assert codes == [0, 0], errs
    for r in range(2):
        got = json.loads((out / f"load-{r}.json").read_text())
        assert got["step"] == 3 and all(got["ok"].values()), got
        assert any("newer steps [5]" in w for w in got["warnings"]), got["warnings"]
    assert "rank-2.safetensors' bytes [0, " in errs[0] + errs[1]


def test_a_table_of_another_size_is_refused_naming_it(tmp_path, saved):
    # A 1-rank job whose "row" table has 11 rows: the checkpoint's has 10.
    script = tmp_path / "other.py"
    script.write_text(f"""
import sys, torch, torch.distributed as dist
sys.path.insert(0, {os.path.dirname(WORKER)!r})
import reshard_worker as w
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
import ettkit
from ettkit.checkpoint import AsyncCheckpointer
dist.init_process_group("gloo", init_method="file://{tmp_path}/rdv", rank=0, world_size=1)
t = init_from_local_shards([Shard(torch.zeros(11, 6), ShardMetadata([0, 0], [11, 6], "rank:0/cpu"))], [11, 6])
tables = {{k: w.sharded(k, 1, 0, torch.zeros(10, 6)) for k in ("col", "tab")}}
tables["row"] = t
mesh = w.init_device_mesh("cpu", (1,))
dtensors = {{k: w.dtensor(k, mesh, torch.zeros(10, 6)) for k in w.DT_PLACEMENT}}
lin, opt = w.model_and_optim(False)
with AsyncCheckpointer({str(saved[4])!r}, recorder=None, read_only=True) as ck:
    try:
        ck.load_latest({{"tables": tables, "dtensors": dtensors, "model": lin, "optim": opt}})
    except ettkit.InvalidArgumentError as e:
        print("REFUSED", e)
""")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in r.stdout and "'tables.row'" in r.stdout and "[11, 6]" in r.stdout, r.stdout + r.stderr[-3000:]
