"""The demo's trainer: one rank of the sharded DLRM-like model, run by torchrun in one of two arms.

Both arms train the same model on the same click logs for the same steps, checkpoint at the same interval,
lose rank ``crash_rank`` to a SIGKILL at ``crash_at_step`` of the first attempt, and are restarted by
torchrun. Both record every phase with the ETT recorder. Only the runtime differs:

===================  ==========================================  =============================================
                     baseline (the plain PyTorch way)             ettkit
===================  ==========================================  =============================================
shard metadata       each rank all-gathers its shards' metadata,  rank 0 broadcasts a compact ShardingPlan; every
                     one ``all_gather_object`` per table          rank builds the global metadata locally
start-up             one thing after another: tables, restore,    a StageGraph: tables and restore run beside
                     loader, first batch, then ``torch.compile``  ``overlapped_start``, which compiles on a
                     compiles lazily in the first step            synthetic batch while the loader fetches the
                                                                  first real one; a CompileCache next to the
                                                                  checkpoints makes the restart's compile warm
checkpoint           ``torch.save`` of each rank's state (tmp,    ``AsyncCheckpointer``: copies into a reused
                     fsync, rename), a barrier, rank 0 moves      arena, persists and commits in the background
                     ``latest``                                   (the same durability)
===================  ==========================================  =============================================

Each attempt compiles with an empty node-local Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` per attempt and
rank), as on a replacement node; ``"fresh_node_per_attempt": false`` in the config (the driver's
``--same-host-restart``) keeps it across attempts, and then the ettkit arm also keeps a memory tier in
``/dev/shm`` (a memory save every ``ckpt_every_memory`` steps), which only a restart on the same node finds.

    torchrun --nproc-per-node=2 --max-restarts=1 examples/python/demo/train.py --arm ettkit \
        --config CONFIG.json --run-dir RUN --data-dir DATA
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

T_PROCESS = time.time()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=("baseline", "ettkit"), required=True)
    p.add_argument("--config", required=True, help="the JSON config the driver wrote")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--data-dir", required=True)
    p.add_argument(
        "--shared-dir",
        help="ettkit arm: the compile cache that jobs share (its HMAC secret in $ETTKIT_COMPILE_CACHE_SECRET); "
        "a first start without a file of its own loads the precompiled graphs from there",
    )
    p.add_argument("--job", help="this job's name in the shared cache's files (default: torchrun's run id)")
    return p.parse_args(argv)


ARGS = parse_args()
with open(ARGS.config) as _f:
    CFG = json.load(_f)
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
# Before torch is imported: where Inductor keeps its local caches on this "node".
_node = f"restart-{RESTART}-rank-{RANK}" if CFG.get("fresh_node_per_attempt", True) else f"rank-{RANK}"
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(ARGS.run_dir, "node-local", _node, "torchinductor")

import itertools
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ettkit import ett

if ARGS.arm == "ettkit":  # imported before the recorder starts, like torch: part of process_bootstrap
    from ettkit import sharding, startup
    from ettkit.checkpoint import AsyncCheckpointer, latest_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clicklogs import ClickLogDataset
from dlrm import DenseArch, LocalShard, ShardedEmbeddings, ShardedStep
from save_calls import SaveCalls

TABLES = CFG["tables"]
DIM = CFG["embedding_dim"]
B = CFG["batch_size"]
STEPS = CFG["steps"]
EVERY = CFG["ckpt_every"]
# The memory tier survives a killed process, not a replacement node: used only when restarts stay on the node.
MEMORY_EVERY = None if CFG.get("fresh_node_per_attempt", True) else CFG.get("ckpt_every_memory")
# Each save call's thread CPU, faults and imports beside its wall time: the driver's first-save rows.
SAVE_CALLS = SaveCalls(ARGS.run_dir, RANK, RESTART)


def say(msg: str, *, all_ranks: bool = False) -> None:
    if RANK == 0 or all_ranks:
        print(f"[{ARGS.arm:8s} r{RANK} a{RESTART}] {msg}", flush=True)


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, batch["label"])


def init_process_group(rec) -> None:
    with rec.phase("process_group_init"):
        # torchrun keeps one TCPStore across restarts: a per-attempt prefix keeps the restarted gloo group
        # (and the checkpointer's commit protocol, which uses the default store) away from the dead
        # attempt's keys.
        store, _, _ = next(dist.rendezvous("env://"))
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"attempt-{RESTART}", store), rank=RANK, world_size=WORLD
        )


def make_loader(start_step: int):
    ds = ClickLogDataset(ARGS.data_dir, RANK, CFG, start_step=start_step)
    return torch.utils.data.DataLoader(
        ds, batch_size=None, num_workers=CFG["num_workers"], persistent_workers=True, prefetch_factor=4
    )


def build_model(local_shards: list):
    embeddings = ShardedEmbeddings(TABLES, local_shards, DIM, CFG["seed"])
    torch.manual_seed(CFG["seed"])  # the replicated dense part starts identical on every rank
    dense = DenseArch(13, len(TABLES), DIM, CFG["bottom_mlp"], CFG["top_mlp"])
    return embeddings, dense


def make_optimizer(embeddings, dense):
    # Adagrad with sparse gradients for the tables (their accumulators double the checkpoint), as DLRM.
    return torch.optim.Adagrad(
        [
            {"params": list(embeddings.parameters()), "lr": CFG["lr_embeddings"]},
            {"params": list(dense.parameters()), "lr": CFG["lr_dense"]},
        ]
    )


def state_of(embeddings, dense, opt) -> dict:
    return {
        "model": {"embeddings": embeddings.state_dict(), "dense": dense.state_dict()},
        "optim": opt.state_dict(),
    }


# ---- shard metadata ------------------------------------------------------------------------------------------


def shards_baseline() -> tuple[list, dict]:
    """The status quo (``ShardedTensor._init_from_local_shards``): each rank describes its own shard of every
    table and the ranks all-gather those descriptions, one pickled ``all_gather_object`` per table; torch's
    ``build_global_metadata`` merges and validates them."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import ShardedTensorMetadata, TensorProperties
    from torch.distributed._shard.sharded_tensor.utils import build_global_metadata

    with ett.phase("launcher_init/sharding"):
        global_md = {}
        for t in TABLES:
            rows = int(t["rows"])
            if t["sharding"] == "row_wise":  # TorchRec's split: ceil blocks, rank r holds block r
                block = -(-rows // WORLD)
                lo = min(rows, RANK * block)
                local = [ShardMetadata([lo, 0], [min(rows, lo + block) - lo, DIM], f"rank:{RANK}/cpu")]
            else:
                local = [ShardMetadata([0, 0], [rows, DIM], f"rank:{RANK}/cpu")] if t["rank"] == RANK else []
            md = (
                ShardedTensorMetadata(local, torch.Size([rows, DIM]), TensorProperties(dtype=torch.float32))
                if local
                else None
            )
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, md)
            global_md[t["name"]] = build_global_metadata(gathered)
    local_shards = [
        LocalShard(name, s.shard_offsets[0], s.shard_sizes[0])
        for name, md in global_md.items()
        for s in md.shards_metadata
        if s.placement.rank() == RANK
    ]
    layout = {
        name: [(s.shard_offsets[0], s.shard_sizes[0], s.placement.rank()) for s in md.shards_metadata]
        for name, md in global_md.items()
    }
    return local_shards, layout


