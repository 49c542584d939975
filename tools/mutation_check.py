"""Mutation check: applies named one-line bugs to the integrity paths and shows that the tests named for each
one fail (docs/sanitizers.md, "Mutation check"; issue #48).

    python tools/mutation_check.py                       # every mutation, against build/py
    python tools/mutation_check.py --only prefetch-group-loop normal-load-chunk-loop
    python tools/mutation_check.py --list

Why this shape (cost on a 2-core machine, and never touching the tree others work in):
  * The sources are never edited in place. A mutation is applied to a copy of its one file under the scratch
    directory (build/mutation by default).
  * Nothing is rebuilt from scratch. The build directory (build/py: `make build` leaves it complete) already
    holds every object of libettkit.so and every test binary. Per mutation, only the mutated file is compiled
    (with the build's own compile command, read from ninja) into the scratch directory, and libettkit.so is
    relinked there from the build's other objects plus that one. The build directory is only read.
  * The tests run unchanged, the build's gtest binaries and the in-tree Python sources with the build's
    extension module (linked together under the scratch directory's site/), with LD_LIBRARY_PATH naming
    the scratch library: the binaries and the extension find libettkit through
    RUNPATH, which LD_LIBRARY_PATH precedes. A baseline first relinks the unmutated library the same way
    and runs every named test against it: each must pass, and the binaries must resolve libettkit to the
    scratch copy, or no verdict is given (a "caught" that the harness itself caused would mean nothing).
  * The build must be up to date with the sources (`ninja -n` has nothing to do); otherwise the relinked
    library would mix objects of two source trees, and the check refuses to run.

A mutation is caught when every test named for it fails (a gtest filter that fails, a pytest node that
fails; a test killed by the timeout counts as failed). Exit status 0 when the baseline passed and every
mutation run was caught, 1 otherwise. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Test:
    """One test that must fail under a mutation: a gtest binary of the build with a --gtest_filter, or a
    pytest node id (relative to the repository root)."""

    gtest: str = ""  # binary name under <build>/tests/cpp
    filter: str = "*"
    pytest: str = ""

    def label(self) -> str:
        return f"{self.gtest} --gtest_filter={self.filter}" if self.gtest else f"pytest {self.pytest}"


@dataclasses.dataclass(frozen=True)
class Mutation:
    name: str
    path: str  # relative to the repository root; must be one of libettkit.so's sources
    original: str  # must occur exactly once in the file
    replacement: str
    why: str  # the bug it stands for
    tests: tuple[Test, ...]


MANY = "checkpoint_integrity_many_chunks_test"
ARENA = "checkpoint_memory_tier_arena_test"
FUSED = "checkpoint_fused_digest_test"

# The table. Each entry is a plausible one-line bug that leaves every good checkpoint loading, so that only a
# test with the right corrupt input sees it. Keep `original` exact (the check refuses a snippet that is not
# in the file exactly once, so a refactor of the line shows up here instead of silently testing nothing).
MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "normal-load-chunk-loop", "src/checkpoint/file_checksums.cpp",
        "for (size_t i = 0; i < all.size(); ++i) all[i] = i;",
        "for (size_t i = 0; i < all.size(); ++i) all[i] = 0;",
        "the normal load (and the replica's receipt) verifies chunk 0 as many times as there are chunks",
        (Test(MANY, "IntegrityManyChunks.NormalDiskLoad*"), Test(MANY, "IntegrityManyChunks.MemoryTierLoad*"),
         Test(MANY, "IntegrityManyChunks.CheckStepFiles*"))),
    Mutation(
        "prefetch-group-loop", "src/checkpoint/step_files.cpp",
        "std::iota(which.begin(), which.end(), first);",
        "std::iota(which.begin(), which.end(), size_t{0});",
        "the prefetch's group loop checks the first group of load_threads chunks over and over (issue #48)",
        (Test(MANY, "IntegrityManyChunks.DiskPrefetch*"), Test(MANY, "IntegrityManyChunks.MemoryTierPrefetch*"),
         Test(MANY, "IntegrityManyChunks.CheckStepFiles*"),
         Test(pytest="tests/python/test_checkpoint_prefetch.py::"
                     "test_a_late_chunk_corrupt_before_the_prefetch_is_refused_among_many_chunk_groups"))),
    Mutation(
        "prefetch-reverify-evicted", "src/checkpoint/read_plan.cpp",
        "if (!again.empty()) verify_file_chunks(f.data, d, threads, again);",
        "if (again.empty()) verify_file_chunks(f.data, d, threads, again);",
        "a load that takes the prefetch's verification never hashes again the chunks that left the page cache",
        (Test(pytest="tests/python/test_checkpoint_prefetch.py::"
                     "test_a_file_changed_and_dropped_from_the_page_cache_after_the_prefetch_is_caught"),)),
    Mutation(
        "reshard-chunk-range", "src/checkpoint/reshard_plan.cpp",
        "for (uint64_t k = begin / d.chunk_bytes; k <= (begin + length - 1) / d.chunk_bytes; ++k) chunks[r].insert(k);",
        "for (uint64_t k = begin / d.chunk_bytes; k <= begin / d.chunk_bytes; ++k) chunks[r].insert(k);",
        "a resharding load verifies only the chunk each read starts in",
        (Test(MANY, "IntegrityManyChunks.Resharding*"),)),
    Mutation(
        "reshard-source-offset", "src/checkpoint/reshard.cpp",
        "src += (g - piece.box.offsets[d]) * ps[d];",
        "src += (g - want.offsets[d]) * ps[d];",
        "a resharding read takes its bytes relative to the wanted box instead of the saved piece (#46)",
        (Test("reshard_test", "Reshard.RandomLayoutsFillEveryWantedBoxExactlyOnce"),
         Test("reshard_test", "Reshard.ACppTrainersShardsLoadAtAnotherWorldSize"),
         Test("reshard_test", "Reshard.AnotherLayoutAtTheSameWorldSizeReshardsAndKeepsEachRanksOwnState"))),
    Mutation(
        "reshard-run-length", "src/checkpoint/reshard.cpp",
        "if (part.sizes[d] != piece.box.sizes[d] || part.sizes[d] != want.sizes[d]) break;",
        "if (part.sizes[d] != piece.box.sizes[d]) break;",
        "a contiguous run is grown across a dimension the wanted box cuts (a column-wise shard read as rows)",
        (Test("reshard_test", "Reshard.RandomLayoutsFillEveryWantedBoxExactlyOnce"),)),
    Mutation(
        "whole-from-pieces-shape", "src/checkpoint/reshard.cpp",
        "ETTKIT_EXPECTS(extent == shape,",
        "ETTKIT_EXPECTS(true || extent == shape,",
        "a plain tensor is filled from the pieces of a larger saved table: a corner of it, silently (#46)",
        (Test("reshard_test", "Reshard.ATensorSavedInPiecesLoadsWholeAndOneSavedWholeLoadsAsShards"),
         Test(pytest="tests/python/test_checkpoint_layout_kinds.py::"
                     "test_a_sharded_step_read_whole_into_another_shape_is_refused_naming_it"))),
    Mutation(
        "shards-from-whole-shape", "src/checkpoint/reshard.cpp",
        "ETTKIT_EXPECTS(whole->box.sizes == *global_shape,",
        "ETTKIT_EXPECTS(true || whole->box.sizes == *global_shape,",
        "shards of another global shape are cut from a tensor saved whole (#46)",
        (Test("reshard_test", "Reshard.ATensorSavedInPiecesLoadsWholeAndOneSavedWholeLoadsAsShards"),
         Test(pytest="tests/python/test_checkpoint_layout_kinds.py::"
                     "test_a_step_saved_whole_read_as_shards_of_another_global_shape_is_refused_naming_it"))),
    Mutation(
        "extra-chunk-check", "src/checkpoint/step_files.cpp",
        "ETTKIT_CHECK(h == d.chunks[i], CorruptData,",
        "ETTKIT_CHECK(true || h == d.chunks[i], CorruptData,",
        "an extra file of more than one chunk (its checksum derived from the chunks') loads unverified",
        (Test(MANY, "IntegrityManyChunks.AnExtraOfManyChunksIsCheckedChunkByChunk"),)),
    Mutation(
        "arena-linked-reuse", "src/checkpoint/stager.cpp",
        "if (a.busy || a.linked()) continue;",
        "if (a.busy) continue;",
        "the stager stages into an arena that a committed memory step still links: the step's bytes change",
        (Test(ARENA, "MemoryTierArena.LaterSavesNeverWriteIntoACommittedStep"),)),
    Mutation(
        "arena-reclaim-newest", "src/checkpoint/stager.cpp",
        "if (oldest < 0 || oldest == newest) return -1;",
        "if (oldest < 0) return -1;",
        "a save beside a persisting one reclaims the newest memory step: a crash then leaves no memory step",
        (Test(ARENA, "MemoryTierArena.AHeldSaveStagesIntoTheOlderArenaAndTheNewestStepStays"),)),
    Mutation(
        "arena-publish-before-commit", "src/checkpoint/step_writer.cpp",
        "  link(data_file);\n  if (hooks.after_data) hooks.after_data();",
        "  link(data_file);\n  snapshot_.publish(step_);\n  if (hooks.after_data) hooks.after_data();",
        "a memory save hands its arena back before its step is committed: the next save reclaims the newest "
        "committed step, and a crash then leaves none",
        (Test(ARENA, "MemoryTierArena.AHeldSaveStagesIntoTheOlderArenaAndTheNewestStepStays"),
         Test("checkpoint_memory_tier_test", "MemoryTierCrash.KillAtRandomMomentsRestoresTheNewestCompleteSnapshot"))),
    Mutation(
        "fused-digest-skips-gaps", "src/checkpoint/in_order_digest.cpp",
        "while (!s.pending.empty() && s.pending.begin()->first <= until) {",
        "while (!s.pending.empty()) {",
        "a piece that arrives before the one in front of it is hashed at once: the chunk's hash skips the gap "
        "and no loader can verify the step",
        (Test(FUSED, "InOrderDigest.AnyOrderGivesTheOnePassDigest"),
         Test(FUSED, "FusedDigestStager.EveryKindOfCopyEndsInTheOnePassDigestOfTheArenaFile"))),
    Mutation(
        "fused-digest-not-in-copies", "src/checkpoint/copy_engine.cpp",
        "state->report(s.dst + off, n);",
        "(void)n;",
        "the copy jobs no longer hash what they write: every save is correct but pays the writer's whole "
        "passes again (the fusion silently gone)",
        (Test(FUSED, "FusedDigestStager.EveryKindOfCopyEndsInTheOnePassDigestOfTheArenaFile"),
         Test(FUSED, "FusedDigestStager.ADiskStageHashesTheFileAfterItsHeaderAndEachWholeTensor"))),
    Mutation(
        "memory-tier-verify", "src/checkpoint/loader.cpp",
        "im.opt.verify_on_load && im.opt.memory_tier.verify,",
        "im.opt.verify_on_load && !im.opt.memory_tier.verify,",
        "the memory tier's verify option read the wrong way round: memory steps load unverified",
        (Test(MANY, "IntegrityManyChunks.MemoryTierLoad*"),
         Test("checkpoint_memory_tier_test", "MemoryTier.CorruptMemoryBytesFallBackToTheDiskWithTheReason"))),
    Mutation(
        "replica-give-back-verify", "src/checkpoint/peer_replica.cpp",
        "verify_file_chunks(file, d, 2);",
        "(void)file;",
        "a received replica (a give-back included) is committed without its chunk checksums",
        (Test(MANY, "IntegrityManyChunks.PeerReplica*"),
         Test("peer_replica_test", "PeerReplica.ACorruptReplicaSendsBothRanksToTheDiskTier"))),
    Mutation(
        "manifest-commit-result", "src/checkpoint/commit.cpp",
        'if (result == "ok") return;',
        'if (result != "") return;',
        "a rank other than 0 takes any commit result, a refused one included, for a committed manifest",
        (Test("checkpoint_commit_test", "CommitVote.ATornRankRefusesTheStepAsTornOnEveryRank"),
         Test("checkpoint_commit_test", "CommitVote.AFailedRankAndALostPeerKeepTheirKinds"))),
)

# A subset for CI, one per integrity layer that compiles fastest (file_checksums.cpp and step_files.cpp have no
# torch headers).
CI_SUBSET = ("prefetch-group-loop", "normal-load-chunk-loop", "manifest-commit-result")


class Refused(Exception):
    """The check cannot give a verdict (stale build, missing snippet, failed compile, failed baseline)."""


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


class Build:
    """The build directory's library: how ninja compiles each of its sources and links it."""

    def __init__(self, build_dir: str):
        self.dir = os.path.abspath(build_dir)
        if not os.path.exists(os.path.join(self.dir, "build.ninja")):
            raise Refused(f"--build-dir {build_dir}: no build.ninja there (run `make build` first)")
        libs = sorted(glob.glob(os.path.join(self.dir, "src", "libettkit.so.*.*.*")))
        if not libs:
            raise Refused(f"--build-dir {build_dir}: no src/libettkit.so.X.Y.Z (run `make build` first)")
        self.lib_target = os.path.relpath(libs[-1], self.dir)  # src/libettkit.so.0.1.0
        out = run(["ninja", "-C", self.dir, "-t", "commands", self.lib_target])
        if out.returncode != 0:
            raise Refused(f"ninja -t commands {self.lib_target} failed: {out.stderr.strip()}")
        self.compile: dict[str, str] = {}  # absolute source path -> compile command
        self.objects: dict[str, str] = {}  # absolute source path -> object path (relative to the build dir)
        self.link = ""
        for line in out.stdout.splitlines():
            m = re.search(r" -o (\S+\.o) -c (\S+)$", line)
            if m:
                self.compile[m.group(2)] = line
                self.objects[m.group(2)] = m.group(1)
            elif f" -o {self.lib_target} " in line and "-shared" in line:
                self.link = line
        if not self.link:
            raise Refused(f"no link command for {self.lib_target} in ninja's commands")
        m = re.search(r"-Wl,-soname,(\S+)", self.link)
        if not m:
            raise Refused(f"the link command of {self.lib_target} names no soname")
        self.soname = m.group(1)

    def check_up_to_date(self, targets: list[str]) -> None:
        out = run(["ninja", "-C", self.dir, "-n", self.lib_target, *targets])
        if "no work to do" not in out.stdout:
            pending = [ln for ln in out.stdout.splitlines() if re.match(r"\[\d+/\d+\]", ln)]
            raise Refused(
                f"{self.dir} is not up to date with the sources ({len(pending)} step(s) pending, e.g. "
                f"{pending[0] if pending else out.stdout.strip()[:200]}): the relinked library would mix two "
                "source trees. Run `make build` (or ninja -C on the build directory) first.")

    def test_binary(self, name: str) -> str:
        path = os.path.join(self.dir, "tests", "cpp", name)
        if not os.access(path, os.X_OK):
            raise Refused(f"test binary {path} is missing (is ETTKIT_BUILD_TESTS on in this build?)")
        return path


