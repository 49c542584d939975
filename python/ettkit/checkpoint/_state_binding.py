"""The bound save (issue #65): a state's structure walked once, then checked, not walked, at every save.

A save walks the state in Python (_flatten.py), about half a microsecond per tensor: 10-25 ms at 20,001
tensors, on the training thread. Binding does that walk once and keeps its result (the names, the tensors,
the skeleton's encoding) with a :class:`ettkit._C.checkpoint.StateGuard`: the identity of every container
that holds tensors and of everything in it, as it was. A later save asks the guard (one C++ loop, no Python
code runs) whether all of it still holds; if it does, the walk would find the same names and the same tensor
objects, so the save reuses them. What can change without changing the structure is each tensor's storage,
shape and dtype (``p.data = ...``, ``resize_``, ``set_``): the C++ save compares those with its plan at every
save and plans again when they differ.

The parts of a state that hold no tensor (a step count, an LR scheduler, a GradScaler, an optimizer's
``param_groups`` with its learning rates) change at every step and cost little: they are walked and encoded
afresh at every save and put into the holes of the skeleton's encoding (_extra_encode.SkeletonTemplate),
which gives the bytes a whole encoding would.

What a state may hold to be bound (anything else is saved by the walk, as before, at every save):
plain ``dict`` (and ``defaultdict``), ``list`` and ``tuple`` containers; tensors of exactly ``torch.Tensor``
or ``nn.Parameter`` (not DTensors, ShardedTensors or other subclasses); ``nn.Module``\\ s whose
``state_dict`` machinery is torch's own (no override of ``state_dict``/``_save_to_state_dict``/
``get_extra_state`` in the module tree, no state-dict hooks); ``torch.optim.Optimizer``\\ s whose
``state_dict`` is torch's own and that have no state-dict hooks; and, in tensor-free parts, anything the walk
takes. The guard also pins what would make the walk take another path: a module's parameters, buffers,
submodules, non-persistent buffer names and hook tables, an optimizer's ``state``, ``param_groups``, each
group's keys and parameter list, and its hook tables.

Who owns what: the binding holds references to the containers and tensors it was bound to (that is what
makes an identity check a proof: nothing it references can be freed and its address reused). A tensor
replaced in the state therefore stays alive until the next save binds again, or the checkpointer closes.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

import torch

from .. import _C
from ._extra_encode import Hole, Refused, SkeletonTemplate
from ._extra_format import EncodedSkeleton
from ._flatten import _SaveWalk
from ._skeleton_walk import child_name
from ._tensor_kinds import TENSOR, DTensorSlot, ShardedSlot

_Module = torch.nn.Module
_Optimizer = torch.optim.Optimizer
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_DICTS = (dict, collections.defaultdict)
_MODULE_ATTRS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_state_dict_pre_hooks",
                 "_state_dict_hooks")
_OPTIMIZER_ATTRS = ("state", "param_groups", "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks")


class _Unbindable(Exception):
    """Something in the state the binding does not cover: the state is walked at every save instead."""


class _Island:
    """A tensor-free part of the state, taken afresh at every save: ``source(state)`` gives the object the
    walk starts from there (from the state passed to this save for an entry of the root, which may be a new
    dict at every save; from the bound container, which the guard proved is still the one, below it) (a value, a container, a Stateful), ``prefix`` its key."""

    __slots__ = ("source", "prefix", "inside", "walk")

    def __init__(self, source: Callable[[Any], Any], prefix: str, inside: bool,
                 walk: Optional[Callable[[_SaveWalk], Any]] = None):
        # inside: the part lies in a Stateful's state dict, which the walk trusts as current (_SaveWalk.inside).
        # walk: the part's own walk, in place of walking source(state) (an optimizer's param_groups, whose
        # parameter numbers are fixed while the guard holds: walking them would cost a call per parameter).
        self.source, self.prefix, self.inside, self.walk = source, prefix, inside, walk


class StateBinding:
    """A state bound by :func:`bind`: the names and tensors of its walk, the guard that proves they still
    stand, and the skeleton's encoding with a hole for each tensor-free part."""

    __slots__ = ("guard", "names", "tensors", "template", "islands", "hits")

    def __init__(self, guard: Any, names: list, tensors: list, template: SkeletonTemplate, islands: list):
        self.guard, self.names, self.tensors = guard, names, tensors
        self.template, self.islands = template, islands
        self.hits = 0  # saves that used this binding

    def refresh(self, state: Any, find_optimizer: Any) -> Optional[EncodedSkeleton]:
        """The skeleton's encoding for this save of ``state`` when the binding still holds for it (then
        :attr:`names`/:attr:`tensors` are what the walk would find); None when it does not (walk instead).
        Raises what the walk of a tensor-free part raises (a copied scheduler state dict, a string too long)."""
        if not self.guard.check(state):
            return None
        parts = []
        for island in self.islands:
            walk = _SaveWalk(True, find_optimizer, False)
            walk.inside = island.inside
            part = island.walk(walk) if island.walk else walk.node(island.source(state), island.prefix)
            if walk.names:  # a tensor where there was none: the structure changed
                return None
            parts.append(part)
        try:
            code = self.template.fill(parts)
        except Refused:
            return None  # the walk's encoding raises the error that names the key
        self.hits += 1
        return code


