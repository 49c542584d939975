"""Optimizer state dicts captured by value from an attached optimizer (``state = {"optim": opt.state_dict()}``):
recognising such a dict as its optimizer's (:func:`find_captured_optimizer`) and keeping it current
(:func:`refresh_captured`), for the save walk and for the load's restore alike.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidArgumentError
from ._tensor_kinds import describe_key


def refresh_captured(captured: dict, state: dict) -> None:
    """Makes a dict captured from ``opt.state_dict()`` hold what ``opt.state_dict()`` holds now, in place:
    its ``state`` maps to the optimizer's live per-parameter state (which the first ``step()`` creates
    after the capture), its ``param_groups`` carry the current hyperparameters (an LR scheduler changes
    them)."""
    live = captured["state"]
    if live is not state["state"]:
        live.clear()
        live.update(state["state"])
    groups = captured["param_groups"]
    for mine, now in zip(groups, state["param_groups"]):
        mine.update(now)


def find_captured_optimizer(optimizers: list, adopted: Any = ()):
    """The ``find_optimizer`` of :func:`flatten_state` for the attached ``optimizers``: a dict with
    ``state`` and ``param_groups`` is taken for ``opt.state_dict()`` of the attached optimizer whose
    parameter groups it matches (group count, hyperparameter names, parameter ids as ``state_dict()``
    numbers them) and, when the dict has state, shares it (its per-parameter dicts or their tensors are the
    optimizer's). A dict captured before the first step has none: one that matches several attached
    optimizers raises (pass the optimizer itself instead). ``adopted``: ids of dicts that ``load_latest`` filled
    with an optimizer's saved state (read into new tensors, which ``optimizer.load_state_dict(d)`` copies to
    the parameters' device, so they need not be shared): matched by their parameter groups alone."""
    if not optimizers:
        return None

    def matches(d: dict, opt) -> bool:
        groups = d.get("param_groups")
        if not isinstance(groups, list) or not isinstance(d.get("state"), dict):
            return False
        if len(groups) != len(opt.param_groups):
            return False
        start = 0
        for g, live in zip(groups, opt.param_groups):
            n = len(live["params"])
            ids = g.get("params") if isinstance(g, dict) else None
            # state_dict() numbers parameters 0, 1, ... across groups: the ends of each range suffice.
            # Keys: an LR scheduler created after the capture adds some (initial_lr) to the live groups.
            if not isinstance(ids, list) or len(ids) != n or not g.keys() <= live.keys():
                return False
            if n and (ids[0] != start or ids[-1] != start + n - 1):
                return False
            start += n
        return True

    def shares_state(d: dict, opt) -> bool:
        # One entry decides: state_dict() hands out the optimizer's own per-parameter dicts; after
        # opt.load_state_dict(d) the optimizer holds new dicts with the same tensors.
        state = d["state"]
        k = next(iter(state))
        params = [p for g in opt.param_groups for p in g["params"]]
        if not (isinstance(k, int) and 0 <= k < len(params)):
            return False
        mine, live = state[k], opt.state.get(params[k])
        if mine is live:
            return True
        return isinstance(mine, dict) and isinstance(live, dict) and any(
            isinstance(v, torch.Tensor) and live.get(f) is v for f, v in mine.items())

    def find(d: dict, prefix: str):
        candidates = [opt for opt in optimizers if matches(d, opt)]
        if candidates and d["state"] and id(d) not in adopted:
            # A dict with state is live only if it shares it: a deep copy, or another optimizer's dict of
            # the same shape, is saved as it is.
            candidates = [opt for opt in candidates if shares_state(d, opt)]
        if len(candidates) > 1:
            raise InvalidArgumentError(
                f"{describe_key(prefix)} looks like the state_dict() of more than one attached optimizer; "
                "put the optimizer itself in the state ({'optim': optimizer}) so that ettkit knows which")
        return candidates[0] if candidates else None

    return find

