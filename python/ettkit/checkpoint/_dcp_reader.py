"""DCP interop: ``EttkitStorageReader``, a ``torch.distributed.checkpoint`` ``StorageReader`` over a committed
ettkit step, so that ``dcp.load`` reads ettkit's checkpoints at any world size with DCP's own planner.
Imported lazily by ``ettkit.checkpoint`` (``torch.distributed.checkpoint`` is slow to import).

It reads a step's manifest and safetensors headers as untrusted data: JSON of bounded size, opened without
following a final symlink, each field type- and range-checked (:class:`ettkit.CorruptDataError` naming the
file and the field otherwise). It never reads ``rank-<r>.extra`` and never unpickles."""

from __future__ import annotations

import errno
import json
import os
import warnings
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.futures import Future

from .. import _C
from ..errors import CorruptDataError, InvalidArgumentError
from ._directory import latest_step

# safetensors dtype strings (what ettkit writes) -> torch dtypes: the C++ table the writer and loader use
# (include/ettkit/checkpoint/safetensors_dtypes.h), so that this reader takes exactly the dtypes ettkit saves.
_DTYPES: dict[str, torch.dtype] = dict(_C.checkpoint.safetensors_dtypes())


def _step_dir(checkpoint_id: str | os.PathLike) -> str:
    """``checkpoint_id`` is a step directory (``CKPT_DIR/step-<N>``) or a checkpoint directory (its newest
    committed step)."""
    path = os.path.abspath(os.fspath(checkpoint_id))
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    step = latest_step(path)
    if step is None:
        raise InvalidArgumentError(f"checkpoint_id '{path}' is neither an ettkit step directory (it has no "
                                   f"manifest.json) nor a checkpoint directory with a committed step")
    return os.path.join(path, f"step-{step}")


# The names of what a step saved are C++'s (include/ettkit/checkpoint/shard_names.h): a shard's
# "<key>@<offsets>" (split_shard_name) and where a disk save records the XXH3 of each tensor it saved whole.
_split_shard_name = _C.checkpoint.split_shard_name
_WHOLE_DIGEST = _C.checkpoint.WHOLE_TENSOR_DIGEST_PREFIX
# A manifest lists a few files per rank: 16 MiB is far beyond any real one. A safetensors header: the
# format's own cap.
_MAX_MANIFEST_BYTES = 16 << 20
_MAX_HEADER_BYTES = 100 << 20


def _open(path: str) -> Any:
    """``path`` opened for reading, refusing a symlink in its last component (a step's files are regular
    files its writer created; a link there points somewhere the step does not own)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptDataError(f"'{path}' is a symbolic link; a step's files are regular files") from None
        raise
    return os.fdopen(fd, "rb")


def _json(path: str, data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        raise CorruptDataError(f"'{path}' is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


def _header(path: str) -> tuple[int, dict, dict, int]:
    """(data offset, {name: entry}, ``__metadata__``, file size) of a safetensors file."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise CorruptDataError(f"'{path}' is shorter than a safetensors header")
        n = int.from_bytes(raw, "little")
        if n > min(_MAX_HEADER_BYTES, size - 8):
            raise CorruptDataError(f"'{path}' declares a {n}-byte safetensors header in a {size}-byte file")
        header = _json(path, f.read(n))
    if type(header) is not dict:
        raise CorruptDataError(f"'{path}': the safetensors header is a {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", None) or {}
    if type(meta) is not dict or any(type(v) is not str for v in meta.values()):
        raise CorruptDataError(f"'{path}': the safetensors __metadata__ is not an object of strings")
    return 8 + n, header, meta, size


def _entry(path: str, name: str, e: Any, data_bytes: int) -> tuple[torch.dtype, list, int, int]:
    """(dtype, shape, begin, end) of one safetensors entry, every field checked: the dtype one DCP reads, the
    shape non-negative ints, the byte range inside the file's data and of the shape's size."""
    if type(e) is not dict:
        raise CorruptDataError(f"'{path}': the entry of '{name}' is not an object")
    dtype = _DTYPES.get(e.get("dtype")) if type(e.get("dtype")) is str else None
    if dtype is None:
        raise CorruptDataError(f"'{path}': tensor '{name}' has dtype {e.get('dtype')!r}, which DCP cannot read")
    shape, offsets = e.get("shape"), e.get("data_offsets")
    if type(shape) is not list or any(type(s) is not int or s < 0 for s in shape) or len(shape) > 64:
        raise CorruptDataError(f"'{path}': tensor '{name}' has shape {shape!r}, not a list of sizes")
    if type(offsets) is not list or len(offsets) != 2 or any(type(o) is not int for o in offsets) \
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes:
        raise CorruptDataError(f"'{path}': tensor '{name}' has data_offsets {offsets!r}, not a range inside the "
                               f"file's {data_bytes} data bytes")
    numel = 1
    for s in shape:
        numel *= s
    if numel * dtype.itemsize != offsets[1] - offsets[0]:
        raise CorruptDataError(f"'{path}': tensor '{name}' of shape {shape} and dtype {dtype} takes "
                               f"{numel * dtype.itemsize} bytes, not the {offsets[1] - offsets[0]} of its range")
    return dtype, shape, offsets[0], offsets[1]


