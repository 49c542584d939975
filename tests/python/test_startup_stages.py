"""The start-up StageGraph with Python callables: context propagation, errors, deadlines, the GIL."""

from __future__ import annotations

import contextvars
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import ettkit
import pytest
import torch
import torch._dynamo
from ettkit import ett
from ettkit.startup import StageGraph

HERE = os.path.dirname(os.path.abspath(__file__))
request_id = contextvars.ContextVar("request_id", default="unset")


def test_stages_see_the_callers_contextvars_and_thread_state():
    graph = StageGraph(max_workers=2)
    graph.add("limit", lambda: torch._dynamo.config.recompile_limit)
    graph.add("var", lambda: request_id.get())
    graph.add("grad", torch.is_grad_enabled)
    plain = []
    token = request_id.set("job-42")
    try:
        with torch._dynamo.config.patch(recompile_limit=64), torch.no_grad():
            # The torch >= 2.12 trap: a plain thread sees the default, not the caller's override.
            t = threading.Thread(target=lambda: plain.append(torch._dynamo.config.recompile_limit))
            t.start()
            t.join()
            graph.run()
    finally:
        request_id.reset(token)
    assert plain == [8], "torch config is no longer thread-local: this test guards a trap that is gone"
    assert graph.results == {"limit": 64, "var": "job-42", "grad": False}


def test_each_stage_runs_in_its_own_context_copy():
    # A stage that sets a ContextVar affects neither the caller nor the other stages.
    graph = StageGraph(max_workers=2)
    graph.add("writer", lambda: request_id.set("stage-value") and request_id.get())
    graph.add("reader", lambda: request_id.get(), after=["writer"])
    graph.run()
    assert graph.results["writer"] == "stage-value"
    assert graph.results["reader"] == "unset"
    assert request_id.get() == "unset"


def test_results_order_and_report():
    order = []
    graph = StageGraph(max_workers=3)
    graph.add("first_step", lambda: order.append("first_step"), after=["compile", "get_first_batch_data"])
    graph.add("device_init", lambda: order.append("device_init") or "cpu")
    graph.add("compile", lambda: order.append("compile"), after=["device_init"], runs_dynamo=True)
    graph.add("get_first_batch_data", lambda: order.append("get_first_batch_data"), after="device_init")
    report = graph.run()
    assert order[0] == "device_init" and order[-1] == "first_step"
    assert graph.results["device_init"] == "cpu"
    assert list(report.stages) == ["first_step", "device_init", "compile", "get_first_batch_data"]
    assert all(s.status == "succeeded" for s in report.stages.values())
    assert report.critical_path[0] == "device_init" and report.critical_path[-1] == "first_step"
    assert report.stages["compile"].runs_dynamo
    assert report.serial_sum_s >= report.critical_path_s >= 0
    assert "critical path" in str(report)
    assert report.to_dict()["stages"][0]["name"] == "first_step"


def test_failure_is_reraised_with_the_stage_name_and_cancels_dependents():
    ran = []

    def fetch():
        raise FileNotFoundError("/data/shard-0 missing")

    graph = StageGraph(max_workers=2)
    graph.add("get_first_batch_data", fetch)
    graph.add("first_step", lambda: ran.append("first_step"), after=["get_first_batch_data"])
    graph.add("compile", lambda: ran.append("compile"))
    with pytest.raises(ettkit.errors.StageError) as info:
        graph.run()
    err = info.value
    assert err.stage == "get_first_batch_data"
    assert "start-up stage 'get_first_batch_data' failed: FileNotFoundError: /data/shard-0 missing" in str(
        err
    )
    assert isinstance(err.__cause__, FileNotFoundError)
    assert ran == ["compile"]
    assert graph.report.stages["first_step"].status == "cancelled"
    assert "get_first_batch_data" in graph.report.stages["first_step"].error


