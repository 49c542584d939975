"""Old against new: the checkpoint benchmarks of a base revision and of the current tree, in the same run.

    python tools/compare_revisions.py [--base 42f7757] [--rounds 3] [--tolerance 0.05]
                                      [--benchmarks checkpoint,reshard,isolated] [--json FILE]

#43's criterion for a behaviour-preserving redesign: `benchmarks/checkpoint.py --quick` (the disk tier, the
memory tier, restore_s) and the reshard benchmark within 5 % of the numbers before the change, measured old
and new on the same machine in the same run. This tool:

1. checks the base revision out into a scratch git worktree, build/compare/base (reused by later runs), and
   builds its extension there with build/py's CMake options (the same compiler, build type, CUDA and Torch;
   ccache when CCACHE_DIR is set: the worktree mirrors this tree's layout, so unchanged sources hit);
2. makes two scratch packages, build/compare/site-{old,new}/ettkit: each revision's in-tree Python sources
   (links) with that revision's extension module, put first on PYTHONPATH (tools/mutation_check.py's pattern);
3. runs the current tree's benchmark scripts (the same measuring code for both) for old and new interleaved,
   --rounds times, alternating which goes first, each writing --json;
4. prints per figure (`metric[params]:variant` of the benchmarks' JSON, filtered by --figures) the old and the
   new median, new/old and a verdict: `same` within the tolerance, else `better` or `WORSE` (times and
   percentages are better lower, GB/s higher). Exit status 1 when a figure is WORSE, 2 when a step failed.

The build of the current tree is build/py as it stands (build it first). Pure parts (arguments, medians,
verdicts, the table) are tested by tests/python/test_compare_revisions.py without building anything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BASE = "42f7757"  # main before #43

# What each benchmark runs (the current tree's script) and which of its figures the criterion is about.
BENCHMARKS = {
    "checkpoint": ["benchmarks/checkpoint.py", "--quick", "--cases", "1GB_large,256MB_small",
                   "--variants", "ettkit,ettkit_memory"],
    "reshard": ["benchmarks/reshard.py", "--quick"],
    # One save at a time, no training thread beside it: ettkit's own cost without the scheduler's noise.
    "isolated": ["benchmarks/checkpoint_isolated.py"],
}
DEFAULT_FIGURES = (r"^(blocking_ms|time_to_durable_s|persist_GBps|persist_idle_GBps|restore_s)"
                   r"\[.*\]:(ettkit|memory)"
                   r"|^(reshard_load_s|save_s)\[.*\]:ettkit$"
                   r"|^(save_call_ms|persist_ms|persist_cpu_ms)\[tensors=.*\]:(disk|memory)$")
# The CMake cache entries that make the base's build the same as build/py's (the rest are found again).
CACHE_KEYS = re.compile(r"^(ETTKIT_\w+|CMAKE_BUILD_TYPE|CMAKE_(C|CXX|CUDA)_COMPILER(_LAUNCHER)?"
                        r"|CMAKE_CUDA_ARCHITECTURES|CMAKE_MAKE_PROGRAM|CMAKE_PREFIX_PATH"
                        r"|Python_EXECUTABLE|Torch_DIR)$")
SIDES = ("old", "new")


class Failed(Exception):
    """A step of the comparison could not be done (exit status 2)."""


# ---- pure parts -----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=DEFAULT_BASE,
                    help="the old revision (default: %(default)s, main before #43)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of each benchmark per side (default: %(default)s)")
    ap.add_argument("--tolerance", type=float, default=0.05,
                    help="how far new/old may be from 1 and still be the same (default: %(default)s)")
    ap.add_argument("--benchmarks", default=",".join(BENCHMARKS),
                    help=f"comma-separated, of {', '.join(BENCHMARKS)} (default: all)")
    ap.add_argument("--figures", default=DEFAULT_FIGURES,
                    help="regular expression over 'metric[params]:variant' naming the figures compared")
    ap.add_argument("--extra-args", action="append", default=[], metavar="BENCH=ARGS",
                    help="more arguments for one benchmark, e.g. checkpoint='--saves 2' (repeatable)")
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "py"),
                    help="the current tree's configured and built build directory (default: build/py)")
    ap.add_argument("--scratch", default=os.path.join(ROOT, "build", "compare"),
                    help="where the base worktree, its build, the packages and the results go")
    ap.add_argument("--build-prefix", default="",
                    help="a command the base's cmake calls run under, e.g. 'flock /tmp/b.lock nice -n 10'")
    ap.add_argument("--json", help="also write the comparison (and every run's figures) to this file")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds={args.rounds}: at least 1 run per side is needed")
    if not 0 <= args.tolerance < 1:
        ap.error(f"--tolerance={args.tolerance}: a fraction in [0, 1), e.g. 0.05 for 5 %")
    names = [b for b in args.benchmarks.split(",") if b]
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown or not names:
        ap.error(f"--benchmarks={args.benchmarks!r}: each must be one of {', '.join(BENCHMARKS)}")
    args.benchmarks = names
    extra: dict[str, list[str]] = {}
    for item in args.extra_args:
        name, sep, rest = item.partition("=")
        if not sep or name not in BENCHMARKS:
            ap.error(f"--extra-args={item!r}: write BENCH=ARGS with BENCH one of {', '.join(BENCHMARKS)}")
        extra.setdefault(name, []).extend(shlex.split(rest))
    args.extra_args = extra
    args.build_prefix = shlex.split(args.build_prefix)
    try:
        args.figures = re.compile(args.figures)
    except re.error as e:
        ap.error(f"--figures={args.figures!r} is not a regular expression: {e}")
    return args


def figures_of(doc: dict, pattern: re.Pattern) -> dict[str, float]:
    """The numeric figures of a benchmark's --json document that `pattern` names (`metric:variant`)."""
    out = {}
    results = doc.get("results")
    if not isinstance(results, dict):
        raise Failed("a benchmark's JSON has no 'results' object")
    for metric, variants in results.items():
        if not isinstance(variants, dict):
            continue
        for variant, value in variants.items():
            name = f"{metric}:{variant}"
            if isinstance(value, (int, float)) and not isinstance(value, bool) and pattern.search(name):
                out[name] = float(value)
    return out


