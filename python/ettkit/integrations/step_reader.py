"""A committed ettkit step read tensor by tensor, every byte verified against the step's own checksums, by one
process without a process group (for export: ``ettkit export``).

:class:`StepTensors` promises: the step's ``manifest.json`` and every ``rank-<r>.safetensors`` header are
decoded strictly (bounded sizes, every field type- and range-checked; :class:`ettkit.errors.CorruptDataError`
naming the file and the field otherwise); every rank file's size equals its manifest entry; every byte handed
out (headers included) lies in a manifest checksum chunk whose XXH3-64 was recomputed and matched first
(:class:`ettkit.errors.CorruptCheckpointError` naming the file and the chunk otherwise). Pieces saved as
``<key>@<offsets>`` (FSDP2's and other DTensors' shards, ShardedTensors' local shards) are put together
into the whole tensor ``<key>``; a piece that several ranks saved (replicated mesh dimensions) is read once;
pieces that do not tile the whole tensor exactly are refused. A tensor saved whole is read from old rank 0,
once the headers' digests show every rank saved the same bytes. These are the C++ loader's rules, applied by
the one function ``load_latest`` and ``EttkitStorageReader`` read a step through
(``_C.checkpoint.step_tensors``). Memory: a tensor whose pieces are rows of it (whole tensors, ``Shard(0)``)
streams in pieces of at most one checksum chunk (4-32 MiB); any other layout is put together by C++
(``_C.checkpoint.assemble_pieces``, the loader's resharding plan) in one buffer of the tensor's size.
Nothing is unpickled and ``rank-<r>.extra`` is never opened.
"""

from __future__ import annotations

import errno
import json
import math
import os
from dataclasses import dataclass, field
from typing import Iterator

from .. import _C
from ..errors import CorruptCheckpointError, CorruptDataError, InvalidArgumentError

# A manifest lists a few files per rank: 16 MiB is far beyond any real one.
MAX_MANIFEST_BYTES = 16 << 20
# The rules that the C++ loader owns and this reader applies through ettkit._C.checkpoint (one owner each,
# include/ettkit/checkpoint/step_format.h and step_pieces.h): the manifest's world_size range and file entries
# (FileChecksums.decode), the safetensors header's parse and checks (overlapping ranges included), and the
# replica rule with the pieces (step_tensors: which copy of a tensor saved whole is read, which boxes of a
# sharded one, that they tile it) and how pieces are put together (assemble_pieces).
MAX_WORLD_SIZE = _C.checkpoint.MAX_WORLD_SIZE
# The dtypes ettkit writes (safetensors names) and their element sizes: the C++ table the writer uses.
_ITEMSIZE: dict[str, int] = {name: dtype.itemsize for name, dtype in _C.checkpoint.safetensors_dtypes()}


def step_directory(path: str | os.PathLike) -> str:
    """``path`` if it is a step directory (it has ``manifest.json``), else the newest committed step of the
    checkpoint directory ``path``."""
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return path
    step = _C.checkpoint.latest_step(path)
    if step is None:
        raise InvalidArgumentError(f"'{path}' is neither an ettkit step directory (it has no manifest.json) nor "
                                   f"a checkpoint directory with a committed step")
    return os.path.join(path, f"step-{step}")


def _open_regular(path: str) -> int:
    """A read-only descriptor of ``path``, refusing a symbolic link as its last component (a step's files are
    regular files its writer created)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CorruptDataError(f"'{path}' is a symbolic link; a step's files are regular files") from None
        raise


def _json(path: str, data: bytes) -> object:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise CorruptDataError(f"'{path}' is not valid JSON ({type(e).__name__}: {str(e)[:200]})") from None


@dataclass(frozen=True)
class FileChecksums:
    """One data file's entry of the manifest: its size and the XXH3-64 of each ``chunk_bytes`` chunk."""

    size: int
    chunk_bytes: int
    chunks: tuple[str, ...]

    @staticmethod
    def decode(manifest_path: str, name: str, entry: object) -> "FileChecksums":
        """The entry, decoded and checked by the C++ loader's decoder (step_format.h), which names the field
        ``files['<name>'].<key>``; export then needs its chunk checksums, which verify every byte it reads."""
        field = f"files['{name}']"
        size, _, chunk_bytes, chunks = _C.checkpoint.decode_manifest_file_entry(json.dumps(entry), manifest_path,
                                                                              field)
        if not chunks and size:
            raise CorruptDataError(f"manifest '{manifest_path}': field '{field}' has no chunk checksums (a step "
                                   f"saved before ettkit wrote them): export verifies every byte against them; "
                                   f"load it with load_latest and save it again to export it")
        return FileChecksums(size, chunk_bytes, tuple(chunks))


