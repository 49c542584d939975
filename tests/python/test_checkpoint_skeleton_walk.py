"""The one skeleton walk (_skeleton_walk.py) and the load plan held as data (_load_plan.py), tested as values:
what each visits and pairs, and what a plan holds before any file is read (issue #64)."""

from __future__ import annotations

import torch

from ettkit.checkpoint._extra_encode import encode_extra, encode_skeleton
from ettkit.checkpoint._flatten import flatten_state
from ettkit.checkpoint._load_plan import LoadPlan
from ettkit.checkpoint._skeleton_walk import ABSENT, child_name, tensor_names, walk, walk_pair
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
