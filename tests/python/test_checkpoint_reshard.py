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


PER_RANK = """
import json, sys, torch, torch.distributed as dist
import ettkit
from ettkit.checkpoint import AsyncCheckpointer
rank, world, init, ckpt, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
lin = torch.nn.Linear(3, 2)
torch.nn.init.constant_(lin.weight, 0.5)  # a replica: the same on every rank, as DDP keeps it
torch.nn.init.constant_(lin.bias, 0.25)
# A per-rank tensor saved whole: a per-rank generator's state (what a data-parallel rank keeps for its own
# dropout masks): it differs on every rank.
gen = torch.Generator().manual_seed(100 + rank)
state = {"model": lin, "rng": gen.get_state() if mode == "save" else torch.zeros_like(gen.get_state())}
result = {}
with AsyncCheckpointer(ckpt, recorder=None, reshard_whole_from_rank0=mode == "load_rank0") as ck:
    if mode == "save":
        ck.save(2, state).wait()
    elif mode in ("load", "load_rank0"):
        try:
            result["step"] = ck.load_latest(state)[0]
            result["rng_seed_of"] = [s for s in range(100, 110)
                                     if torch.equal(state["rng"], torch.Generator().manual_seed(s).get_state())]
        except ettkit.InvalidArgumentError as e:
            result["refused"] = str(e)
        result["rng_untouched"] = bool((state["rng"] == 0).all()) if "refused" in result else None
    else:  # dcp: the replicated model alone reads; the per-rank tensor is refused
        import torch.distributed.checkpoint as dcp
        from ettkit.checkpoint import EttkitStorageReader
        sd = {"model.weight": torch.zeros(2, 3)}
        dcp.load(sd, storage_reader=EttkitStorageReader(ckpt))
        result["weight"] = sd["model.weight"].tolist()
        try:
            dcp.load({"rng": torch.zeros_like(gen.get_state())}, storage_reader=EttkitStorageReader(ckpt))
        except BaseException as e:  # DCP wraps a rank's error in a CheckpointException, a BaseException
            result["refused"] = f"{type(e).__name__}: {e}"
with open(f"{out}/{mode}-{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""


def run_script(tmp_path, source, name, world, ckpt, mode):
    """Runs `source` as `world` gloo ranks (argv: rank world init ckpt mode out); each writes
    out/<mode>-<rank>.json, returned in rank order."""
    script = tmp_path / "script.py"
    script.write_text(source)
    out = tmp_path / f"out-{name}"
    out.mkdir()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), f"file://{tmp_path}/rdv-{name}",
                               str(ckpt), mode, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(world)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, errs
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(world)]


def test_per_rank_state_saved_whole_is_refused_at_another_world_size_not_replaced_by_rank_0s(tmp_path):
    # A whole tensor is read from one old rank's copy only when the digests in the old headers show every old
    # rank saved the same bytes; a per-rank one (here a per-rank generator state) is refused naming it.
    ckpt = tmp_path / "ckpt"

    def go(name, world, mode):
        return run_script(tmp_path, PER_RANK, name, world, ckpt, mode)

    go("save", 2, "save")
    for world in (1, 3):
        for got in go(f"load{world}", world, "load"):
            assert "'rng' was saved whole and differs between old ranks 0 and 1" in got["refused"], got
            assert "'model." not in got["refused"], got  # the replicated Linear is fine
            assert got["rng_untouched"] is True
    # At the world size that saved it, each rank gets its own generator state back.
    assert [g["rng_seed_of"] for g in go("load2", 2, "load")] == [[100], [101]]
    # Told that old rank 0 is the authority (what DDP does with its buffers): its copy on every new rank.
    assert [g["rng_seed_of"] for g in go("load_rank0", 3, "load_rank0")] == [[100], [100], [100]]
    for got in go("dcp", 1, "dcp"):
        assert got["weight"] == [[0.5] * 3] * 2
        assert "InvalidArgumentError" in got["refused"] and "'rng' was saved whole and differs" in got["refused"], got


ETTKIT_PLAN = """
import json, sys, torch, torch.distributed as dist
import ettkit
from ettkit import sharding
from ettkit.checkpoint import AsyncCheckpointer
rank, world, init, ckpt, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
full = torch.arange(13 * 4, dtype=torch.float32).reshape(13, 4)
plan = sharding.ShardingPlan([sharding.Table("t", 13, 4, "float32", "row_wise")], world_size=world,
                             ranks_per_host=world) if rank == 0 else None
md = sharding.build_global_metadata(sharding.broadcast_plan(plan))
(piece,) = [s for s in md.local_shards(rank) if s.table == "t"]
(r0, _), (n, _) = piece.shard.offsets, piece.shard.sizes
rows = full[r0:r0 + n].clone() if mode == "save" else torch.zeros(n, 4)
result = {"rows": [r0, n]}
table = md.to_sharded_tensor("t", rank, [rows])
result["no_copy"] = table.local_shards()[0].tensor.data_ptr() == rows.data_ptr()
for bad in ([], [torch.zeros(n + 1, 4)], [torch.zeros(n, 4, dtype=torch.float64)]):
    try:
        md.to_sharded_tensor("t", rank, bad)
    except ettkit.InvalidArgumentError as e:
        result.setdefault("refused", []).append(str(e))
with AsyncCheckpointer(ckpt, recorder=None) as ck:
    if mode == "save":
        ck.save(4, {"t": table}).wait()
    else:
        result["step"] = ck.load_latest({"t": table})[0]
        result["resharded_from"] = ck.resharded_from
        result["ok"] = torch.equal(rows, full[r0:r0 + n])
with open(f"{out}/{mode}-{rank}.json", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
"""


def test_tables_kept_as_plain_tensors_placed_by_an_ettkit_plan_reshard(tmp_path):
    # #20 item 1's third source of placement: an ettkit ShardingPlan. The plain row tensors are wrapped without
    # a copy or a collective; saved by 2 ranks, loaded by 3 (13 rows: 7/6 -> 5/5/3, TorchRec's row-wise blocks) and by 1.
    ckpt = tmp_path / "ckpt"
    saved = run_script(tmp_path, ETTKIT_PLAN, "save", 2, ckpt, "save")
    assert [g["rows"] for g in saved] == [[0, 7], [7, 6]]
    for world, rows in ((3, [[0, 5], [5, 5], [10, 3]]), (1, [[0, 13]])):
        got = run_script(tmp_path, ETTKIT_PLAN, f"load{world}", world, ckpt, "load")
        assert [g["rows"] for g in got] == rows
        for g in got:
            assert g["step"] == 4 and g["resharded_from"] == 2 and g["ok"] is True and g["no_copy"] is True, g
            assert len(g["refused"]) == 3, g
            assert "holds 1 shard(s) in the plan, but 0 local tensor(s)" in g["refused"][0]
            assert "the plan says" in g["refused"][1] and "torch.float64" in g["refused"][2]
