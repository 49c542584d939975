"""The load's checks and merges on skeletons: what the live state and the saved step must agree on before any
tensor is copied (:func:`check_sharded`, :func:`check_by_value`, :func:`saved_states`), and how the saved
state goes back into the live one afterwards (:func:`restore_by_value`, :func:`restore_stateful`). The load
plan (_load_plan.py) calls them in order. The checks and queries are :mod:`._skeleton_walk`'s walks
(``walk``, ``walk_pair``, ``rebuild``), and so are the three merges of a saved skeleton into a live one
(:func:`prune_to_live`, :func:`reconcile_moved`, :func:`restore_by_value`): each a ``place`` and a ``join``
of ``rebuild_pair``, which pairs the places as ``walk_pair`` does. None of them recurses itself
(tests/python/test_checkpoint_skeleton_walk.py lists every recursion of the package).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

import torch

from .. import _C
from ..errors import InvalidArgumentError
from ._captured_optimizer import refresh_captured
from ._skeleton_walk import (
    ABSENT,
    DESCEND,
    DROP,
    child_name,
    find_saved,
    holds_values,
    is_optimizer_dict,
    is_sequence,
    only_sharded,
    rebuild,
    rebuild_pair,
    sharded_slots,
    tensor_names,
    walk,
    walk_pair,
)
from ._tensor_kinds import TENSOR, ShardedSlot, StatefulSlot, is_plain_optimizer, is_stateful, state_dict_of

#: The most mismatches one error message describes; the rest are counted, so that a wrong model of 10^4
#: tensors gives a message a person reads rather than pages of keys. The C++ loader's cap, one for both
#: languages (include/ettkit/checkpoint/step_format.h).
MAX_NAMED = _C.checkpoint.MAX_LISTED_IN_MESSAGE


def bounded(items: list, sep: str = "; ") -> str:
    """``items`` joined by ``sep``, the first :data:`MAX_NAMED` of them and then how many more there are."""
    shown = sep.join(items[:MAX_NAMED])
    return shown if len(items) <= MAX_NAMED else f"{shown}{sep}... and {len(items) - MAX_NAMED} more"


# ---- checks, before any tensor is copied -------------------------------------------------------------------
def _what(s: Any) -> str:
    if isinstance(s, ShardedSlot):
        return s.describe()
    return "nothing" if s is None else ("a plain tensor" if s is TENSOR else f"a {type(s).__name__}")


class _ShardedCheck:
    """The visitor of :func:`check_sharded`: walks the live skeleton beside the saved one and collects the
    mismatches. Its context (which parameter an optimizer's state belongs to, whether the optimizer around it
    has only plain parameters) is a stack pushed on entering a container and popped on leaving it."""

    def __init__(self, live: Any, saved: Any, world_changed: bool, live_slots: dict, saved_slots: dict):
        self.wrong: list[str] = []
        self.lazy: list[str] = []  # keys of optimizer state the state lacks (created by an optimizer's first step)
        self.plain_lazy: list[str] = []  # the same, of an optimizer of plain parameters (ettkit creates none)
        self.stack: list[tuple[str, str, Optional[str]]] = []  # (name, kind, param) of the containers entered
        self.in_plain_optimizer = [False]
        # Whether this rank's shards moved: then each side may hold per-rank sharded state the other lacks. The
        # verdict is the C++ loader's (step_format.h): the skeletons add the keys this rank holds no shard of
        # and the placements, which a file lacks.
        self.moved = world_changed or bool(_C.checkpoint.first_moved_shard(
            {k: x.shards for k, x in saved_slots.items()}, {k: x.shards for k, x in live_slots.items()}))
        self.shardless = [k for k, x in live_slots.items() if not x.shards]  # no shard of these here now
        self.plain_names = [n for n in tensor_names(live) if n not in live_slots]

    def param(self, name: str) -> Optional[str]:
        """The parameter (an optimizer state's key) that the node at ``name`` is the state of, if any."""
        if not self.stack:
            return None
        parent, kind, param = self.stack[-1]
        if kind == "stateful":
            return None
        if kind == "state":  # an optimizer's "state" is keyed by parameter: this node's key is one
            return name[len(parent) + 1:] if parent else name
        return param

    def visit(self, x: Any, s: Any, name: str) -> bool:
        s = None if s is ABSENT else s
        param = self.param(name)
        if x is ABSENT:
            self.saved_only(s, name, None, param)
            return False
        if isinstance(x, StatefulSlot):
            self.stack.append((name, "stateful", None))
            self.in_plain_optimizer.append(is_plain_optimizer(x.obj))
            return True
        if isinstance(x, ShardedSlot):
            if s is None and self.moved:
                return False  # per-rank state this rank now holds: read from the old rank that saved it
            if s is TENSOR:
                return False  # saved whole, wanted sharded: a replica's box, its global shape checked by the loader
            if not isinstance(s, ShardedSlot) or (s.size, s.dtype) != (x.size, x.dtype):
                self.wrong.append(f"'{name}': the checkpoint holds {_what(s)}; the state holds {x.describe()}")
            return False
        if isinstance(x, dict):
            self.stack.append((name, "state" if name == "state" or name.endswith(".state") else "dict", param))
            return True
        if is_sequence(x):
            self.stack.append((name, "list", param))
            return True
        self.saved_only(s, name, x, param)
        return False

    def leave(self, x: Any, name: str) -> None:
        self.stack.pop()
        if isinstance(x, StatefulSlot):
            self.in_plain_optimizer.pop()

    def no_shard_here(self, param: Optional[str]) -> bool:
        return param is not None and any(k == param or k.endswith("." + param) for k in self.shardless)

    def saved_only(self, s: Any, name: str, live: Any, param: Optional[str]) -> None:
        """The saved sharded tensors at and below ``s``, where the state holds ``live`` (None: nothing)."""

        def visit(node: Any, n: str) -> bool:
            if isinstance(node, ShardedSlot):
                self.saved_sharded(node, n, live if node is s else None, param)
                return False
            return True

        walk(s, visit, name)

    def saved_sharded(self, s: ShardedSlot, name: str, live: Any, param: Optional[str]) -> None:
        # `live`: what the state holds where the checkpoint has `s` (None: nothing). `param`: the parameter
        # (an optimizer state's key) that `s` is the state of.
        if live is TENSOR:
            return  # saved sharded, wanted whole: read from every piece
        if live is None and self.moved and self.no_shard_here(param):
            return
        holds = "" if live is None else f": it holds {_what(live)}"
        # (A torch optimizer keys its state by parameter index, which names no tensor: only a named key.)
        plain = live is None and param is not None and not param.isdigit() and next(
            (n for n in self.plain_names if n == param or n.endswith("." + param)), None)
        if plain:
            # A re-plan made its table data-parallel: a plain tensor whose optimizer is another one.
            holds = (f" (its parameter '{plain}' is a plain tensor in the state, e.g. a table now "
                     f"data-parallel, whose optimizer is not this one: load the model alone with partial=True, "
                     f"or this state by value into that optimizer's)")
        self.wrong.append(f"'{name}': the checkpoint holds {s.describe()}; the state has no {s.kind} there{holds}")
        if live is None and ".state." in name and not plain:
            (self.plain_lazy if self.in_plain_optimizer[-1] else self.lazy).append(name)

    def raise_if_wrong(self) -> None:
        if not self.wrong:
            return
        hint = ""
        if self.lazy:
            hint = (" (optimizer state that the state lacks is created by the optimizer's first step(); ettkit "
                    "creates it before a load for Adam, AdamW, RMSprop and SGD with dampening=0, "
                    "docs/checkpoint.md, 'FSDP2')")
        if self.plain_lazy:
            hint += (f" ({bounded([repr(n) for n in self.plain_lazy], ', ')}: the step holds this state sharded and "
                     "the optimizer, of plain parameters, has none yet to read it into; ettkit creates first-step "
                     "state only for optimizers of DTensor or ShardedTensor parameters. Take one optimizer step "
                     "before the load (the load replaces its state and the parameters), or load the model alone "
                     "with partial=True)")
        raise InvalidArgumentError(
            "sharded tensors do not match the checkpoint (another global size or dtype, or a sharded tensor "
            "only one side has; a layout alone, such as another sharding plan, mesh or world size, is "
            "resharded): " + bounded(self.wrong) + hint)


def check_sharded(live: Any, saved: Any, world_changed: bool = False, live_slots: Optional[dict] = None) -> None:
    """Compares every ShardedTensor and DTensor of the live skeleton (from ``flatten_state(for_load=True)``)
    with what the checkpoint holds at the same place on this rank, and every one of the checkpoint with the
    live state, before any tensor is copied. Raises :class:`InvalidArgumentError` naming each one whose global
    size or dtype differs, or that one side has where the other holds something else.

    Another layout (sharding plan, world size, mesh shape, placements) is not a mismatch: the C++ loader reads
    it by resharding whenever this rank's shards are not in its own file. Nor is a sharded tensor saved where
    the state holds a plain tensor (one rank's plain model, a data-parallel table: its pieces are read whole),
    or a plain tensor saved where the state holds a sharded one (a replica read as shards): the loader checks
    the global shape and dtype of those from the files (``global_shapes``). So is, when the layout changed, a
    sharded tensor only one side has on this rank, where the sharded state itself is per rank: TorchRec's fused
    optimizer keeps a table's state only on the ranks that hold a shard of the table, so after a re-plan a rank
    may have state the checkpoint kept on another rank (read from that rank's file; the loader refuses a key no
    old rank saved) or lack state its old self kept (tolerated only when this rank holds no shard of the
    parameter it belongs to: another rank reads it). A saved sharded tensor without a place in the state is
    refused otherwise, as at the saved layout (a model without that table; optimizer state the first step
    would create, with a hint). ``live_slots``: ``sharded_slots(live)`` when the caller has it."""
    live_slots = sharded_slots(live) if live_slots is None else live_slots
    saved_slots = sharded_slots(saved)
    if not live_slots and not saved_slots:
        return  # nothing sharded on either side: nothing here to compare (a plain state's load walks no pair)
    check = _ShardedCheck(live, saved, world_changed, live_slots, saved_slots)
    walk_pair(live, saved, check.visit, leave=check.leave)
    check.raise_if_wrong()


def check_by_value(live: Any, saved: Any) -> None:
    """Before any tensor is copied: every entry of the state being loaded that holds a value other than a
    tensor (the C++ loader checks those) must be in the saved state, since the load would otherwise leave it as
    it was beside restored ones, and a root tuple must hold only tensors (nowhere to put its values). Raises
    :class:`InvalidArgumentError` naming each such entry. The other direction needs no check: a saved entry
    the state lacks is put into its dict or list by :func:`restore_by_value` (the per-parameter state of an
    optimizer's state dict passed by value: a fresh optimizer has none), and a saved tensor with no place is
    the C++ loader's to refuse. Statefuls are their own ``load_state_dict``'s to check."""
    wrong: list[str] = []
    # A list takes the saved length (restore_by_value); its items beyond it hold no tensor or Stateful, or the
    # C++ loader or saved_states refused them: they need no saved value.
    beyond_saved: set = set()

    def visit(x: Any, s: Any, name: str) -> bool:
        if x is ABSENT or name in beyond_saved:
            return False
        if s is ABSENT:
            if holds_values(x):
                wrong.append(f"'{name}' is in the state, not in the checkpoint")
            return False
        if isinstance(x, dict) and isinstance(s, dict):
            return True
        if is_sequence(x) and is_sequence(s):
            beyond_saved.update(child_name(name, i) for i in range(len(s), len(x)))
            return True
        return False

    walk_pair(live, saved, visit)
    if isinstance(live, tuple) and holds_values(live):
        wrong.append("the state is a tuple, whose values load_latest cannot replace: pass a dict or a list")
    if wrong:
        raise InvalidArgumentError(
            "load_latest restores every value of the state or none, and these have nothing saved to restore "
            "them from: " + bounded(wrong) + ". Load with the keys that were saved (a key added since: put "
            "it in the state after load_latest)")


def saved_states(slots: list, live: Any, saved_skeleton: Any) -> dict:
    """``id(slot)`` -> the saved state dict skeleton of each Stateful of the state being loaded
    (``saved_skeleton`` None: a C++ checkpointer's step, restored from the live structure). Raises
    :class:`InvalidArgumentError` (a mismatch: the load stops, naming the key) when the step has none for
    one, or an optimizer's parameter groups differ from the saved ones."""
    if not slots:
        return {}
    if saved_skeleton is None:
        # A C++ checkpointer's step has no skeleton: restore from the live structure (tensors load in place).
        return {id(s): s.skeleton for s in slots}
    saved = find_saved(live, saved_skeleton)
    for s in slots:
        where = f"'{s.prefix}'" if s.prefix else "the root"
        if id(s) not in saved:
            raise InvalidArgumentError(f"the checkpoint has no state dict at {where} for the "
                                       f"{type(s.obj).__qualname__} there (nothing saved there)")
        sub = saved[id(s)]
        if not isinstance(sub, (dict, list, tuple)):
            raise InvalidArgumentError(f"the checkpoint has no state dict at {where} for the "
                                       f"{type(s.obj).__qualname__} there (it holds a {type(sub).__name__})")
        if isinstance(s.obj, torch.optim.Optimizer) and isinstance(s.state, dict) and "param_groups" in s.state:
            _check_param_groups(s, sub, where)
    return saved


def _check_param_groups(slot: StatefulSlot, sub: Any, where: str) -> None:
    # (TorchRec's KeyedOptimizer of fused tables has no param_groups in its state dict.)
    groups = sub.get("param_groups") if isinstance(sub, dict) else None
    want = [len(g["params"]) for g in slot.obj.param_groups]
    have = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups] \
        if isinstance(groups, list) else None
    if have != want:
        raise InvalidArgumentError(
            f"the optimizer at {where} has parameter groups of sizes {want}; the checkpoint's has "
            f"{have}: it was saved from another model or optimizer")