def shards_ettkit() -> tuple[list, dict]:
    """ettkit: rank 0 broadcasts the compact plan once; every rank builds the global metadata locally."""
    plan = None
    if RANK == 0:
        plan = sharding.ShardingPlan(
            [
                sharding.Table(t["name"], t["rows"], DIM, "float32", "row_wise")
                if t["sharding"] == "row_wise"
                else sharding.Table(t["name"], t["rows"], DIM, "float32", "table_wise", [t["rank"]])
                for t in TABLES
            ],
            world_size=WORLD,
            ranks_per_host=WORLD,
            device="cpu",
        )
    plan = sharding.broadcast_plan(plan)  # records launcher_init/sharding
    md = sharding.build_global_metadata(plan, strict=True)  # local; records launcher_init/sharding
    local_shards = [
        LocalShard(ls.table, ls.shard.offsets[0], ls.shard.sizes[0]) for ls in md.local_shards(RANK)
    ]
    layout = {
        name: [(s.offsets[0], s.sizes[0], s.rank) for s in md.tables[name].shards] for name in md.tables
    }
    return local_shards, layout


# ---- checkpoints: the baseline's -----------------------------------------------------------------------------


def ckpt_dir() -> str:
    return os.path.join(ARGS.run_dir, "checkpoints")