def test_a_failed_start_names_its_stage_and_exception_in_the_report(tmp_path):
    # Issue #62: a start that failed left only "exception:StageError" in the report, and the demo's check then
    # died on a missing note (KeyError: 'compile_cache') instead of saying which stage failed and why.
    def build_model():
        raise ImportError("cannot import name 'Block' from 'mylib' (circular import?)")

    with pytest.raises(ettkit.errors.StageError), ett.Recorder(tmp_path, rank=0, world_size=1):
        graph = StageGraph(max_workers=2)
        graph.add("train_module_creation", build_model)
        graph.add("device_init", lambda: None)
        graph.run()
    attempt = ett.build_report(str(tmp_path))["attempts"][0]
    assert attempt["status"] == "exception" and attempt["exception_type"] == "StageError", attempt
    assert attempt["notes"]["start_failed"] == (
        "stage 'train_module_creation': ImportError: cannot import name 'Block' from 'mylib' (circular import?)"
    )


def test_cycles_and_unknown_dependencies_are_rejected_before_anything_runs():
    ran = []
    graph = StageGraph()
    graph.add("independent", lambda: ran.append(1))
    graph.add("a", lambda: ran.append(1), after=["b"])
    graph.add("b", lambda: ran.append(1), after=["a"])
    with pytest.raises(ettkit.InvalidArgumentError, match="cycle"):
        graph.run()
    graph = StageGraph()
    graph.add("compile", lambda: ran.append(1), after=["cache_laod"])
    with pytest.raises(ValueError, match="'compile' depends on 'cache_laod', which is not a stage"):
        graph.validate()
    with pytest.raises(ettkit.InvalidArgumentError, match="already defined"):
        graph.add("compile", lambda: None)
    with pytest.raises(ettkit.InvalidArgumentError, match="must be callable"):
        graph.add("not_callable", 42)
    assert ran == []


def test_a_timeout_names_the_stage_and_shows_where_it_is_stuck():
    release = threading.Event()

    def stuck_in_io():
        release.wait(30)

    graph = StageGraph(max_workers=2)
    graph.add("get_first_batch_data", stuck_in_io, timeout_s=0.1)
    graph.add("first_step", lambda: None, after=["get_first_batch_data"])
    graph.add("compile", lambda: "ok")
    with pytest.raises(ettkit.TimeoutError) as info:
        graph.run()
    text = str(info.value)
    assert "start-up stage 'get_first_batch_data' exceeded its deadline of 0.1 s" in text
    assert "stuck_in_io" in text, "the watchdog shows the stuck stage's Python stack"
    assert graph.report.stages["first_step"].status == "cancelled"
    assert graph.results["compile"] == "ok"
    assert not graph.join(0.0), "the stuck stage still holds its worker"
    release.set()
    assert graph.join(10.0)


def test_stages_are_recorded_into_the_ett_recorder(tmp_path):
    with ett.Recorder(tmp_path, rank=0, world_size=1, launcher_phases_from_env=False) as rec:
        graph = StageGraph(recorder=rec)
        graph.add("device_init", lambda: None)
        graph.add("pt2_compile", lambda: None, phase="compile", after=["device_init"])
        report = graph.run()
        rec.flush()
        phases = {}
        with open(rec.ledger_path) as f:
            for line in f:
                record = json.loads(line)
                if record.get("t") == "phase":
                    phases[record["name"]] = record
    assert phases["device_init"]["b"] == report.stages["device_init"].begin_epoch_us
    assert phases["compile"]["e"] == report.stages["pt2_compile"].end_epoch_us


def test_the_default_recorder_is_used_when_there_is_one(tmp_path):
    rec = ett.Recorder(tmp_path, rank=0, world_size=1, launcher_phases_from_env=False)  # the current one
    try:
        graph = StageGraph()
        graph.add("train_module_creation", lambda: None)
        graph.run()
        rec.flush()
        with open(rec.ledger_path) as f:
            names = [json.loads(line).get("name") for line in f]
    finally:
        rec.close()
    assert "train_module_creation" in names


def test_dynamo_stages_are_serialized_through_the_binding():
    release = threading.Event()
    held = []
    graph = StageGraph(max_workers=3)
    graph.add("compile_model", lambda: release.wait(10), runs_dynamo=True)
    graph.add("compile_loss", lambda: None, runs_dynamo=True)

    def watch():
        held.append(graph.wait_held_for_testing("compile_loss", 10.0))
        release.set()

    graph.add("watch", watch)
    report = graph.run()
    assert held == [True]
    assert report.stages["compile_loss"].begin_s >= report.stages["compile_model"].end_s