def prune_to_live(saved: Any, live: Any) -> Any:
    """The saved skeleton without the dict entries the live state has no place for (a partial load:
    ``load_latest(state, partial=True)``, e.g. a model without its optimizer). Only whole dict entries are
    left out; below a Stateful, a list or a tuple the saved skeleton is kept as it is (and checked as in a
    full load)."""

    def place(x: Any, s: Any, name: str) -> Any:
        if isinstance(s, dict) and isinstance(x, dict):
            return DESCEND
        return DROP if x is ABSENT or s is ABSENT else s

    def join(x: Any, s: Any, name: str, items: list) -> dict:
        kept = dict(items)
        return {k: kept[k] for k in s if k in kept}  # in the saved dict's order

    return rebuild_pair(live, saved, place, join)


def unplaced_tensors(saved: Any, live: Any, names: list, read_prefixes: list) -> list:
    """The tensors of a (pruned) saved skeleton that a load would leave unread: neither a live tensor's name
    (``names``), nor a live sharded tensor's key, nor under a read prefix. A partial load refuses them."""
    have = set(names) | set(sharded_slots(live))

    def covered(n: str) -> bool:
        return n in have or any(not p or n == p or n.startswith(p + ".") for p in read_prefixes)

    return [n for n in tensor_names(saved) if not covered(n)]


