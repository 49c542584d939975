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
# A manifest lists a few files per rank: 16 MiB is far beyond any real one.
_MAX_MANIFEST_BYTES = 16 << 20
# How many names a message lists: the C++ loader's cap (step_format.h).
_LISTED = _C.checkpoint.MAX_LISTED_IN_MESSAGE


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


# The safetensors header's rules (the format's layout and cap, dtypes, sizes, ranges inside the data and not
# overlapping) are C++'s (include/ettkit/checkpoint/step_format.h), the C++ loader's own: one owner.
def _header(path: str) -> tuple[int, dict, dict, int]:
    """(data offset, {name: (dtype string, shape, begin, end)}, ``__metadata__``, file size) of a safetensors
    file, parsed and checked by C++."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        n = _C.checkpoint.safetensors_header_length(path, f.read(8), size)
        data_offset, entries, meta = _C.checkpoint.parse_safetensors_header(path, f.read(n), size)
    return data_offset, entries, meta, size


def _dtype(path: str, name: str, dtype: str) -> torch.dtype:
    """The torch dtype DCP reads for a header's dtype string (the table this reader was given)."""
    got = _DTYPES.get(dtype)
    if got is None:
        raise CorruptDataError(f"'{path}': tensor '{name}' has dtype {dtype!r}, which DCP cannot read")
    return got


def _entry(path: str, name: str, e: Any, data_bytes: int) -> tuple[torch.dtype, list, int, int]:
    """(dtype, shape, begin, end) of one safetensors entry ``e`` of a file with ``data_bytes`` data bytes,
    checked by the C++ header parser as part of a header of that one entry."""
    text = json.dumps({name: e}).encode()
    _, entries, _ = _C.checkpoint.parse_safetensors_header(path, text, 8 + len(text) + data_bytes)
    dtype, shape, begin, end = entries[name]
    return _dtype(path, name, dtype), shape, begin, end


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
        # The range is the C++ loader's (MAX_WORLD_SIZE), checked there.
        world = _C.checkpoint.checked_world_size(
            json.dumps(manifest.get("world_size") if type(manifest) is dict else None), mpath)
        metadata: dict = {}
        storage: dict = {}
        self._per_rank = {}
        whole: dict = {}  # a tensor saved whole -> (the first old rank that holds it, its digest)
        for rank in range(world):
            path = os.path.join(self._path, f"rank-{rank}.safetensors")
            data_offset, header, meta, _ = _header(path)
            for name, (dtype_name, shape, begin, end) in header.items():
                key, shard_offsets = _split_shard_name(name)
                dtype = _dtype(path, name, dtype_name)
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
                          f"({asked[:_LISTED]}); old rank 0's copy is read (whole_from_rank0=True)", RuntimeWarning,
                          stacklevel=2)
        elif asked:
            key = asked[0]
            a, b = self._per_rank[key]
            raise InvalidArgumentError(
                f"'{key}' was saved whole and differs between old ranks {a} and {b} of '{self._path}' "
                f"({len(asked)} such tensor(s) asked for: {asked[:_LISTED]}): per-rank state cannot be read as one "
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
