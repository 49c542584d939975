"""The one traversal of skeletons (everything but the save's hot path): :func:`walk` visits one skeleton,
:func:`walk_pair` a live skeleton beside a saved one, and the queries built on them.

A node's children are the same for every caller: a :class:`StatefulSlot`'s skeleton (under the slot's own
name), a dict's values, a list's or tuple's items; a ``torch.Size`` is a value (a tuple of ints kept as it
is), never walked into. Names are joined in one place (:func:`child_name`), as the save walk names tensors.
:func:`rebuild` is the walk that returns a new skeleton (a map over the leaves), :func:`rebuild_pair` the one
that makes a value from a live skeleton beside a saved one (the load's merges). The save walk (_flatten.py)
stays hand-inlined: it runs once per tensor inside ``save()`` (issue #65 binds a state's repeat saves in C++),
and tests/python/test_checkpoint_skeleton_walk.py holds it to the names and the order :func:`walk` gives.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch

from ._tensor_kinds import TENSOR, ShardedSlot, StatefulSlot

#: What :func:`walk_pair` hands a visitor for the side that has nothing at a place.
ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "<absent>", "__slots__": ()})()


#: The nodes :func:`children` may yield anything for (a ``torch.Size`` is a tuple it yields nothing for).
_CONTAINERS = (StatefulSlot, dict, list, tuple)


def child_name(name: str, key: Any) -> str:
    """The name of ``key`` below ``name``, as the save walk names tensors (``model.layer.weight``)."""
    return f"{name}.{key}" if name else str(key)


def is_sequence(x: Any) -> bool:
    """A list or tuple the walk descends into (a ``torch.Size`` is a value)."""
    return isinstance(x, (list, tuple)) and type(x) is not torch.Size


def children(x: Any, name: str) -> Iterator[tuple[Any, Any, str]]:
    """``(key, child, its name)`` of a skeleton node; a Stateful's skeleton has the slot's name and key None."""
    if isinstance(x, StatefulSlot):
        yield None, x.skeleton, name
    elif isinstance(x, dict):
        for k, v in x.items():
            yield k, v, child_name(name, k)
    elif is_sequence(x):
        for i, v in enumerate(x):
            yield i, v, child_name(name, i)


def walk(skeleton: Any, visit: Callable[[Any, str], bool], name: str = "") -> None:
    """Calls ``visit(node, name)`` on every node, parents first; a node's children are visited when
    ``visit`` returns True."""
    # Only a container has children: a leaf (most nodes: a tensor's placeholder) makes no generator (#64: a
    # load walks every node of the state several times).
    if visit(skeleton, name) and isinstance(skeleton, _CONTAINERS):
        for _, v, n in children(skeleton, name):
            walk(v, visit, n)


def pairs(live: Any, saved: Any, name: str) -> Iterator[tuple[Any, Any, Any, str]]:
    """``(key, live child, saved child, its name)`` of a place of :func:`walk_pair` (:data:`ABSENT` for the side
    that has nothing there): a Stateful's skeleton with the saved node at its place (key None, the slot's name);
    a dict's keys (the live ones in order, then those only the saved dict has); a list's or tuple's items by
    the live one's indices. The one pairing rule of both :func:`walk_pair` and :func:`rebuild_pair`."""
    if isinstance(live, StatefulSlot):
        yield None, live.skeleton, saved, name
    elif isinstance(live, dict):
        sd = saved if isinstance(saved, dict) else {}
        for k, v in live.items():
            yield k, v, sd.get(k, ABSENT), child_name(name, k)
        for k, v in sd.items():
            if k not in live:
                yield k, ABSENT, v, child_name(name, k)
    elif is_sequence(live):
        ss = saved if is_sequence(saved) else ()
        for i, v in enumerate(live):
            yield i, v, ss[i] if i < len(ss) else ABSENT, child_name(name, i)


def walk_pair(live: Any, saved: Any, visit: Callable[[Any, Any, str], bool], name: str = "",
              leave: Optional[Callable[[Any, str], None]] = None) -> None:
    """Walks a live skeleton beside the saved one: ``visit(live, saved, name)`` at each place either side has
    (:data:`ABSENT` for the side that has nothing there), descending when it returns True, the places paired
    by :func:`pairs`. ``leave(live, name)`` runs after a node's children, for a visitor that keeps context."""
    if not visit(live, saved, name):
        return
    for _, v, s, n in pairs(live, saved, name):
        walk_pair(v, s, visit, n, leave)
    if leave is not None:
        leave(live, name)


#: What a ``place`` of :func:`rebuild_pair` returns to go into a pair's children, and to leave a place out.
DESCEND: Any = type("Descend", (), {"__repr__": lambda self: "<descend>", "__slots__": ()})()
DROP: Any = type("Drop", (), {"__repr__": lambda self: "<drop>", "__slots__": ()})()


def rebuild_pair(live: Any, saved: Any, place: Callable[[Any, Any, str], Any],
                 join: Callable[[Any, Any, str, list], Any], name: str = "") -> Any:
    """A value made from a live skeleton beside the saved one (:func:`rebuild`'s counterpart of
    :func:`walk_pair`, the places paired by :func:`pairs`): ``place(live, saved, name)`` returns the value of a
    place, :data:`DROP` to leave it out, or :data:`DESCEND`; then ``join(live, saved, name, items)`` makes the
    pair's value from its children's, ``items`` their ``(key, value)`` in :func:`pairs`' order without the
    dropped ones (a join that builds a new container or fills the live one in place)."""
    v = place(live, saved, name)
    return _rebuild_children(live, saved, place, join, name) if v is DESCEND else v