def lower_is_better(figure: str) -> bool:
    """Times (_s, _ms) and percentages are better lower; throughputs (GBps) higher."""
    metric = figure.split("[", 1)[0].split(":", 1)[0]
    return not metric.endswith("GBps")


@dataclass
class Row:
    figure: str
    old: float | None  # median over the rounds; None when a side never reported it
    new: float | None
    ratio: float | None  # new / old
    verdict: str  # same, better, WORSE, or missing


def verdict(figure: str, old: float | None, new: float | None, tolerance: float) -> tuple[float | None, str]:
    """new/old and whether it is the same within `tolerance`, better or WORSE for this figure's direction."""
    if old is None or new is None:
        return None, "missing"
    if old == 0:
        return None, "same" if new == 0 else ("WORSE" if (new > 0) == lower_is_better(figure) else "better")
    ratio = new / old
    if abs(ratio - 1) <= tolerance:
        return ratio, "same"
    return ratio, "WORSE" if (ratio > 1) == lower_is_better(figure) else "better"


def compare(runs: dict[str, list[dict[str, float]]], tolerance: float) -> list[Row]:
    """One row per figure: the median of each side's runs (runs[side] = one figures_of() per run)."""
    names = sorted({f for side in SIDES for run in runs.get(side, []) for f in run})
    rows = []
    for name in names:
        med = {}
        for side in SIDES:
            values = [run[name] for run in runs.get(side, []) if name in run]
            med[side] = statistics.median(values) if values else None
        ratio, word = verdict(name, med["old"], med["new"], tolerance)
        rows.append(Row(name, med["old"], med["new"], ratio, word))
    return rows


def format_table(rows: list[Row], tolerance: float) -> str:
    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.4g}"

    width = max([len(r.figure) for r in rows] + [6])
    head = f"{'figure':<{width}}  {'old':>10}  {'new':>10}  {'new/old':>8}"
    lines = [f"{head}  verdict (tolerance {tolerance:.0%})"]
    for r in rows:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        lines.append(f"{r.figure:<{width}}  {num(r.old):>10}  {num(r.new):>10}  {ratio:>8}  {r.verdict}")
    return "\n".join(lines)


def run_order(rounds: int) -> list[tuple[int, str]]:
    """(round, side) in the order they run: interleaved, the side that goes first alternating by round."""
    order = []
    for r in range(rounds):
        order += [(r, s) for s in (SIDES if r % 2 == 0 else SIDES[::-1])]
    return order


def cmake_options(cache_text: str) -> list[str]:
    """-D options for the entries of a CMakeCache.txt that CACHE_KEYS names (set, not internal)."""
    out = []
    for line in cache_text.splitlines():
        m = re.match(r"^([A-Za-z_][\w]*):([A-Z]+)=(.*)$", line)
        if m and m.group(2) not in ("INTERNAL", "STATIC") and CACHE_KEYS.match(m.group(1)) and m.group(3):
            out.append(f"-D{m.group(1)}={m.group(3)}")
    return out


def cmake_command(cache_text: str) -> str:
    """The cmake that configured a build (its CMAKE_COMMAND): a cmake on PATH may be older than the
    project requires."""
    m = re.search(r"^CMAKE_COMMAND:INTERNAL=(.+)$", cache_text, re.MULTILINE)
    return m.group(1) if m else "cmake"


# ---- the steps that build and run -----------------------------------------------------------

def sh(cmd: list[str], what: str, **kw) -> None:
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    r = subprocess.run(cmd, **kw)
    if r.returncode != 0:
        raise Failed(f"{what} failed (exit status {r.returncode}): {' '.join(cmd)}")


def git_out(*args: str) -> str:
    r = subprocess.run(["git", "-C", ROOT, *args], check=True, capture_output=True, text=True)
    return r.stdout.strip()


