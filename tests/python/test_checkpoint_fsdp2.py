"""FSDP2 end to end (#40): a ``fully_shard`` trainer saves ``{"model": model, "optim": optimizer}`` attached
while training, is killed, resumes with a fresh model and a fresh AdamW bit for bit, and its step loads at
other world sizes (ettkit and ``dcp.load``); a Parameter around a DTensor or a ShardedTensor is saved, and so
is a DTensor of TorchRec's local shards; an unknown tensor subclass is refused with a typed error, never a
crash; a ``DcpStager()`` created inline keeps what DCP's background write reads alive. Every process is
tests/python/fsdp2_worker.py; a crash shows as its exit status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import ettkit
from ettkit.checkpoint._restore import MAX_NAMED, check_sharded
from ettkit.checkpoint._tensor_kinds import TENSOR, ShardedSlot, StatefulSlot

WORKER = os.path.join(os.path.dirname(__file__), "fsdp2_worker.py")
DURABLE_STEP, LAST_STEP = 4, 9  # fsdp2_worker.py


def run(tmp, mode, world, ckpt, out, name):
    """`world` worker processes of `mode`; returns their exit statuses and stderr tails."""
    init = f"file://{tmp / ('rdv-' + name)}"
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(r), str(world), init, str(ckpt), str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    errs = [p.communicate(timeout=300)[1][-4000:] for p in procs]
    return [p.returncode for p in procs], errs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two ranks trained, saving attached, killed by SIGKILL with a save in flight."""
    tmp = tmp_path_factory.mktemp("fsdp2")
    out = tmp / "out"
    out.mkdir()
    codes, errs = run(tmp, "train", 2, tmp / "ckpt", out, "train")
    assert codes == [-signal.SIGKILL] * 2, errs  # killed as planned, not crashed or failed earlier
    return tmp, tmp / "ckpt", out


def test_fresh_model_and_fresh_adamw_resume_bit_for_bit_after_sigkill(trained):
    tmp, ckpt, out = trained
    codes, errs = run(tmp, "resume", 2, ckpt, out, "resume")
    assert codes == [0, 0], errs
    for rank in range(2):
        got = json.loads((out / f"resume-{rank}.json").read_text())
        step = got["step"]
        # The step in flight at the kill committed on every rank or on none: the newest durable one otherwise.
        assert step in (DURABLE_STEP, DURABLE_STEP + 2), got
        assert list(got["resumed"]) == [str(s) for s in range(step + 1, LAST_STEP + 1)]
        for s, loss in got["resumed"].items():
            assert loss == got["reference"][s], (rank, s, loss, got["reference"][s])  # bit for bit
        assert got["final_differ"] == [], got


@pytest.mark.parametrize("world", [1, 3])
def test_the_step_loads_at_another_world_size_through_ettkit_and_dcp(trained, world):
    tmp, ckpt, out = trained
    codes, errs = run(tmp, "load", world, ckpt, out, f"load{world}")
    assert codes == [0] * world, errs
    for rank in range(world):
        got = json.loads((out / f"load-{world}-{rank}.json").read_text())
        assert got["resharded_from"] == 2, got
        # 9 parameters, each with exp_avg, exp_avg_sq and step: every one bit-identical to what was saved.
        assert got["tensors"] == 36 and got["ettkit_differ"] == [] and got["dcp_differ"] == [], got


def test_the_fsdp2_step_loads_into_a_plain_model_in_one_process(trained):
    # Evaluation or export, or fine-tuning on one machine: no process group, no FSDP2; every parameter and AdamW
    # state tensor whole from the 2 ranks' DTensor shards.
    tmp, ckpt, out = trained
    codes, errs = run(tmp, "export", 1, ckpt, out, "export")
    assert codes == [0], errs
    got = json.loads((out / "export.json").read_text())
    # A plain AdamW before its first step: refused naming its state and what to do, nothing copied.
    assert "'optim.state.0.exp_avg'" in got["refused"] and "Take one optimizer step" in got["refused"], got
    assert got["untouched"], got
    # The model alone, then with an AdamW that has state: 9 parameters and 27 state tensors, each equal to the
    # saved whole tensor bit for bit.
    assert got["resharded_from"] == 2 and got["tensors"] == 36 and got["differ"] == [], got


def test_a_one_process_step_resumes_under_fsdp2_at_two_ranks(tmp_path):
    # Scale-out: a model and AdamW trained in one process (plain tensors, saved whole) resume as FSDP2 DTensors
    # on 2 ranks. Each rank's shards of the weights and of exp_avg/exp_avg_sq are read from the whole tensors
    # (their global shapes checked); the next steps give the one-process run's losses, up to reassociation:
    # the one process backward-passes the ranks' mean loss, FSDP2 averages the ranks' gradients after each
    # rank's own backward (another order of the same sums; measured: equal to the last bit on the 2-vCPU VM).
    out = tmp_path / "out"
    out.mkdir()
    codes, errs = run(tmp_path, "plain_train", 1, tmp_path / "ckpt", out, "plain")
    assert codes == [0], errs
    codes, errs = run(tmp_path, "scale_out", 2, tmp_path / "ckpt", out, "scale")
    assert codes == [0, 0], errs
    reference = json.loads((out / "plain.json").read_text())["reference"]
    for rank in range(2):
        got = json.loads((out / f"scale_out-{rank}.json").read_text())
        assert got["step"] == 4 and got["resharded_from"] == 1, got
        assert list(got["losses"]) == list(reference), got
        for s, loss in got["losses"].items():
            want = reference[s][rank]
            assert abs(loss - want) <= 1e-5 * abs(want), (rank, s, loss, want)


