"""One rank of a TorchRec trainer checkpointed by ettkit (tests/python/test_checkpoint_torchrec.py).

An ``EmbeddingBagCollection`` of four tables (table-wise on each rank, row-wise, column-wise) sharded by
``DistributedModelParallel`` over gloo ranks on CPU, trained with TorchRec's fused Adagrad (the tables and
their optimizer state are updated inside the backward kernel: no version bump, no optimizer step to hook).

``train``: eight steps on fixed batches; ``AsyncCheckpointer.save`` after steps 3 and 6 returns before its
copies are done (the model is attached) and the next step runs at once. A forward pre-hook registered after
``attach`` records whether the copies were done by the time the forward ran. Writes what step 6 held
(cloned when ``save`` returned, before the next forward) and the losses of steps 7 and 8, then kills itself
with SIGKILL. ``restore``: a fresh model (another seed), ``load_latest``, the checks below, steps 7 and 8.
``replan``: the same under another sharding plan (``PLANS``: B at 2 ranks, every table's sharding type
changed; C at 3 ranks): each rank's new shards of every table and of its Adagrad state are compared with the
same box of the saved global tensors (assembled from every saving rank's ``expected-<rank>.pt``), then steps 7
and 8 run. ``partial``: plan C, the model alone loaded with ``partial=True`` (evaluation): its shards as in
``replan``, the fused optimizer's state not read. ``plain``: one process without DMP (:func:`plain`). ``dp``:
plan D, t0 data-parallel (:func:`data_parallel_load`). Usage: ``torchrec_dmp_trainer.py
train|restore|replan|partial|plain|dp CKPT_DIR OUT_DIR`` under RANK, WORLD_SIZE and INIT_METHOD (``plain``: none).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import ettkit.sharding as S
import torch
import torch.distributed as dist
from ettkit.checkpoint import AsyncCheckpointer

TABLES = [("t0", 37, 8), ("t1", 47, 16), ("t2", 57, 24), ("t3", 67, 32)]
STEPS, SAVES = 8, (3, 6)


def plan_generators(world: int, replan: bool, data_parallel_t0: bool = False) -> dict:
    """Plan A (train, restore): t0 table-wise on rank 0, t1 row-wise, t2 column-wise, t3 table-wise on the last
    rank. Re-planned at 2 ranks (B): every table's sharding type changed; at 3 ranks (C): another mix. D (2
    ranks, ``data_parallel_t0``): t0 data-parallel (a plain tensor on every rank), the others as in B."""
    from torchrec.distributed.sharding_plan import column_wise, data_parallel, row_wise, table_row_wise, table_wise

    if data_parallel_t0:
        return {"t0": data_parallel(), "t1": column_wise(ranks=[1, 0]), "t2": table_wise(rank=1),
                "t3": table_row_wise(host_index=0)}
    if not replan:
        return {"t0": table_wise(rank=0), "t1": row_wise(), "t2": column_wise(ranks=list(range(world))),
                "t3": table_wise(rank=world - 1)}
    if world == 2:
        return {"t0": row_wise(), "t1": column_wise(ranks=[1, 0]), "t2": table_wise(rank=1),
                "t3": table_row_wise(host_index=0)}
    return {"t0": table_wise(rank=2), "t1": row_wise(), "t2": column_wise(ranks=[2, 0, 1]),
            "t3": column_wise(ranks=[0, 2])}


def build(seed: int, world: int, replan: bool = False, data_parallel_t0: bool = False):
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan
    from torchrec.distributed.types import ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(seed)
    configs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
               for n, r, d in TABLES]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.05})
    generators = plan_generators(world, replan, data_parallel_t0)
    module_plan = construct_module_sharding_plan(ebc, generators, local_size=world, world_size=world,
                                                 device_type="cpu")
    plan = ShardingPlan({"": module_plan})
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan)
    return model, plan, configs


def batch(step: int, rank: int):
    import torchrec

    g = torch.Generator().manual_seed(1000 * step + rank)
    keys = [f"f_{n}" for n, _, _ in TABLES]
    lengths = torch.randint(0, 4, (len(keys) * 3,), generator=g)
    values = torch.cat([torch.randint(0, rows, (int(n),), generator=g)
                        for (_, rows, _), n in zip(TABLES, lengths.view(len(keys), 3).sum(1))])
    return torchrec.KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)


def train_step(model, step: int, rank: int) -> float:
    out = model(batch(step, rank)).values()
    loss = (out * out).mean()
    loss.backward()  # the fused optimizer updates the tables and their momentum here
    return float(loss.detach())


def shard_tensors(state: dict) -> dict:
    """``key@offsets`` -> a copy of each local shard of each ShardedTensor in ``state`` (nested)."""
    out = {}

    def walk(x, prefix):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{prefix}.{k}" if prefix else str(k))
        elif hasattr(x, "local_shards"):
            for s in x.local_shards():
                out[f"{prefix}@{','.join(map(str, s.metadata.shard_offsets))}"] = s.tensor.detach().clone()

    walk(state, "")
    return out


def live_state(model) -> dict:
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def saved_globals(out_dir: str) -> dict:
    """Every saved ShardedTensor whole: each saving rank's shards (``expected-<rank>.pt``, cloned when save()
    returned) put at their offsets. Overlapping pieces must agree."""
    pieces = {}
    r = 0
    while os.path.exists(path := os.path.join(out_dir, f"expected-{r}.pt")):
        for name, t in torch.load(path).items():
            key, offsets = name.rsplit("@", 1)
            pieces.setdefault(key, []).append(([int(o) for o in offsets.split(",")], t))
        r += 1
    out = {}
    for key, parts in pieces.items():
        size = [max(o[d] + t.shape[d] for o, t in parts) for d in range(parts[0][1].dim())]
        whole = torch.full(size, float("nan"), dtype=parts[0][1].dtype)
        for o, t in parts:
            whole[tuple(slice(a, a + n) for a, n in zip(o, t.shape))] = t
        out[key] = whole
    return out


def plain(ckpt_dir: str, out_dir: str) -> None:
    """One process, no process group, no DMP: a plain ``EmbeddingBagCollection`` and ``torch.optim.Adagrad``.
    The step's tables load whole from their shards, and the fused Adagrad's ``momentum1`` (the sum of squared
    gradients, as ``torch.optim.Adagrad``'s ``sum``) straight into the Adagrad's ``sum`` tensors, by value
    (``partial=True``: the fused optimizer's param_groups are left out). Then steps 7 and 8 see both ranks'
    batches, whose mean loss is what the two ranks' backward passes added up to."""
    import torchrec
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    torch.manual_seed(99)
    configs = [EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"])
               for n, r, d in TABLES]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    adagrad = torch.optim.Adagrad(ebc.parameters(), lr=0.05, eps=1e-8)  # TorchRec's fused Adagrad's eps
    weights = dict(ebc.named_parameters())
    sums = {name: {f"{name.split('.')[1]}.momentum1": adagrad.state[p]["sum"]} for name, p in weights.items()}
    before = {k: v.detach().clone() for k, v in ebc.state_dict().items()}
    ck = AsyncCheckpointer(ckpt_dir, keep_last=2)
    step, _ = ck.load_latest({"model": ebc, "optim": {"state": sums}}, partial=True)
    saved = saved_globals(out_dir)
    restored = {f"model.{k}": v for k, v in ebc.state_dict().items()}
    restored.update({f"optim.state.{p}.{m}": t for p, d in sums.items() for m, t in d.items()})
    report = {"step": step, "resharded_from": ck.resharded_from, "keys": sorted(restored), "saved_keys": sorted(saved),
              "equal": sorted(k for k, t in restored.items()
                              if torch.equal(t.detach().view(torch.uint8), saved[k].view(torch.uint8))),
              "changed_by_load": sorted(k for k, v in ebc.state_dict().items() if not torch.equal(before[k], v))}
    losses = {}
    for s in range(step + 1, STEPS + 1):
        per_rank = [(ebc(batch(s, r)).values() ** 2).mean() for r in range(WORLD_SAVED)]
        losses[s] = [float(x.detach()) for x in per_rank]
        adagrad.zero_grad()
        # TorchRec divides the gradients its collectives carry back by the world size (comm_ops'
        # set_gradient_division, on by default, as DDP averages): the ranks' mean loss, not their sum.
        (sum(per_rank) / WORLD_SAVED).backward()
        adagrad.step()
    report["losses"] = losses
    with open(os.path.join(out_dir, "plain-0-1.json"), "w") as f:
        json.dump(report, f)
    ck.close()


WORLD_SAVED = 2  # the ranks that trained (test_checkpoint_torchrec.py's WORLD)


def data_parallel_load(model, ck, state: dict, out_dir: str, rank: int, world: int) -> None:
    """Plan D: t0 is data-parallel, a plain tensor on every rank, whose optimizer is the dense one (not the
    fused optimizer, which has no state for it). The full state is refused naming t0's saved momentum; the model
    alone (partial=True) loads: t0 whole on every rank from the shard rank 0 saved, the other tables resharded."""
    from ettkit import InvalidArgumentError

    report: dict = {"rank": rank}
    try:
        ck.load_latest(state)
    except InvalidArgumentError as e:
        report["refused"] = str(e)
    before = model.state_dict()["embedding_bags.t0.weight"].clone()
    step, _ = ck.load_latest({"model": model}, partial=True)
    saved = saved_globals(out_dir)
    t0 = model.state_dict()["embedding_bags.t0.weight"]
    restored = shard_tensors(live_state(model))
    report.update(step=step, resharded_from=ck.resharded_from, t0_plain=type(t0) is torch.Tensor,
                  t0_equal=torch.equal(t0.view(torch.uint8), saved["model.embedding_bags.t0.weight"].view(torch.uint8)),
                  t0_changed=not torch.equal(before, t0),
                  weights=sorted(k for k in restored if "weight@" in k),
                  equal=sorted(name for name, t in restored.items() if "weight@" in name and torch.equal(
                      t.view(torch.uint8), saved[name.rsplit("@", 1)[0]][tuple(
                          slice(int(o), int(o) + n) for o, n in zip(name.rsplit("@", 1)[1].split(","), t.shape))]
                      .contiguous().view(torch.uint8))))
    with open(os.path.join(out_dir, f"dp-{rank}-{world}.json"), "w") as f:
        json.dump(report, f)
    ck.close()
    dist.destroy_process_group()


def main() -> None:
    mode, ckpt_dir, out_dir = sys.argv[1:4]
    if mode == "plain":
        return plain(ckpt_dir, out_dir)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=os.environ["INIT_METHOD"], rank=rank, world_size=world)
    model, plan, configs = build(seed=0 if mode == "train" else 99, world=world, replan=mode in ("replan", "partial"),
                                 data_parallel_t0=mode == "dp")
    ck = AsyncCheckpointer(ckpt_dir, keep_last=2)
    state = {"model": model, "optim": model.fused_optimizer}
    report = {"rank": rank}
    if mode == "train":
        ck.attach(model=model)
        staged_at_forward = []
        pending = {}

        def after_fence(module, args):
            # Runs after ettkit's fence (registered later): the save's copies must all be done by now.
            if "h" in pending:
                staged_at_forward.append(bool(pending.pop("h").staged))

        model.register_forward_pre_hook(after_fence)
        losses = {}
        for step in range(1, STEPS + 1):
            losses[step] = train_step(model, step, rank)
            if step in SAVES:
                h = ck.save(step, state)
                pending["h"] = h
                if step == SAVES[-1]:
                    expected = shard_tensors(live_state(model))
                    handle = h
        handle.wait()
        report.update(losses=losses, staged_at_forward=staged_at_forward, refused=ck.saves_refused)
        torch.save(expected, os.path.join(out_dir, f"expected-{rank}.pt"))
        with open(os.path.join(out_dir, f"train-{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)  # no close(), no destroy_process_group(): a crash

    # ---- restore --------------------------------------------------------------------------------------
    if mode == "dp":
        return data_parallel_load(model, ck, state, out_dir, rank, world)
    before = shard_tensors(live_state(model))
    if mode in ("replan", "partial"):
        if mode == "partial":
            step, _ = ck.load_latest({"model": model}, partial=True)
        else:
            step, _ = ck.load_latest(state)
        saved = saved_globals(out_dir)
        restored = shard_tensors(live_state(model))
        # Every new shard equals the same box of the saved global tensor, bit for bit.
        report.update(step=step, resharded_from=ck.resharded_from, keys=sorted(restored), equal=sorted(
            name for name, t in restored.items()
            if torch.equal(t.view(torch.uint8), saved[name.rsplit("@", 1)[0]][tuple(
                slice(int(o), int(o) + n) for o, n in zip(name.rsplit("@", 1)[1].split(","), t.shape))].contiguous()
                .view(torch.uint8))))
        report["changed_by_load"] = sorted(k for k in restored if not torch.equal(before[k], restored[k]))
        report["saved_keys"] = sorted(saved)
        if mode == "replan":
            report["losses"] = {s: train_step(model, s, rank) for s in range(step + 1, STEPS + 1)}
        with open(os.path.join(out_dir, f"{mode}-{rank}-{world}.json"), "w") as f:
            json.dump(report, f)
        ck.close()
        dist.destroy_process_group()
        return
    step, _ = ck.load_latest(state)
    expected = torch.load(os.path.join(out_dir, f"expected-{rank}.pt"))
    restored = shard_tensors(live_state(model))
    report["step"] = step
    report["keys"] = sorted(expected)
    report["equal"] = sorted(k for k in expected if k in restored and torch.equal(
        expected[k].view(torch.uint8), restored[k].view(torch.uint8)))
    report["changed_by_load"] = sorted(k for k in expected if not torch.equal(before[k], restored[k]))
    # What ettkit recorded for each ShardedTensor, against TorchRec's own ShardedTensor metadata.
    from ettkit.checkpoint._flatten import flatten_state
    from ettkit.checkpoint._tensor_kinds import ShardedSlot

    _, _, skeleton, _, _ = flatten_state(live_state(model))
    recorded = {}

    def collect(x):
        if isinstance(x, ShardedSlot):
            recorded[x.key] = x
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)

    collect(skeleton)
    mismatched = []
    for key, slot in recorded.items():
        st = slot.live
        md = st.metadata()
        mine = [(list(o), list(s), p) for o, s, p in slot.shards]
        theirs = [(list(s.metadata.shard_offsets), list(s.metadata.shard_sizes), str(s.metadata.placement))
                  for s in st.local_shards()]
        if mine != theirs or list(slot.size) != list(md.size) or slot.dtype != md.tensor_properties.dtype:
            mismatched.append(key)
    report["recorded"] = len(recorded)
    report["recorded_mismatched"] = mismatched
    # ettkit's local build of the global metadata (from the plan, no collective) against TorchRec's.
    converted = S.from_torchrec(plan, world_size=world, ranks_per_host=world, tables=configs, qualify=False)
    built = S.build_global_metadata(converted)
    weights = live_state(model)["model"]
    local_equal = []
    for name, _, _ in TABLES:
        theirs = weights[f"embedding_bags.{name}.weight"].metadata()
        ours = built.to_sharded_tensor_metadata(name)
        if ours.shards_metadata == theirs.shards_metadata and ours.size == theirs.size:
            local_equal.append(name)
    report["local_metadata_equal"] = local_equal
    report["losses"] = {s: train_step(model, s, rank) for s in range(step + 1, STEPS + 1)}
    with open(os.path.join(out_dir, f"restore-{rank}.json"), "w") as f:
        json.dump(report, f)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