def _rebuild_children(live: Any, saved: Any, place: Callable, join: Callable, name: str) -> Any:
    # The places of a pair descended into; a child is placed here, before any call for it, since most are
    # leaves (a load's merges run once per tensor of the state).
    items = []
    for k, lv, sv, n in pairs(live, saved, name):
        x = place(lv, sv, n)
        if x is DESCEND:
            x = _rebuild_children(lv, sv, place, join, n)
        if x is not DROP:
            items.append((k, x))
    return join(live, saved, name, items)


def rebuild(skeleton: Any, leaf: Callable[[Any, str], Any], name: str = "") -> Any:
    """A new skeleton: each dict, list and tuple rebuilt (a dict as a dict, a list as a list, any other
    sequence as a tuple) around ``leaf(node, name)`` of each node that is none of those (a placeholder, a
    sharded slot, a Stateful's slot, a ``torch.Size``, a value)."""
    if isinstance(skeleton, dict):
        return {k: rebuild(v, leaf, n) for k, v, n in children(skeleton, name)}
    if is_sequence(skeleton):
        items = [rebuild(v, leaf, n) for _, v, n in children(skeleton, name)]
        return items if isinstance(skeleton, list) else tuple(items)
    return leaf(skeleton, name)


# ---- queries -----------------------------------------------------------------------------------------------
def tensor_names(skeleton: Any, name: str = "") -> list:
    """The names of the tensors a skeleton holds (a sharded tensor by its key)."""
    out: list = []

    def visit(x: Any, n: str) -> bool:
        if x is TENSOR or isinstance(x, ShardedSlot):
            out.append(n)
            return False
        return True

    walk(skeleton, visit, name)
    return out


def sharded_slots(skeleton: Any) -> dict:
    """``name`` -> :class:`ShardedSlot` for every sharded tensor of a skeleton, named as the save names them."""
    out: dict = {}

    def visit(x: Any, n: str) -> bool:
        if isinstance(x, ShardedSlot):
            out[n] = x
            return False
        return True

    walk(skeleton, visit)
    return out


def live_sharded(slots: dict, out: dict) -> dict:
    """``key`` -> live ShardedTensor for every :class:`ShardedSlot` of ``slots`` (:func:`sharded_slots` of a
    skeleton from ``flatten_state``)."""
    for slot in slots.values():
        out[slot.key] = slot.live
    return out


def global_shapes(slots: dict) -> dict:
    """``key`` -> the global size of every sharded tensor of ``slots`` (:func:`sharded_slots` of a live skeleton
    from ``flatten_state``): what the loader checks a tensor saved whole against before reading this rank's
    shards of it from that copy."""
    return {slot.key: list(slot.size) for slot in slots.values()}


def find_saved(live: Any, saved: Any) -> dict:
    """Walks the live skeleton (with :class:`StatefulSlot` markers, from ``flatten_state(for_load=True)``)
    beside the saved one; returns ``id(slot)`` -> the saved skeleton at the same place (absent: not saved)."""
    out: dict = {}

    def visit(x: Any, s: Any, n: str) -> bool:
        if x is ABSENT or s is ABSENT:
            return False
        if isinstance(x, StatefulSlot):
            out[id(x)] = s
            return False
        # Only where both sides are containers of the same kind do places correspond.
        return (isinstance(x, dict) and isinstance(s, dict)) or (is_sequence(x) and is_sequence(s))

    walk_pair(live, saved, visit)
    return out


def is_optimizer_dict(x: Any) -> bool:
    """Whether a live skeleton node is an optimizer's ``state_dict()`` passed by value."""
    return isinstance(x, dict) and isinstance(x.get("state"), dict) and isinstance(x.get("param_groups"), list)


def by_value_optimizer_prefixes(live: Any) -> list[str]:
    """The names of the ``state`` of every optimizer state dict passed by value (not a Stateful, not one
    recognised as an attached optimizer's) in the live skeleton from ``flatten_state(for_load=True)``: the
    saved per-parameter state a fresh optimizer's dict lacks (Adam creates it in its first ``step()``) is read
    there into new tensors and put into the dict, for the caller's ``optimizer.load_state_dict(d)``."""
    out: list[str] = []

    def visit(x: Any, n: str) -> bool:
        if is_optimizer_dict(x):
            out.append(child_name(n, "state"))
        return not isinstance(x, StatefulSlot)  # a Stateful's own state dict is its load_state_dict's

    walk(live, visit)
    return out


def holds_values(x: Any) -> bool:
    """Whether a skeleton node holds anything but tensors (the C++ name check reports those): a plain value
    or an empty container is an entry that a load must restore or refuse."""
    found: list = []

    def visit(node: Any, _: str) -> bool:
        if found or node is TENSOR or isinstance(node, (ShardedSlot, StatefulSlot)):
            return False
        if (isinstance(node, dict) or is_sequence(node)) and node:
            return True
        found.append(node)  # a value, or an empty container
        return False

    walk(x, visit)
    return bool(found)


def only_sharded(x: Any, name: str = "", loaded: Any = ()) -> bool:
    """Whether a skeleton node is a sharded slot, or a non-empty dict of dicts whose leaves are all sharded
    slots, none of them named in ``loaded``: per-rank sharded state (TorchRec's fused optimizer state of a
    table), which a re-plan may move from one rank to another."""
    ok = [True]

    def visit(node: Any, n: str) -> bool:
        if not ok[0]:
            return False
        if isinstance(node, ShardedSlot):
            ok[0] = n not in loaded
            return False
        if isinstance(node, dict) and node:
            return True
        ok[0] = False
        return False

    walk(x, visit, name)
    return ok[0]
