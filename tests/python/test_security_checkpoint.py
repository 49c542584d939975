"""Issue 39 item 1: a checkpoint directory runs no code when it is loaded.

The attacker here can write the checkpoint directory (a co-tenant, a hostile copy handed over): they plant a
step whose manifest carries correct XXH3 checksums (they compute them), so every check but the format's
must pass. Each attack asserts the planted code did not run (a marker file stays uncreated), and that the
user's state and earlier steps are what they were. Round trips cover every plain value type of the
pickle-free ``rank-<r>.extra`` format, and the former pickled format under ``allow_pickle=True``."""

import collections
import hashlib
import io
import json
import math
import os
import pickle
import shlex
import struct
import subprocess
import sys
import tracemalloc

import pytest
import torch

import ettkit
from ettkit import _C
from ettkit.checkpoint import AsyncCheckpointer
from ettkit.checkpoint._tensor_kinds import TENSOR, ShardedSlot
from ettkit.checkpoint._skeleton_codec import (
    MAGIC,
    MAGIC_PICKLE,
    MAX_DEPTH,
    MAX_NODES,
    MAX_RECORD_BYTES,
    RestrictedUnpickler,
    decode_extra,
    encode_extra,
    encode_skeleton,
)
from extra_record_bytes import record, varint


class RunsShell:
    """Pickles to ``os.system("touch <marker>")``: what a hostile ``.extra`` would run at load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


class Config:
    """A user object in the state: stored only under allow_pickle=True."""

    def __init__(self, name, depth):
        self.name, self.depth = name, depth

    def __eq__(self, other):
        return type(other) is Config and (self.name, self.depth) == (other.name, other.depth)


def state(step):
    return {"w": torch.full((64,), float(step)), "meta": {"epoch": step, "lr": 0.5 / step}}


def zeros():
    return {"w": torch.zeros(64), "meta": {"epoch": -1, "lr": -1.0}}


def save_two_steps(path, **kw):
    with AsyncCheckpointer(path, recorder=None, **kw) as ck:
        for step in (1, 2):
            assert ck.save(step, state(step), extra={"epoch": step}).wait()


def fingerprint(step_dir):
    """Every file of a step and its bytes' SHA-256: what must not change."""
    return {n: hashlib.sha256((step_dir / n).read_bytes()).hexdigest() for n in sorted(os.listdir(step_dir))}