DEADLOCK_SCRIPT = textwrap.dedent(
    """
    import threading, time, torch
    from torch.utils.data import DataLoader
    from ettkit.startup import StageGraph
    from startup_helpers import RecDataset, TinyRec, loss_fn, make_batch

    def matmuls():
        a = torch.randn(256, 256)
        for _ in range(20):
            a = torch.tanh(a @ a)          # ATen releases the GIL inside
        return float(a.sum())

    def compile_and_step():
        model = torch.compile(TinyRec(), backend="eager")
        loss_fn(model(make_batch(8)), make_batch(8)).backward()
        return "compiled"

    def python_thread_inside():
        out = []
        t = threading.Thread(target=lambda: out.append(torch.ones(3).sum().item()))
        t.start(); t.join()
        return out[0]

    def nested_graph():
        inner = StageGraph(max_workers=2)
        inner.add("x", lambda: torch.randn(64, 64).sum().item())
        inner.add("y", lambda: torch.randn(64, 64).sum().item())
        inner.run()
        return sorted(inner.results)

    loader = DataLoader(RecDataset(64), batch_size=8, num_workers=2)
    graph = StageGraph(max_workers=4, timeout_s=90)
    graph.add("loader_iter", lambda: iter(loader), forks=True)
    graph.add("get_first_batch_data", lambda: next(graph.results["loader_iter"]), after=["loader_iter"])
    for i in range(3):
        graph.add(f"matmuls_{i}", matmuls)
    graph.add("compile", compile_and_step, runs_dynamo=True)
    graph.add("python_thread", python_thread_inside)
    graph.add("nested", nested_graph)
    graph.add("autograd", lambda: torch.randn(4, requires_grad=True).exp().sum().backward())
    t0 = time.monotonic()
    report = graph.run()
    assert graph.results["compile"] == "compiled"
    assert graph.results["nested"] == ["x", "y"]
    assert graph.results["get_first_batch_data"]["ids"].shape == (8, 3)
    assert report.workers == 4
    print("OK", round(time.monotonic() - t0, 2))
    """
)


