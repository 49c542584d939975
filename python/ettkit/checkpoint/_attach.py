"""The fences ``AsyncCheckpointer.attach()`` installs, so that ``save()`` can return before its copies are done
without ever committing a torn snapshot.

A save records every tensor's version counter. A tensor written while its copy may still run would be
caught by that counter and the save refused; the hooks here make such writes wait for the copy first, so
the save commits. Each hook waits only for the tensors its writer is about to write, and the copies run in
the order the writers come (buffers a forward pass writes, then parameters updated inside backward, then
the rest), so the waits are short. docs/checkpoint.md explains the rules.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..errors import InvalidArgumentError
from ._tensor_kinds import dtensor_type, owns_storage, sharded_tensor_type

# Copy classes (CopyPriority in C++): lower runs first.
_BUFFERS, _IN_BACKWARD = 0, 1


class Attachment:
    """What one ``attach()`` call installed. ``remove()`` takes its hooks out (the checkpointer then keeps
    overlapping its saves: a writer that is no longer fenced makes saves refused, never torn)."""

    def __init__(self, handles: list):
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def as_list(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def local_tensors(tensors: Iterable[torch.Tensor]) -> list:
    """``tensors`` as the tensors whose storage a save copies: a DTensor's local tensor (FSDP2's parameters
    and their optimizer state), a ShardedTensor's local shards, any other tensor itself. The C++ fences match
    tensors by storage, and a wrapper subclass has none of its own: handed over as it is, a fence on it would
    match nothing and wait for nothing."""
    out = []
    dt = st = None
    for t in tensors:
        if owns_storage(t):
            out.append(t)
            continue
        dt = dt or dtensor_type()
        st = st or sharded_tensor_type()
        if dt is not None and isinstance(t, dt):
            out.append(t._local_tensor)
        elif st is not None and isinstance(t, st):
            out.extend(s.tensor for s in t.local_shards())
    return out


def optimizer_tensors(opt: torch.optim.Optimizer) -> list:
    """What ``opt.step()`` writes: its parameters and the tensors of its state (their local tensors)."""
    out = [p for g in opt.param_groups for p in g["params"]]
    for st in opt.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return local_tensors(out)


def _is_fused(module: torch.nn.Module) -> bool:
    # TorchRec's FusedOptimizerModule (fused embedding optimizers update the tables inside the backward
    # kernel, without a version bump and without a hook point of their own): duck-typed, so TorchRec is
    # never imported.
    return not isinstance(module, torch.optim.Optimizer) and hasattr(type(module), "fused_optimizer")


class Fences:
    """The hooks of every ``attach()`` of one checkpointer (``c``: its ``_C.checkpoint.AsyncCheckpointer``)."""

    def __init__(self, c):
        self._c = c
        self._optimizers: list = []
        self._in_backward_optimizers: dict = {}  # id -> optimizer whose step ran inside backward
        self._buffer_modules: list = []
        self._fused_modules: list = []
        self._early_params: list = []
        self.attachments: list = []

    def attach(self, objects: Iterable[Any], in_backward: Any) -> Attachment:
        if in_backward not in ("auto", True, False):
            raise InvalidArgumentError(f"in_backward={in_backward!r} must be 'auto', True or False")
        modules, optimizers = [], []
        for o in objects:
            if isinstance(o, torch.nn.Module):
                modules.append(o)
            elif isinstance(o, torch.optim.Optimizer):
                optimizers.append(o)
            else:
                raise InvalidArgumentError(
                    f"attach() takes torch.nn.Module and torch.optim.Optimizer objects (as arguments or as "
                    f"model=/optimizer=); got {type(o).__module__}.{type(o).__qualname__}")
        if not modules and not optimizers:
            raise InvalidArgumentError("attach() needs a model and/or an optimizer")
        handles = []
        for opt in optimizers:
            self._optimizers.append(opt)
            handles.append(opt.register_step_pre_hook(self._optimizer_fence))
        for root in modules:
            for m in root.modules():
                fused = _is_fused(m)
                if fused:
                    self._fused_modules.append(m)
                if fused or any(b is not None for b in m._buffers.values()):
                    if not fused:
                        self._buffer_modules.append(m)
                    handles.append(m.register_forward_pre_hook(self._module_fence(m, fused)))
            if in_backward is False:
                continue
            for p in root.parameters():
                # A parameter that already has a post-accumulate-grad hook is updated inside backward (the
                # optimizer-in-backward pattern): fence it right before that hook, and copy it early.
                if in_backward is True or getattr(p, "_post_accumulate_grad_hooks", None):
                    h = p.register_post_accumulate_grad_hook(self._param_fence)
                    p._post_accumulate_grad_hooks.move_to_end(h.id, last=False)  # before the user's hooks
                    handles.append(h)
                    self._early_params.append(p)
        if modules:
            # With the model's buffers fenced, save() may return before its copies are done. An optimizer
            # alone is not enough: the next forward writes BatchNorm statistics without a version bump,
            # which only a fence (or a byte comparison) can catch.
            self._c.enable_overlap()
            self._c.set_unfenced_sync_max_bytes(0)
        att = Attachment(handles)
        self.attachments.append(att)
        return att

    @property
    def optimizers(self) -> list:
        """Every optimizer attached so far (save() recognises the dicts captured from their state_dict())."""
        return self._optimizers

    # ---- the hooks -------------------------------------------------------------------------------------
    def _optimizer_fence(self, opt, *_):
        if not self._c.fence_pending:
            return
        if torch._C._current_autograd_node() is not None:
            # step() inside backward (optimizer-in-backward): wait only for what this optimizer writes, so
            # that the rest of the copy keeps overlapping the backward pass.
            self._in_backward_optimizers.setdefault(id(opt), opt)
            self._c.wait_for(optimizer_tensors(opt))
        else:
            # The dense step: every copy must be done by now anyway; a full fence also decides the tensors
            # that nothing attached writes (e.g. an EMA updated after the step), so their later writes are
            # known to come after the copy.
            self._c.wait_staged_on_current_stream()

    def _module_fence(self, module: torch.nn.Module, fused: bool):
        def hook(m, args):
            if not self._c.fence_pending:
                return
            if fused:
                # The backward after this forward runs the fused kernel, which writes the tables *and* the
                # fused optimizer's state (momentum), and the latter is no parameter or buffer of the module:
                # a fence on the module's own tensors let the backward overwrite momentum still being copied
                # (seen as a save not yet staged at the next forward under load). Wait for the whole copy.
                self._c.wait_staged_on_current_stream()
                return
            tensors = [b for b in m._buffers.values() if b is not None]
            self._c.wait_for(local_tensors(tensors))

        # A fence only waits (it changes nothing the forward computes), so a precompiled graph traced without
        # it may run it first and then run without it (ettkit.startup.PrecompiledModel looks for this mark).
        hook._ettkit_checkpoint_fence = True
        return hook

    def _param_fence(self, p: torch.Tensor) -> None:
        if not self._c.fence_pending:
            return
        tensors = [p]
        for opt in self._optimizers:
            st = opt.state.get(p)
            if st:
                tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        self._c.wait_for(local_tensors(tensors))

    # ---- copy order ------------------------------------------------------------------------------------
    def priority(self) -> tuple[list, list]:
        """Tensors to copy first, and their classes: buffers, then what backward updates."""
        tensors, classes = [], []
        for m in self._buffer_modules:
            buffers = local_tensors(b for b in m._buffers.values() if b is not None)
            tensors.extend(buffers)
            classes.extend([_BUFFERS] * len(buffers))
        early = list(self._early_params)
        for m in self._fused_modules:
            early.extend(m.parameters())
            early.extend(b for b in m.buffers() if b is not None)
        for opt in self._in_backward_optimizers.values():
            early.extend(optimizer_tensors(opt))
        for opt in self._optimizers:
            for p in self._early_params:
                st = opt.state.get(p)
                if st:
                    early.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        early = local_tensors(early)
        tensors.extend(early)
        classes.extend([_IN_BACKWARD] * len(early))
        return tensors, classes
