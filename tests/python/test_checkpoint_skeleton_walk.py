"""The one skeleton walk (_skeleton_walk.py) and the load plan held as data (_load_plan.py), tested as values:
what each visits and pairs, and what a plan holds before any file is read; the hand-inlined save walk
(_flatten.py) held to the names and order of the one walk; every other recursion of the checkpoint layer
listed with its reason (issue #64)."""

from __future__ import annotations

import torch
from graph_cycles import cycles

from ettkit.checkpoint._extra_encode import encode_extra, encode_skeleton
from ettkit.checkpoint._flatten import flatten_state
from ettkit.checkpoint._load_plan import LoadPlan
from ettkit.checkpoint._skeleton_walk import (
    ABSENT,
    child_name,
    holds_values,
    only_sharded,
    DESCEND,
    DROP,
    rebuild,
    rebuild_pair,
    tensor_names,
    walk,
    walk_pair,
)
from ettkit.checkpoint._tensor_kinds import TENSOR


def test_a_torch_size_is_a_value_that_no_walk_enters():
    skeleton = {"a": TENSOR, "shape": torch.Size([2, 3]), "l": [TENSOR, (1, TENSOR)]}
    seen = []
    walk(skeleton, lambda x, n: seen.append(n) or True)
    assert seen == ["", "a", "shape", "l", "l.0", "l.1", "l.1.0", "l.1.1"]  # the Size's ints are not visited
    assert tensor_names(skeleton) == ["a", "l.0", "l.1.1"]
    assert child_name("", 3) == "3" and child_name("m", "w") == "m.w"


def test_walk_pair_pairs_the_live_keys_then_the_saved_only_ones_and_list_items_by_the_live_indices():
    pairs = []

    def visit(x, s, n):
        pairs.append((n, x if x is ABSENT else type(x).__name__, s if s is ABSENT else type(s).__name__))
        return isinstance(x, (dict, list))

    walk_pair({"a": 1, "l": [1, 2]}, {"b": 2, "a": 1.0, "l": [3]}, visit)
    assert pairs == [("", "dict", "dict"), ("a", "int", "float"), ("l", "list", "list"), ("l.0", "int", "int"),
                     ("l.1", "int", ABSENT), ("b", ABSENT, "int")]


def test_rebuild_pair_places_joins_and_drops_by_the_pairing_of_walk_pair():
    live = {"a": [1, 2, 3], "s": torch.Size([2]), "live_only": 0}
    saved = {"a": [10, 20], "s": torch.Size([4]), "saved_only": 5}
    placed = []

    def place(x, s, n):
        placed.append((n, x is ABSENT, s is ABSENT))
        if isinstance(x, (dict, list)) and type(x) is type(s):
            return DESCEND
        return DROP if s is ABSENT else s  # a torch.Size is a value: placed whole, never entered

    def join(x, s, n, items):
        return dict(items) if isinstance(x, dict) else [v for _, v in items]

    assert rebuild_pair(live, saved, place, join) == {"a": [10, 20], "s": torch.Size([4]), "saved_only": 5}
    assert placed == [("", False, False), ("a", False, False), ("a.0", False, False), ("a.1", False, False),
                      ("a.2", False, True), ("s", False, False), ("live_only", False, True),
                      ("saved_only", True, False)]


def test_a_load_plan_is_made_once_and_checks_a_candidate_before_any_copy():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt, "epoch": 3}
    plan = LoadPlan.make(state, None, partial=False, world_size=1, allow_pickle=False)
    assert plan.names == ["model.weight", "model.bias"]
    assert plan.read_prefixes == ["optim"]  # an optimizer's state is read into new tensors
    assert [s.prefix for s in plan.slots] == ["model", "optim"] and plan.checked is None
    _, _, skeleton, _, _ = flatten_state(state)
    blob = encode_extra(encode_skeleton(skeleton, allow_pickle=False), None, 1, allow_pickle=False)
    plan.check(blob)
    assert plan.checked is not None and plan.checked.value.skeleton["epoch"] == 3
    assert set(plan.checked.saved) == {id(s) for s in plan.slots}