def test_python_stages_on_several_threads_finish_without_deadlock(tmp_path):
    # In a subprocess with a hard timeout: a GIL deadlock would hang the interpreter, not raise.
    script = tmp_path / "deadlock_check.py"
    script.write_text(DEADLOCK_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    try:
        proc = subprocess.run(
            [sys.executable, str(script)], check=False, env=env, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"Python stages deadlocked (no exit within 120 s): {exc.stderr}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("OK"), proc.stdout


def test_a_keyboard_interrupt_in_a_forking_stage_cancels_the_graph_at_once():
    # A forking stage runs on the main thread, where Python delivers Ctrl-C: the graph must stop there,
    # not run the other stages to the end and then report a StageError.
    release = threading.Event()

    def loader_iter():
        raise KeyboardInterrupt

    graph = StageGraph(max_workers=2)
    graph.add("loader_iter", loader_iter, forks=True)
    graph.add("compile", lambda: release.wait(60))
    with pytest.raises(KeyboardInterrupt):
        graph.run()
    stages = graph.report.stages
    assert stages["loader_iter"].status == "failed"
    assert stages["compile"].status == "cancelled" and not stages["compile"].started
    assert stages["compile"].error == "the start-up graph was interrupted before it could start"
    assert graph.join(10.0)


def _popen_script(tmp_path, text: str, *args: str) -> subprocess.Popen:
    script = tmp_path / "script.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path))
    return subprocess.Popen(
        [sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        proc.kill()
        pytest.fail(f"no handshake from the child within {timeout_s} s: {proc.communicate()[1][-3000:]}")
    return proc.stdout.readline().strip()


EXIT_AFTER_TIMEOUT_SCRIPT = textwrap.dedent(
    """
    import _thread, os, sys, threading, time, types
    import ettkit
    from ettkit.startup import StageGraph

    blocked = _thread.allocate_lock(); blocked.acquire()   # the stage waits on it, ignoring cancellation
    started = _thread.allocate_lock(); started.acquire()
    worker = {}

    def stuck():
        worker["tid"] = threading.get_native_id()
        started.release()
        blocked.acquire()

    class WakeTheStageDuringFinalization:
        # Freed when the interpreter removes its module, after it started to finalize: from then on
        # CPython ends a thread that asks for the GIL with pthread_exit, a forced unwind through the stage
        # and the scheduler. Wake the stage then, and wait (bounded) until its thread is gone. Only
        # builtins and default arguments here: module globals may already be cleared.
        def __del__(self, stat=os.stat, write=os.write, sleep=time.sleep, now=time.monotonic,
                    blocked=blocked, worker=worker, parks=sys.version_info >= (3, 14)):  # 3.14+ parks it
            blocked.release()
            task = f"/proc/self/task/{worker['tid']}"
            deadline = now() + 30
            while not parks and now() < deadline:
                try:
                    stat(task)
                except OSError:
                    write(1, b"worker thread ended\\n")
                    return
                sleep(0.01)
            write(1, b"worker thread did not end\\n")

    # Not in __main__: the stage's __globals__ keep __main__'s dict alive through the interpreter's exit.
    sys.modules["wake_at_exit"] = types.ModuleType("wake_at_exit")
    sys.modules["wake_at_exit"].waker = WakeTheStageDuringFinalization()

    graph = StageGraph(max_workers=2)
    graph.add("stuck", stuck, timeout_s=0.2)
    graph.add("ok", lambda: "ok")
    try:
        graph.run()
    except ettkit.TimeoutError:
        assert started.acquire(timeout=60), "the stage never started"
        print("timed out:", [s.name for s in graph.report.stages.values() if s.status == "timed_out"], flush=True)
    if sys.argv[1] == "deleted":
        del graph   # the graph goes first: it must not wait for the stuck stage, which outlives it
        print("graph deleted", flush=True)
    """
)


@pytest.mark.parametrize("graph", ["alive", "deleted"])
def test_interpreter_exit_after_a_stage_timed_out_is_clean(tmp_path, graph):
    proc = _popen_script(tmp_path, EXIT_AFTER_TIMEOUT_SCRIPT, graph)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"interpreter exit hung on a timed-out stage: {proc.communicate()[1][-3000:]}")
    assert "FATAL" not in err, err[-3000:]
    assert proc.returncode == 0, (proc.returncode, err[-3000:])
    assert "timed out: ['stuck']" in out, out
    assert ("graph deleted" in out) == (graph == "deleted"), out
    if sys.version_info < (3, 14):
        assert "worker thread ended" in out, (out, err[-3000:])


CTRL_C_SCRIPT = textwrap.dedent(
    """
    import signal, sys, threading, time
    import ettkit
    from ettkit.startup import StageGraph

    # A process started from a background job inherits SIGINT ignored, and Python then installs no
    # KeyboardInterrupt handler: restore it, so the test does not depend on how pytest was launched.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    wait = sys.argv[1]
    release = threading.Event()

    def load_checkpoint():          # stuck in I/O: ignores the cancellation
        if wait == "run":
            print("waiting", flush=True)
        release.wait(120)

    graph = StageGraph(max_workers=2)
    graph.add("load_checkpoint", load_checkpoint, timeout_s=0.2 if wait == "join" else None)
    graph.add("first_step", lambda: None, after=["load_checkpoint"])
    try:
        if wait == "run":
            graph.run()
        else:
            try:
                graph.run()
            except ettkit.TimeoutError:
                print("waiting", flush=True)
            graph.join()
    except KeyboardInterrupt:
        print("interrupted", time.monotonic(), flush=True)
        print("status", graph.report.stages["load_checkpoint"].status, graph.report.stages["first_step"].status,
              flush=True)
        raise
    """
)


@pytest.mark.parametrize("wait", ["run", "join"])
def test_ctrl_c_while_the_graph_waits_raises_keyboard_interrupt_promptly(tmp_path, wait):
    proc = _popen_script(tmp_path, CTRL_C_SCRIPT, wait)
    try:
        assert _read_line(proc, 120) == "waiting"  # the stage runs; run() (or join()) waits for it
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)  # the stage itself takes 120 s
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"Ctrl-C was not delivered while the graph waited: {proc.communicate()[1][-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err[-3000:])
    assert "Traceback" in err and err.rstrip().endswith("KeyboardInterrupt"), err[-3000:]
    latency = float(lines["interrupted"]) - sent  # time.monotonic is system-wide on Linux
    assert latency < 5.0, f"KeyboardInterrupt took {latency:.2f} s"
    expected = "cancelled cancelled" if wait == "run" else "timed_out cancelled"
    assert lines["status"] == expected, out
