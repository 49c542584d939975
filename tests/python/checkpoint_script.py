"""Subprocess driver for the checkpoint fault tests (a fresh interpreter: no fork after OpenMP).

python checkpoint_script.py diskfull CKPT_DIR OUT_JSON
python checkpoint_script.py loop CKPT_DIR            saves steps 1, 2, ... until killed
python checkpoint_script.py loopwrite CKPT_DIR       the same, writing the saved tensors right after save()
python checkpoint_script.py lifecycle CASE DIR       #25's reproductions (heap corruption, deadlock, abort)
"""

import json
import os
import resource
import signal
import sys

import torch

import ettkit
from ettkit.checkpoint import AsyncCheckpointer


def scaled(n: int, at_least: int = 1) -> int:
    """`n` trials times ETTKIT_TEST_SCALE (the sanitizer runs set it below 1: fewer rounds, same kinds)."""
    return max(at_least, round(n * float(os.environ.get("ETTKIT_TEST_SCALE") or 1)))


def loop_state(step: int):
    # Every tensor is a function of the step, so a loaded step can be checked exactly.
    return {"a": torch.full((300_000,), float(step)), "b": torch.arange(1000, dtype=torch.int64) * step,
            "small": torch.tensor([step, -step], dtype=torch.int32)}


def rank0_hosted_store(rank: int, world: int, rdzv_file: str):
    """A TCPStore hosted by rank 0, as torchrun's rank-0 rendezvous does (its death takes the Store with it),
    on a port the kernel chose when rank 0 bound it; the other ranks learn the port through a FileStore at
    `rdzv_file`. No port is chosen before it is bound, so no other process (pytest-xdist) can take it."""
    import torch.distributed as dist

    boot = dist.FileStore(rdzv_file, world)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        boot.set("port", str(store.port))
        return store
    return dist.TCPStore("127.0.0.1", int(boot.get("port")), world, is_master=False)


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "loop":
        with AsyncCheckpointer(path, recorder=None, keep_last=3) as ck:
            target = {k: torch.zeros_like(v) for k, v in loop_state(0).items()}
            res = ck.load_latest(target)
            step = res[0] if res else 0
            print("ready", flush=True)
            while True:
                step += 1
                ck.save(step, loop_state(step), extra={"step": step}).wait_staged()
    if mode == "loopwrite":
        # One state dict, updated in place to the next step's values right after each save() returns,
        # with overlap forced and only every other save fenced: every committed step must still hold one
        # step's values.
        with AsyncCheckpointer(path, recorder=None, keep_last=3, overlap=True) as ck:
            state = {k: torch.zeros_like(v) for k, v in loop_state(0).items()}
            res = ck.load_latest(state)
            step = res[0] if res else 0
            print("ready", flush=True)
            while True:
                step += 1
                for k, v in loop_state(step).items():
                    state[k].copy_(v)
                ck.save(step, state, extra={"step": step})
                if step % 2 == 0:
                    ck.wait_for(state.values())  # fenced: this save commits
                for k, v in loop_state(step + 1).items():  # otherwise races the copy: refused
                    state[k].copy_(v)
    if mode == "lifecycle":
        import tempfile

        case = path
        if case == "wait_staged":
            ck = AsyncCheckpointer(tempfile.mkdtemp(), keep_last=1, recorder=None, overlap=True)
            for s in range(6):
                h = ck.save(s, {"w": torch.randn(1 << 20)})
                h.wait_staged()
                h.wait()
            ck.close()
            import gc

            gc.collect()
            print("lifecycle-ok", flush=True)
            return 0
        if case == "unclosed":
            def train():
                ck = AsyncCheckpointer(tempfile.mkdtemp(), recorder=None, overlap=True)
                ck.save(1, {"w": torch.randn(1 << 18)})
                raise RuntimeError("training failed")

            try:
                train()
            except RuntimeError:
                print("caught", flush=True)
            return 0
        if case == "uncaught":
            ck = AsyncCheckpointer(tempfile.mkdtemp(), recorder=None, overlap=True)  # noqa: F841
            ck.save(1, {"w": torch.randn(1 << 22)})
            raise RuntimeError("uncaught at module level")
        if case == "threads":
            # Several hundred saves; a second thread pokes the handles and the checkpointer meanwhile.
            import random
            import threading

            rng = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 0)
            ck = AsyncCheckpointer(tempfile.mkdtemp(), keep_last=2, recorder=None, overlap=True)
            handles = []
            stop = threading.Event()

            def poke():
                r = random.Random(rng.random())
                while not stop.is_set():
                    if handles:
                        h = handles[r.randrange(len(handles))]
                        op = r.randrange(4)
                        try:
                            if op == 0:
                                h.wait_staged()
                            elif op == 1:
                                h.wait()
                            elif op == 2:
                                _ = h.staged
                            else:
                                ck.wait_staged()
                        except ettkit.Error:
                            pass

            t = threading.Thread(target=poke)
            t.start()
            w = torch.zeros(1 << 18)
            for s in range(scaled(300, 20)):
                h = ck.save(s, {"w": w, "i": torch.full((1 << 12,), s)})
                handles.append(h)
                op = rng.randrange(4)
                if op == 0:
                    h.wait_staged()
                elif op == 1:
                    try:
                        h.wait()
                    except ettkit.TornSnapshotError:
                        pass
                elif op == 2:
                    _ = h.staged
                else:
                    ck.wait_staged()
                if rng.random() < 0.3:
                    ck.wait_for([w])
                    w.add_(1)
                if len(handles) > 8:
                    handles.pop(0)
            stop.set()
            t.join()
            ck.close()
            print("lifecycle-ok", flush=True)
            return 0
        return 2
    if mode == "preempt":
        ck = AsyncCheckpointer(path, recorder=None, every=10**9, preempt_deadline_s=30)
        state = loop_state(0)
        step = 0
        print("ready", flush=True)
        while True:
            step += 1
            for k, v in loop_state(step).items():
                state[k].copy_(v)
            if step == 2:
                print("step 2", flush=True)  # the test signals once the loop is past step 1
            if ck.should_save(step):
                ck.save(step, state, extra={"step": step})  # durable, then exits with 128+SIGTERM
                return 3  # not reached
    if mode == "rank":
        import torch.distributed as dist

        rank, world, init = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        # A file:// rendezvous (a FileStore) needs no port, so no other process can take it between the test
        # choosing it and rank 0 binding it; a bare number is a TCP port.
        init_method = init if init.startswith("file://") else f"tcp://127.0.0.1:{init}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)

        def rank_state(step):
            return {"w": torch.full((1000 + rank,), float(step * 10 + rank)), "r": torch.tensor([rank, step])}

        with AsyncCheckpointer(path, recorder=None, keep_last=2) as ck:
            for step in (1, 2, 3):
                h = ck.save(step, rank_state(step), extra={"rank": rank})
                h.wait()
                assert h.durable
            target = {k: torch.zeros_like(v) for k, v in rank_state(0).items()}
            step, extra = ck.load_latest(target)
            assert step == 3 and extra == {"rank": rank}, (step, extra)
            for k, v in rank_state(3).items():
                assert torch.equal(target[k], v), k
        dist.barrier()
        if rank == 0:
            # Damage rank 1's file of step 3: every rank must fall back to step 2 together.
            f = os.path.join(path, "step-3", "rank-1.safetensors")
            data = bytearray(open(f, "rb").read())
            data[-3] ^= 0xFF
            open(f, "wb").write(bytes(data))
        dist.barrier()
        with AsyncCheckpointer(path, recorder=None) as ck:
            target = {k: torch.zeros_like(v) for k, v in rank_state(0).items()}
            step, _ = ck.load_latest(target)
            assert step == 2, step
            for k, v in rank_state(2).items():
                assert torch.equal(target[k], v), k
        dist.destroy_process_group()
        print("rank-ok", rank, flush=True)
        return 0
    if mode == "peerdeath":
        # One rank dies (SIGKILL) after step 1 is committed; the survivors keep saving and must get
        # PeerLostError, and close() must return, within seconds (default peer_timeout_s).
        import time

        import torch.distributed as dist

        rank, world, rdzv, victim, store_mode = (int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
                                                 int(sys.argv[6]), sys.argv[7])
        if store_mode == "launcher":  # the test process hosts the Store on the port it bound (rdzv)
            store = dist.TCPStore("127.0.0.1", int(rdzv), world, is_master=False)
        else:
            store = rank0_hosted_store(rank, world, rdzv)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        state = {"w": torch.full((1 << 16,), float(rank))}
        ck = AsyncCheckpointer(path, recorder=None, keep_last=0, commit_timeout_s=600)
        assert ck.save(1, state).wait()
        dist.barrier()  # every rank has step 1 durable
        if rank == victim:
            with open(os.path.join(path, "death"), "w") as f:
                f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        while not os.path.exists(os.path.join(path, "death")):
            time.sleep(0.005)
        errors = []
        for step in (2, 3, 4):
            try:
                ck.save(step, state).wait()
                errors.append("committed")
            except ettkit.PeerLostError as e:
                errors.append(type(e).__name__)
        ck.close()
        print("survivor", rank, errors, flush=True)
        sys.stdout.flush()
        os._exit(0 if all(e == "PeerLostError" for e in errors) else 5)
    if mode == "lockedrank":
        # Another job holds the directory: every rank's constructor must fail with CheckpointLockedError at
        # once (rank 0 passes the failure on through the Store instead of leaving the others waiting).
        import time

        import torch.distributed as dist

        rank, world, init = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        # A file:// rendezvous (a FileStore) needs no port, so no other process can take it between the test
        # choosing it and rank 0 binding it; a bare number is a TCP port.
        init_method = init if init.startswith("file://") else f"tcp://127.0.0.1:{init}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        t0 = time.monotonic()
        try:
            AsyncCheckpointer(path, recorder=None, commit_timeout_s=600)
            return 4
        except ettkit.CheckpointLockedError as e:
            assert ".lock" in str(e), str(e)
        print("locked-ok", rank, round(time.monotonic() - t0, 2), flush=True)
        dist.barrier()  # rank 0 hosts the Store: it must outlive the other ranks' reads
        os._exit(0)
    if mode == "tornrank":
        # The last rank writes a saved tensor while its save of step 2 is held before the verdict: every
        # rank's handle must raise TornSnapshotError and step 1 must stay the latest everywhere.
        import torch.distributed as dist

        rank, world, init = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        # A file:// rendezvous (a FileStore) needs no port, so no other process can take it between the test
        # choosing it and rank 0 binding it; a bare number is a TCP port.
        init_method = init if init.startswith("file://") else f"tcp://127.0.0.1:{init}"
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        state = {"w": torch.full((1 << 18,), float(rank))}
        with AsyncCheckpointer(path, recorder=None, keep_last=0, overlap=True, commit_timeout_s=60) as ck:
            ck.save(1, state).wait()
            culprit = rank == world - 1
            if culprit:
                ck._c._hold_commits_for_testing(True)
            h = ck.save(2, state)
            if culprit:
                state["w"][123] = -1.0
                ck._c._hold_commits_for_testing(False)
            try:
                h.wait()
                print("committed", flush=True)
                return 4
            except ettkit.TornSnapshotError as e:
                # The culprit's own verdict names the tensor; every other rank's names the culprit rank and
                # quotes that verdict (rank 0 from its vote, the others from rank 0's result), so a rank that
                # blamed itself, the wrong rank or no tensor fails here.
                msg = str(e)
                own = "checkpoint step 2 was refused: 1 saved tensor(s) changed while they were being copied"
                assert "'w'" in msg, msg
                if culprit:
                    assert msg.startswith(own), msg
                else:
                    assert f"rank {world - 1}: {own}" in msg and not msg.startswith(own), msg
            target = {"w": torch.zeros(1 << 18)}
            step, _ = ck.load_latest(target)
            assert step == 1, step
            assert torch.equal(target["w"], torch.full((1 << 18,), float(rank)))
        dist.destroy_process_group()
        print("rank-ok", rank, flush=True)
        return 0
    if mode == "diskfull":
        sys.path.insert(0, os.path.dirname(__file__))
        from test_checkpoint import make_state

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        from ettkit import ett

        # The ledger of this run (small lines: the 1 MiB limit does not reach it) records the failed save.
        rec = ett.Recorder(os.path.join(os.path.dirname(sys.argv[3]), "run"), rank=0, world_size=1)
        ck = AsyncCheckpointer(path, every=2)
        ck.save(1, make_state(1)).wait()
        big = make_state(2)
        big["model"]["huge"] = torch.ones(1 << 19)  # 2 MiB > the 1 MiB file-size limit
        h = ck.save(2, big)
        try:
            h.wait()
            err = None
        except ettkit.IoError as e:
            err = str(e)
        ck.save(3, make_state(3)).wait()  # training and saving go on
        res = {"err": err, "handle_error": type(h.error).__name__, "durable": h.durable,
               "dirs": sorted(p for p in os.listdir(path) if p.startswith("step"))}
        ck.close()
        rec.close()
        with open(sys.argv[3], "w") as f:
            json.dump(res, f)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