def plant(step_dir, files):
    """Writes ``files`` into a committed step and a manifest whose sizes and XXH3 checksums match them: what
    anyone who can write the directory can do (the checksums prove integrity, not authorship)."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for name, data in files.items():
        (step_dir / name).write_bytes(data)
        digest = _C.xxh3_hex(data)
        entry = manifest["files"][name]
        entry.update(size=len(data), xxh3=digest, chunks=[digest] if data else [])
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


EMPTY_SAFETENSORS = b"\x02\x00\x00\x00\x00\x00\x00\x00{}"


def pickled_leaf(obj):
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return b"P" + varint(len(data)) + data


# ---- the attack of the issue: a planted step whose .extra is a pickle that runs a shell command ----------------

def test_the_planted_pickle_is_live_under_plain_pickle(tmp_path):
    # The payload the attacks below plant does run code under pickle.loads, which is what ettkit called on it
    # before: the attacks are real, and each test below would fail on that code.
    marker = tmp_path / "pwned"
    blob = MAGIC_PICKLE + pickle.dumps(RunsShell(marker))
    (tmp_path / "blob").write_bytes(blob)
    code = "import pickle, sys; pickle.loads(open(sys.argv[1], 'rb').read()[len(sys.argv[2]):])"
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "blob"), MAGIC_PICKLE.decode()], check=True)
    assert marker.exists()


@pytest.mark.parametrize("safetensors", ["empty", "matching"])
@pytest.mark.parametrize("allow_pickle", [False, True])
def test_hostile_pickled_extra_runs_nothing_at_load(tmp_path, safetensors, allow_pickle):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    save_two_steps(ckpt)
    before = fingerprint(ckpt / "step-1")
    files = {"rank-0.extra": MAGIC_PICKLE + pickle.dumps(RunsShell(marker))}
    if safetensors == "empty":
        files["rank-0.safetensors"] = EMPTY_SAFETENSORS  # the step: no tensors at all
    plant(ckpt / "step-2", files)
    target = zeros()
    with AsyncCheckpointer(ckpt, recorder=None, read_only=True, allow_pickle=allow_pickle) as ck:
        if allow_pickle:
            # The restricted unpickler refuses os.system: step 2 is corrupt, and the load falls back to step 1.
            with pytest.warns(RuntimeWarning, match=r"newer steps \[2\]"):
                assert ck.load_latest(target) == (1, {"epoch": 1})
            assert torch.equal(target["w"], state(1)["w"]) and target["meta"] == state(1)["meta"]
        else:
            # A pickle without the opt-in is refused, naming it; nothing is copied.
            refused = r"former format, a pickle, which loads only with AsyncCheckpointer\(\.\.\., allow_pickle=True\)"
            with pytest.raises(ettkit.InvalidArgumentError, match=refused):
                ck.load_latest(target)
            assert torch.equal(target["w"], torch.zeros(64)) and target["meta"] == zeros()["meta"]
    assert not marker.exists()
    assert fingerprint(ckpt / "step-1") == before


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_hostile_pickled_leaf_in_a_current_record_runs_nothing(tmp_path, allow_pickle):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    save_two_steps(ckpt)
    skeleton = (b"d\x02" + b"s\x01wX" + b"s\x04meta" + b"d\x02" + b"s\x05epoch" + pickled_leaf(RunsShell(marker))
                + b"s\x02lr" + b"f" + struct.pack("<d", 0.25))
    plant(ckpt / "step-2", {"rank-0.extra": record(skeleton=skeleton)})
    target = zeros()
    with AsyncCheckpointer(ckpt, recorder=None, read_only=True, allow_pickle=allow_pickle) as ck:
        if allow_pickle:
            with pytest.warns(RuntimeWarning, match=r"newer steps \[2\]"):
                assert ck.load_latest(target)[0] == 1
        else:
            with pytest.raises(ettkit.InvalidArgumentError,
                               match=r"state entry 'meta\.epoch' holds a pickled object.*allow_pickle=True"):
                ck.load_latest(target)
            assert torch.equal(target["w"], torch.zeros(64))
    assert not marker.exists()


def test_hostile_extra_runs_nothing_through_the_prefetched_load(tmp_path):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    save_two_steps(ckpt)
    plant(ckpt / "step-2", {"rank-0.extra": MAGIC_PICKLE + pickle.dumps(RunsShell(marker))})
    target = zeros()
    with AsyncCheckpointer(ckpt, recorder=None, allow_pickle=True) as ck:
        assert ck.prefetch() == [2] and ck.wait_prefetch()  # step 2's files verified ahead: they are consistent
        with pytest.warns(RuntimeWarning, match=r"newer steps \[2\]"):
            assert ck.load_latest(target) == (1, {"epoch": 1})
    assert not marker.exists()


def as_two_rank_step(step_dir):
    """Makes a one-rank step one of two ranks that saved the same bytes: a load by one rank reshards it."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    for ext in ("safetensors", "extra"):
        (step_dir / f"rank-1.{ext}").write_bytes((step_dir / f"rank-0.{ext}").read_bytes())
        manifest["files"][f"rank-1.{ext}"] = manifest["files"][f"rank-0.{ext}"]
    manifest["world_size"] = 2
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("hostile", [False, True])
def test_hostile_extra_runs_nothing_through_the_resharding_load(tmp_path, hostile):
    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    save_two_steps(ckpt)
    as_two_rank_step(ckpt / "step-2")
    if hostile:  # old rank 0's record is the one a resharding load decodes
        plant(ckpt / "step-2", {"rank-0.extra": MAGIC_PICKLE + pickle.dumps(RunsShell(marker))})
    target = zeros()
    with AsyncCheckpointer(ckpt, recorder=None, read_only=True, allow_pickle=True) as ck:
        if hostile:
            with pytest.warns(RuntimeWarning, match=r"newer steps \[2\]"):
                assert ck.load_latest(target) == (1, {"epoch": 1})
        else:  # the control: the crafted step is loaded by resharding
            assert ck.load_latest(target) == (2, {"epoch": 2}) and ck.resharded_from == 2
    assert torch.equal(target["w"], state(2 - hostile)["w"])
    assert not marker.exists()


