"""A layout change across kinds (#46, one rule for layout changes): a step saved sharded loads into plain
tensors (a plain model on one process, for evaluation or export; a data-parallel table on every rank), and a
step saved whole loads into DTensors and ShardedTensors (a one-process model restored at several ranks).
The values are the global tensors', element for element. What cannot be right is still refused before
anything is copied, naming the key: another global shape either way, and per-rank state (a tensor saved
whole that differs between the old ranks) read as shards. layout_kind_worker.py is the rank."""

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "layout_kind_worker.py")
TABLES = ["dtensors.dt_col", "dtensors.dt_rep", "dtensors.dt_row", "tables.col", "tables.row", "tables.tab"]


def run(tmp_path, world, ckpt, mode):
    out = tmp_path / f"out-{mode}-{world}"
    out.mkdir(exist_ok=True)
    init = f"file://{tmp_path / f'rendezvous-{mode}-{world}'}"
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), str(world), init, str(ckpt), mode, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * world, errs
    return [json.loads((out / f"{mode}-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kinds")
    run(tmp, 3, tmp / "sharded-3", "save_sharded")
    run(tmp, 1, tmp / "whole-1", "save_whole")
    run(tmp, 2, tmp / "whole-2", "save_whole")
    return tmp


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_sharded_step_loads_whole_on_one_process_and_as_a_replica_on_every_rank(tmp_path, steps, world):
    # Saved by 3 ranks (row-, column- and table-wise ShardedTensors, Shard(0)/Shard(1)/Replicate DTensors);
    # loaded by 1 process without a process group, by 2 ranks (another world size) and by 3 (the same world
    # size, each rank's file lacking the pieces the others saved).
    for r, got in enumerate(run(tmp_path, world, steps / "sharded-3", "load_whole")):
        assert got.get("refused") is None and got["step"] == 5, got
        assert got["equal"] == TABLES + ["rep"], (r, got)
        assert got["resharded_from"] == 3
        # Every table whole on every rank: each rank reads the whole of each, once.
        assert got["bytes"]["read"] == 7 * 10 * 6 * 4, got


def test_a_sharded_step_read_whole_into_another_shape_is_refused_naming_it(tmp_path, steps):
    got = run(tmp_path, 1, steps / "sharded-3", "load_whole_wrong")[0]
    msg = got["refused"]
    assert "'tables.col' is [11, 6] in the state" in msg and "making up [10, 6]" in msg, msg
    assert "step 5" in msg and "tables.row" not in msg, msg
    assert got["untouched"] == TABLES, got  # nothing was copied


@pytest.mark.parametrize("world", [2, 3])
def test_a_step_saved_whole_by_one_process_loads_into_dtensors_and_sharded_tensors(tmp_path, steps, world):
    for r, got in enumerate(run(tmp_path, world, steps / "whole-1", "load_sharded")):
        assert got.get("refused") is None and got["step"] == 5, got
        assert got["w_dt"] is True and got["w_st"] is True, (r, got)
        assert got["resharded_from"] == 1


def test_a_step_saved_whole_read_as_shards_of_another_global_shape_is_refused_naming_it(tmp_path, steps):
    for got in run(tmp_path, 2, steps / "whole-1", "load_sharded_wrong"):
        msg = got["refused"]
        assert "'w_dt' is [11, 6] in the state (sharded)" in msg and "saved it whole as [10, 6]" in msg, msg
        assert got["w_dt_untouched"], got


def test_per_rank_state_saved_whole_is_not_read_as_shards(tmp_path, steps):
    # Saved by 2 ranks whose copies of 'per_rank' differ: no global tensor exists to take a box of.
    for got in run(tmp_path, 2, steps / "whole-2", "load_per_rank_sharded"):
        msg = got["refused"]
        assert "'per_rank' was saved whole and differs between old ranks 0 and 1" in msg, msg
        assert got["w_dt_untouched"], got
    # The replicas alone load at the same world size (a layout change, not another world size).
    for got in run(tmp_path, 2, steps / "whole-2", "load_sharded"):
        assert got.get("refused") is None and got["w_dt"] is True and got["w_st"] is True, got
        assert got["resharded_from"] == 2  # read by resharding at the same world size (a layout change)


def test_dcp_load_through_the_ettkit_reader_reads_a_sharded_step_whole_too(steps):
    # The same step through dcp.load (EttkitStorageReader) in this process, without a process group: DCP plans
    # the reads from the chunks the reader lists, the same pieces the native loader reads.
    import torch
    import torch.distributed.checkpoint as dcp

    import layout_kind_worker as W
    from ettkit.checkpoint import EttkitStorageReader

    state = {group: {k: torch.zeros(W.ROWS, W.COLS) for k in kinds} for group, kinds in W.KINDS.items()}
    dcp.load(state, storage_reader=EttkitStorageReader(str(steps / "sharded-3")))
    assert all(torch.equal(state[g][k], W.values(k)) for g, kinds in W.KINDS.items() for k in kinds)
