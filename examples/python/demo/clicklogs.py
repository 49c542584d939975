"""Synthetic click logs: written to disk once by the demo driver, read back by each rank's DataLoader.

The format is Criteo-like text, one impression per line, tab-separated::

    <label> \t <13 counts, 5 decimal digits each> \t <one 8-hex-digit hashed value per categorical feature> \n

Every line has the same width, so a reader can seek to any sample. Each rank owns a directory of part files
(``rank-<r>/part-<k>.tsv``) and reads only its own. The label follows a hidden rule the model can learn:
every id of every table has a fixed effect, the counts add a linear term, and the label is drawn from the
logistic of their sum.

The reader (:class:`ClickLogDataset`, an ``IterableDataset`` used with DataLoader worker processes) reads a
*shuffle block* of lines, parses it, shuffles it with a seed derived from (rank, block) and yields whole
batches as dicts ``{"dense": float32 (B, 13), "ids": {table: int64 (B,)}, "label": float32 (B,)}``. The
order is a pure function of (rank, step): a restarted job that resumes at step ``s`` sees exactly the batches
the first attempt would have seen.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import numpy as np
import torch

DENSE = 13
DENSE_DIGITS = 5
HEX_DIGITS = 8
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def line_width(num_tables: int) -> int:
    return 1 + DENSE * (1 + DENSE_DIGITS) + num_tables * (1 + HEX_DIGITS) + 1


def data_fingerprint(cfg: dict) -> str:
    keys = ("world_size", "batch_size", "steps", "tables", "part_batches", "shuffle_batches", "seed")
    blob = json.dumps({k: cfg[k] for k in keys}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    """A 64-bit integer hash (splitmix64 finaliser), vectorised."""
    z = x.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) % 2**64)  # wraps modulo 2**64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def id_effect(table_index: int, ids: np.ndarray) -> np.ndarray:
    """The hidden effect of each id on the click logit, in [-1, 1)."""
    h = _mix(ids, 1000 + table_index)
    return (h >> np.uint64(11)).astype(np.float64) / float(1 << 53) * 2.0 - 1.0


def _generate_part(rng: np.random.Generator, n: int, tables: list, table_weights: list) -> bytes:
    num_tables = len(tables)
    counts = np.minimum(
        rng.geometric(1.0 / np.geomspace(2, 2000, DENSE), size=(n, DENSE)) - 1, 10**DENSE_DIGITS - 1
    )
    logit = -0.3 + (np.log1p(counts) - np.log1p(np.geomspace(2, 2000, DENSE))) @ np.linspace(
        -0.25, 0.25, DENSE
    )
    raw = np.empty((n, num_tables), dtype=np.uint64)
    for t, table in enumerate(tables):
        rows = int(table["rows"])
        # Popularity is heavy-tailed (a few hot ids, a long tail), scattered over the rows by a hash so that
        # every row-wise shard sees hot ids.
        rank_of_id = np.floor(rows * rng.random(n) ** float(table.get("skew", 3.0))).astype(np.uint64)
        ids = _mix(rank_of_id, 7 + t) % np.uint64(rows)
        logit += table_weights[t] * id_effect(t, ids)
        # The log holds a 32-bit hashed value; the reader maps it to a row with `value % rows`.
        wraps = rng.integers(0, (1 << 32) // rows, size=n, dtype=np.uint64)
        raw[:, t] = ids + wraps * np.uint64(rows)
    label = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.uint8)

    width = line_width(num_tables)
    out = np.empty((n, width), dtype=np.uint8)
    out[:, 0] = ord("0") + label
    col = 1
    for j in range(DENSE):
        out[:, col] = ord("\t")
        v = counts[:, j].astype(np.int64)
        for d in range(DENSE_DIGITS):
            out[:, col + DENSE_DIGITS - d] = ord("0") + (v // 10**d) % 10
        col += 1 + DENSE_DIGITS
    for t in range(num_tables):
        out[:, col] = ord("\t")
        v = raw[:, t]
        for d in range(HEX_DIGITS):
            out[:, col + HEX_DIGITS - d] = _HEX[((v >> np.uint64(4 * d)) & np.uint64(15)).astype(np.int64)]
        col += 1 + HEX_DIGITS
    out[:, col] = ord("\n")
    return out.tobytes()


def write_click_logs(data_dir: str, cfg: dict, log=print) -> bool:
    """Writes the click logs for ``cfg`` into ``data_dir`` unless they are already there. Returns True
    when it wrote them."""
    fp = data_fingerprint(cfg)
    meta_path = os.path.join(data_dir, "meta.json")
    try:
        with open(meta_path) as f:
            if json.load(f).get("fingerprint") == fp:
                return False
    except (OSError, ValueError):
        pass
    t0 = time.time()
    shutil.rmtree(data_dir, ignore_errors=True)
    tables = cfg["tables"]
    weights = [float(t.get("signal", 1.0)) for t in tables]
    per_part = cfg["part_batches"] * cfg["batch_size"]
    samples = cfg["steps"] * cfg["batch_size"]
    parts = -(-samples // per_part)
    total = 0
    for rank in range(cfg["world_size"]):
        rdir = os.path.join(data_dir, f"rank-{rank}")
        os.makedirs(rdir)
        for k in range(parts):
            rng = np.random.default_rng([cfg["seed"], rank, k])
            body = _generate_part(rng, per_part, tables, weights)
            with open(os.path.join(rdir, f"part-{k:04d}.tsv"), "wb") as f:
                f.write(body)
            total += len(body)
    with open(meta_path, "w") as f:
        json.dump(
            {
                "fingerprint": fp,
                "parts_per_rank": parts,
                "lines_per_part": per_part,
                "line_width": line_width(len(tables)),
                "bytes": total,
                "tables": [t["name"] for t in tables],
            },
            f,
            indent=1,
        )
    log(
        f"demo: wrote {total / 1e6:.0f} MB of click logs ({cfg['world_size']} x {parts} parts) into "
        f"{data_dir} in {time.time() - t0:.1f} s"
    )
    return True


def parse_lines(buf: bytes, tables: list) -> dict:
    """Parses fixed-width click-log lines into numpy arrays (vectorised)."""
    num_tables = len(tables)
    width = line_width(num_tables)
    a = np.frombuffer(buf, dtype=np.uint8).reshape(-1, width)
    if not (a[:, -1] == ord("\n")).all():
        raise ValueError("corrupt click log: a line does not end where its width says")
    label = (a[:, 0] - ord("0")).astype(np.float32)
    col = 1
    pow10 = 10 ** np.arange(DENSE_DIGITS - 1, -1, -1, dtype=np.int64)
    dense = np.empty((a.shape[0], DENSE), dtype=np.float32)
    for j in range(DENSE):
        digits = a[:, col + 1 : col + 1 + DENSE_DIGITS].astype(np.int64) - ord("0")
        dense[:, j] = np.log1p((digits @ pow10).astype(np.float32))
        col += 1 + DENSE_DIGITS
    lut = np.zeros(256, dtype=np.int64)
    lut[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
    lut[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
    pow16 = 16 ** np.arange(HEX_DIGITS - 1, -1, -1, dtype=np.int64)
    ids = {}
    for t, table in enumerate(tables):
        value = lut[a[:, col + 1 : col + 1 + HEX_DIGITS]] @ pow16
        ids[table["name"]] = value % int(table["rows"])
        col += 1 + HEX_DIGITS
    return {"dense": dense, "ids": ids, "label": label}


class ClickLogDataset(torch.utils.data.IterableDataset):
    """This rank's batches from step ``start_step`` (1-based) to ``steps``; use with one DataLoader worker
    (``batch_size=None``: the dataset yields whole batches)."""

    def __init__(self, data_dir: str, rank: int, cfg: dict, start_step: int = 1):
        super().__init__()
        with open(os.path.join(data_dir, "meta.json")) as f:
            self.meta = json.load(f)
        if self.meta["fingerprint"] != data_fingerprint(cfg):
            raise ValueError(f"{data_dir} holds click logs for another configuration; rerun the driver")
        self.dir = os.path.join(data_dir, f"rank-{rank}")
        self.rank = rank
        self.cfg = cfg
        self.start_step = start_step

    def __iter__(self):
        cfg = self.cfg
        B, block_batches = cfg["batch_size"], cfg["shuffle_batches"]
        width = self.meta["line_width"]
        lines_per_part = self.meta["lines_per_part"]
        first = (self.start_step - 1) // block_batches
        last = (cfg["steps"] - 1) // block_batches
        for block in range(first, last + 1):
            # Read and parse one shuffle block, then shuffle it: the first batch waits for a whole block.
            line0 = block * block_batches * B
            part, within = divmod(line0, lines_per_part)
            with open(os.path.join(self.dir, f"part-{part:04d}.tsv"), "rb") as f:
                f.seek(within * width)
                buf = f.read(block_batches * B * width)
            cols = parse_lines(buf, cfg["tables"])
            perm = np.random.default_rng([cfg["seed"], 99, self.rank, block]).permutation(len(cols["label"]))
            for i in range(block_batches):
                step = block * block_batches + i + 1
                if step < self.start_step or step > cfg["steps"]:
                    continue
                sel = perm[i * B : (i + 1) * B]
                yield {
                    "dense": torch.from_numpy(cols["dense"][sel]),
                    "ids": {name: torch.from_numpy(v[sel]) for name, v in cols["ids"].items()},
                    "label": torch.from_numpy(cols["label"][sel]),
                }