class BoundSaves:
    """A checkpointer's binding, and when to make one: at :meth:`prepare` and at a save whose walk found the
    same names as the save before (a structure that holds still). A binding that a save found broken
    before any save used it (a state built afresh every save, such as ``{"model": model.state_dict()}``,
    whose tensors are new objects each time) makes the checkpointer wait 2, 4, ... 64 saves before it binds
    again, so that such a state pays for a bind once in a while, not at every save."""

    __slots__ = ("binding", "allow_pickle", "misses", "wait", "saves")

    def __init__(self, *, allow_pickle: bool):
        self.binding: Optional[StateBinding] = None
        self.allow_pickle = allow_pickle
        self.saves = 0  # saves made through a binding (tests read it)
        self.misses = 0  # bindings in a row that no save used
        self.wait = 0  # walked saves to let pass before binding again

    def take(self, state: Any, find_optimizer: Any) -> tuple:
        """``(tensors, encoded skeleton)`` of a save of ``state`` by the binding (the checkpointer's current
        names are the binding's), or ``(None, None)``: walk it (the binding, if any, is dropped)."""
        b = self.binding
        if b is None:
            return None, None
        code = b.refresh(state, find_optimizer)
        if code is None:
            if b.hits == 0:
                self.misses = min(self.misses + 1, 6)
                self.wait = 1 << self.misses
            self.binding = None
            return None, None
        self.misses = 0
        self.saves += 1
        return b.tensors, code

    def walked(self, state: Any, names: list, tensors: list, skeleton: Any, code: EncodedSkeleton,
               find_optimizer: Any) -> None:
        """A save walked ``state`` and found the names of the save before: bind it, unless backing off."""
        if self.wait > 0:
            self.wait -= 1
            return
        self.bind(state, names, tensors, skeleton, code, find_optimizer)

    def bind(self, state: Any, names: list, tensors: list, skeleton: Any, code: EncodedSkeleton,
             find_optimizer: Any) -> None:
        self.binding = bind(state, names, tensors, skeleton, code, allow_pickle=self.allow_pickle,
                            find_optimizer=find_optimizer)

    def drop(self) -> None:
        self.binding = None


def bind(state: Any, names: list, tensors: list, skeleton: Any, code: EncodedSkeleton, *, allow_pickle: bool,
         find_optimizer: Any) -> Optional[StateBinding]:
    """A :class:`StateBinding` of ``state``, whose walk gave ``names``, ``tensors``, ``skeleton`` and the
    encoding ``code``; None when the state holds something the binding does not cover, or when the bound
    encoding would differ from ``code`` in any byte (checked here, once: the binding never changes a file)."""
    if type(state) not in _DICTS and type(state) is not list and type(state) is not tuple:
        return None  # the guard's root is a container (a Stateful passed alone is walked)
    binder = _Binder(find_optimizer)
    try:
        template = binder.node(state, skeleton, "", None, root=True)
    except _Unbindable:
        return None
    if not binder.islands and not tensors:
        return None
    binding = StateBinding(binder.guard, names, tensors, SkeletonTemplate(template, allow_pickle=allow_pickle),
                           binder.islands)
    if not binder.guard.check(state):
        return None
    try:
        again = binding.refresh(state, find_optimizer)
    except Exception:  # noqa: BLE001 - a tensor-free part that cannot be taken twice: not bound
        return None
    if again is None or again != code:
        return None
    binding.hits = 0
    return binding


