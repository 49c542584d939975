"""Processes of test_checkpoint_fsdp2.py.

python fsdp2_worker.py MODE RANK WORLD INIT CKPT_DIR OUT_DIR

An FSDP2 trainer written the way LLM users write one: ``fully_shard`` on a 1-D CPU mesh with gloo, an
embedding, two linear blocks, LayerNorm and a head, AdamW, ``{"model": model, "optim": optimizer}`` saved
by an AsyncCheckpointer attached to both (saves overlap the next steps, FSDP2's own hooks in place).

- ``train``: saves once before the first step (the fresh AdamW has no state yet), then after every
  SAVE_EVERY-th step, writing the whole tensors each save holds (``full_tensor()``) to
  OUT_DIR/saved-<step>.pt; waits until step DURABLE_STEP is durable and kills itself with SIGKILL as step
  KILL_STEP begins, the save of the step before still in flight (the restart loads that step if it
  committed, DURABLE_STEP if not).
- ``resume``: a fresh model and a fresh AdamW (no state) load the newest step and train to LAST_STEP; in
  the same process an uninterrupted run trains steps 1..LAST_STEP. Writes both runs' losses per step and
  the tensors whose final values differ to OUT_DIR/resume-<rank>.json.
- ``load``: at any world size, a fresh model and AdamW load the newest step (resharding it) and compare
  every whole tensor with saved-<step>.pt; then the same tensors, zeroed, are read again by ``dcp.load``
  through ``EttkitStorageReader``. Writes OUT_DIR/load-<world>-<rank>.json.
- ``export`` (one process, no process group): the newest step into a plain ``Net``: the model alone, then
  with an AdamW that has taken a step (one before its first step is refused).
- ``plain_train`` (one process, no process group, no FSDP2): trains, saves step PLAIN_STEPS and goes on to
  LAST_STEP (the reference); ``scale_out``: FSDP2 at 2 ranks resumes that step (tensors saved whole read as
  shards).
- ``case:<name>`` (one rank): a tensor subclass saved through every path that hands tensors to C++
  (AsyncCheckpointer, DcpStager, the C++ Stager itself); writes OUT_DIR/<name>.json. A crash shows as the
  exit status.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._pytree import tree_map

import ettkit
from ettkit.checkpoint import AsyncCheckpointer, latest_step

SAVE_EVERY, DURABLE_STEP, KILL_STEP, LAST_STEP = 2, 4, 7, 9
VOCAB, DIM = 10, 6  # uneven shards at 3 ranks: 4/4/2 embedding rows; the head's one row 1/0 at 2 ranks


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        h = self.emb(x)
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(self.norm(h)).squeeze(-1)


def build(world: int):
    """The same initial weights on every rank and in every process, sharded by FSDP2."""
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def train_step(model, optimizer, step: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randint(0, VOCAB, (8,), generator=g), torch.randn(8, generator=g)
    optimizer.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    return loss.item()


def whole(model, optimizer) -> dict:
    """Every tensor of the state as the whole tensor (a collective: every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        out[f"model.{name}"] = p.full_tensor()
        for field, v in optimizer.state[p].items():
            out[f"optim.{name}.{field}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out


def mismatches(got: dict, want: dict) -> list:
    return sorted(k for k in set(got) | set(want) if k not in got or k not in want or not torch.equal(got[k], want[k]))


def train(rank: int, world: int, ckpt: str, out: str) -> None:
    model, optimizer = build(world)
    with AsyncCheckpointer(ckpt, recorder=None, keep_last=5) as ck:
        ck.attach(model=model, optimizer=optimizer)
        state = {"model": model, "optim": optimizer}
        handles = {0: ck.save(0, state)}
        for step in range(1, KILL_STEP + 1):
            if step == KILL_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
            train_step(model, optimizer, step, rank)
            if step % SAVE_EVERY == 0:
                handles[step] = ck.save(step, state)
                saved = whole(model, optimizer)  # what the save holds (read only: its copies may still run)
                if rank == 0:
                    torch.save(saved, os.path.join(out, f"saved-{step}.pt"))
            if step == DURABLE_STEP + 1:
                handles[DURABLE_STEP].wait()
                assert ck.overlapped and all(handles[s].durable for s in range(0, DURABLE_STEP + 1, SAVE_EVERY))
                assert ck.saves_refused == 0 and ck.saves_failed == 0


def resume(rank: int, world: int, ckpt: str, out: str) -> None:
    model, optimizer = build(world)
    assert not optimizer.state
    with AsyncCheckpointer(ckpt, recorder=None) as ck:
        step, _ = ck.load_latest({"model": model, "optim": optimizer})
    resumed = {s: train_step(model, optimizer, s, rank) for s in range(step + 1, LAST_STEP + 1)}
    ref_model, ref_optimizer = build(world)
    reference = {s: train_step(ref_model, ref_optimizer, s, rank) for s in range(1, LAST_STEP + 1)}
    differ = mismatches(whole(model, optimizer), whole(ref_model, ref_optimizer))
    with open(os.path.join(out, f"resume-{rank}.json"), "w") as f:
        json.dump({"step": step, "resumed": resumed, "reference": reference, "final_differ": differ}, f)


def load(rank: int, world: int, ckpt: str, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    from ettkit.checkpoint import EttkitStorageReader

    model, optimizer = build(world)
    with AsyncCheckpointer(ckpt, recorder=None, read_only=True) as ck:
        step, _ = ck.load_latest({"model": model, "optim": optimizer})
        resharded_from = ck.resharded_from
    saved = torch.load(os.path.join(out, f"saved-{step}.pt"))
    got = whole(model, optimizer)
    result = {"step": step, "resharded_from": resharded_from, "tensors": len(got),
              "ettkit_differ": mismatches(got, saved)}
    # dcp.load into the same tensors, zeroed first: the optimizer's state by its integer keys, as saved.
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
            for v in optimizer.state[p].values():
                v.zero_()
    dcp.load({"model": model.state_dict(), "optim": {"state": optimizer.state_dict()["state"]}},
             storage_reader=EttkitStorageReader(ckpt))
    result["dcp_differ"] = mismatches(whole(model, optimizer), saved)
    with open(os.path.join(out, f"load-{world}-{rank}.json"), "w") as f:
        json.dump(result, f)


# ---- tensor subclasses on one rank ---------------------------------------------------------------------

class Wrapped(torch.Tensor):
    """A ``__torch_dispatch__`` wrapper ettkit does not know (what quantization and tracing libraries make):
    its storage is an empty placeholder, its values are in ``inner``."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = func(*tree_map(lambda x: x.inner if isinstance(x, Wrapped) else x, args),
                   **tree_map(lambda x: x.inner if isinstance(x, Wrapped) else x, kwargs or {}))
        return tree_map(lambda x: Wrapped(x) if isinstance(x, torch.Tensor) else x, out)


class Tagged(torch.Tensor):
    """A plain subclass (``as_subclass``): its own storage holds its values."""


def refused(fn) -> str:
    """The InvalidArgumentError ``fn`` raises (a typed refusal), or "" when it returns."""
    try:
        fn()
    except ettkit.InvalidArgumentError as e:
        return str(e)
    return ""


def roundtrip(ckpt: str, make) -> dict:
    """Saves make(values) with the native checkpointer, loads it into make(zeros) in place, and stages it
    with DcpStager; the values come back equal."""
    from ettkit.checkpoint import DcpStager

    values = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    src, dst = make(values), make(torch.zeros(6, 4))
    with AsyncCheckpointer(ckpt, recorder=None) as ck:
        ck.save(1, {"x": src}).wait()
        step, _ = ck.load_latest({"x": dst})
    staged = DcpStager().stage({"x": src})["x"]
    local = (lambda t: t.to_local() if hasattr(t, "to_local") else t.local_shards()[0].tensor)
    return {"type": type(src).__name__, "is_parameter": isinstance(src, nn.Parameter), "step": step,
            "loaded": torch.equal(local(dst), values), "staged": torch.equal(local(staged), values),
            "staged_type": type(staged).__name__}


def dcp_inline(ckpt: str, mesh) -> dict:
    """``dcp.async_save(..., async_stager=DcpStager())`` as DcpStager's docstring shows it: the stager is
    dropped when async_save returns, and DCP's background write runs only after it was collected and its
    memory could have been reused (the writer waits for an event set then)."""
    import gc
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    from ettkit.checkpoint import DcpStager

    gate = threading.Event()

    class GatedWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            gate.wait()
            return super().write_data(plan, planner)

    g = torch.Generator().manual_seed(7)
    state = {"w": torch.randn(1 << 18, generator=g), "dt": distribute_tensor(torch.randn(64, 8, generator=g), mesh,
                                                                              [DShard(0)])}
    want = {"w": state["w"].clone(), "dt": state["dt"].to_local().clone()}
    future = dcp.async_save(state, storage_writer=GatedWriter(ckpt), async_stager=DcpStager())
    gc.collect()
    filler = [torch.full((1 << 18,), 7.0) for _ in range(16)]  # memory the freed arena could go to
    gate.set()
    future.result()
    back = {"w": torch.zeros(1 << 18), "dt": distribute_tensor(torch.zeros(64, 8), mesh, [DShard(0)])}
    dcp.load(back, checkpoint_id=ckpt)
    return {"equal": torch.equal(back["w"], want["w"]) and torch.equal(back["dt"].to_local(), want["dt"]),
            "filler": len(filler)}


def first_step(mesh) -> dict:
    """For each optimizer the rule knows, over FSDP2's DTensor parameters: the state created ahead of the
    first step has the fields, dtypes, devices and layouts the step creates, holds zeros and step 0, and
    training from it is bit for bit the training from a fresh optimizer."""
    from ettkit.checkpoint._optim_state import create_first_step_state

    optimizers = {
        "Adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.05, amsgrad=True),
        "AdamW": lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1),
        "SGD_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
        "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05),
        "RMSprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5, centered=True),
        "SGD_dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1),
        "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
    }

    def sharded(make):
        torch.manual_seed(0)
        model = Net()
        fully_shard(model, mesh=mesh)
        return model, make(model.parameters())

    def layout(opt) -> list:
        return [{f: (type(v).__name__, str(v.dtype), str(v.device), tuple(v.shape),
                     str(getattr(v, "placements", None))) for f, v in opt.state[p].items()}
                for g in opt.param_groups for p in g["params"]]

    def zero(opt) -> bool:
        return all(torch.count_nonzero(v.full_tensor() if hasattr(v, "full_tensor") else v) == 0
                   for st in opt.state.values() for v in st.values())

    result = {}
    for name, make in optimizers.items():
        model, opt = sharded(make)
        created = create_first_step_state(opt)
        ahead, ahead_zero = layout(opt), zero(opt)
        fresh_model, fresh_opt = sharded(make)
        train_step(fresh_model, fresh_opt, 1, 0)  # the state the first step creates
        for s in (1, 2, 3):
            train_step(model, opt, s, 0)
        for s in (2, 3):
            train_step(fresh_model, fresh_opt, s, 0)
        result[name] = {"created": created, "same_layout": ahead == layout(fresh_opt), "zeros": ahead_zero,
                        "training_unchanged": not mismatches(whole(model, opt), whole(fresh_model, fresh_opt))}
    # Plain parameters: nothing is created (their state is read into new tensors at load).
    plain = torch.nn.Linear(3, 2)
    result["AdamW_plain"] = {"created": create_first_step_state(torch.optim.AdamW(plain.parameters()))}
    return result


def case(name: str, ckpt: str, out: str) -> None:
    from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    from ettkit import _C
    from ettkit.checkpoint import DcpStager

    mesh = init_device_mesh("cpu", (1,))
    if name == "param_dtensor":
        result = roundtrip(ckpt, lambda v: nn.Parameter(distribute_tensor(v.clone(), mesh, [DShard(0)])))
    elif name == "param_sharded":
        result = roundtrip(ckpt, lambda v: nn.Parameter(init_from_local_shards(
            [Shard(v.clone(), ShardMetadata([0, 0], [6, 4], "rank:0/cpu"))], [6, 4])))
    elif name == "local_shards_wrapper":
        # TorchRec's DTensor tables: a column-wise table whose two shards are both on this rank.
        from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
        from torch.distributed.tensor import DTensor

        def table(values):
            wrapper = LocalShardsWrapper([values[:, :2].clone(), values[:, 2:].clone()], [(0, 0), (0, 2)])
            return DTensor.from_local(wrapper, mesh, [DShard(1)], shape=(6, 4), stride=(4, 1), run_check=False)

        values = torch.arange(24, dtype=torch.float32).reshape(6, 4)
        src, dst = table(values), table(torch.zeros(6, 4))
        with AsyncCheckpointer(ckpt, recorder=None) as ck:
            ck.save(1, {"t": src}).wait()
            step, _ = ck.load_latest({"t": dst})
        from safetensors import safe_open

        with safe_open(os.path.join(ckpt, "step-1", "rank-0.safetensors"), "pt") as f:
            names = sorted(f.keys())
        shards = dst._local_tensor.local_shards()
        result = {"step": step, "names": names,
                  "loaded": torch.equal(torch.cat(shards, dim=1), values)}
    elif name == "unknown":
        values = torch.arange(6.0)
        wrapped, param = Wrapped(values.clone()), nn.Parameter(Wrapped(values.clone()))
        dtensor = distribute_tensor(values.clone(), mesh, [DShard(0)])
        result = {}
        with AsyncCheckpointer(ckpt, recorder=None) as ck:
            result["save"] = refused(lambda: ck.save(1, {"w": wrapped}))
            result["save_param"] = refused(lambda: ck.save(1, {"p": param}))
        result["committed"] = latest_step(ckpt)
        result["dcp"] = refused(lambda: DcpStager().stage({"w": wrapped}))
        # The C++ Stager refuses a wrapper handed to it directly (a Python-side mistake), never copies it.
        result["cpp_dtensor"] = refused(lambda: _C.checkpoint.Stager().stage(["d"], [dtensor]))
        result["cpp_param"] = refused(lambda: _C.checkpoint.Stager().stage(["p"], [param]))
        result["unchanged"] = torch.equal(wrapped.inner, values) and torch.equal(param.inner, values)
        # A wrong argument to the stager's binding is a TypeError, and its second overload (a TensorList)
        # stages (pybind11 3.1 crashed in the keep-alive of an overload whose arguments did not convert).
        try:
            _C.checkpoint.Stager().stage(["a"], "not tensors")
        except TypeError:
            result["bad_args"] = "TypeError"
        listed = _C.checkpoint.TensorList()
        listed.set(["v"], [values])
        snap = _C.checkpoint.Stager().stage(listed)
        snap.wait_staged()
        result["tensor_list"] = torch.equal(snap.tensors()[0][1], values)
        # A subclass whose storage holds its values is saved like a plain tensor.
        with AsyncCheckpointer(os.path.join(ckpt, "tagged"), recorder=None) as ck:
            ck.save(1, {"t": values.clone().as_subclass(Tagged)}).wait()
            back = torch.zeros(6).as_subclass(Tagged)
            ck.load_latest({"t": back})
        result["tagged"] = torch.equal(back.as_subclass(torch.Tensor), values)
    elif name == "dcp_inline":
        result = dcp_inline(ckpt, mesh)
    elif name == "first_step":
        result = first_step(mesh)
    else:
        raise SystemExit(f"unknown case {name}")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f)


PLAIN_STEPS, SCALE_OUT_RANKS = 4, 2  # the one-process run's steps before its save; the ranks that resume it


def batches(step: int) -> list:
    """The batches the ranks of a SCALE_OUT_RANKS-rank job see at `step` (train_step's)."""
    out = []
    for rank in range(SCALE_OUT_RANKS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        out.append((torch.randint(0, VOCAB, (8,), generator=g), torch.randn(8, generator=g)))
    return out


def plain_step(model, optimizer, step: int) -> list:
    """One step of one process doing what SCALE_OUT_RANKS FSDP2 ranks do together: FSDP2 averages the ranks'
    gradients, so the mean of their losses. Returns each rank's loss."""
    losses = [((model(x) - y) ** 2).mean() for x, y in batches(step)]
    optimizer.zero_grad()
    (sum(losses) / len(losses)).backward()
    optimizer.step()
    return [loss.item() for loss in losses]


def plain_train(ckpt: str, out: str) -> None:
    """One process, no process group, no FSDP2: PLAIN_STEPS steps, a save, then the steps up to LAST_STEP (the
    reference the scaled-out resume is compared with)."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(1, PLAIN_STEPS + 1):
        plain_step(model, optimizer, step)
    with AsyncCheckpointer(ckpt, recorder=None) as ck:
        ck.save(PLAIN_STEPS, {"model": model, "optim": optimizer}).wait()
    reference = {s: plain_step(model, optimizer, s) for s in range(PLAIN_STEPS + 1, LAST_STEP + 1)}
    with open(os.path.join(out, "plain.json"), "w") as f:
        json.dump({"reference": reference}, f)


def scale_out(rank: int, world: int, ckpt: str, out: str) -> None:
    """The one-process step resumed by FSDP2 at `world` ranks: the model's and AdamW's tensors, saved whole, are
    read as this rank's shards of them; then the steps up to LAST_STEP."""
    model, optimizer = build(world)
    with AsyncCheckpointer(ckpt, recorder=None, read_only=True) as ck:
        step, _ = ck.load_latest({"model": model, "optim": optimizer})
        resharded_from = ck.resharded_from
    losses = {s: train_step(model, optimizer, s, rank) for s in range(step + 1, LAST_STEP + 1)}
    with open(os.path.join(out, f"scale_out-{rank}.json"), "w") as f:
        json.dump({"step": step, "resharded_from": resharded_from, "losses": losses}, f)


def export(ckpt: str, out: str) -> None:
    """The FSDP2 job's newest step loaded into a plain model in one process without a process group (evaluation,
    export): every parameter whole from the ranks' shards; the optimizer left out (partial=True)."""
    torch.manual_seed(1)
    model = Net()
    fresh = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = {}
    with AsyncCheckpointer(ckpt, recorder=None, read_only=True) as ck:
        # A plain AdamW before its first step has no tensors to read the sharded state into: refused, saying
        # what to do, before anything is copied.
        try:
            ck.load_latest({"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.05)})
        except ettkit.InvalidArgumentError as e:
            report["refused"] = str(e)
        report["untouched"] = all(torch.equal(p, fresh[n]) for n, p in model.named_parameters())
        step, _ = ck.load_latest({"model": model}, partial=True)
        report["resharded_from"] = ck.resharded_from
        # After one step it has state of the parameters' shapes: model and optimizer load, each tensor whole.
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        model(torch.arange(VOCAB)).sum().backward()
        optimizer.step()
        assert ck.load_latest({"model": model, "optim": optimizer})[0] == step
    saved = torch.load(os.path.join(out, f"saved-{step}.pt"))
    got = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    got.update({f"optim.{n}.{field}": v for n, p in model.named_parameters() for field, v in optimizer.state[p].items()})
    report.update(step=step, tensors=len(got), differ=mismatches(got, saved))
    with open(os.path.join(out, "export.json"), "w") as f:
        json.dump(report, f)


def main() -> int:
    mode, rank, world, init, ckpt, out = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4],
                                          sys.argv[5], sys.argv[6])
    if mode in ("plain_train", "export"):  # one process, no process group
        (plain_train if mode == "plain_train" else export)(ckpt, out)
        return 0
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    if mode.startswith("case:"):
        case(mode[len("case:"):], ckpt, out)
    else:
        {"train": train, "resume": resume, "load": load, "scale_out": scale_out}[mode](rank, world, ckpt, out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
