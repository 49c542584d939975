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
# overlapping) and the replica rule (which old rank's copy of a tensor saved whole is read, which boxes of a
# sharded one count, and that they tile it) are C++'s (include/ettkit/checkpoint/step_format.h, step_pieces.h),
# the C++ loader's own: one owner each. This module translates what C++ decided into DCP's metadata.
def _header_text(path: str) -> tuple[bytes, int]:
    """(the header's JSON, the file's size) of a safetensors file, its length checked by C++."""
    with _open(path) as f:
        size = os.fstat(f.fileno()).st_size
        n = _C.checkpoint.safetensors_header_length(path, f.read(8), size)
        return f.read(n), size


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
    as ``<key>@<offsets>`` becomes a chunk of ``<key>`` at those offsets (one copy of a box several old ranks
    saved), and a whole tensor one chunk of itself (old rank 0's copy, once the digests in the headers show
    every old rank saved the same bytes: per-rank state is refused with ``InvalidArgumentError``); which copy
    and which boxes are C++'s rule, the loader's (``_C.checkpoint.step_tensors``). DCP's planner then reads, on each
    rank, the chunks that overlap its state. Tensors only: the non-tensor state in ``rank-<r>.extra`` is for
    ettkit's own ``load_latest`` and is never read here. ettkit's checksums are not checked on this path (DCP
    has no place for them): ``AsyncCheckpointer.load_latest`` is the verified load."""

    def __init__(self, checkpoint_id: Optional[str | os.PathLike] = None, *, whole_from_rank0: bool = False):
        super().__init__()
        self._whole_from_rank0 = bool(whole_from_rank0)  # as AsyncCheckpointer's reshard_whole_from_rank0
        self._path: Optional[str] = None
        self._storage: dict = {}
        self._per_rank: dict = {}  # see read_metadata
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
        files = []
        for rank in range(world):
            path = os.path.join(self._path, f"rank-{rank}.safetensors")
            files.append((path, *_header_text(path)))
        metadata: dict = {}
        storage: dict = {}
        # Tensors saved whole whose copies differ between old ranks -> the two ranks (refused when asked for).
        self._per_rank = {}
        for key, (dtype_name, shape, _, pieces, differs, _) in _C.checkpoint.step_tensors(files, self._path).items():
            dtype = _dtype(files[pieces[0][0]][0] if pieces else mpath, key, dtype_name)
            md = metadata[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape), [])
            if differs is not None:
                self._per_rank[key] = tuple(differs)
            for rank, offsets, sizes, begin, end in pieces:
                if 0 in sizes:
                    continue  # a DCP chunk holds elements: an empty tensor has none
                md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
                storage[MetadataIndex(key, offsets)] = (files[rank][0], begin, end - begin, dtype, sizes)
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