def test_dcp_reader_never_reads_the_extra(tmp_path):
    import torch.distributed.checkpoint as dcp

    from ettkit.checkpoint import EttkitStorageReader

    ckpt, marker = tmp_path / "ckpt", tmp_path / "pwned"
    save_two_steps(ckpt)
    plant(ckpt / "step-2", {"rank-0.extra": MAGIC_PICKLE + pickle.dumps(RunsShell(marker))})
    target = {"w": torch.zeros(64)}
    dcp.load(target, storage_reader=EttkitStorageReader(ckpt), no_dist=True)
    assert torch.equal(target["w"], state(2)["w"])
    assert not marker.exists()


def test_dcp_reader_refuses_a_hostile_manifest_and_header_with_typed_errors(tmp_path):
    from ettkit.checkpoint import EttkitStorageReader

    ckpt = tmp_path / "ckpt"
    save_two_steps(ckpt)
    step = ckpt / "step-2"
    good = (step / "manifest.json").read_bytes()
    (step / "manifest.json").write_bytes(b"[" * 100_000)  # nesting deeper than json's stack
    with pytest.raises(ettkit.CorruptDataError, match=r"manifest\.json' is not valid JSON"):
        EttkitStorageReader(step).read_metadata()
    (step / "manifest.json").write_bytes(good)
    header = json.dumps({"w": {"dtype": "F32", "shape": [64], "data_offsets": [0, 1 << 40]}}).encode()
    (step / "rank-0.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(256))
    with pytest.raises(ettkit.CorruptDataError, match=r"'w' has data_offsets \[0, 1099511627776\], not a range"):
        EttkitStorageReader(step).read_metadata()
    os.replace(step / "rank-0.safetensors", tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", step / "rank-0.safetensors")
    with pytest.raises(ettkit.CorruptDataError, match=r"is a symbolic link"):
        EttkitStorageReader(step).read_metadata()


# ---- the restricted unpickler (allow_pickle=True) ------------------------------------------------------------

@pytest.mark.parametrize("global_name", ["posix system", "builtins eval", "torch load", "os system",
                                         "subprocess Popen", "builtins getattr"])
def test_restricted_unpickler_refuses_globals_outside_the_allow_list(global_name):
    module, name = global_name.split()
    data = b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"."
    with pytest.raises(pickle.UnpicklingError, match=f"'{module}.{name}', which is not allowed"):
        RestrictedUnpickler(io.BytesIO(data)).load()


@pytest.mark.parametrize("target", [("torch._utils", "_rebuild_tensor_v2"),
                                    ("ettkit.checkpoint._flatten", "ShardedSlot")])
def test_restricted_unpickler_cannot_alter_an_allowed_global(target):
    # BUILD on a class or function of the allow-list would set its attributes for the whole process
    # (a function's defaults, a class's methods): only instances of registered classes take state.
    module, name = target
    obj = getattr(__import__(module, fromlist=[name]), name)
    before = dict(vars(obj)) if isinstance(obj, type) else obj.__defaults__
    attr = b"__defaults__" if not isinstance(obj, type) else b"describe"
    data = (b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"N}X" + len(attr).to_bytes(4, "little") + attr
            + b")s\x86b.")
    with pytest.raises(pickle.UnpicklingError, match="sets the state of a"):
        RestrictedUnpickler(io.BytesIO(data)).load()
    assert (dict(vars(obj)) if isinstance(obj, type) else obj.__defaults__) == before


def test_restricted_unpickler_refuses_persistent_ids():
    data = b"\x80\x02X\x01\x00\x00\x00xQ."  # BINPERSID
    with pytest.raises(pickle.UnpicklingError, match="persistent id"):
        RestrictedUnpickler(io.BytesIO(data)).load()


# ---- hostile current-format records: typed errors, bounded memory ----------------------------------------------

HOSTILE = {
    "deep lists": (record(skeleton=b"l\x01" * 200_000 + b"N"), r"nests deeper than 100 levels"),
    "deep dicts": (record(skeleton=b"d\x01s\x01a" * 200_000 + b"N"), r"nests deeper than 100 levels"),
    "huge str length": (record(skeleton=b"s" + varint(1 << 62)), r"says 4611686018427387904, more than the"),
    "huge list count": (record(skeleton=b"l" + varint(1 << 40)), r"list's count says 1099511627776"),
    "huge dict count": (record(skeleton=b"d" + varint(1 << 40)), r"dict's count says 1099511627776"),
    "huge bytes length": (record(extra=b"b" + varint(1 << 50) + b"x"), r"bytes' length says"),
    "huge int length": (record(extra=b"I" + varint(1 << 33)), r"int's length says"),
    "huge tensor": (record(extra=b"A\x07float32\x01" + varint(1 << 40) + varint(1 << 42)),
                    r"tensor's byte length says"),
    "tensor shape and bytes disagree": (record(extra=b"A\x07float32\x01\x04\x08" + bytes(8)),
                                        r"float32 tensor of shape \[4\] takes 16 bytes, not 8"),
    "too many values": (record(skeleton=b"l" + varint(MAX_NODES + 1) + b"N" * (MAX_NODES + 1)),
                        rf"more than {MAX_NODES} values"),
    "unknown tag": (record(skeleton=b"d\x01s\x01aZ"), r"\(state entry 'a'\): unknown tag 0x5a"),
    "unknown field": (record(fields=[("world_size", b"i" + (1).to_bytes(8, "little")), ("skeleton", b"N"),
                                     ("extra", b"N"), ("evil", b"N")]), r"unknown field 'evil'"),
    "missing field": (record(fields=[("world_size", b"i" + (1).to_bytes(8, "little")), ("skeleton", b"N")]),
                      r"the field 'extra' is missing"),
    "trailing bytes": (record() + b"N", r"1 bytes follow the record"),
    "repeated key": (record(skeleton=b"d\x02s\x01aNs\x01aN"), r"a dict of 2 entries repeats a key"),
    "not utf-8": (record(skeleton=b"s\x02\xff\xfe"), r"not UTF-8"),
    "unknown dtype": (record(skeleton=b"D\x04evil"), r"'evil' is not a torch dtype"),
    "bad device": (record(skeleton=b"V\x0ccuda:0; rm /"), r"is not a device name"),
    "world size 0": (record(world=b"i" + bytes(8)), r"world_size is 0"),
    "unhashable key": (record(skeleton=b"d\x01l\x00N"), r"a dict key is a list"),
    "bad sharded slot": (record(skeleton=b"Ht\x03t\x01i" + bytes(8) + b"D\x07float32s\x00"),
                         r"sharded tensor's size, dtype or shards have the wrong type"),
    "newer format": (b"ettkit-py-extra-v9\n" + b"N", r"a format this ettkit does not know"),
    "key set used before it is defined": (record(skeleton=b"R\x00"), r"key set 0 is referred to before it is defined"),
    "key lengths past the keys": (record(skeleton=b"K\x01" + (5).to_bytes(4, "little") + b"\x01a"),
                                  r"the keys' lengths add up to 5, not the 1 code points stored"),
    "repeated key in a key set": (record(skeleton=b"K\x02" + (1).to_bytes(4, "little") * 2 + b"\x02aa"),
                                  r"a dict of 2 entries repeats a key"),
    "huge int list": (record(skeleton=b"J" + varint(1 << 40)), r"int list's count says 1099511627776"),
    "too large": (MAGIC + b"N" * (MAX_RECORD_BYTES + 1), r"record takes at most"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_record_is_refused_with_a_typed_error_in_bounded_memory(name):
    blob, match = HOSTILE[name]
    tracemalloc.start()
    try:
        with pytest.raises(ettkit.CorruptDataError, match=match):
            decode_extra(blob, "rank-0.extra", allow_pickle=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The record itself was allocated before; decoding it must not cost more than a fraction of it, whatever
    # its lengths say. "too many values" is refused at the count, before any of them is built.
    assert peak < 8 << 20, (name, peak)


def test_hostile_record_in_a_step_falls_back_to_the_previous_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_two_steps(ckpt)
    before = fingerprint(ckpt / "step-1")
    plant(ckpt / "step-2", {"rank-0.extra": HOSTILE["deep lists"][0]})
    target = zeros()
    with AsyncCheckpointer(ckpt, recorder=None, read_only=True) as ck:
        with pytest.warns(RuntimeWarning, match=r"newer steps \[2\]"):
            assert ck.load_latest(target) == (1, {"epoch": 1})
    assert torch.equal(target["w"], state(1)["w"])
    assert fingerprint(ckpt / "step-1") == before


_LOAD_AND_REPORT_PEAK = """
import sys, warnings, torch
from ettkit.checkpoint import AsyncCheckpointer

def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

target = {"w": torch.zeros(64), "meta": {"epoch": -1, "lr": -1.0}}
with AsyncCheckpointer(sys.argv[1], recorder=None, read_only=True) as ck:
    before = peak_kib()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = ck.load_latest(target)
    after = peak_kib()
print(got[0], float(target["w"][0]), after - before, "|".join(str(w.message) for w in caught))
"""


def test_an_extra_listed_larger_than_the_bound_is_refused_before_it_is_read(tmp_path):
    """A manifest may name any size for rank-<r>.extra (its writer computes the checksums); a 512 MiB sparse
    file costs 4 KiB of disk. The loader must refuse the size from the manifest, not read the file whole
    (which took the loading process's peak RSS up by 512 MiB before the bound)."""
    ckpt = tmp_path / "ckpt"
    save_two_steps(ckpt)
    before = fingerprint(ckpt / "step-1")
    step2 = ckpt / "step-2"
    manifest = json.loads((step2 / "manifest.json").read_text())
    size, chunk = 288 << 20, 32 << 20  # over the 256 MiB bound
    with open(step2 / "rank-0.extra", "wb") as f:
        f.truncate(size)  # sparse: no data blocks
    # Checksums that match: the attacker computes them (the whole file's on a buffer here, freed before the load).
    manifest["files"]["rank-0.extra"].update(size=size, chunk_bytes=chunk, xxh3=_C.xxh3_hex(bytes(size)),
                                             chunks=[_C.xxh3_hex(bytes(chunk))] * (size // chunk))
    (step2 / "manifest.json").write_text(json.dumps(manifest))
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_REPORT_PEAK, str(ckpt)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    step, value, grew_kib, warned = out.stdout.strip().split(" ", 3)
    assert (int(step), float(value)) == (1, 1.0)
    assert "newer steps [2]" in warned
    assert int(grew_kib) < 100 << 10, f"the load raised the peak RSS by {int(grew_kib) >> 10} MiB"
    assert fingerprint(ckpt / "step-1") == before


def test_the_cpp_checkpointer_refuses_an_extra_over_the_bound_at_save(tmp_path):
    with AsyncCheckpointer(tmp_path / "ckpt", recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match=r"256 MiB"):
            tensors = _C.checkpoint.TensorList()
            tensors.set(["w"], [torch.zeros(4)])
            ck._c.save(1, tensors, b"x" * ((256 << 20) + 1), "disk")


# ---- round trips: every plain value, without pickle -----------------------------------------------------------

PLAIN = {
    "none": None, "yes": True, "no": False, "int": -7, "int64 max": 2**63 - 1, "int64 min": -(2**63),
    "big": 3**200, "big negative": -(2**64) - 1, "float": 0.1, "nan": float("nan"), "inf": float("inf"),
    "-inf": float("-inf"), "negative zero": -0.0, "complex": complex(1.5, -0.0), "str": "ünïcode \ud800 ✓",
    "empty str": "", "bytes": bytes(range(256)), "list": [1, [2.5, ["x"]], []], "tuple": (1, ("a", (None,)), ()),
    "int keys": {3: "c", 1: "a", 2: "b"}, "odd keys": {(1, "t"): 1, None: 2, 2.5: 3, b"k": 4, True: 5, -1: 6},
    "size": torch.Size([2, 3, 0]), "empty size": torch.Size([]), "dtype": torch.bfloat16,
    "float8": torch.float8_e4m3fn, "device": torch.device("cuda", 3), "cpu": torch.device("cpu"),
}
EXTRA = {
    "rng": torch.get_rng_state(), "cuda-like rng": [torch.arange(16, dtype=torch.uint8), torch.zeros(0)],
    "matrix": torch.arange(12, dtype=torch.float64).reshape(3, 4).t(),  # not contiguous: stored as its values
    "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "mask": torch.tensor([True, False]),
    "plain": PLAIN,
}


def assert_same(a, b, where=""):
    """Equal with the same types all the way down (bool is not int, tuple is not list, Size is not tuple), key
    order included; nan equals nan and -0.0 is told from 0.0."""
    assert type(a) is type(b), (where, a, b)
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for (ka, va), (kb, vb) in zip(a.items(), b.items()):
            assert_same(ka, kb, f"{where}.key")
            assert_same(va, vb, f"{where}.{ka}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b), where
    elif isinstance(a, (float, complex)):
        pairs = [(a.real, b.real), (a.imag, b.imag)] if isinstance(a, complex) else [(a, b)]
        for x, y in pairs:
            assert (math.isnan(x) and math.isnan(y)) or (x == y and math.copysign(1, x) == math.copysign(1, y)), where
    else:
        assert a == b, where


# A skeleton as a model and its optimizer give one: dicts of placeholders (stored as one key set, then by its
# number where it repeats) and a list of parameter ids (packed).
OPTIMIZER_LIKE = {"model": {"0.weight": TENSOR, "0.bias": TENSOR, "ünï": TENSOR},
                  "optim": {"state": {0: {"step": TENSOR, "exp_avg": TENSOR}, 1: {"step": TENSOR, "exp_avg": TENSOR},
                                      2: {"exp_avg": TENSOR, "step": TENSOR}},
                            "param_groups": [{"lr": 0.1, "params": [0, 1, 2], "betas": (0.9, 0.999)}]},
                  "named": {"a": {"step": TENSOR, "exp_avg": TENSOR}, "b": {"step": TENSOR, "exp_avg": TENSOR}}}


@pytest.mark.parametrize("skeleton", [PLAIN, OPTIMIZER_LIKE], ids=["plain", "optimizer-like"])
def test_a_truncated_record_is_refused_at_every_cut(skeleton):
    blob = encode_extra(encode_skeleton(skeleton, allow_pickle=False), EXTRA, 4, allow_pickle=False)
    for cut in range(len(MAGIC), len(blob)):
        with pytest.raises(ettkit.CorruptDataError, match=r"does not decode at byte \d+"):
            decode_extra(blob[:cut], "rank-0.extra", allow_pickle=False)
    assert decode_extra(blob, "rank-0.extra", allow_pickle=False).world_size == 4


def test_a_skeleton_of_repeated_key_sets_round_trips_in_order():
    code = encode_skeleton(OPTIMIZER_LIKE, allow_pickle=False)
    back = decode_extra(encode_extra(code, None, 1, allow_pickle=False), "rank-0.extra", allow_pickle=False).skeleton
    assert_same(back, OPTIMIZER_LIKE)
    assert all(v is TENSOR for d in back["optim"]["state"].values() for v in d.values())
    # Every value counted as in the generic form (a dict, each key, each value): the limits do not depend on
    # which form the encoder chose.
    def values(x):
        if isinstance(x, dict):
            return 1 + sum(values(k) + values(v) for k, v in x.items())
        return 1 + sum(map(values, x)) if isinstance(x, (list, tuple)) else 1

    assert code.nodes == values(OPTIMIZER_LIKE)


def test_every_plain_value_round_trips_through_a_checkpoint_without_pickle(tmp_path):
    saved = {"w": torch.arange(4.0), "values": dict(PLAIN)}
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        assert ck.save(1, saved, extra=EXTRA).wait()
    raw = (tmp_path / "step-1" / "rank-0.extra").read_bytes()
    assert raw.startswith(MAGIC)
    decode_extra(raw, "rank-0.extra", allow_pickle=False)  # holds no pickle: decodes without the opt-in
    target = {"w": torch.zeros(4), "values": {k: None for k in PLAIN}}
    with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck:
        step, extra = ck.load_latest(target)
    assert step == 1 and torch.equal(target["w"], torch.arange(4.0))
    assert_same(target["values"], PLAIN)
    assert_same(extra, {**EXTRA, "matrix": EXTRA["matrix"].contiguous()})


def test_the_skeleton_nodes_round_trip_and_malformed_ones_are_refused():
    slot = ShardedSlot((10, 4), torch.float32, (((0, 0), (5, 4), "rank:0/cpu"), ((5, 0), (5, 4), None)))
    skeleton = {"emb": slot, "w": TENSOR, "list": [TENSOR, (TENSOR, 1)]}
    back = decode_extra(encode_extra(encode_skeleton(skeleton, allow_pickle=False), None, 2, allow_pickle=False),
                        "rank-0.extra", allow_pickle=False).skeleton
    assert back["w"] is TENSOR and back["list"][0] is TENSOR and back["list"][1][0] is TENSOR
    assert type(back["emb"]) is ShardedSlot and back["emb"] == slot and back["emb"].shards == slot.shards
    # Offsets of another rank than the size's, a negative size: refused naming what is wrong.
    bad = ShardedSlot((10, 4), torch.float32, (((0,), (5, 4), None),))
    with pytest.raises(ettkit.CorruptDataError, match=r"shard is not \(offsets, sizes, placement\)"):
        decode_extra(encode_extra(encode_skeleton({"emb": bad}, allow_pickle=False), None, 1, allow_pickle=False),
                     "rank-0.extra", allow_pickle=False)


def nested(levels):
    value = None
    for _ in range(levels):
        value = [value]
    return value


def test_limits_are_checked_at_save_so_a_written_step_always_loads(tmp_path):
    # The record's dict and the state's are two of the MAX_DEPTH levels.
    fits, too_deep = nested(MAX_DEPTH - 2), nested(MAX_DEPTH - 1)
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match=r"state entry 'cfg(\.0)+' is a list that is nested more "
                                                              r"than 100 levels deep"):
            ck.save(1, {"w": torch.ones(1), "cfg": too_deep})
        with pytest.raises(ettkit.InvalidArgumentError, match=r"hold \d+ values together, more than"):
            ck.save(1, {"w": torch.ones(1)}, extra=[0] * MAX_NODES)
        assert ck.save(2, {"w": torch.ones(1), "cfg": fits}).wait()
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step-")) == ["step-2"]
    target = {"w": torch.zeros(1), "cfg": None}
    with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck:
        assert ck.load_latest(target)[0] == 2
    assert target["cfg"] == fits


# ---- objects of the user's own classes: refused without the opt-in, allow-listed with it ----------------------

def test_a_user_object_is_refused_at_save_without_the_opt_in(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        with pytest.raises(ettkit.InvalidArgumentError,
                           match=r"state entry 'meta\.cfg' is a test_security_checkpoint\.Config, which ettkit's "
                                 r"checkpoint format stores only as a pickle.*allow_pickle=True"):
            ck.save(1, {"w": torch.ones(2), "meta": {"cfg": Config("a", 2)}})
        with pytest.raises(ettkit.InvalidArgumentError, match=r"save\(\.\.\., extra=\.\.\.\)\['cfg'\] is a "
                                                              r"test_security_checkpoint\.Config"):
            ck.save(1, {"w": torch.ones(2)}, extra={"cfg": Config("a", 2)})
        assert ck.save(2, {"w": torch.ones(2)}).wait()  # the refused saves left nothing behind
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step-")) == ["step-2"]


def test_a_user_object_round_trips_under_the_opt_in_and_is_refused_on_load_without_it(tmp_path):
    with AsyncCheckpointer(tmp_path, recorder=None, allow_pickle=True) as ck:
        # Not registered: it could not be loaded back, so it is not written.
        with pytest.raises(ettkit.InvalidArgumentError, match=r"'test_security_checkpoint\.Config', which is not "
                                                              r"allowed.*add_safe_globals"):
            ck.save(1, {"w": torch.ones(2), "cfg": Config("a", 2)})
        with torch.serialization.safe_globals([Config]):
            assert ck.save(2, {"w": torch.ones(2), "cfg": Config("a", 2)}, extra={"c": Config("b", 3)}).wait()
    target = {"w": torch.zeros(2), "cfg": None}
    with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck:
        with pytest.raises(ettkit.InvalidArgumentError,
                           match=r"state entry 'cfg' holds a pickled object.*allow_pickle=True"):
            ck.load_latest(target)
    assert target == {"w": target["w"], "cfg": None} and torch.equal(target["w"], torch.zeros(2))
    with AsyncCheckpointer(tmp_path, recorder=None, read_only=True, allow_pickle=True) as ck:
        with torch.serialization.safe_globals([Config]):
            step, extra = ck.load_latest(target)
    assert step == 2 and target["cfg"] == Config("a", 2) and extra == {"c": Config("b", 3)}


# ---- the former, pickled format --------------------------------------------------------------------------------

def former_format(skeleton, extra, world_size):
    """``rank-<r>.extra`` as ettkit wrote it before this format: the encoder of that code, verbatim."""
    return b"ettkit-py-extra-v1\n" + pickle.dumps(
        {"skeleton_pickle": pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), "extra": extra,
         "world_size": world_size}, protocol=pickle.HIGHEST_PROTOCOL)


def test_a_checkpoint_in_the_former_pickled_format_loads_only_under_the_opt_in(tmp_path):
    values = {"epoch": 7, "dtype": torch.float16, "device": torch.device("cpu"), "z": 1 - 2j,
              "shape": torch.Size([3, 4]), "ids": {0: "a", 1: "b"}, "t": (1, 2)}
    extra = {"rng": torch.get_rng_state(), "order": collections.OrderedDict(b=1, a=2), "set": {1, 2}}
    with AsyncCheckpointer(tmp_path, recorder=None) as ck:
        assert ck.save(5, {"w": torch.arange(3.0), "values": values}).wait()
    # The same step as the former code wrote it: its skeleton (the tensor a placeholder), pickled.
    plant(tmp_path / "step-5", {"rank-0.extra": former_format({"w": TENSOR, "values": values}, extra, 1)})
    target = {"w": torch.zeros(3), "values": {k: None for k in values}}
    with AsyncCheckpointer(tmp_path, recorder=None, read_only=True) as ck:
        with pytest.raises(ettkit.InvalidArgumentError, match=r"step 5 .*former format, a pickle, which loads only "
                                                              r"with AsyncCheckpointer\(\.\.\., allow_pickle=True\)"):
            ck.load_latest(target)
    assert torch.equal(target["w"], torch.zeros(3)) and set(target["values"].values()) == {None}
    with AsyncCheckpointer(tmp_path, recorder=None, read_only=True, allow_pickle=True) as ck:
        step, got = ck.load_latest(target)
    assert step == 5 and torch.equal(target["w"], torch.arange(3.0))
    assert_same(target["values"], values)
    assert torch.equal(got["rng"], extra["rng"]) and got["order"] == extra["order"] and got["set"] == {1, 2}


def test_the_former_format_reads_sharded_slots_checked():
    slot = ShardedSlot((8,), torch.float32, (((0,), (4,), "rank:0/cpu"),))
    good = decode_extra(former_format({"emb": slot}, None, 2), "rank-0.extra", allow_pickle=True)
    assert good.skeleton["emb"] == slot and good.world_size == 2
    # A slot the former format could hold but no save wrote: built through the allow-list, then checked.
    bad = ShardedSlot((8,), torch.float32, ((("0",), (4,), None),))
    with pytest.raises(ettkit.CorruptDataError, match=r"former format\) does not load: a sharded tensor's shard"):
        decode_extra(former_format({"emb": bad}, None, 2), "rank-0.extra", allow_pickle=True)