def run_case(tmp_path, name):
    out = tmp_path / "out"
    out.mkdir()
    codes, errs = run(tmp_path, f"case:{name}", 1, tmp_path / "ckpt", out, name)
    assert codes == [0], errs  # a memory error would be a negative status (SIGSEGV)
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.parametrize("name,kind", [("param_dtensor", "DTensor"), ("param_sharded", "ShardedTensor")])
def test_a_parameter_around_a_dtensor_or_sharded_tensor_saves_loads_and_stages(tmp_path, name, kind):
    got = run_case(tmp_path, name)
    assert got == {"type": kind, "is_parameter": True, "step": 1, "loaded": True, "staged": True,
                   "staged_type": kind}


def test_a_dtensor_of_local_shards_as_torchrec_makes_them_saves_each_shard_at_its_offsets(tmp_path):
    got = run_case(tmp_path, "local_shards_wrapper")
    assert got == {"step": 1, "names": ["t@0,0", "t@0,2"], "loaded": True}


def test_an_unknown_tensor_subclass_is_refused_by_type_in_python_and_in_cpp(tmp_path):
    got = run_case(tmp_path, "unknown")
    assert "'w' is a __main__.Wrapped;" in got["save"], got
    assert "'p' is a __main__.Wrapped (an nn.Parameter);" in got["save_param"], got
    assert "'w' is a __main__.Wrapped;" in got["dcp"], got
    assert got["committed"] is None and got["unchanged"] is True  # nothing saved, nothing of the user's touched
    # Handed to the C++ stager directly (what a Python-side mistake would do): a typed refusal, no copy.
    for key, name in (("cpp_dtensor", "'d'"), ("cpp_param", "'p'")):
        assert f"state dict entry {name} cannot be staged: it is a Python tensor subclass" in got[key], got
    assert got["tagged"] is True  # a subclass whose own storage holds its values saves like a tensor
    assert got["bad_args"] == "TypeError" and got["tensor_list"] is True


def test_an_inline_dcp_stager_keeps_the_arena_alive_until_dcps_background_write_is_done(tmp_path):
    assert run_case(tmp_path, "dcp_inline")["equal"] is True


def test_optimizer_state_created_ahead_of_the_first_step_is_what_the_step_creates(tmp_path):
    got = run_case(tmp_path, "first_step")
    for name in ("Adam_amsgrad", "AdamW", "SGD_momentum", "RMSprop_centered"):
        assert got[name] == {"created": True, "same_layout": True, "zeros": True, "training_unchanged": True}, name
    # SGD without momentum keeps no state; Adagrad made its state at construction; with dampening the first
    # buffer is a copy of the gradient, which cannot exist before it: nothing is created for those.
    assert got["SGD"]["created"] is False and got["Adagrad"]["created"] is False
    assert got["SGD_dampening"]["created"] is False and got["SGD_dampening"]["training_unchanged"] is True
    assert got["AdamW_plain"] == {"created": False}


def dtensor_slot(rows):
    return ShardedSlot((rows, 4), "torch.float32", (((0, 0), (rows // 2, 4), "Shard(dim=0)"),))


def test_a_mismatch_names_the_saved_and_the_live_type_and_stays_short():
    # The checkpoint holds FSDP2 AdamW state for 40 parameters; the live optimizer has none. Where the model had
    # a DTensor the live state has a plain tensor: not a mismatch (read whole from its pieces; the loader checks
    # its shape), so the message names the optimizer state alone.
    saved = {"model": {"emb": dtensor_slot(10)},
             "optim": {"state": {i: {"exp_avg": dtensor_slot(8), "exp_avg_sq": dtensor_slot(8)} for i in range(40)},
                       "param_groups": []}}
    live = {"model": StatefulSlot("model", None, None, {}, {"emb": TENSOR}),
            "optim": StatefulSlot("optim", None, None, {}, {"state": {}, "param_groups": []})}
    with pytest.raises(ettkit.InvalidArgumentError) as e:
        check_sharded(live, saved)
    msg = str(e.value)
    assert "'model.emb'" not in msg
    assert "'optim.state.0.exp_avg': the checkpoint holds a DTensor [8, 4] torch.float32" in msg
    assert "ShardedTensor" not in msg
    assert msg.count("'optim.state.") == MAX_NAMED and "... and 68 more" in msg  # 80 found, 12 named
    assert "creates it before a load for Adam, AdamW" in msg
    assert len(msg) < 2500, len(msg)
