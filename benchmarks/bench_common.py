"""What every ettkit benchmark shares: the machine description and the JSON layout at the top of docs/benchmarks.md.

    {"benchmark": name, "machine": {...}, "config": {...},
     "results": {"<metric>[<case>]": {"<variant>": value, ...}}}
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from typing import Callable


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        import ettkit

        info["ettkit"] = ettkit.__version__
    except ImportError:
        pass
    return info


def median_of(fn: Callable[[], float], repeats: int) -> float:
    """Median of `repeats` calls of fn (each returns one measurement)."""
    return statistics.median(fn() for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def write_json(path: str, name: str, config: dict, results: dict) -> None:
    doc = {"benchmark": name, "machine": machine(), "config": config, "results": results}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def print_table(title: str, results: dict) -> None:
    print(f"\n{title}")
    width = max(len(k) for k in results) if results else 10
    for metric, variants in results.items():
        cells = "  ".join(f"{v}={_fmt(x)}" for v, x in variants.items())
        print(f"  {metric:<{width}}  {cells}")


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)