# ---- the save walk (_flatten.py, hand-inlined) against the one walk -----------------------------------------
class _Counter:
    """A user Stateful whose state dict holds every node kind again, one level down."""

    def __init__(self):
        self.w = torch.ones(2)

    def state_dict(self):
        return {"w": self.w, "shape": torch.Size([4]), "hist": [1.5, None, (self.w, "x")], "empty": {}}

    def load_state_dict(self, sd):
        self.w = sd["w"]


def _every_kind(sharded):
    """A state with every node kind the save walk tells apart: dicts, lists, tuples (nested and empty), a
    torch.Size (a value, never entered), a module and a user Stateful, a sharded tensor, None, scalars, text."""
    t = torch.arange(6.0)
    return {
        "model": torch.nn.Linear(2, 3),
        "counter": _Counter(),
        "emb": sharded,
        "size": torch.Size([2, 3]),
        "nested": {"a": [t, (t.view(2, 3), torch.Size([1])), []], "b": (), "none": None},
        "scalars": [1, 2.5, True, "text", b"bytes", 1j, torch.float16, torch.device("cpu")],
        "root_tensor": t,
        "tuple": (t, {"deep": [t]}),
    }


def _unsharded(names):
    # A sharded tensor's pieces are saved under "key@offsets" (one piece on one rank); the walks name it by key.
    return [n.split("@", 1)[0] for n in names]


def _dtensor_state(tmp_path, check):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        check(_every_kind(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])))
    finally:
        dist.destroy_process_group()


def test_the_save_walk_names_every_node_kind_as_the_one_walk_does(tmp_path):
    def check(state):
        for for_load in (False, True):
            names, tensors, skeleton, _, slots = flatten_state(state, for_load=for_load)
            assert len(names) == len(tensors) == 10
            # The same tensors, named alike and in the same order, by the save walk and by walk().
            assert _unsharded(names) == tensor_names(skeleton)
            seen = []
            walk(skeleton, lambda x, n: seen.append(n) or True)
            # A torch.Size is kept as itself (its type too) and neither walk enters it.
            assert type(skeleton["size"]) is torch.Size and skeleton["size"] == (2, 3)
            assert "size" in seen and "size.0" not in seen and "nested.a.1.1.0" not in seen
            assert "counter.shape" in seen and "counter.shape.0" not in seen
            # A Stateful's state dict is named under the Stateful's key, by both walks.
            assert [s.prefix for s in slots] == ["model", "counter"]
            assert "counter.hist.2.0" in names and "counter.hist.2.0" in seen
            assert "emb@0,0" in names and "emb" in seen and "emb.0" not in seen
            # Values stay in the skeleton where they were; empty containers too.
            assert skeleton["nested"]["none"] is None and skeleton["nested"]["b"] == ()
            assert skeleton["nested"]["a"][2] == [] and skeleton["scalars"][3] == "text"

    _dtensor_state(tmp_path, check)


def test_rebuild_and_the_queries_keep_each_node_kind(tmp_path):
    def check(state):
        _, _, skeleton, _, _ = flatten_state(state, for_load=True)
        named = rebuild(skeleton, lambda x, n: n if x is TENSOR else x)
        assert named["nested"]["a"][1] == ("nested.a.1.0", torch.Size([1]))
        assert type(named["nested"]["a"][1][1]) is torch.Size and named["size"] is skeleton["size"]
        assert named["model"] is skeleton["model"]  # a Stateful's slot is a leaf to rebuild
        assert not holds_values({"a": TENSOR, "b": [TENSOR, (TENSOR,)]}) and holds_values({"a": []})
        assert holds_values([TENSOR, torch.Size([2])]) and not holds_values(skeleton["model"])
        slot = skeleton["emb"]
        assert only_sharded({"s": {"m": slot}}) and not only_sharded({"s": {"m": slot}}, "o", {"o.s.m"})
        assert not only_sharded({}) and not only_sharded({"s": [slot]}) and not only_sharded(TENSOR)

    _dtensor_state(tmp_path, check)


