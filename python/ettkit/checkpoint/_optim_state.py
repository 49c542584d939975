"""An optimizer's per-parameter state, created ahead of its first ``step()`` exactly as that step would.

``torch.optim`` optimizers create their state lazily, in the first ``step()``. A checkpoint of an optimizer
whose parameters are DTensors or ShardedTensors (FSDP2's ``fully_shard``, tensor parallelism) holds that
state as shards of each parameter's layout, so a fresh optimizer in a restarted process must already have
tensors of that layout to load them into in place (a plain optimizer's state is read into new tensors and
handed to ``load_state_dict()`` instead, which needs nothing created). The rule of what a first step
creates is C++'s ``first_step_state()`` (include/ettkit/checkpoint/training_state.h), the one
``TrainingState`` follows for LibTorch optimizers: zeros shaped like the parameter and a step count of 0.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import _C
from ..errors import UnsupportedError
from ._tensor_kinds import owns_storage

# The optimizer classes the rule knows, by exact type: a subclass may keep other state.
_KNOWN = {torch.optim.Adam: "Adam", torch.optim.AdamW: "AdamW", torch.optim.SGD: "SGD",
          torch.optim.RMSprop: "RMSprop", torch.optim.Adagrad: "Adagrad"}

# Optimizers found to have only plain parameters, with the group sizes they had then: their state is read
# into new tensors at load, and the check (one look at every parameter) is not repeated on every save.
_plain: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _scalar_dtype(fused: bool = False) -> torch.dtype:
    # torch.optim.optimizer._get_scalar_dtype: the dtype every optimizer keeps its step count in.
    if fused:
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _step_count(name: str, group: dict, p: torch.Tensor) -> torch.Tensor:
    """The step count tensor the first step of optimizer ``name`` creates for ``p``: on the parameter's
    device only for ``capturable`` (and Adam's ``fused``) groups, on the CPU otherwise."""
    fused = bool(group.get("fused")) and name in ("Adam", "AdamW")
    if group.get("capturable") or fused:
        return torch.zeros((), dtype=_scalar_dtype(fused), device=p.device)
    return torch.zeros((), dtype=_scalar_dtype())


def _has_sharded_parameter(opt: torch.optim.Optimizer, groups: list) -> bool:
    sizes = tuple(len(g["params"]) for g in groups)
    if _plain.get(opt) == sizes:
        return False
    if any(not owns_storage(p) for g in groups for p in g["params"]):
        return True
    _plain[opt] = sizes
    return False


def create_first_step_state(opt: Any) -> bool:
    """Creates, for an optimizer of DTensor or ShardedTensor parameters, the state its first ``step()``
    would create for every parameter that has none: the fields and the step count of C++
    ``first_step_state()``, each field ``torch.zeros_like(p)`` (so a DTensor of the parameter's layout), the
    step count where that step puts it. Training is unchanged, every save of the optimizer holds its whole
    state, and a load has tensors to load into in place. Does nothing for an optimizer the rule does not
    know, one whose first state is not zeros (SGD with dampening != 0), one whose state is complete, and
    one of plain parameters. Returns whether it created anything."""
    name = _KNOWN.get(type(opt))
    if name is None:
        return False
    groups = opt.param_groups
    state = opt.state
    if len(state) >= sum(len(g["params"]) for g in groups) or not _has_sharded_parameter(opt, groups):
        return False
    created = False
    for group in groups:
        try:
            fields, step = _C.checkpoint.first_step_state(
                name, amsgrad=bool(group.get("amsgrad", False)), momentum=float(group.get("momentum", 0.0)),
                dampening=float(group.get("dampening", 0.0)), centered=bool(group.get("centered", False)))
        except UnsupportedError:
            continue  # the first step creates it; a load of such state names the reason (check_sharded)
        if not fields and not step:
            continue
        with torch.no_grad():
            for p in group["params"]:
                if p in state and state[p]:
                    continue
                st = state[p]  # a defaultdict: the optimizer's own dict for p
                if step:
                    st["step"] = _step_count(name, group, p)
                for f in fields:
                    st[f] = torch.zeros_like(p, memory_format=torch.preserve_format)
                created = True
    return created
