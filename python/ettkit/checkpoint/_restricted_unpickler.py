"""The restricted unpickler of the ``.extra`` record's pickled leaves and of its former, pickled format: it
builds nothing outside an allow-list, as ``torch.load(weights_only=True)`` does."""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from typing import Any

import torch

from ._extra_format import (  # the format's constants, tags and shared checks
    DTYPES, INT64_END, INT64_MIN, MAX_KEYS_PER_HASH
)
from ._tensor_kinds import TENSOR, ShardedSlot

# ---- the restricted unpickler ------------------------------------------------------------------------------
def _storage_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` (how a plain pickle of a tensor holds its storage: a ``torch.save``
    of it, in the legacy format), read through ``torch.load(weights_only=True)`` instead of the unrestricted
    load it calls; a zip only when its members are stored, not compressed (_stored_zip). Either way the
    storage must not be larger than the bytes that held it."""
    if type(data) is not bytes:
        raise pickle.UnpicklingError("a pickled tensor's storage is not bytes")
    if zipfile.is_zipfile(io.BytesIO(data)):
        _stored_zip(data)
    storage = torch.load(io.BytesIO(data), weights_only=True)
    nbytes = storage.nbytes() if hasattr(storage, "nbytes") else 0
    if nbytes > len(data):
        raise pickle.UnpicklingError(f"a pickled tensor's storage of {nbytes} bytes came from {len(data)}")
    return storage


def _stored_zip(data: bytes) -> None:
    """Refuses a storage in ``torch.save``'s zip format with a member that is compressed: a DEFLATE member
    inflates a 2 MB record into a 2 GiB tensor (1000:1). Stored members take what they hold, so a storage
    costs its bytes."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, ValueError) as e:
        raise pickle.UnpicklingError(f"a pickled tensor's storage is not a valid zip ({e})") from None
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size:
            raise pickle.UnpicklingError(
                f"a pickled tensor's storage holds a compressed member ({m.filename[:64]!r}: {m.compress_size} "
                f"bytes that would inflate to {m.file_size}); torch.save stores its members uncompressed")


def _no_hooks(backward_hooks: Any) -> dict:
    """A rebuilt tensor's backward hooks: torch.save writes none (an empty OrderedDict); a pickle that brings
    some would install any allowed callable as a hook that runs, and fails, in the next backward."""
    if backward_hooks is None or (type(backward_hooks) in (dict, OrderedDict) and not backward_hooks):
        return OrderedDict()
    raise pickle.UnpicklingError(f"a pickled tensor carries backward hooks ({type(backward_hooks).__name__} of "
                                 f"{len(backward_hooks) if hasattr(backward_hooks, '__len__') else '?'}); a "
                                 f"checkpoint's tensors carry none")


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                    backward_hooks: Any, metadata: Any = None) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2`` without backward hooks (_no_hooks)."""
    from torch import _utils

    return _utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, _no_hooks(backward_hooks),
                                     metadata)


def _rebuild_parameter(data: Any, requires_grad: Any, backward_hooks: Any) -> torch.nn.Parameter:
    """``torch._utils._rebuild_parameter`` without backward hooks (_no_hooks)."""
    from torch import _utils

    return _utils._rebuild_parameter(data, requires_grad, _no_hooks(backward_hooks))


def _allowed_globals() -> tuple[dict, set]:
    """``"module.name"`` -> object, for every global a pickle in a record may name: plain containers and
    numbers, torch's sizes, devices and dtypes, tensors rebuilt from their storage bytes through
    ``torch.load(weights_only=True)``, ettkit's skeleton nodes, and what the user registered with
    ``torch.serialization.add_safe_globals`` (as for ``torch.load(weights_only=True)``); and the ids of the
    classes the user registered (only their instances may have their state set)."""
    allowed = {
        "builtins.complex": complex, "builtins.set": set, "builtins.frozenset": frozenset,
        "collections.OrderedDict": OrderedDict,
        "torch.Size": torch.Size, "torch.device": torch.device,
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch.storage._load_from_bytes": _storage_from_bytes,
        # The skeleton's nodes under the module that defined them when the former format was written (the
        # names on disk), and under the one that defines them now.
        "ettkit.checkpoint._flatten.TENSOR": TENSOR,
        "ettkit.checkpoint._flatten.ShardedSlot": ShardedSlot,
        f"{ShardedSlot.__module__}.TENSOR": TENSOR,
        f"{ShardedSlot.__module__}.ShardedSlot": ShardedSlot,
    }
    allowed.update({f"torch.{n}": d for n, d in DTYPES.items()})
    user: set = set()
    for g in torch.serialization.get_safe_globals():
        if isinstance(g, tuple) and len(g) == 2 and isinstance(g[1], str):
            g, name = g
        else:
            name = f"{g.__module__}.{g.__qualname__}"
        allowed[name] = g
        if isinstance(g, type):
            user.add(id(g))
    return allowed, user


class RestrictedUnpickler(pickle._Unpickler):  # the Python unpickler: its BUILD can be restricted
    """Unpickles only what :func:`_allowed_globals` names: a global outside it, a persistent id, or state set
    on anything but an instance of a class the user registered raises ``pickle.UnpicklingError`` (a class
    or function of the allow-list cannot be altered through it). Opt-in only (``allow_pickle=True``): the
    allow-list decides what may be built, and a registered class's constructor and ``__setstate__`` run."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any):
        super().__init__(file)
        self._allowed, self._user = _allowed_globals()
        self._key_counts: dict = {}  # id(container) -> (container, {hash: keys}) for _keys
        for name in ("builtins.set", "builtins.frozenset", "collections.OrderedDict"):
            self._allowed[name] = self._counted(self._allowed[name])

    def _counted(self, build: Any) -> Any:
        """`build` (set, frozenset, OrderedDict: callable from a pickle's REDUCE with an iterable) with the
        iterable's keys counted first (_keys)."""

        def checked(items: Any = ()) -> Any:
            items = list(items.items()) if isinstance(items, dict) else list(items)
            keys = [i[0] if build is OrderedDict and isinstance(i, tuple) and len(i) == 2 else i for i in items]
            self._keys(items, keys)
            return build(items)

        return checked

    def find_class(self, module: str, name: str) -> Any:
        obj = self._allowed.get(f"{module}.{name}")
        if obj is None:
            raise pickle.UnpicklingError(
                f"the pickle names the global '{module}.{name}', which is not allowed: only plain values, tensors "
                f"and classes registered with torch.serialization.add_safe_globals load (register it only if you "
                f"trust this checkpoint's writer)")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("the pickle holds a persistent id, which a checkpoint record never does")

    def _load_build(self) -> None:
        inst = self.stack[-2] if len(self.stack) >= 2 else None  # under the state BUILD pops
        if id(type(inst)) not in self._user:
            raise pickle.UnpicklingError(f"the pickle sets the state of a {type(inst).__name__}, which only "
                                         f"instances of registered classes may have set")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build

    # ---- keys of one hash (MAX_KEYS_PER_HASH), as the record's own dicts: a pickle's dicts and sets are
    # built by these opcodes, and hashes of big ints, floats and tuples can be made to collide ----
    def _keys(self, container: Any, keys: Any) -> None:
        """Counts `keys` going into `container` under their hash; refuses past MAX_KEYS_PER_HASH of one."""
        entry = self._key_counts.get(id(container))
        if entry is None:  # the container is held with its counts, so its id stays its own
            entry = self._key_counts[id(container)] = (container, {})
        counts = entry[1]
        for k in keys:
            if type(k) is str or (type(k) is int and INT64_MIN <= k < INT64_END):
                continue
            h = hash(k)
            c = counts[h] = counts.get(h, 0) + 1
            if c > MAX_KEYS_PER_HASH:
                raise pickle.UnpicklingError(
                    f"the pickle builds a dict or set with more than {MAX_KEYS_PER_HASH} keys of type "
                    f"{type(k).__name__} that share one hash value (its decoding would take quadratic time)")

    def _load_setitems(self) -> None:
        items = self.pop_mark()
        self._keys(self.stack[-1], items[0::2])
        d = self.stack[-1]
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]

    def _load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._keys(self.stack[-1], (key,))
        self.stack[-1][key] = value

    def _load_dict(self) -> None:
        items = self.pop_mark()
        d: dict = {}
        self._keys(d, items[0::2])
        for i in range(0, len(items), 2):
            d[items[i]] = items[i + 1]
        self.append(d)

    def _load_additems(self) -> None:
        items = self.pop_mark()
        self._keys(self.stack[-1], items)
        s = self.stack[-1]
        for item in items:
            s.add(item)

    def _load_frozenset(self) -> None:
        items = self.pop_mark()
        self._keys(items, items)
        self.append(frozenset(items))

    dispatch[pickle.SETITEMS[0]] = _load_setitems
    dispatch[pickle.SETITEM[0]] = _load_setitem
    dispatch[pickle.DICT[0]] = _load_dict
    dispatch[pickle.ADDITEMS[0]] = _load_additems
    dispatch[pickle.FROZENSET[0]] = _load_frozenset