def base_worktree(rev: str, scratch: str) -> str:
    """build/compare/base checked out at `rev` (detached), created on first use, reused afterwards."""
    try:
        commit = git_out("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise Failed(f"--base={rev!r} is not a commit of this repository") from None
    tree = os.path.join(scratch, "base")
    if os.path.exists(os.path.join(tree, ".git")):
        sh(["git", "-C", tree, "checkout", "--quiet", "--detach", commit], f"checking out {rev} in {tree}")
    else:
        os.makedirs(scratch, exist_ok=True)
        sh(["git", "-C", ROOT, "worktree", "add", "--quiet", "--detach", tree, commit],
           f"adding the worktree {tree}")
    return tree


def build_extension(tree: str, build_dir: str, prefix: list[str]) -> str:
    """Configures (once) and builds `tree`'s extension with build_dir's options; returns its build dir."""
    cache = os.path.join(build_dir, "CMakeCache.txt")
    if not os.path.exists(cache):
        raise Failed(f"{cache} is missing: configure and build the current tree first (build/py)")
    with open(cache) as f:
        text = f.read()
    options, cmake = cmake_options(text), cmake_command(text)
    out = os.path.join(tree, os.path.relpath(build_dir, ROOT))  # the same layout: ccache hits across the two
    env = dict(os.environ)
    if env.get("CCACHE_DIR"):
        env.setdefault("CCACHE_BASEDIR", os.path.dirname(ROOT))
        env.setdefault("CCACHE_NOHASHDIR", "1")
    if not os.path.exists(os.path.join(out, "build.ninja")):
        sh([*prefix, cmake, "-S", tree, "-B", out, "-G", "Ninja", *options], "configuring the base",
           env=env)
    sh([*prefix, cmake, "--build", out, "--target", "ettkit_python"], "building the base's extension",
       env=env)
    return out


def package(site: str, tree: str, build_dir: str) -> str:
    """site/ettkit: `tree`'s Python sources (links) and `build_dir`'s extension module; returns `site`."""
    csrc = os.path.join(build_dir, "python", "csrc")
    modules = [n for n in os.listdir(csrc) if n.startswith("_C") and n.endswith(".so")]
    if len(modules) != 1:
        raise Failed(f"expected one extension module in {build_dir}/python/csrc, found {modules}")
    pkg = os.path.join(site, "ettkit")
    shutil.rmtree(site, ignore_errors=True)  # links only: the sources and the build stay where they are
    os.makedirs(pkg)
    src = os.path.join(tree, "python", "ettkit")
    for name in os.listdir(src):
        if not name.startswith("_C.") and name != "__pycache__":
            os.symlink(os.path.join(src, name), os.path.join(pkg, name))
    os.symlink(os.path.join(build_dir, "python", "csrc", modules[0]), os.path.join(pkg, modules[0]))
    return site


def run_benchmark(name: str, extra: list[str], site: str, out_json: str, scratch: str) -> dict:
    """Runs benchmark `name` against the package in `site`; returns its --json document."""
    env = dict(os.environ, PYTHONPATH=site + os.pathsep + os.environ.get("PYTHONPATH", ""))
    script, *fixed = BENCHMARKS[name]
    cmd = [sys.executable, os.path.join(ROOT, script), *fixed, *extra, "--json", out_json]
    if name == "checkpoint":
        cmd += ["--dir", os.path.join(scratch, "bench-dir")]
    sh(cmd, f"benchmark {name}", env=env, cwd=ROOT)
    with open(out_json) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        tree = base_worktree(args.base, args.scratch)
        base_build = build_extension(tree, args.build_dir, args.build_prefix)
        sites = {"old": package(os.path.join(args.scratch, "site-old"), tree, base_build),
                 "new": package(os.path.join(args.scratch, "site-new"), ROOT, args.build_dir)}
        results_dir = os.path.join(args.scratch, "results")
        os.makedirs(results_dir, exist_ok=True)
        runs: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
        for rnd, side in run_order(args.rounds):
            figures: dict[str, float] = {}
            for name in args.benchmarks:
                print(f"== round {rnd + 1}/{args.rounds}: {name}, {side}", flush=True)
                out = os.path.join(results_dir, f"{name}-{side}-{rnd}.json")
                figures.update(figures_of(run_benchmark(name, args.extra_args.get(name, []), sites[side], out,
                                                        args.scratch), args.figures))
            runs[side].append(figures)
    except Failed as e:
        print(f"compare_revisions: {e}", file=sys.stderr)
        return 2
    rows = compare(runs, args.tolerance)
    print(f"\n{args.base} (old) against the current tree (new), medians of {args.rounds} interleaved rounds")
    print(format_table(rows, args.tolerance))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base": args.base, "base_commit": git_out("rev-parse", args.base),
                       "rounds": args.rounds, "tolerance": args.tolerance, "benchmarks": args.benchmarks,
                       "rows": [asdict(r) for r in rows], "runs": runs}, f, indent=2, sort_keys=True)
            f.write("\n")
    return 1 if any(r.verdict == "WORSE" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