# ---- merges, after the tensors were loaded in place --------------------------------------------------------
def rebuild_named(skeleton: Any, prefix: str, tensors: dict) -> Any:
    """The skeleton with each TENSOR placeholder replaced by ``tensors[name]``, names made as the save makes
    them under ``prefix``."""

    def leaf(x: Any, name: str) -> Any:
        if x is TENSOR:
            return tensors[name]
        if isinstance(x, ShardedSlot):
            # The live ShardedTensor, its shards already loaded in place (the load put it under its key).
            if name not in tensors:
                raise InvalidArgumentError(
                    f"the checkpoint has a {x.kind} at '{name}' ({x.describe()}); the state being "
                    f"loaded has no {x.kind} there to load it into")
            return tensors[name]
        return x

    return rebuild(skeleton, leaf, prefix)


def restore_by_value(target: Any, saved: Any, tensors: dict, skip: Any = frozenset(),
                     optimizer_dicts: Any = None) -> Any:
    """Puts the saved state into ``target``'s containers in place, after :func:`check_by_value` passed and
    the tensors were loaded in place: plain values are replaced, a tuple is rebuilt around its (loaded)
    tensors, a list gets the saved list's length, and an entry only the checkpoint has (an optimizer's
    per-parameter state that a fresh optimizer's ``state_dict()`` lacks, a key a dict gained in training) is
    added, its tensors the new ones in ``tensors`` (by name).
    Statefuls and the dicts whose ids are in ``skip`` (captured optimizer state dicts) are restored by their
    own ``load_state_dict`` and left alone. The optimizer state dicts restored by value are appended to the
    list ``optimizer_dicts``. Returns what belongs where ``target`` was."""

    def place(cur: Any, s: Any, name: str) -> Any:
        if cur is ABSENT:  # an entry only the checkpoint has
            return DROP if held_elsewhere(s, name, tensors) else rebuild_named(s, name, tensors)
        if s is ABSENT or isinstance(cur, torch.Tensor) or id(cur) in skip or is_stateful(cur):
            return cur  # (an item beyond the saved list's length: left out by join)
        if s is TENSOR or isinstance(s, ShardedSlot):
            return rebuild_named(s, name, tensors)
        if isinstance(s, dict) and isinstance(cur, dict):
            if optimizer_dicts is not None and is_optimizer_dict(cur):
                optimizer_dicts.append(cur)
            return DESCEND
        if is_sequence(s) and is_sequence(cur):
            return DESCEND
        return rebuild_named(s, name, tensors)

    def join(cur: Any, s: Any, name: str, merged: list) -> Any:
        if isinstance(cur, dict):
            for k, v in merged:
                if k not in cur or cur[k] is not v:
                    cur[k] = v
            return cur
        items = [v for i, v in merged if i < len(s)]
        items += [rebuild_named(v, child_name(name, i), tensors) for i, v in enumerate(s) if i >= len(cur)]
        if isinstance(cur, list) and isinstance(s, list):
            cur[:] = items
            return cur
        return items if isinstance(s, list) else tuple(items)

    return rebuild_pair(target, saved, place, join)


