"""A committed ettkit step written as a Hugging Face model directory: ``model.safetensors`` (or
``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json`` past ``max_shard_size``), plus the
user's ``config.json``, so that ``AutoModel*.from_pretrained(OUT)`` loads it.

::

    from ettkit.integrations.hf_export import export_hf
    export_hf("ckpt/step-300", "gpt2-out", config="config.json")   # or: ettkit export ckpt/step-300 --format hf gpt2-out --config config.json

:func:`export_hf` promises: any world size and layout the step was saved in (``<key>@<offsets>`` pieces are
put together, see :mod:`ettkit.integrations.step_reader`), one process, no process group; every byte read is
verified against the step's checksums before it is written; one tensor in memory at a time, and for tensors
saved in rows (whole, FSDP2's ``Shard(0)``) at most one checksum chunk (4-32 MiB); each output file is
written beside its final name and renamed into place, the index last. Names: only the step's tensors under
``strip_prefix`` (default ``"model."``, the key a trainer gives its model in the saved state) are exported,
that prefix removed and ``add_prefix`` put in front; the optimizer's state is left out. Tied weights: the
names in ``tied`` (``{dropped: kept}``; by default the output embedding a config with
``tie_word_embeddings`` ties, ``lm_head.weight`` to the input embedding) are written once, after their
bytes are checked equal to what they are tied to; ``from_pretrained`` ties them again from the config.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import struct
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Union

from ..errors import InvalidArgumentError
from .step_reader import SavedTensor, StepTensors, _open_regular

__all__ = ["ExportResult", "export_hf", "parse_size"]

#: ``save_pretrained``'s own default limit per file.
DEFAULT_MAX_SHARD_SIZE = "5GB"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_CONFIG_BYTES = 16 << 20
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
# The input embedding an output embedding is tied to, by model family, when the config ties them and the
# caller names no pairs: the names ``save_pretrained`` drops for these families.
_TIED_BY_DEFAULT = {"lm_head.weight": ("transformer.wte.weight", "model.embed_tokens.weight",
                                       "model.decoder.embed_tokens.weight", "transformer.word_embeddings.weight")}


def parse_size(size: Union[int, str]) -> int:
    """``max_shard_size`` in bytes: an int, or ``"500MB"`` / ``"5GB"`` (decimal, as ``save_pretrained``) /
    ``"512MiB"`` (binary)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str) and (m := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, re.I)):
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    else:
        raise InvalidArgumentError(f"max_shard_size={size!r} is not a size: give bytes or e.g. '500MB', '5GB', "
                                   f"'512MiB'")
    if n < 1:
        raise InvalidArgumentError(f"max_shard_size={size!r} must be at least 1 byte")
    return n


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_hf` wrote: the files (in ``out_dir``), each exported name → its file, the tied names
    left out (→ the name they are tied to), the bytes written and verified, and the seconds taken."""

    out_dir: str
    step_dir: str
    files: tuple[str, ...]
    weight_map: dict[str, str]
    tied: dict[str, str]
    total_bytes: int
    bytes_verified: int
    seconds: float


def _read_config(config: Union[str, os.PathLike, Mapping, None]) -> Optional[dict]:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    path = os.fspath(config)
    with os.fdopen(_open_regular(path), "rb") as f:
        data = f.read(_MAX_CONFIG_BYTES + 1)
    if len(data) > _MAX_CONFIG_BYTES:
        raise InvalidArgumentError(f"config '{path}' is larger than {_MAX_CONFIG_BYTES} bytes: not a model config")
    try:
        value = json.loads(data)
    except ValueError as e:
        raise InvalidArgumentError(f"config '{path}' is not valid JSON ({e})") from None
    if type(value) is not dict:
        raise InvalidArgumentError(f"config '{path}' holds a {type(value).__name__}, not a JSON object")
    return value


def _tied_pairs(tied: Optional[Mapping[str, str]], config: Optional[dict], names: dict[str, SavedTensor]
                ) -> dict[str, str]:
    """``{dropped: kept}`` among the exported names (see the module docstring)."""
    if tied is not None:
        for dropped, kept in tied.items():
            for n in (dropped, kept):
                if n not in names:
                    raise InvalidArgumentError(f"tied={{{dropped!r}: {kept!r}}}: '{n}' is not an exported name "
                                               f"(names look like {sorted(names)[:3]})")
        return dict(tied)
    if config is None or not config.get("tie_word_embeddings", True):
        return {}
    pairs = {}
    for dropped, candidates in _TIED_BY_DEFAULT.items():
        kept = next((c for c in candidates if c in names), None)
        if dropped in names and kept is not None:
            pairs[dropped] = kept
    return pairs


def _plan_files(order: list[str], sizes: dict[str, int], limit: int) -> list[list[str]]:
    """Names grouped into files in order, a file closed when the next tensor would take it past ``limit``
    (a tensor larger than the limit gets a file of its own), as ``save_pretrained`` splits."""
    files: list[list[str]] = [[]]
    used = 0
    for name in order:
        if files[-1] and used + sizes[name] > limit:
            files.append([])
            used = 0
        files[-1].append(name)
        used += sizes[name]
    return files


def _header_bytes(names: list[str], tensors: dict[str, SavedTensor]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = tensors[name]
        header[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors library writes it
    return struct.pack("<Q", len(raw)) + raw


def _digest(step: StepTensors, t: SavedTensor) -> bytes:
    """A digest of the tensor's bytes, streamed (comparing two tensors holds neither whole)."""
    h = hashlib.blake2b(digest_size=32)
    for c in step.stream(t):
        h.update(c)
    return h.digest()


def _write_durably(path: str, chunks) -> int:
    """Writes the byte strings to ``path`` through a temporary file renamed into place; returns the bytes."""
    # A fresh, unguessable name created exclusively and never through a link: in an output directory others can
    # write, a planted symbolic link or FIFO at the temporary's name is refused instead of followed or blocked on.
    tmp = f"{path}.tmp-{secrets.token_hex(8)}"
    written = 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        for c in chunks:
            f.write(c)
            written += len(c)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return written


def export_hf(step_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], *,
              strip_prefix: str = "model.", add_prefix: str = "",
              max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
              config: Union[str, os.PathLike, Mapping, None] = None,
              tied: Optional[Mapping[str, str]] = None, overwrite: bool = False) -> ExportResult:
    """Writes the committed step ``step_dir`` (a step directory, or a checkpoint directory: its newest step)
    into ``out_dir`` as a Hugging Face model directory. See the module docstring for what it promises.

    ``config``: a ``config.json`` path or a dict, written to ``out_dir/config.json`` (``from_pretrained``
    needs it). ``tied``: ``{name: name it is tied to}`` in exported names; ``{}`` writes every tensor.
    ``overwrite``: replace an earlier export's model files in ``out_dir`` (otherwise refused)."""
    start = time.perf_counter()
    limit = parse_size(max_shard_size)
    config_value = _read_config(config)
    out = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out, exist_ok=True)
    earlier = [f for f in os.listdir(out) if f == INDEX_FILE or re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", f)]
    if earlier and not overwrite:
        raise InvalidArgumentError(f"'{out}' already holds model files ({', '.join(sorted(earlier)[:3])}): give "
                                   f"overwrite=True (--overwrite) to replace them, or another directory")
    with StepTensors(step_dir) as step:
        exported: dict[str, SavedTensor] = {}
        for name in sorted(step.tensors):
            if name.startswith(strip_prefix):
                exported[add_prefix + name[len(strip_prefix):]] = step.tensors[name]
        if not exported:
            raise InvalidArgumentError(f"step '{step.step_dir}' has no tensor under the prefix '{strip_prefix}' (its names "
                                       f"look like {sorted(step.tensors)[:3]}): give the prefix of the model's "
                                       f"key in the saved state as strip_prefix (--strip-prefix)")
        pairs = _tied_pairs(tied, config_value, exported)
        for dropped, kept in pairs.items():
            a, b = exported[dropped], exported[kept]
            if (a.dtype, a.shape) != (b.dtype, b.shape) or _digest(step, a) != _digest(step, b):
                raise InvalidArgumentError(f"'{dropped}' is not the same tensor as '{kept}' it is to be tied to "
                                           f"(dtype, shape or values differ): pass tied={{}} (--no-tie) to write both")
        order = [n for n in exported if n not in pairs]
        groups = _plan_files(order, {n: exported[n].nbytes for n in order}, limit)
        names = [SINGLE_FILE] if len(groups) == 1 else [
            f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        for f in earlier:
            os.unlink(os.path.join(out, f))
        total = 0
        weight_map: dict[str, str] = {}
        for fname, group in zip(names, groups):
            def chunks(group=group):
                yield _header_bytes(group, exported)
                for n in group:
                    yield from step.stream(exported[n])
            _write_durably(os.path.join(out, fname), chunks())
            total += sum(exported[n].nbytes for n in group)
            weight_map.update((n, fname) for n in group)
        if len(groups) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            _write_durably(os.path.join(out, INDEX_FILE), [json.dumps(index, indent=2).encode()])
        if config_value is not None:
            _write_durably(os.path.join(out, "config.json"), [json.dumps(config_value, indent=2).encode()])
        return ExportResult(out, step.step_dir, tuple(names) + ((INDEX_FILE,) if len(groups) > 1 else ()),
                            weight_map, pairs, total, step.bytes_verified, time.perf_counter() - start)