# ---- every recursion of the checkpoint layer is known ------------------------------------------------------
#: The functions of python/ettkit/{checkpoint,integrations,sharding} that call themselves (directly or through
#: the same module's functions and methods), and why each is not built on _skeleton_walk. A new hand-written
#: walk of a state fails here: write it on walk / walk_pair / rebuild, or say here why it cannot be.
KNOWN_RECURSIONS = {
    # The one walk itself.
    "checkpoint/_skeleton_walk.py": [["_rebuild_children"], ["walk"], ["walk_pair"], ["rebuild"]],
    # The save walk: hand-inlined, once per tensor on save()'s critical path (pinned to walk() above).
    "checkpoint/_flatten.py": [["_SaveWalk.dict_of_object", "_SaveWalk.leaf", "_SaveWalk.node",
                                "_SaveWalk.stateful"]],
    # The bound save (#65): walks a live state beside its skeleton once at the bind, by exact types.
    "checkpoint/_state_binding.py": [["_has_tensors"], ["_Binder.dict", "_Binder.node", "_Binder.optimizer",
                                                         "_Binder.sequence"]],
    # The .extra codec: encodes a skeleton's values by the format's tags (its order is the save walk's).
    "checkpoint/_extra_encode.py": [["_Encoder._other", "_Encoder.value"]],
}


def _recursions(path):
    """The strongly connected sets of a module's call graph that recurse (Tarjan's): calls by name to the
    module's functions (a nested one first) and through ``self.``/``cls.`` to the same class's methods."""
    import ast

    funcs: dict = {}

    def collect(body, cls=None, outer=None):
        for n in body:
            if isinstance(n, ast.ClassDef):
                collect(n.body, n.name, outer)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                q = ".".join(x for x in (outer, cls, n.name) if x)
                funcs[q] = (n, cls, outer)
                collect(n.body, None, q)

    collect(ast.parse(path.read_text()).body)
    edges: dict = {q: set() for q in funcs}
    for q, (node, cls, outer) in funcs.items():
        cls = cls or (funcs[outer][1] if outer in funcs else None)
        for c in ast.walk(node):
            if not isinstance(c, ast.Call):
                continue
            f = c.func
            if isinstance(f, ast.Name):
                targets = ([f"{outer}.{f.id}"] if outer else []) + [f.id]
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("self", "cls"):
                owner = funcs[q][2] if funcs[q][1] else (funcs[outer][2] if outer in funcs else None)
                targets = [".".join(x for x in (owner, cls, f.attr) if x)]
            else:
                continue
            hit = next((t for t in targets if t in funcs), None)
            if hit:
                edges[q].add(hit)
    return sorted(cycles(edges, self_loops=True))


def test_every_recursion_of_the_checkpoint_layer_is_a_known_one():
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2] / "python" / "ettkit"
    found = {}
    for package in ("checkpoint", "integrations", "sharding"):
        for path in sorted((root / package).rglob("*.py")):
            rec = _recursions(path)
            if rec:
                found[path.relative_to(root).as_posix()] = rec
    assert found == {k: sorted(v) for k, v in KNOWN_RECURSIONS.items()}


def test_the_recursion_finder_sees_direct_mutual_and_method_recursion(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "def a(x):\n    return [a(v) for v in x]\n"
        "def b(x):\n    return c(x)\n"
        "def c(x):\n    return b(x)\n"
        "def flat(x):\n    return len(x)\n"
        "class W:\n    def node(self, x):\n        return self.leaf(x)\n"
        "    def leaf(self, x):\n        return self.node(x)\n"
        "def outer(x):\n    def inner(y):\n        return inner(y)\n    return inner(x)\n")
    assert _recursions(src) == [["W.leaf", "W.node"], ["a"], ["b", "c"], ["outer.inner"]]
