"""The C++ example trainer (examples/cpp/) built out of tree against the installed package with
find_package(ettkit): killed once, resumed from its last committed checkpoint, then checked through its
ETT report, its checkpoints and an uninterrupted reference run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import ettkit
import pytest
import torch
from ettkit import ett

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, EVERY, CRASH = 120, 25, 90  # CRASH is not a multiple of EVERY: the steps after the last save are lost


def _env():
    env = dict(os.environ)
    for var in ("CMAKE_PREFIX_PATH", "RANK", "WORLD_SIZE", "ETTKIT_LAUNCHER_PHASES"):
        env.pop(var, None)
    # libettkit.so finds libtorch through its RUNPATH ($ORIGIN/../../torch/lib) only when ettkit is
    # installed beside torch in site-packages; a `pip install --target DIR` needs the loader path too.
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (torch_lib, env.get("LD_LIBRARY_PATH")) if p)
    return env


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """Configures and builds examples/cpp once for the module (compiling against LibTorch takes a while)."""
    cmake = shutil.which("cmake", path=os.path.dirname(sys.executable)) or "cmake"
    build = tmp_path_factory.mktemp("cpp-example") / "build"
    configure = subprocess.run(
        [cmake, "-S", os.path.join(REPO, "examples", "cpp"), "-B", str(build), "-G", "Ninja",
         f"-DCMAKE_PREFIX_PATH={ettkit.cmake_prefix_path}", "-DCMAKE_BUILD_TYPE=Release",
         # ettkit's package config asks this interpreter where its torch is.
         f"-DPython_EXECUTABLE={sys.executable}"],
        check=False, capture_output=True, text=True, env=_env(), timeout=300)
    assert configure.returncode == 0, configure.stdout[-3000:] + configure.stderr[-3000:]
    b = subprocess.run([cmake, "--build", str(build)], check=False, capture_output=True, text=True,
                       timeout=600)
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    return str(build / "trainer")


def _train(trainer, run_dir, *extra):
    # One intra-op thread (the trainer's default, spelled out): the runs compared bit for bit must use the
    # same thread count, and on CI's shared cores OpenMP barriers would turn 2 ms steps into 200 ms ones.
    cmd = [trainer, "--run-dir", str(run_dir), "--steps", str(STEPS), "--ckpt-every", str(EVERY),
           "--threads", "1", "--log-every", "10", *extra]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, env=_env(), timeout=180)


def _committed_steps(run_dir):
    ckpt = os.path.join(run_dir, "checkpoints")
    return sorted(int(d[len("step-"):]) for d in os.listdir(ckpt)
                  if d.startswith("step-") and os.path.exists(os.path.join(ckpt, d, "manifest.json")))


@pytest.fixture(scope="module")
def crashed_and_resumed(trainer, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cpp-example-run")
    first = _train(trainer, run_dir, "--crash-at-step", str(CRASH))
    committed_at_crash = _committed_steps(run_dir)
    # The same command line again, as a restarting launcher would run it (the crash is first-attempt only).
    second = _train(trainer, run_dir, "--crash-at-step", str(CRASH))
    return run_dir, first, committed_at_crash, second


@pytest.fixture(scope="module")
def resumed_step(crashed_and_resumed):
    second = crashed_and_resumed[3]
    if "no checkpoint: training from step 1" in second.stdout:
        return 0  # a very slow disk had not made even the first save durable before the kill
    m = re.search(r"^resumed from checkpoint step (\d+) .*, verified ahead by prefetch\(\)$", second.stdout, re.MULTILINE)
    assert m, second.stdout  # the prefetch before the start-up stages verified the step the restore loaded
    return int(m.group(1))


def _losses(stdout):
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+) loss ([0-9.]+)$", stdout, re.MULTILINE)}


def test_crash_then_resume_from_last_committed_checkpoint(crashed_and_resumed, resumed_step):
    run_dir, first, committed, second = crashed_and_resumed
    assert first.returncode == -signal.SIGKILL, first.stdout + first.stderr
    assert "no checkpoint: training from step 1" in first.stdout
    assert f"crash: SIGKILL after step {CRASH}" in first.stdout
    # Saves are asynchronous: the kill may land before the newest one is durable, so the expected step is
    # what was committed on disk at the moment of the crash, and it must be one of the periodic saves.
    assert all(s % EVERY == 0 and s <= CRASH for s in committed), committed
    assert resumed_step == (committed[-1] if committed else 0)
    assert second.returncode == 0, second.stdout + second.stderr
    assert re.search(rf"^step {resumed_step + 1} loss ", second.stdout, re.MULTILINE), second.stdout
    assert f"done: step {STEPS} " in second.stdout
    assert "ETT: attempts 2 failures 1 " in second.stdout
    assert _committed_steps(run_dir)[-1] == STEPS  # the final step is saved and durable before exit


def test_startup_graph_runs_restore_after_model(crashed_and_resumed):
    _, first, _, second = crashed_and_resumed
    for out in (first.stdout, second.stdout):
        rows = {m[0]: (float(m[1]), float(m[2])) for m in
                re.findall(r"^(model|data|restore)\s+succeeded\s+([0-9.]+)\s+([0-9.]+)", out, re.MULTILINE)}
        assert set(rows) == {"model", "data", "restore"}, out
        assert rows["restore"][0] >= rows["model"][1]  # "restore" depends on "model"


def test_loss_goes_down_and_replays_identically(crashed_and_resumed, resumed_step):
    _, first, _, second = crashed_and_resumed
    before, after = _losses(first.stdout), _losses(second.stdout)
    assert before[1] > 5 * after[STEPS], (before, after)
    # The re-trained steps see the same batches from the same restored state: the same losses.
    replayed = [s for s in after if s in before and s > resumed_step]
    assert replayed, (before, after)
    for s in replayed:
        assert after[s] == before[s], s


def test_ett_report(crashed_and_resumed, resumed_step):
    run_dir, _, _, _ = crashed_and_resumed
    r = ett.build_report(run_dir)
    assert [a["status"] for a in r["attempts"]] == ["killed", "clean"]
    assert r["failures"] == 1 and r["failures_by_category"] == {"killed": 1}
    assert r["attempts"][1]["first_step"] == resumed_step + 1 and r["attempts"][1]["last_step"] == STEPS
    assert r["steps"]["retrained"] == CRASH - resumed_step
    assert r["steps"]["max_step"] == STEPS
    assert r["unsaved_training_s"]["measured"] > 0

    saves = {EVERY * k for k in range(1, STEPS // EVERY + 1)} | {STEPS}
    assert r["checkpoints"]["count"] >= len(saves)
    assert r["checkpoint_blocking_s"]["measured"] > 0
    assert r["checkpoints"]["durable_latency_median_s"] > 0
    with open(os.path.join(run_dir, "ett", "rank-0.jsonl")) as f:
        records = [json.loads(line) for line in f]
    blocking_steps = {x["step"] for x in records
                      if x.get("t") == "phase" and x["name"] == "checkpoint_blocking"}
    assert blocking_steps == saves

    # Every attempt records its start-up stages under Meta's launcher_init sub-stages. (Where concurrent
    # stages overlap, the job timeline gives each instant to one of them (docs/ett.md §4), so only the
    # ledger shows both.)
    phases = [x["name"] for x in records if x.get("t") == "phase"]
    for name in ("train_module_creation", "get_first_batch_data", "launcher_init", "shutdown"):
        assert phases.count(name) == (1 if name == "shutdown" else 2), name
    for name in ("train_module_creation", "get_first_batch_data"):
        assert f"launcher_init/{name}" in r["substages"]
    # The restore after the kill falls inside the recovery window (failure time), not before it.
    (recovery,) = r["recoveries"]
    assert recovery["recovered"] and recovery["breakdown"].get("checkpoint_restore", 0) > 0
    # Idle in attempt 0, failure in attempt 1. It read "failure" when attempt 1's process start, taken with
    # a boot time in whole seconds, reached back over attempt 0's restore (the unit tests pin both causes:
    # ProcessStart.IsNotBeforeTheProcessWasForked, Report.AProcessStartBeforeThePreviousAttemptEnded...).
    assert r["phase_buckets"]["checkpoint_restore"] == "mixed"
    restore0 = [s for s in r["timeline"] if s["attempt"] == 0 and s["name"] == "checkpoint_restore"]
    assert restore0 and all(s["bucket"] == "idle" for s in restore0)
    assert r["attempts"][1]["begin_us"] >= r["attempts"][0]["end_us"]

    buckets = r["effective_s"] + r["idle_s"] + r["failure_s"] + r["unattributed_s"]
    assert buckets == pytest.approx(r["e2e_s"], abs=1e-5)
    pcts = r["ett_pct"] + r["idle_pct"] + r["failure_pct"] + r["unattributed_pct"]
    assert pcts == pytest.approx(100.0, abs=1e-6)
    assert 0 < r["ett_pct"] < 100


def test_checkpoint_matches_printed_state_and_uninterrupted_run(trainer, crashed_and_resumed, tmp_path):
    from safetensors.torch import load_file

    run_dir, _, _, second = crashed_and_resumed
    final = os.path.join(run_dir, "checkpoints", f"step-{STEPS}")
    resumed = load_file(os.path.join(final, "rank-0.safetensors"))
    model_keys = sorted(k for k in resumed if k.startswith("model."))
    assert model_keys == ["model.0.bias", "model.0.weight", "model.2.bias", "model.2.weight",
                          "model.4.bias", "model.4.weight"]
    assert set(resumed) == set(model_keys) | {f"optim.{k[len('model.'):]}.{s}" for k in model_keys
                                              for s in ("exp_avg", "exp_avg_sq", "step")}
    # Adam's step count travels as an int64 tensor: every optimizer step of the job is counted once.
    assert all(resumed[k].item() == STEPS for k in resumed if k.endswith(".step"))

    m = re.search(r"^done: step \d+ loss ([0-9.]+) param_sum (\S+) ", second.stdout, re.MULTILINE)
    assert m, second.stdout
    param_sum = sum(resumed[k].double().sum().item() for k in model_keys)
    assert param_sum == pytest.approx(float(m.group(2)), rel=1e-12)
    with open(os.path.join(final, "rank-0.extra")) as f:
        assert f.read() == f"loss at save {m.group(1)}"
    # Python loads what C++ wrote: the same tensors in place, `extra` as the C++ caller's raw bytes.
    from ettkit.checkpoint import AsyncCheckpointer

    target = {k: torch.zeros_like(v) for k, v in resumed.items()}
    with AsyncCheckpointer(os.path.join(run_dir, "checkpoints"), recorder=None) as ck:
        step, extra = ck.load_latest(target)
    assert step == STEPS and extra == f"loss at save {m.group(1)}".encode()
    for k, v in resumed.items():
        assert torch.equal(target[k], v), k

    # The crash and the resume leave no trace in the weights: bit-identical to a run that never failed.
    reference = _train(trainer, tmp_path / "reference")
    assert reference.returncode == 0, reference.stdout + reference.stderr
    expected = load_file(tmp_path / "reference" / "checkpoints" / f"step-{STEPS}" / "rank-0.safetensors")
    assert set(expected) == set(resumed)
    for k in expected:
        assert torch.equal(expected[k], resumed[k]), k