def _has_tensors(skeleton: Any) -> bool:
    """Whether a skeleton part holds a tensor slot of any kind (a placeholder, a sharded or DTensor slot)."""
    t = type(skeleton)
    if skeleton is TENSOR:
        return True
    if t is dict:
        return any(_has_tensors(v) for v in skeleton.values())
    if t is list or t is tuple:
        return any(_has_tensors(v) for v in skeleton)
    return t is ShardedSlot or t is DTensorSlot


_key = child_name  # names as the save walk names tensors (_skeleton_walk: one rule)


class _Binder:
    """One walk of a state beside its skeleton: the guard's nodes, the template and the islands."""

    def __init__(self, find_optimizer: Any):
        self.guard = _C.checkpoint.StateGuard()
        self.islands: list[_Island] = []
        self.find_optimizer = find_optimizer
        self.inside = 0  # > 0 while binding an optimizer's state dict

    def island(self, source: Optional[Callable[[Any], Any]], prefix: str,
               walk: Optional[Callable[[_SaveWalk], Any]] = None) -> Hole:
        self.islands.append(_Island(source, prefix, self.inside > 0, walk))
        return Hole(len(self.islands) - 1)

    def node(self, live: Any, skel: Any, prefix: str, source: Optional[Callable[[Any], Any]],
             root: bool = False) -> Any:
        if not _has_tensors(skel):
            if source is None:
                raise _Unbindable("a tensor-free state")
            return self.island(source, prefix)
        t = type(live)
        if t in _DICTS:
            return self.dict(live, skel, prefix, root)
        if t is list or t is tuple:
            return self.sequence(live, skel, prefix, root)
        if t in _PLAIN_TENSORS:
            if skel is not TENSOR:
                raise _Unbindable(prefix)
            return TENSOR
        if isinstance(live, _Module):
            return self.module(live, skel)
        if isinstance(live, _Optimizer):
            self.inside += 1
            try:
                return self.optimizer(live, skel, prefix)
            finally:
                self.inside -= 1
        raise _Unbindable(prefix)

    def dict(self, live: dict, skel: Any, prefix: str, root: bool) -> dict:
        if type(skel) is not dict or len(skel) != len(live):
            raise _Unbindable(prefix)
        if self.find_optimizer is not None and "param_groups" in live:
            raise _Unbindable(prefix)  # maybe a dict captured from an attached optimizer: the walk's to judge
        out, checked = {}, []
        for (k, v), (sk, sv) in zip(live.items(), skel.items()):
            if sk is not k:
                raise _Unbindable(prefix)
            source = (lambda state, k=k: state[k]) if root else (lambda state, d=live, k=k: d[k])
            child = self.node(v, sv, _key(prefix, k), source)
            checked.append(type(child) is not Hole)
            out[k] = child
        self.guard.dict(live, list(live), list(live.values()), checked, root=root)
        return out

    def sequence(self, live: Any, skel: Any, prefix: str, root: bool) -> Any:
        if type(skel) is not type(live) or len(skel) != len(live):
            raise _Unbindable(prefix)
        out, checked = [], []
        for i, (v, sv) in enumerate(zip(live, skel)):
            source = (lambda state, i=i: state[i]) if root else (lambda state, s=live, i=i: s[i])
            child = self.node(v, sv, _key(prefix, i), source)
            checked.append(type(child) is not Hole)
            out.append(child)
        self.guard.sequence(live, list(live), checked, root=root)
        return out if type(live) is list else tuple(out)

    def module(self, module: _Module, skel: Any) -> Any:
        """A module whose state dict is torch's: the guard pins every table ``state_dict()`` reads."""
        if type(skel) is not dict or any(v is not TENSOR for v in skel.values()):
            raise _Unbindable("a module with extra state")
        for m in module.modules():
            t = type(m)
            if (t.state_dict is not _Module.state_dict or t._save_to_state_dict is not _Module._save_to_state_dict
                    or getattr(t, "get_extra_state", _Module.get_extra_state) is not _Module.get_extra_state):
                raise _Unbindable(t.__name__)
            d = m.__dict__
            tables = [d.get(a) for a in _MODULE_ATTRS]
            if any(type(x) is not dict for x in tables[:3]) or type(tables[3]) is not set:
                raise _Unbindable(t.__name__)
            if tables[4] or tables[5]:
                raise _Unbindable("a module with state-dict hooks")
            self.guard.attrs(d, list(_MODULE_ATTRS), tables)
            for table in tables[:3]:
                self.guard.dict(table, list(table), list(table.values()), [True] * len(table))
            self.guard.set(tables[3], list(tables[3]))
            for hooks in tables[4:]:
                self.guard.dict(hooks, [], [], [])
        return skel

    def optimizer(self, opt: _Optimizer, skel: Any, prefix: str) -> Any:
        """An optimizer whose state dict is torch's: its ``state`` bound, its ``param_groups`` an island
        (their learning rates change at every step), packed as ``Optimizer.state_dict`` packs them."""
        if type(opt).state_dict is not _Optimizer.state_dict or type(skel) is not dict or list(skel) != [
                "state", "param_groups"]:
            raise _Unbindable(type(opt).__name__)
        d = opt.__dict__
        tables = [d.get(a) for a in _OPTIMIZER_ATTRS]
        state, groups = tables[0], tables[1]
        if type(state) not in _DICTS or type(groups) is not list or any(type(g) is not dict for g in groups):
            raise _Unbindable(type(opt).__name__)
        if tables[2] or tables[3]:
            raise _Unbindable("an optimizer with state-dict hooks")
        self.guard.attrs(d, list(_OPTIMIZER_ATTRS), tables)
        for hooks in tables[2:]:
            self.guard.dict(hooks, [], [], [])
        skel_state = skel["state"]
        if type(skel_state) is not dict or len(skel_state) != len(state):
            raise _Unbindable(prefix)
        out_state = {}
        for (p, per_param), (index, sv) in zip(state.items(), skel_state.items()):
            out_state[index] = self.node(per_param, sv, _key(_key(prefix, "state"), index),
                                         lambda state, s=state, p=p: s[p])
        self.guard.dict(state, list(state), list(state.values()), [True] * len(state))
        self.guard.sequence(groups, list(groups), [True] * len(groups))
        indices = _param_indices(groups)
        for g in groups:
            params = g.get("params")
            if type(params) is not list:
                raise _Unbindable(prefix)
            self.guard.dict(g, list(g), list(g.values()), [k == "params" for k in g])
            self.guard.sequence(params, list(params), [True] * len(params))
        where = _key(prefix, "param_groups")
        hole = self.island(None, where, lambda walk: _walk_groups(walk, groups, indices, where))
        return {"state": out_state, "param_groups": hole}


def _param_indices(groups: list) -> list:
    """Each group's parameter indices as ``Optimizer.state_dict`` numbers them (a parameter in two groups
    keeps its first number); fixed while the guard holds each group's parameter list."""
    mapping: dict = {}
    start, out = 0, []
    for g in groups:
        params = g["params"]
        for i, p in enumerate(params, start):
            mapping.setdefault(id(p), i)
        out.append([mapping[id(p)] for p in params])
        start += len(params)
    return out


def _walk_groups(walk: _SaveWalk, groups: list, indices: list, prefix: str) -> list:
    """The skeleton of ``Optimizer.state_dict()["param_groups"]`` without its per-parameter work: each group's
    entries but ``params`` walked, then ``params`` as the numbers fixed at the bind (packed as torch packs
    them: ``params`` last; the whole is checked against the walk's when the state is bound)."""
    out = []
    for i, (g, numbers) in enumerate(zip(groups, indices)):
        packed = {k: walk.node(v, f"{prefix}.{i}.{k}") for k, v in g.items() if k != "params"}
        packed["params"] = numbers
        out.append(packed)
    return out