class Scratch:
    """The scratch directory: mutated sources, their objects and the relinked library."""

    def __init__(self, path: str, build: Build):
        self.dir = os.path.abspath(path)
        self.build = build
        self.lib_dir = os.path.join(self.dir, "lib")
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.lib_dir)
        self.site_dir = self._package()

    def _package(self) -> str:
        """site/ettkit: the in-tree Python sources (links) with the build's extension module, the package the
        pytest tests import (first on PYTHONPATH). The tree itself has no extension in a clean clone (the
        build installs it into the venv, whose copy links its own libettkit, not the scratch one)."""
        modules = glob.glob(os.path.join(self.build.dir, "python", "csrc", "_C*.so"))
        if len(modules) != 1:
            raise Refused(f"expected one extension module in {self.build.dir}/python/csrc, found {modules}")
        pkg = os.path.join(self.dir, "site", "ettkit")
        os.makedirs(pkg)
        src = os.path.join(ROOT, "python", "ettkit")
        for name in os.listdir(src):
            if not name.startswith("_C.") and name != "__pycache__":
                os.symlink(os.path.join(src, name), os.path.join(pkg, name))
        os.symlink(modules[0], os.path.join(pkg, os.path.basename(modules[0])))
        return os.path.dirname(pkg)

    def compile(self, rel: str, text: str) -> str:
        """Compiles `text` as the source `rel` with the build's command; returns the object's path."""
        src_abs = os.path.join(ROOT, rel)
        cmd = self.build.compile.get(src_abs)
        if cmd is None:
            raise Refused(f"{rel} is not a source of {self.build.lib_target} (ninja compiles no such file for it)")
        copy = os.path.join(self.dir, "src", rel)
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        with open(copy, "w") as f:
            f.write(text)
        obj = os.path.join(self.dir, "obj", rel + ".o")
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        cmd = cmd.replace(f" -o {self.build.objects[src_abs]} -c {src_abs}", f" -o {obj} -c {copy}")
        # The dependency file goes to the scratch directory, not beside the build's object; quoted includes
        # of the original directory stay found (the copy's directory holds only the copy).
        cmd = re.sub(r" -MF \S+", f" -MF {obj}.d", cmd)
        cmd = cmd.replace(" -c ", f" -iquote {os.path.dirname(src_abs)} -c ", 1)
        out = run(["bash", "-c", cmd], cwd=self.build.dir)
        if out.returncode != 0:
            raise Refused(f"compiling the mutated {rel} failed:\n{out.stderr[-3000:]}")
        return obj

    def link(self, replace: dict[str, str]) -> None:
        """Relinks the library into lib/, with the objects of `replace` (source -> object) swapped in."""
        cmd = self.build.link
        out_path = os.path.join(self.lib_dir, os.path.basename(self.build.lib_target))
        cmd = cmd.replace(f" -o {self.build.lib_target} ", f" -o {out_path} ")
        for src_abs, obj in replace.items():
            old = f" {self.build.objects[src_abs]} "
            if old not in cmd:
                raise Refused(f"the link command does not name {self.build.objects[src_abs]}")
            cmd = cmd.replace(old, f" {obj} ")
        # ninja's form ": && g++ ... && :" runs as is in bash.
        out = run(["bash", "-c", cmd], cwd=self.build.dir)
        if out.returncode != 0:
            raise Refused(f"relinking {self.build.lib_target} failed:\n{out.stderr[-3000:]}")
        soname = os.path.join(self.lib_dir, self.build.soname)
        if os.path.lexists(soname):
            os.remove(soname)
        os.symlink(os.path.basename(out_path), soname)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = self.lib_dir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env["PYTHONPATH"] = self.site_dir + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env