class EttkitStorageReader(StorageReader):
    """Reads a committed ettkit step with ``dcp.load``, at any world size::

        dcp.load(state_dict, storage_reader=EttkitStorageReader("ckpt"))  # the newest committed step
        dcp.load(state_dict, storage_reader=EttkitStorageReader("ckpt/step-300"))

    Every rank's ``rank-<r>.safetensors`` header is read; a ShardedTensor's or DTensor's local shard saved
    as ``<key>@<offsets>`` becomes a chunk of ``<key>`` at those offsets, and a whole tensor one chunk of
    itself (old rank 0's copy, once the digests in the headers show every old rank saved the same bytes:
    per-rank state is refused with ``InvalidArgumentError``). DCP's planner then reads, on each
    rank, the chunks that overlap its state. Tensors only: the non-tensor state in ``rank-<r>.extra`` is for
    ettkit's own ``load_latest`` and is never read here. ettkit's checksums are not checked on this path (DCP
    has no place for them): ``AsyncCheckpointer.load_latest`` is the verified load."""

    def __init__(self, checkpoint_id: Optional[str | os.PathLike] = None, *, whole_from_rank0: bool = False):
        super().__init__()
        self._whole_from_rank0 = bool(whole_from_rank0)  # as AsyncCheckpointer's reshard_whole_from_rank0
        self._path: Optional[str] = None
        self._storage: dict = {}
        # Tensors saved whole whose copies differ between old ranks -> two ranks that disagree (refused when
        # the plan asks for them).
        self._per_rank: dict = {}
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    def reset(self, checkpoint_id: Optional[str | os.PathLike] = None) -> None:
        if checkpoint_id is not None:
            self._path = _step_dir(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            _step_dir(checkpoint_id)
            return True
        except Exception:
            return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._path is None:
            raise InvalidArgumentError("EttkitStorageReader needs a checkpoint_id (a step or checkpoint directory)")
        mpath = os.path.join(self._path, "manifest.json")
        with _open(mpath) as f:
            data = f.read(_MAX_MANIFEST_BYTES + 1)
        if len(data) > _MAX_MANIFEST_BYTES:
            raise CorruptDataError(f"'{mpath}' is larger than {_MAX_MANIFEST_BYTES} bytes: not an ettkit manifest")
        manifest = _json(mpath, data)
        world = manifest.get("world_size") if type(manifest) is dict else None
        if type(world) is not int or not 1 <= world <= 1 << 24:
            raise CorruptDataError(f"'{mpath}' has no valid world_size (an int in [1, 2^24])")
        metadata: dict = {}
        storage: dict = {}
        self._per_rank = {}
        whole: dict = {}  # a tensor saved whole -> (the first old rank that holds it, its digest)
        for rank in range(world):
            path = os.path.join(self._path, f"rank-{rank}.safetensors")
            data_offset, header, meta, size = _header(path)
            for name, e in header.items():
                key, shard_offsets = _split_shard_name(name)
                dtype, shape, begin, end = _entry(path, name, e, size - data_offset)
                offsets = shard_offsets if shard_offsets is not None else [0] * len(shape)
                if len(offsets) != len(shape):
                    raise CorruptDataError(f"'{path}': '{name}' has {len(offsets)} offsets for {len(shape)} dims")
                if shard_offsets is None:
                    # A whole tensor is read from one copy: right only when every old rank held the same
                    # bytes (the digests say so; a step without them is taken as replicated).
                    digest = meta.get(_WHOLE_DIGEST + name)
                    first = whole.setdefault(key, (rank, digest))
                    if digest is not None and first[1] is not None and digest != first[1]:
                        self._per_rank.setdefault(key, (first[0], rank))
                    if key in metadata:
                        continue  # old rank 0's copy
                md = metadata.get(key)
                if md is None:
                    md = metadata[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])
                if md.properties.dtype != dtype:
                    raise CorruptDataError(f"'{path}': '{name}' is {dtype}; another piece of '{key}' is "
                                           f"{md.properties.dtype}")
                if any(s == 0 for s in shape):
                    continue
                md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(shape)))
                # The whole tensor's size: the extent of its pieces.
                md.size = torch.Size(max(a, o + s) for a, o, s in zip(md.size, offsets, shape))
                storage[MetadataIndex(key, offsets)] = (path, data_offset + begin, end - begin, dtype, shape)
        self._storage = storage
        return Metadata(state_dict_metadata=metadata, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan):
        asked = sorted({item.storage_index.fqn for item in plan.items} & self._per_rank.keys())
        if asked and self._whole_from_rank0:
            warnings.warn(f"'{self._path}': {len(asked)} tensor(s) saved whole differ between old ranks "
                          f"({asked[:12]}); old rank 0's copy is read (whole_from_rank0=True)", RuntimeWarning,
                          stacklevel=2)
        elif asked:
            key = asked[0]
            a, b = self._per_rank[key]
            raise InvalidArgumentError(
                f"'{key}' was saved whole and differs between old ranks {a} and {b} of '{self._path}' "
                f"({len(asked)} such tensor(s) asked for: {asked[:12]}): per-rank state cannot be read as one "
                f"tensor (only a tensor every rank holds the same, such as a DDP replica, can); save it as a "
                f"DTensor or ShardedTensor, leave it out of the state dict given to dcp.load, or, when old rank 0's "
                f"copy is the right one (a DDP model's buffers), pass EttkitStorageReader(..., whole_from_rank0=True)")
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        files: dict = {}
        try:
            for item in plan.items:
                path, begin, length, dtype, shape = self._storage[MetadataIndex(item.storage_index.fqn,
                                                                                item.storage_index.offset)]
                f = files.get(path)
                if f is None:
                    f = files[path] = _open(path)
                f.seek(begin)
                raw = bytearray(f.read(length))
                if len(raw) != length:
                    raise CorruptDataError(f"'{path}' is shorter than its header says")
                stored = torch.frombuffer(raw, dtype=dtype).reshape(shape) if length else torch.empty(shape, dtype=dtype)
                src = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                target.copy_(src)
                planner.commit_tensor(item, target)
        finally:
            for f in files.values():
                f.close()
        fut: Future = Future()
        fut.set_result(None)
        return fut
