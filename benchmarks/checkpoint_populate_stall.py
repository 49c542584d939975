"""What a background prepare() costs the training thread (#65): while one thread backs a tmpfs mapping the way
`Arena::populate` does (MADV_POPULATE_WRITE), the main thread times a 1 MiB mmap + munmap every millisecond
(what a tensor or a malloc above glibc's mmap threshold does). The backing is done the old way (one call over
the whole mapping) and the new way (256 KiB slices, host_arena.cpp), interleaved in one run, and with no
backing beside it. Linux only (MADV_POPULATE_WRITE: 5.14); standard library only.

    python benchmarks/checkpoint_populate_stall.py [--quick] [--json FILE] [--mib 256] [--rounds 3]
                                                   [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import threading
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import write_json  # noqa: E402

MADV_POPULATE_WRITE = 23
PROT_RW, MAP_SHARED, MAP_PRIVATE_ANON = 3, 1, 0x22

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def one_round(directory: str, size: int, slice_bytes: int | None) -> tuple[float, list]:
    """(seconds the backing took, mmap+munmap latencies in seconds beside it); slice_bytes None: no backing,
    the latencies over 200 ms."""
    path = os.path.join(directory, f"ettkit-populate-stall-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        base = libc.mmap(None, size, PROT_RW, MAP_SHARED, fd, 0)
        done = threading.Event()
        took = [0.0]

        def back():
            t = time.perf_counter()
            for off in range(0, size, slice_bytes):
                if libc.madvise(base + off, min(slice_bytes, size - off), MADV_POPULATE_WRITE) != 0:
                    raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")
            took[0] = time.perf_counter() - t
            done.set()

        worker = threading.Thread(target=back) if slice_bytes else None
        if worker:
            worker.start()
        else:
            threading.Timer(0.2, done.set).start()
        latencies = []
        while not done.is_set():
            t = time.perf_counter()
            q = libc.mmap(None, 1 << 20, PROT_RW, MAP_PRIVATE_ANON, -1, 0)
            libc.munmap(q, 1 << 20)
            latencies.append(time.perf_counter() - t)
            time.sleep(0.001)
        if worker:
            worker.join()
        libc.munmap(base, size)
        return took[0], latencies
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="the mapping backed beside the main thread")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/dev/shm", help="a tmpfs, as the memory tier's")
    ap.add_argument("--quick", action="store_true", help="64 MiB, one round")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.mib, args.rounds = 64, 1
    size = args.mib << 20
    ways = {"none": None, "one call": size, "256 KiB slices": 256 << 10}
    results: dict = {w: ([], []) for w in ways}
    for _ in range(args.rounds):
        for way, slice_bytes in ways.items():
            took, lat = one_round(args.dir, size, slice_bytes)
            results[way][0].append(took)
            results[way][1].extend(lat)
    print(f"load average {os.getloadavg()[0]:.1f}; {args.mib} MiB in {args.dir}, "
          f"{args.rounds} rounds interleaved")
    figures = {}
    for way, (took, lat) in results.items():
        backing = f"backing {statistics.median(took) * 1e3:.0f} ms" if ways[way] else "no backing"
        print(f"{way:15s} {backing:18s} mmap+munmap: median {statistics.median(lat) * 1e3:.3f} ms, "
              f"max {max(lat) * 1e3:.1f} ms (n={len(lat)})")
        figures[way] = {"backing_ms": statistics.median(took) * 1e3 if ways[way] else None,
                        "mmap_munmap_median_ms": statistics.median(lat) * 1e3,
                        "mmap_munmap_max_ms": max(lat) * 1e3}
    if args.json:
        config = {"mib": args.mib, "rounds": args.rounds, "dir": args.dir}
        write_json(args.json, "checkpoint_populate_stall", config, figures)


if __name__ == "__main__":
    main()