class VerifiedFile:
    """A step's data file, read by byte range; every chunk a read touches is hashed and compared with the
    manifest before its bytes are returned (each chunk once: a verified chunk is remembered)."""

    def __init__(self, path: str, sums: FileChecksums):
        self.path = path
        self.sums = sums
        self._fd = _open_regular(path)
        size = os.fstat(self._fd).st_size
        if size != sums.size:
            os.close(self._fd)
            raise CorruptCheckpointError(f"'{path}' has {size} bytes; the step's manifest says {sums.size}")
        self._verified: set[int] = set()
        self.bytes_verified = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def read(self, begin: int, end: int) -> bytes:
        """Bytes ``[begin, end)`` of the file, verified. Reads whole chunks when a chunk is not yet verified."""
        if not 0 <= begin <= end <= self.sums.size:
            raise CorruptDataError(f"'{self.path}': range [{begin}, {end}) is outside its {self.sums.size} bytes")
        if begin == end:
            return b""
        cb = self.sums.chunk_bytes
        first, last = begin // cb, (end - 1) // cb
        if all(c in self._verified for c in range(first, last + 1)):
            return os.pread(self._fd, end - begin, begin)
        lo, hi = first * cb, min(self.sums.size, (last + 1) * cb)
        data = os.pread(self._fd, hi - lo, lo)
        if len(data) != hi - lo:
            raise CorruptCheckpointError(f"'{self.path}' ended at byte {lo + len(data)}; expected {hi}")
        for c in range(first, last + 1):
            if c in self._verified:
                continue
            piece = data[c * cb - lo:min(hi, (c + 1) * cb) - lo]
            if _C.xxh3_hex(piece) != self.sums.chunks[c]:
                raise CorruptCheckpointError(f"'{self.path}': checksum chunk {c} (bytes {c * cb}..{c * cb + len(piece)}) "
                                             f"does not match the step's manifest: the file is corrupt")
            self._verified.add(c)
            self.bytes_verified += len(piece)
        return data[begin - lo:end - lo]

    def stream(self, begin: int, end: int) -> Iterator[bytes]:
        """Bytes ``[begin, end)`` in verified pieces that end on chunk boundaries (at most one chunk each)."""
        cb = self.sums.chunk_bytes
        pos = begin
        while pos < end:
            stop = min(end, (pos // cb + 1) * cb)
            yield self.read(pos, stop)
            pos = stop


@dataclass(frozen=True)
class Piece:
    """One saved box of a tensor: which rank file holds it, where in the tensor and in the file."""

    rank: int
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    begin: int  # absolute file offsets of its bytes
    end: int


@dataclass
class SavedTensor:
    """A tensor of the step: its name in the step (without ``@<offsets>``), its safetensors dtype, its whole
    shape (the extent of its pieces) and the pieces to read it from (one per distinct box), as
    ``_C.checkpoint.step_tensors`` chose them."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    pieces: list[Piece] = field(default_factory=list)
    sharded: bool = False

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]

    @property
    def rows_in_order(self) -> bool:
        """Whether the pieces, sorted by offset, are consecutive rows of the tensor: then the tensor's bytes
        are the pieces' bytes one after the other, and it streams without being put together."""
        return all(p.offsets[1:] == (0,) * (len(self.shape) - 1) and p.shape[1:] == self.shape[1:]
                   for p in self.pieces)


class StepTensors:
    """The tensors of one committed step (see the module docstring for what it promises). Use as a context
    manager, or call :meth:`close`."""

    def __init__(self, step_dir: str | os.PathLike):
        self.step_dir = step_directory(step_dir)
        mpath = os.path.join(self.step_dir, "manifest.json")
        fd = _open_regular(mpath)
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise CorruptDataError(f"'{mpath}' is larger than {MAX_MANIFEST_BYTES} bytes: not an ettkit manifest")
        manifest = _json(mpath, data)
        if type(manifest) is not dict or manifest.get("format") != "ettkit-checkpoint":
            raise CorruptDataError(f"'{mpath}' has no \"format\": \"ettkit-checkpoint\": not an ettkit manifest")
        files, step = manifest.get("files"), manifest.get("step")
        world = _C.checkpoint.checked_world_size(json.dumps(manifest.get("world_size")), mpath)
        if type(files) is not dict:
            raise CorruptDataError(f"'{mpath}' has no \"files\" object")
        self.step = step if type(step) is int else None
        self.world_size = world
        self.files: list[VerifiedFile] = []
        self.tensors: dict[str, SavedTensor] = {}
        try:
            headers = []
            for rank in range(world):
                name = f"rank-{rank}.safetensors"
                if name not in files:
                    raise CorruptDataError(f"'{mpath}': files has no entry for '{name}' (world_size {world})")
                vf = VerifiedFile(os.path.join(self.step_dir, name), FileChecksums.decode(mpath, name, files[name]))
                self.files.append(vf)
                headers.append(self._header(vf))
            self._add_tensors(_C.checkpoint.step_tensors(headers, self.step_dir))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "StepTensors":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for f in self.files:
            f.close()

    @property
    def bytes_verified(self) -> int:
        return sum(f.bytes_verified for f in self.files)

    @staticmethod
    def _header(vf: VerifiedFile) -> tuple[str, bytes, int]:
        """(path, header JSON, size) of a rank file: the bytes handed to the C++ parser are the verified ones."""
        path, size = vf.path, vf.sums.size
        n = _C.checkpoint.safetensors_header_length(path, vf.read(0, min(8, size)), size)
        return path, vf.read(8, 8 + n), size

    def _add_tensors(self, saved: dict) -> None:
        for key, (dtype, shape, sharded, pieces, differs, _) in saved.items():
            if differs is not None:
                a, b = differs
                raise InvalidArgumentError(f"'{key}' was saved whole with different bytes by rank {a} and rank {b} "
                                           f"(per-rank state): it has no single value to export")
            self.tensors[key] = SavedTensor(key, dtype, tuple(shape), [
                Piece(rank, tuple(offsets), tuple(sizes), begin, end) for rank, offsets, sizes, begin, end in pieces],
                sharded)

    def stream(self, t: SavedTensor) -> Iterator[bytes]:
        """The tensor's bytes, row-major, verified: in chunk-sized pieces when its pieces are rows of it, else
        as one buffer put together from its pieces."""
        if t.rows_in_order:
            for p in t.pieces:
                yield from self.files[p.rank].stream(p.begin, p.end)
            return
        data = [self.files[p.rank].read(p.begin, p.end) for p in t.pieces]
        yield _C.checkpoint.assemble_pieces(t.name, t.dtype, list(t.shape), [
            (p.rank, list(p.offsets), list(p.shape), p.begin, p.end) for p in t.pieces], data)
