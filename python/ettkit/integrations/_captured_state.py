"""The whole saved state of a step read back as a new dict, through ``AsyncCheckpointer.load_latest``'s public
Stateful protocol, for frameworks that want the checkpoint as a value (Lightning's ``load_checkpoint``, the
Trainer's resume) rather than loaded into objects they hand over."""

from __future__ import annotations

from typing import Any, Optional


class CapturedState:
    """A Stateful with no state of its own: ``load_latest`` reads every tensor saved under its key into new
    CPU tensors and hands the rebuilt state dict to :meth:`load_state_dict`, which keeps it in ``value``."""

    def __init__(self) -> None:
        self.value: Optional[Any] = None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: Any) -> None:
        self.value = state