def baseline_latest_step() -> int | None:
    try:
        with open(os.path.join(ckpt_dir(), "latest")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def baseline_save(step: int, embeddings, dense, opt, layout: dict) -> None:
    d = os.path.join(ckpt_dir(), f"step-{step}")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"rank-{RANK}.pt")
    state = state_of(embeddings, dense, opt)
    state.update(step=step, shard_layout=layout)
    # Durable and atomic, the same guarantee as ettkit's commit: write a temporary file, fsync it, rename it,
    # fsync the directory. A crash (of the process or the machine) never leaves a torn or missing file.
    with open(path + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    fsync_dir(d)
    dist.barrier()  # every rank's file is durable: the step may become the latest
    if RANK == 0:
        tmp = os.path.join(ckpt_dir(), "latest.tmp")
        with open(tmp, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(ckpt_dir(), "latest"))
        fsync_dir(ckpt_dir())
        for name in os.listdir(ckpt_dir()):  # keep the last two steps
            if name.startswith("step-") and int(name[5:]) <= step - 2 * EVERY:
                for fn in os.listdir(os.path.join(ckpt_dir(), name)):
                    os.remove(os.path.join(ckpt_dir(), name, fn))
                os.rmdir(os.path.join(ckpt_dir(), name))


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def baseline_restore(embeddings, dense, opt) -> int:
    step = baseline_latest_step()
    if step is None:
        return 0
    state = torch.load(os.path.join(ckpt_dir(), f"step-{step}", f"rank-{RANK}.pt"), weights_only=True)
    embeddings.load_state_dict(state["model"]["embeddings"])
    dense.load_state_dict(state["model"]["dense"])
    opt.load_state_dict(state["optim"])
    return step


def ettkit_peek_latest_step() -> int:
    """The newest committed step, to position the data loader before the restore has run (read-only: no
    lock, only manifests read); the restore itself validates and may fall back to an older step (checked
    after it)."""
    return latest_step(ckpt_dir()) or 0


# ---- the training loop (shared) ------------------------------------------------------------------------------


class Trainer:
    def __init__(self, rec, embeddings, dense, opt):
        self.rec = rec
        self.embeddings, self.dense, self.opt = embeddings, dense, opt
        self.sharded = ShardedStep(embeddings, list(dense.parameters()), RANK, WORLD)
        self.compiled = None
        self.losses: list[float] = []
        self.t_train = None
        # Every step's loss, bit-exact (float.hex), one line per step, flushed at once: a second job of the same
        # model must reproduce the first job's losses bit for bit (test_demo), a killed attempt's lines included.
        self.loss_log = open(  # noqa: SIM115 - open for the trainer's life; line-buffered
            os.path.join(ARGS.run_dir, f"losses-rank-{RANK}.txt"), "a", buffering=1
        )

    def forward_backward(self, batch: dict) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        partial, pooled = self.sharded.forward_embeddings(batch["ids"])
        loss = loss_fn(self.compiled(batch["dense"], pooled), batch)
        loss.backward()
        self.sharded.backward_embeddings(partial, pooled)
        return loss

    def finish_step(self, step: int, loss: torch.Tensor) -> None:
        self.sharded.allreduce_dense_grads()
        self.opt.step()
        self.losses.append(loss.item())
        self.loss_log.write(f"{RESTART} {step} {self.losses[-1].hex()}\n")

    def progress(self, step: int, first_step: int) -> None:
        if self.t_train is None:
            self.t_train = time.time()
        every = CFG["log_every"]
        if step % every == 0 or step == STEPS:
            window = self.losses[-every:]
            rate = (step - first_step + 1) / max(time.time() - self.t_train, 1e-9)
            say(
                f"step {step:5d}/{STEPS}  loss {sum(window) / len(window):.4f}  {rate:5.1f} steps/s  "
                f"{time.time() - T_PROCESS:6.1f} s since exec"
            )

    def maybe_crash(self, step: int) -> None:
        if RESTART == 0 and step == CFG["crash_at_step"] and RANK == CFG["crash_rank"]:
            say(f"step {step}: injected failure, SIGKILL of rank {RANK}", all_ranks=True)
            self.rec.flush()  # the steps before the crash are in the ledger; then a real, uncatchable kill
            os.kill(os.getpid(), signal.SIGKILL)


def run_baseline(rec) -> None:
    init_process_group(rec)
    with rec.phase("train_module_creation"):
        local_shards, layout = shards_baseline()
        embeddings, dense = build_model(local_shards)
        opt = make_optimizer(embeddings, dense)
    start = 1
    if baseline_latest_step() is not None:
        with rec.phase("checkpoint_restore"):
            start = baseline_restore(embeddings, dense, opt) + 1
        say(f"restored step {start - 1}")
    with rec.phase("preproc_creation"):
        batches = iter(make_loader(start))
    with rec.phase("get_first_batch_data"):
        first = next(batches)
    tr = Trainer(rec, embeddings, dense, opt)
    t0 = time.time()
    with rec.phase("compile"):
        # The plain way: compile after the first real batch; the first step compiles forward and backward.
        tr.compiled = torch.compile(dense)
        loss = tr.forward_backward(first)
    say(
        f"start-up done: {time.time() - T_PROCESS:.1f} s since exec; compile in the first step "
        f"{time.time() - t0:.1f} s"
    )
    for step, batch in zip(range(start, STEPS + 1), itertools.chain([None], batches)):
        if batch is not None:
            loss = tr.forward_backward(batch)
        tr.finish_step(step, loss)
        tr.maybe_crash(step)
        if step % EVERY == 0:
            with rec.phase("checkpoint_blocking", step=step), SAVE_CALLS.measure(step):
                baseline_save(step, embeddings, dense, opt, layout)
        rec.step(step)
        tr.progress(step, start)
    with rec.phase("shutdown"):
        del batches
        dist.destroy_process_group()


def run_ettkit(rec) -> None:
    init_process_group(rec)
    with rec.phase("train_module_creation"):
        local_shards, layout = shards_ettkit()
        # The dense part is tiny and must exist before its compile; the tables are built beside the compile.
        torch.manual_seed(CFG["seed"])
        dense = DenseArch(13, len(TABLES), DIM, CFG["bottom_mlp"], CFG["top_mlp"])
        # preempt_signals=(): under torchrun a SIGTERM is the agent tearing the worker group down after a
        # peer failed, not a preemption; the default handler (SIGTERM when `every` is set) would keep this rank
        # alive through the teardown instead of letting it die at once as the baseline does.
        ck = AsyncCheckpointer(
            ckpt_dir(),
            every=EVERY,
            keep_last=2,
            metadata={"shard_layout": json.dumps(layout)},
            preempt_signals=(),
            memory_tier=MEMORY_EVERY is not None,  # job id: torchrun's TORCHELASTIC_RUN_ID
            every_memory=MEMORY_EVERY,
        )
        # A restart: verify the step it will restore on a background thread while the tables are built and
        # the dense part compiles; the restore stage is then left with the copy.
        ck.prefetch()
    # Where the data loader starts; checked after the restore. With a memory tier, this rank's newest memory
    # step counts too (the restore takes it when every rank holds it and the disk has nothing newer).
    start = ettkit_peek_latest_step() + 1
    if ck.memory_tier_directory:
        start = max(start, (latest_step(ck.memory_tier_directory) or 0) + 1)
    built: dict = {}

    def create_tables():
        built["embeddings"] = ShardedEmbeddings(TABLES, local_shards, DIM, CFG["seed"])
        built["opt"] = make_optimizer(built["embeddings"], dense)

    def restore():
        embeddings, opt = built["embeddings"], built["opt"]
        state = state_of(embeddings, dense, opt)
        restored = ck.load_latest(state)  # in place; the ranks agree on the step through the store
        if restored is None:
            return 0
        opt.load_state_dict(state["optim"])  # param_groups too (load_latest replaces them in `state` only)
        return restored[0]

    graph = startup.StageGraph()
    graph.add("train_module_creation", create_tables)
    if start > 1:
        graph.add("checkpoint_restore", restore, after=["train_module_creation"])
    spec = startup.BatchSpec(
        {
            "dense": startup.TensorSpec((B, 13), torch.float32),
            "ids": {
                t["name"]: startup.TensorSpec((B,), torch.int64, value_range=(0, t["rows"] - 1))
                for t in TABLES
            },
            "label": startup.TensorSpec((B,), torch.float32, value_range=(0, 1)),
        }
    )

    def warm_forward(model, batch):
        # The compiled part sees pooled embeddings, which the sharded lookup produces in training: a
        # synthetic leaf of the same shape, dtype and requires_grad gives the same graphs.
        pooled = torch.randn(batch["dense"].shape[0], len(TABLES), DIM, requires_grad=True)
        return model(batch["dense"], pooled)

    # precompile=True: the cold start precompiles the dense part's forward and backward and saves them; the
    # restart loads them and compiles nothing (the MegaCache file, saved after the first step, is the
    # fallback for a model that cannot be precompiled). With --shared-dir, a first start whose own cache is
    # empty loads the file an earlier job of the same model wrote there, and a start that compiled writes its
    # file there (the driver's second ettkit job; docs/startup.md, "A warm first start").
    # One directory per rank: each rank compiles (or loads) on its own, and a rank's start never finds a file
    # another rank of the same attempt just wrote (the ledger's compile_cache note says where each start's
    # graphs came from, and would otherwise depend on which rank got there first).
    cache = startup.CompileCache(
        os.path.join(ARGS.run_dir, "compile-cache", f"rank-{RANK}"),
        model=dense,
        spec=spec,
        config={"backend": "inductor"},
        precompile=True,
        shared_dir=ARGS.shared_dir,
        job=ARGS.job,
    )
    loader = make_loader(start)
    # The stages record their own phases (compile, preproc_creation, ...) with their real intervals; this
    # scope covers the gaps between them and ends where the first step begins (see docs/demo.md).
    with rec.phase("launcher_init/startup_graph"):
        compiled, first, report, batches = startup.overlapped_start(
            dense, loader, spec, loss_fn, cache, forward=warm_forward, graph=graph
        )
    embeddings, opt = built["embeddings"], built["opt"]
    restored = graph.results.get("checkpoint_restore", 0)
    if restored + 1 != start:  # the newest step failed validation and the restore fell back: re-position
        say(f"restored step {restored}, not {start - 1}: restarting the data loader")
        del batches
        start = restored + 1
        batches = iter(make_loader(start))
        first = next(batches)
    elif start > 1:
        say(f"restored step {restored}")
    # Fences every writer of the saved tensors (the optimizer step; the model has no buffers that a forward
    # writes), so save() returns before its copies are done and still never commits a torn snapshot.
    ck.attach(model=[embeddings, dense], optimizer=opt)
    # The objects, not their state_dict()s (the same files): a module's state_dict() is an OrderedDict and
    # opt.state_dict() a copy that save() must recognise and refresh at every call, neither of which the bound
    # save covers, so every save walked the state in Python. Passed as objects, the state is bound at
    # prepare() and each save only checks it (docs/checkpoint.md, "The bound save").
    state = {"model": {"embeddings": embeddings, "dense": dense}, "optim": opt}
    # The first save of the attempt blocks like the later ones: its arena is sized, allocated and faulted in
    # now, on a background thread, instead of inside that save.
    ck.prepare(state)
    s = report.summary()
    say(
        f"start-up done: {time.time() - T_PROCESS:.1f} s since exec; overlapped_start {s['time_to_start_s']:.1f} s "
        f"(compile {s['compile_s']:.1f} s, cache {s['cache']}; first batch {s['first_batch_s']:.2f} s)"
    )
    tr = Trainer(rec, embeddings, dense, opt)
    tr.compiled = compiled
    for step, batch in zip(range(start, STEPS + 1), itertools.chain([first], batches)):
        tr.finish_step(step, tr.forward_backward(batch))
        tr.maybe_crash(step)
        if ck.should_save(step):
            # records checkpoint_blocking; persists and commits in the background, to disk every EVERY steps
            # and, with a memory tier, to /dev/shm every MEMORY_EVERY steps in between
            with SAVE_CALLS.measure(step):
                ck.save(step, state)
        rec.step(step)
        if step == start and RANK == 0:
            with rec.phase("compile/cache_save"):  # forward and backward have compiled: a restart is warm
                cache.save()
        if step == start + 1:
            say(f"recompiles after the first real steps: {report.recompiles}")
        tr.progress(step, start)
    with rec.phase("shutdown"):
        ck.close()  # waits until the last save is durable; a clean end removes the memory tier
        del batches
        dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # Adagrad's sparse update, each step
    rec = ett.init(ARGS.run_dir, heartbeat_s=0.5)
    rec.set_config("checkpoint_interval_steps", EVERY)
    if ARGS.arm == "baseline":
        run_baseline(rec)
    else:
        run_ettkit(rec)
    say(f"done in {time.time() - T_PROCESS:.1f} s since exec")


if __name__ == "__main__":
    main()
