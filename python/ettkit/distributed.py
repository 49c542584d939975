"""One call that initialises the default process group so that a torchrun restart can rejoin it.

Why a plain ``dist.init_process_group(backend)`` fails after a torchrun restart (torch 2.14):

- torchrun's rendezvous handler (``DynamicRendezvousHandler.next_rendezvous`` in
  ``torch/distributed/elastic/rendezvous/dynamic_rendezvous.py``, what ``--standalone`` and
  ``--rdzv-backend=c10d`` use) creates one TCPStore *server* in the agent at the first rendezvous
  (``_shared_tcp_store_server``) and hands the same ``MASTER_ADDR:MASTER_PORT`` to every later attempt,
  with ``TORCHELASTIC_USE_AGENT_STORE=True``.
- The workers' ``env://`` rendezvous (``_create_c10d_store`` in ``torch/distributed/rendezvous.py``) then
  makes a new TCPStore *client* per attempt. Its comment says "We create a new TCPStore for every retry so
  no need to add prefix for each attempt", but a new client of the same server sees every key the dead
  attempt wrote.
- ``init_process_group`` prefixes the default group's keys with ``default_pg/0/`` in every attempt, so gloo's
  full-mesh connect of the new attempt can read a peer's address published by the dead attempt before the
  peer overwrites it: ``Gloo connectFullMesh failed ... Connection refused`` (or a hang), depending on which
  rank gets there first.

:func:`init_process_group` gives every attempt its own key space on that store
(``PrefixStore("ettkit/attempt-<TORCHELASTIC_RESTART_COUNT>", store)``: keys ``ettkit/attempt-<n>/...``), so nothing of a dead attempt is
ever read; the checkpointer's commit keys, which live in the default group's store, are per attempt too.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist

from .errors import InvalidArgumentError

__all__ = ["init_process_group", "attempt_prefix"]

# What the helper derives itself from the launcher's environment; passing them would bypass the prefix.
_DERIVED = ("store", "init_method", "rank", "world_size")


def attempt_prefix() -> str | None:
    """The per-attempt key prefix used under torchrun with the agent's shared store, else None.

    None when not launched by torchrun (no ``TORCHELASTIC_RESTART_COUNT``) or when every attempt gets a
    fresh store anyway (``TORCHELASTIC_USE_AGENT_STORE`` is not ``True``, e.g. torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: rank 0 then hosts a new server per attempt)."""
    raw = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if raw is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        restart = int(raw)
    except ValueError:
        restart = -1
    if restart < 0:
        raise InvalidArgumentError(
            f"TORCHELASTIC_RESTART_COUNT={raw!r}: expected the non-negative integer torchrun sets for each attempt"
        )
    return f"ettkit/attempt-{restart}"  # PrefixStore adds the "/"


def _as_timedelta(timeout: Any) -> datetime.timedelta | None:
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise InvalidArgumentError(
            f"timeout={timeout!r}: expected seconds (a positive number), a datetime.timedelta, or None"
        )
    if not seconds > 0:
        raise InvalidArgumentError(f"timeout={timeout!r}: must be positive (seconds)")
    return datetime.timedelta(seconds=seconds)


def init_process_group(backend: str = "gloo", *, recorder: Any = "current", timeout: Any = None,
                       **kwargs: Any) -> None:
    """Initialises the default process group like ``torch.distributed.init_process_group(backend)``, in a
    way that a torchrun restart (``--max-restarts``) can rejoin.

    - ``backend``: ``"gloo"``, ``"nccl"``, ... as for torch.
    - ``recorder``: where the ``process_group_init`` phase is recorded: the current recorder by default
      (:func:`ettkit.ett.current`, with a :class:`ettkit.NoRecorderWarning` when none is open), ``None`` for
      none, or a :class:`ettkit.ett.Recorder`.
    - ``timeout``: seconds or a ``timedelta`` for the rendezvous and the group's collectives (torch's
      default when None).
    - other keyword arguments (``device_id``, ``pg_options``, ...) go to torch unchanged. ``store``,
      ``init_method``, ``rank`` and ``world_size`` are refused: they come from torchrun's environment.

    Under torchrun with the agent's shared store, the group uses the store prefixed with
    :func:`attempt_prefix`; otherwise (a single process, another launcher, or a fresh store per attempt)
    this is exactly ``torch.distributed.init_process_group(backend, timeout=timeout, **kwargs)``.
    """
    passed = [k for k in _DERIVED if k in kwargs]
    if passed:
        raise InvalidArgumentError(
            f"ettkit.init_process_group: {', '.join(passed)} cannot be passed: the helper takes them from "
            f"torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT); call "
            f"torch.distributed.init_process_group directly to bring your own"
        )
    if not isinstance(backend, str) or not backend:
        raise InvalidArgumentError(f"backend={backend!r}: expected a backend name such as 'gloo' or 'nccl'")
    delta = _as_timedelta(timeout)
    if delta is not None:
        kwargs["timeout"] = delta

    from .ett import recorder as _recorder  # the recorder module resolves "current" with its warning

    rec = _recorder.resolve(recorder, "ettkit.init_process_group")
    if rec is None:
        _init(backend, kwargs, delta)
    else:
        with rec.phase("process_group_init"):
            _init(backend, kwargs, delta)


def _init(backend: str, kwargs: dict, delta: datetime.timedelta | None) -> None:
    prefix = attempt_prefix()
    if prefix is None:
        dist.init_process_group(backend, **kwargs)
        return
    rdzv = dist.rendezvous("env://") if delta is None else dist.rendezvous("env://", timeout=delta)
    store, rank, world_size = next(rdzv)
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size,
                            **kwargs)
