"""The Python load as a plan held as data, the mirror of C++'s ``ReadPlan``: :class:`LoadPlan` is made once
from the live state (what to read, into which tensors, under which prefixes new tensors are wanted), checks
each candidate step's ``.extra`` record before any tensor is copied (:meth:`LoadPlan.check`, which the C++
loader calls), and puts the chosen step's state back once the tensors were read (:meth:`LoadPlan.apply`).

    make ──> C++ load_latest(names, tensors, plan.check, read_prefixes, partial, global_shapes) ──> apply
                          └─ per candidate step: check(blob) ──> CheckedStep (or a refusal)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import InvalidArgumentError
from . import rng_state
from ._flatten import check_unique, flatten_state
from ._restore import (
    bounded,
    check_by_value,
    check_sharded,
    prune_to_live,
    restore_by_value,
    restore_stateful,
    saved_states,
    unplaced_tensors,
)
from ._skeleton_codec import ExtraRecord, decode_extra
from ._skeleton_walk import by_value_optimizer_prefixes, global_shapes, live_sharded, sharded_slots

_WHERE = "the step's .extra file"


@dataclass(frozen=True)
class CheckedStep:
    """A candidate step's ``.extra`` record, decoded and checked against the plan: ``value`` (None: written by
    the C++ ``AsyncCheckpointer``, with no skeleton) and ``saved`` (``id(slot)`` -> the saved state dict
    skeleton of each Stateful)."""

    blob: bytes
    value: Optional[ExtraRecord]
    saved: dict


@dataclass
class LoadPlan:
    """What one ``load_latest`` reads and where it goes. ``names``/``tensors``: the live tensors, loaded in
    place; ``live``: the live skeleton with a :class:`StatefulSlot` where each Stateful is; ``read_prefixes``:
    where tensors the state lacks are read into new tensors (under a Stateful that is not a module: an
    optimizer before its first step; under the ``state`` of an optimizer state dict passed by value), which a
    partial load may also leave unread; ``live_slots``: the live sharded tensors by name (``sharded_slots``,
    walked once per load); ``global_shapes``: their global sizes, for the loader's checks of pieces saved
    whole. ``checked``: the last candidate :meth:`check` passed."""

    state: Any
    names: list
    tensors: list
    live: Any
    slots: list
    read_prefixes: list
    live_slots: dict
    global_shapes: dict
    partial: bool
    world_size: int
    allow_pickle: bool
    checked: Optional[CheckedStep] = field(default=None)

    @classmethod
    def make(cls, state: Any, find_optimizer: Any, *, partial: bool, world_size: int,
             allow_pickle: bool) -> "LoadPlan":
        names, tensors, live, _, slots = flatten_state(state, find_optimizer, for_load=True)
        check_unique(names)
        # Names a partial load may leave unread: none inside what the state holds (a Stateful, list or tuple
        # is loaded whole), only whole dict entries it lacks.
        read_prefixes = [s.prefix for s in slots if not isinstance(s.obj, torch.nn.Module)]
        read_prefixes += by_value_optimizer_prefixes(live)
        live_slots = sharded_slots(live)  # walked once: the checks, the loader's shapes and the apply use it
        return cls(state, names, tensors, live, slots, read_prefixes, live_slots, global_shapes(live_slots), partial,
                   world_size, allow_pickle)

    def decode(self, blob: bytes) -> Optional[ExtraRecord]:
        """The step's record; for a partial load, its skeleton pruned to the state's entries (a tensor inside
        what the state holds that the state lacks is refused)."""
        value = decode_extra(blob, _WHERE, allow_pickle=self.allow_pickle)
        if self.partial and value is not None:
            value = value._replace(skeleton=prune_to_live(value.skeleton, self.live))
            left = unplaced_tensors(value.skeleton, self.live, self.names, self.read_prefixes)
            if left:
                raise InvalidArgumentError(
                    f"partial=True leaves out whole entries of the state's dicts only, not tensors inside what "
                    f"the state holds: it lacks {bounded([repr(n) for n in left], ', ')}, which the step holds "
                    f"there")
        return value

    def check(self, blob: bytes) -> None:
        """The C++ loader calls this for each candidate once its manifest, files, checksums and tensor names
        were checked, and before any tensor is copied: an extra that does not decode makes the step fall back
        like any corrupt step instead of failing after the tensors were overwritten; a Stateful the step
        cannot restore, or a pickle without allow_pickle=True, is a mismatch (InvalidArgumentError: no
        fallback to an older step, which would silently lose the newer one)."""
        value = self.decode(blob)
        if value is not None and value.rng is not None:
            rng_state.check(value.rng, _WHERE)
        if value is not None:
            check_sharded(self.live, value.skeleton,
                          world_changed=value.world_size is not None and value.world_size != self.world_size,
                          live_slots=self.live_slots)
            # Every saved value either has a place in the state or the load is refused, before any copy.
            check_by_value(self.live, value.skeleton)
        saved = saved_states(self.slots, self.live, None if value is None else value.skeleton)
        self.checked = CheckedStep(blob, value, saved)

    def _chosen(self, blob: bytes) -> CheckedStep:
        if self.checked is not None and self.checked.blob == blob:
            return self.checked
        value = self.decode(blob)
        return CheckedStep(blob, value, saved_states(self.slots, self.live, None if value is None else value.skeleton))

    def apply(self, result: Any, *, restore_rng: bool) -> tuple[tuple[int, Any], list]:
        """Puts the chosen step (the C++ loader's ``result``, its tensors read) back into the state: Statefuls
        through ``load_state_dict``, the random generators (``restore_rng``), the values by value. Returns
        ``((step, extra), the optimizer state dicts passed by value that it filled)``."""
        step, blob = int(result.step), result.extra
        chosen = self._chosen(blob)
        loaded = dict(zip(self.names, self.tensors))
        loaded.update(result.read)
        if self.slots:
            live_sharded(self.live_slots, loaded)  # a ShardedTensor goes back whole (its shards were loaded in place)
            for slot in self.slots:
                restore_stateful(slot, chosen.saved[id(slot)], loaded)
        value = chosen.value
        if value is None:
            # Written by the C++ AsyncCheckpointer: `extra` is its opaque bytes and there is no skeleton.
            return (step, bytes(blob)), []
        if restore_rng:
            rng_state.restore(value.rng, world_changed=bool(result.resharded), step=step)
        captured = frozenset(id(s.captured) for s in self.slots if s.captured is not None)
        filled: list = []
        restore_by_value(self.state, value.skeleton, loaded, captured, filled)
        return (step, value.extra), filled

