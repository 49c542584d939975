"""Warm compile: compile forward, loss and backward on a (fast) batch without changing training.

Running the compiled model once compiles its forward; AOTAutograd compiles the backward lazily, at the
first ``backward()``, so a forward-only warm-up would leave half of the compile in the first real step.
:func:`warm_compile` therefore runs forward, the loss and backward, then puts back everything those
touched: parameter gradients, buffers (BatchNorm statistics, counters) and the random number generators
(torch CPU and CUDA, Python's ``random``, NumPy's global generator). No optimizer step runs. What it does not
restore: Python attributes a model mutates in ``forward``, and wrapper state such as DDP's reducer (which
counts the warm-up as an iteration) — compile before wrapping, or compile the wrapped model only when
that is acceptable.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidArgumentError

__all__ = ["WarmCompileReport", "compile_counters", "compiled_graphs", "warm_compile"]


def compiled_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (``counters["stats"]["unique_graphs"]``). The
    difference across a training step is the number of (re)compilations it caused."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_counters() -> dict:
    """The Dynamo/Inductor/AOTAutograd counters that tell graphs, cache hits and cache misses apart."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "frames": int(counters["frames"]["ok"]),
        "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "fxgraph_cache_bypass": int(counters["inductor"]["fxgraph_cache_bypass"]),
        "autograd_cache_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "autograd_cache_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
        "autograd_cache_bypass": int(counters["aot_autograd"]["autograd_cache_bypass"]),
    }


def counter_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


@dataclasses.dataclass(frozen=True)
class WarmCompileReport:
    """What a warm compile did: its wall time, the graphs it compiled (forward graphs; backward graphs are
    compiled with them) and the cache counters it moved."""

    seconds: float
    graphs: int
    backward: bool  # whether backward ran (False when the loss did not require grad)
    counters: dict


class _Snapshot:
    """Gradients, buffers and RNG states, taken before the warm-up and put back after it."""

    def __init__(self, model: Any):
        modules = list(model.modules()) if isinstance(model, torch.nn.Module) else []
        seen = set()
        self.grads = []  # (param, grad tensor or None, saved copy or None)
        self.buffers = []  # (module, name, tensor, saved copy)
        for module in modules:
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                g = p.grad
                self.grads.append((p, g, None if g is None else g.detach().clone()))
            for name, b in module._buffers.items():
                if b is not None and id(b) not in seen:
                    seen.add(id(b))
                    self.buffers.append((module, name, b, b.detach().clone()))
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.py_rng = random.getstate()
        np = sys.modules.get("numpy")
        self.np_rng = np.random.get_state() if np is not None else None

    def restore(self) -> None:
        with torch.no_grad():
            for p, g, saved in self.grads:
                if g is None:
                    p.grad = None
                else:
                    g.copy_(saved)
                    p.grad = g  # the same tensor object the optimizer and hooks may hold
            for module, name, b, saved in self.buffers:
                b.copy_(saved)
                if module._buffers.get(name) is not b:
                    module._buffers[name] = b  # the forward replaced the buffer instead of updating it
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        if self.np_rng is not None:
            sys.modules["numpy"].random.set_state(self.np_rng)


def _default_forward(model, batch):
    return model(batch)


def warm_compile(
    model: Any,
    batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    forward: Callable[[Any, Any], Any] | None = None,
) -> WarmCompileReport:
    """Runs ``loss_fn(forward(model, batch), batch).backward()`` once (``forward`` defaults to
    ``model(batch)``) so that the compiled forward, loss and backward exist before the first real step, then
    restores gradients, buffers and RNG state: training afterwards is bit-for-bit what it would have been.

    ``model`` is what the training step calls — usually ``torch.compile(module)``; ``loss_fn`` may be
    compiled too. Runs with grad mode on (the training step's mode, which Dynamo guards on).
    """
    forward = forward or _default_forward
    snapshot = _Snapshot(model)
    before = compile_counters()
    t0 = time.perf_counter()
    ran_backward = False
    try:
        with torch.enable_grad():
            out = forward(model, batch)
            loss = loss_fn(out, batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise InvalidArgumentError(
                    f"loss_fn returned {type(loss).__name__}"
                    + (f" with shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                    + "; warm_compile needs a scalar tensor to run backward on"
                )
            if loss.requires_grad:
                loss.backward()
                ran_backward = True
            del out, loss
    finally:
        snapshot.restore()
    seconds = time.perf_counter() - t0
    after = compile_counters()
    return WarmCompileReport(
        seconds=seconds,
        graphs=after["graphs"] - before["graphs"],
        backward=ran_backward,
        counters=counter_delta(before, after),
    )
