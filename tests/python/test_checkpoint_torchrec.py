"""A real TorchRec model checkpointed by ettkit's AsyncCheckpointer (#24 item 3), restored under other plans,
at other world sizes, with a data-parallel table, and into a plain EmbeddingBagCollection on one process (#46).

Two gloo ranks on CPU run ``DistributedModelParallel`` over an ``EmbeddingBagCollection`` (table-wise on
each rank, row-wise, column-wise) with TorchRec's fused Adagrad, which updates the tables and their momentum
inside the backward kernel. ettkit saves while training continues, the ranks are killed with SIGKILL, and
fresh ranks (another init seed) restore. tests/python/torchrec_dmp_trainer.py is the trainer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from torchrec_gate import import_torchrec

import_torchrec()

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2


def run_ranks(mode: str, ckpt: str, out: str, world: int = WORLD) -> list[subprocess.CompletedProcess]:
    init = f"file://{out}/rendezvous-{mode}-{world}"  # no port to race for with other processes
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), INIT_METHOD=init, PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen([sys.executable, os.path.join(HERE, "torchrec_dmp_trainer.py"), mode, ckpt,
                                       out], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    done = []
    for p in procs:
        stdout, _ = p.communicate(timeout=300)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout))
    return done


def read(out: str, what: str, rank) -> dict:
    with open(os.path.join(out, f"{what}-{rank}.json")) as f:
        return json.load(f)


def test_dmp_with_fused_optimizer_saved_while_training_killed_and_restored(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(out)
    for p in run_ranks("train", ckpt, out):
        assert p.returncode == -signal.SIGKILL, p.stdout[-3000:]
    trained = [read(out, "train", r) for r in range(WORLD)]
    for t in trained:
        # Both saves returned before their copies were done, and the fence made the next forward (whose
        # backward rewrites the tables in the fused kernel) wait for them: nothing was refused.
        assert t["staged_at_forward"] == [True, True] and t["refused"] == 0, t
    # The committed steps are on disk (keep_last=2), the newest being 6, beside the lock the killed rank 0
    # held (the kernel released it with the process; the next checkpointer takes it).
    assert sorted(os.listdir(ckpt)) == [".lock", "latest", "step-3", "step-6"]

    for p in run_ranks("restore", ckpt, out):
        assert p.returncode == 0, p.stdout[-3000:]
    for rank in range(WORLD):
        r, t = read(out, "restore", rank), trained[rank]
        assert r["step"] == 6
        # Each rank holds its own shards of the weights and of the fused momentum (table-wise tables only on
        # their rank), and every byte of each equals what the trainer held when save() returned.
        assert len(r["keys"]) == 6 and all("momentum1" in k or "weight@" in k for k in r["keys"]), r["keys"]
        assert r["equal"] == r["keys"]
        assert r["changed_by_load"] == r["keys"]  # the fresh model's values really were replaced
        # What ettkit records for each ShardedTensor (size, dtype, this rank's offsets, sizes, placements)
        # equals TorchRec's ShardedTensor metadata: 4 tables and 3 local momentum tensors per rank.
        assert r["recorded"] == 7 and r["recorded_mismatched"] == []
        # ettkit builds every table's global ShardedTensorMetadata locally from the plan, equal to TorchRec's.
        assert r["local_metadata_equal"] == ["t0", "t1", "t2", "t3"]
        # The restored trainer goes on exactly as the uninterrupted one did: weights and Adagrad state.
        assert r["losses"] == {s: t["losses"][s] for s in ("7", "8")}

    # The same checkpoint under another sharding plan: at 2 ranks with every table's sharding type changed
    # (B), and at 3 ranks (C). Every rank's new shards of every table and of its Adagrad momentum equal the
    # same box of the saved global tensors, bit for bit.
    for world in (2, 3):
        for p in run_ranks("replan", ckpt, out, world):
            assert p.returncode == 0, p.stdout[-3000:]
        for rank in range(world):
            r = read(out, f"replan-{rank}", world)
            assert r["step"] == 6 and r["resharded_from"] == 2, r
            assert r["keys"] and r["equal"] == r["keys"], r
            assert r["changed_by_load"] == r["keys"], r
        held = sorted({k.rsplit("@", 1)[0] for rank in range(world)
                       for k in read(out, f"replan-{rank}", world)["keys"]})
        # Together the ranks hold every table and every momentum tensor that was saved.
        assert held == read(out, "replan-0", world)["saved_keys"], held
        assert len(held) == 8, held
        if world == WORLD:
            # Under plan B the next steps see the same batches: the losses are those of the uninterrupted run
            # up to floating-point reassociation (a row-wise table's pooled sums now add partial sums from
            # both ranks, in another order than the table-wise one's local sum).
            for rank in range(world):
                got, want = read(out, f"replan-{rank}", world)["losses"], trained[rank]["losses"]
                for s in ("7", "8"):
                    assert abs(got[s] - want[s]) <= 1e-6 * abs(want[s]), (rank, s, got[s], want[s])

    # The model alone, for evaluation (partial=True), under plan C at 3 ranks: every table's new shards equal
    # the saved ones; the fused optimizer's state, which the state does not hold, is not read (its shards keep
    # the fresh model's values).
    for p in run_ranks("partial", ckpt, out, 3):
        assert p.returncode == 0, p.stdout[-3000:]
    for rank in range(3):
        r = read(out, f"partial-{rank}", 3)
        weights = [k for k in r["keys"] if "weight@" in k]
        assert r["step"] == 6 and r["resharded_from"] == 2 and weights, r
        assert r["equal"] == weights and r["changed_by_load"] == weights, r
        assert any("momentum1" in k for k in r["keys"]), r  # the optimizer was there, and left alone

    # Plan D at 2 ranks: t0 data-parallel (a plain tensor on every rank, trained by the dense optimizer). The
    # fused optimizer has no place for t0's saved momentum: the full state is refused naming it and saying why
    # (every rank, nothing copied); the model alone loads, t0 whole on both ranks from the shard old rank 0 saved.
    for p in run_ranks("dp", ckpt, out, 2):
        assert p.returncode == 0, p.stdout[-3000:]
    for rank in range(2):
        r = read(out, f"dp-{rank}", 2)
        assert "'optim.state.embedding_bags.t0.weight.t0.momentum1'" in r["refused"], r
        assert "'model.embedding_bags.t0.weight' is a plain tensor in the state" in r["refused"], r
        assert r["step"] == 6 and r["resharded_from"] == 2, r
        assert r["t0_plain"] and r["t0_equal"] and r["t0_changed"], r
        assert r["weights"] and r["equal"] == r["weights"], r

    # One process without DMP or a process group (evaluation, export, debugging on one machine): a plain
    # EmbeddingBagCollection reads every table whole from the shards the 2 ranks saved, and torch.optim.Adagrad's
    # `sum` reads the fused Adagrad's momentum1 (the same quantity) by value. Every table and every momentum
    # element equals the saved global tensors bit for bit, and the next steps, fed both ranks' batches, give each
    # rank's losses of the uninterrupted run, up to floating-point reassociation: the dense backward sums a row's
    # gradient over both batches in another order than TorchRec's sparse kernel, and divides by the world size
    # in another place. (They were equal to the last bit on the 2-vCPU VM.)
    p = subprocess.run([sys.executable, os.path.join(HERE, "torchrec_dmp_trainer.py"), "plain", ckpt, out],
                       env=dict(os.environ, PYTHONWARNINGS="ignore"), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    r = read(out, "plain-0", 1)
    assert r["step"] == 6 and r["resharded_from"] == 2, r
    assert r["keys"] == r["saved_keys"] and len(r["keys"]) == 8, r
    assert r["equal"] == r["keys"], r
    assert len(r["changed_by_load"]) == 4, r  # the fresh tables really were replaced
    for s in ("7", "8"):
        for rank in range(WORLD):
            got, want = r["losses"][s][rank], trained[rank]["losses"][s]
            assert abs(got - want) <= 1e-6 * abs(want), (rank, s, got, want)