def held_elsewhere(saved: Any, name: str, loaded: dict) -> bool:
    """Whether a saved skeleton node holds only sharded tensors that this rank did not load: per-rank sharded
    state (TorchRec's fused optimizer state of a table) that its old self kept and, after a re-plan, another
    rank holds (:func:`check_sharded` allowed it)."""
    return only_sharded(saved, name, loaded)


def reconcile_moved(saved: Any, live: Any, name: str, loaded: dict) -> Any:
    """A Stateful's saved skeleton with its per-rank sharded state where this rank holds it now: entries whose
    sharded tensors this rank did not load (:func:`held_elsewhere`) are left out, and entries of the live
    skeleton made only of sharded tensors that the saved one lacks (state this rank holds since a re-plan,
    loaded from another old rank's file) are put in. Unchanged when nothing moved."""

    def place(x: Any, s: Any, n: str) -> Any:
        if isinstance(s, dict) and isinstance(x, dict):
            return DESCEND
        if x is ABSENT:  # saved only: kept unless another rank holds it now
            return DROP if held_elsewhere(s, n, loaded) else s
        if s is ABSENT:  # live only: put in when it is sharded state this rank holds since a re-plan
            return x if only_sharded(x) else DROP
        return s

    def join(x: Any, s: Any, n: str, items: list) -> dict:
        kept = dict(items)
        # The saved dict's order, then the entries only the live one has.
        return {k: kept[k] for k in [*s, *(k for k in x if k not in s)] if k in kept}

    return rebuild_pair(live, saved, place, join, name)


def restore_stateful(slot: StatefulSlot, saved: Any, loaded: dict) -> None:
    """Hands a Stateful its saved state dict (built from the saved skeleton: the tensors loaded in place
    into its current state dict's, and the new ones) through its own ``load_state_dict``; a captured
    optimizer dict is then made current again."""
    state = rebuild_named(reconcile_moved(saved, slot.skeleton, slot.prefix, loaded), slot.prefix, loaded)
    metadata = getattr(slot.state, "_metadata", None)
    if metadata is not None:
        # nn.Module versions its state dict layout (BatchNorm, ...): the live module's versions apply.
        state = OrderedDict(state)
        state._metadata = metadata
    slot.obj.load_state_dict(state)
    if slot.captured is not None:
        refresh_captured(slot.captured, state_dict_of(slot.obj))