def run_test(t: Test, build: Build, scratch: Scratch, timeout_s: float) -> tuple[bool, float, str]:
    """Runs one test against the scratch library. Returns (passed, seconds, the tail of its output)."""
    if t.gtest:
        cmd = [build.test_binary(t.gtest), f"--gtest_filter={t.filter}"]
    else:
        cmd = [sys.executable, "-m", "pytest", t.pytest, "-q", "-p", "no:cacheprovider", "-x"]
    t0 = time.monotonic()
    try:
        out = run(cmd, cwd=ROOT, env=scratch.env(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False, time.monotonic() - t0, f"killed after {timeout_s} s"
    text = out.stdout + out.stderr
    if t.gtest and "Running 0 tests" in text:
        raise Refused(f"{t.label()} selects no test: fix the filter")
    return out.returncode == 0, time.monotonic() - t0, text[-1500:]


def resolves_to_scratch(binary: str, scratch: Scratch) -> bool:
    out = run(["ldd", binary], env=scratch.env())
    return any("libettkit" in ln and scratch.lib_dir in ln for ln in out.stdout.splitlines())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build", "py"),
                    help="a complete build with the C++ tests (default: build/py, what `make build` makes)")
    ap.add_argument("--scratch", default=os.path.join(ROOT, "build", "mutation"),
                    help="where the mutated copies, their objects and the relinked library go (emptied first)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="run these mutations only (--list names them)")
    ap.add_argument("--ci", action="store_true", help=f"run the CI subset only: {', '.join(CI_SUBSET)}")
    ap.add_argument("--list", action="store_true", help="print the table and exit")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds per test run (a mutation may hang a test; killed counts as failed)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    if args.list:
        for m in MUTATIONS:
            print(f"{m.name}  ({m.path})\n    {m.why}\n    - {m.original}\n    + {m.replacement}")
            for t in m.tests:
                print(f"    must fail: {t.label()}")
        return 0
    by_name = {m.name: m for m in MUTATIONS}
    names = list(CI_SUBSET) if args.ci else (args.only or [m.name for m in MUTATIONS])
    unknown = [n for n in names if n not in by_name]
    if unknown:
        print(f"mutation_check: unknown mutation(s) {unknown}; valid: {sorted(by_name)}", file=sys.stderr)
        return 2
    chosen = [by_name[n] for n in names]

    t_all = time.monotonic()
    results = []
    try:
        build = Build(args.build_dir)
        binaries = sorted({t.gtest for m in chosen for t in m.tests if t.gtest})
        build.check_up_to_date([os.path.join("tests", "cpp", b) for b in binaries])
        # Every snippet is checked before anything is compiled.
        texts = {}
        for m in chosen:
            path = os.path.join(ROOT, m.path)
            with open(path) as f:
                text = f.read()
            n = text.count(m.original)
            if n != 1:
                raise Refused(f"{m.name}: the snippet occurs {n} times in {m.path} (exactly 1 needed): {m.original!r}")
            texts[m.name] = text.replace(m.original, m.replacement)
        scratch = Scratch(args.scratch, build)

        # Baseline: the unmutated library relinked the same way; every named test must pass against it.
        t0 = time.monotonic()
        scratch.link({})
        for b in binaries:
            if not resolves_to_scratch(build.test_binary(b), scratch):
                raise Refused(f"{b} does not load libettkit from {scratch.lib_dir} under LD_LIBRARY_PATH (RPATH?)")
        seen = []
        for t in (t for m in chosen for t in m.tests):
            if t in seen:
                continue
            seen.append(t)
            ok, secs, tail = run_test(t, build, scratch, args.timeout)
            if not ok:
                raise Refused(f"baseline: {t.label()} fails without any mutation:\n{tail}")
        print(f"baseline: {len(seen)} test run(s) pass against the relinked library ({time.monotonic() - t0:.0f} s)",
              flush=True)

        for m in chosen:
            t0 = time.monotonic()
            obj = scratch.compile(m.path, texts[m.name])
            t_compile = time.monotonic() - t0
            scratch.link({os.path.join(ROOT, m.path): obj})
            t_build = time.monotonic() - t0
            tests = []
            for t in m.tests:
                ok, secs, tail = run_test(t, build, scratch, args.timeout)
                tests.append({"test": t.label(), "failed": not ok, "seconds": round(secs, 1),
                              **({} if not ok else {"output": tail})})
            caught = all(x["failed"] for x in tests)
            r = {"mutation": m.name, "file": m.path, "caught": caught, "compile_s": round(t_compile, 1),
                 "build_s": round(t_build, 1), "total_s": round(time.monotonic() - t0, 1), "tests": tests}
            results.append(r)
            print(f"{'CAUGHT  ' if caught else 'SURVIVED'} {m.name:26s} {r['total_s']:6.0f} s "
                  f"(compile {t_compile:.0f} s, link {t_build - t_compile:.0f} s, tests "
                  f"{sum(x['seconds'] for x in tests):.0f} s)", flush=True)
            for x in tests:
                print(f"    {'failed' if x['failed'] else 'PASSED'}: {x['test']} ({x['seconds']} s)")
                if not x["failed"]:
                    print("      " + x["output"].replace("\n", "\n      "))
    except Refused as e:
        print(f"mutation_check: no verdict: {e}", file=sys.stderr)
        return 1
    total = time.monotonic() - t_all
    survived = [r["mutation"] for r in results if not r["caught"]]
    print(f"mutation_check: {len(results) - len(survived)}/{len(results)} caught in {total:.0f} s"
          + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_s": round(total, 1), "results": results}, f, indent=1)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
