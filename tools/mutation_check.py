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
    relinked there from the build's other objects plus that one. A test binary that compiles the mutated
    source itself (INTERNAL sources in tests/cpp/CMakeLists.txt, e.g. report_passes_test's report_timeline.cpp)
    never sees the library's copy: that source is compiled again with the binary's own command and the
    binary relinked into the scratch directory too. The build directory is only read.
  * A mutation of a Python file of the package (python/ettkit/...py) needs no compile: the package the tests
    import (below) holds the mutated copy instead of its link to the tree's file, for that mutation only.
  * The tests run unchanged, the build's gtest binaries and the in-tree Python sources with the build's
    extension module (linked together under the scratch directory's site/), with LD_LIBRARY_PATH naming
    the scratch library: the binaries and the extension find libettkit through
    RUNPATH, which LD_LIBRARY_PATH precedes. A baseline first relinks the unmutated library (and the binaries
    that compile a mutated source themselves) the same way and runs every named test against them: each must
    pass, and the binaries must resolve libettkit to the scratch copy, or no verdict is given (a "caught"
    that the harness itself caused would mean nothing).
  * The build must be up to date with the sources, or the relinked library would mix objects of two source
    trees, and the check refuses to run. It asks the ninja that made the build (CMakeCache.txt's
    CMAKE_MAKE_PROGRAM: another version reads its log as foreign and calls every object's command line
    changed); where ninja's only reason is a changed command line, each such object is compared with the
    files it was compiled from (`ninja -t deps`) instead: newer than every one of them is up to date.

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
    # Relative to the repository root: a C++ source of libettkit.so or of a named test binary (src/...cpp), or
    # a file of the Python package (python/ettkit/...py).
    path: str
    original: str  # must occur exactly once in the file
    replacement: str
    why: str  # the bug it stands for
    tests: tuple[Test, ...]

    @property
    def python(self) -> bool:
        return self.path.endswith(".py")


MANY = "checkpoint_integrity_many_chunks_test"
ARENA = "checkpoint_memory_tier_arena_test"
ARENA_SEC = "checkpoint_memory_tier_arena_security_test"
PREPARE = "tests/python/test_checkpoint_prepare.py::"
FUSED = "checkpoint_fused_digest_test"
BOUND = "tests/python/test_checkpoint_bound_save.py::"
BOUND_CPP = "checkpoint_bound_save_test"

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
        "ETTKIT_EXPECTS(whole_shape == *global_shape,",
        "ETTKIT_EXPECTS(true || whole_shape == *global_shape,",
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
        "arena-reclaim-newest", "src/checkpoint/host_arena.cpp",
        "return oldest == newest ? -1 : oldest;",
        "return oldest;",
        "a save beside a persisting one reclaims the newest memory step: a crash then leaves no memory step",
        (Test(ARENA, "MemoryTierArena.AHeldSaveStagesIntoTheOlderArenaAndTheNewestStepStays"),)),
    Mutation(
        "arena-spare-unused", "src/checkpoint/stager.cpp",
        "if (spare.fd >= 0 && spare.size == a.size && spare.reserve == a.reserve) {",
        "if (false && spare.fd >= 0 && spare.size == a.size && spare.reserve == a.reserve) {",
        "a reclaimed arena that another link keeps is replaced inside the save by a new file, which the save's "
        "copies fault in, although one was backed after the commit before (#65)",
        (Test(ARENA, "MemoryTierArena.AnArenaAStepStillLinksIsReplacedByOneBackedAfterTheCommitNotInTheSave"),)),
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
        "fused-digest-reuse-not-reset", "src/checkpoint/in_order_digest.cpp",
        "  if (!fresh_) {",
        "  if (false) {",
        "the arena's whole-tensor digest, reused save after save (#65), keeps what a save that never finished "
        "hashed and left pending: the next save's digests are of mixed bytes and its step fails verification",
        (Test(FUSED, "InOrderDigest.AReusedDigestHashesEachPassAloneWhetherTheOneBeforeWasFinishedOrNot"),)),
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
    Mutation(
        "memory-tier-mode-exact", "src/checkpoint/memory_tier.cpp",
        "if (st.st_uid != ::geteuid() || (st.st_mode & 07777) != MemoryTier::kDirectoryMode) {",
        "if (st.st_uid != ::geteuid() || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {",
        "the memory tier takes an existing directory of this uid that is not group- or world-writable (0755, "
        "0750): others read every snapshot written into it (#68)",
        (Test("checkpoint_memory_tier_security_test",
              "MemoryTierSecurity.AnOwnDirectoryOthersMayReadOrEnterIsRefusedAndItsModeKept"),)),
    Mutation(
        "fused-digest-unreported-tail", "src/checkpoint/in_order_digest.cpp",
        "if (from < s.end) s.stream().update(",
        "if (from < s.end && !s.pending.empty()) s.stream().update(",
        "the in-order digest's finish hashes the rest of a chunk only when a piece waits in it: a tail nobody "
        "reported after a prefix hashed at once is left out of the chunk's checksum (#68)",
        (Test(FUSED, "InOrderDigest.AnUnreportedTailWithNothingPendingIsHashedByFinish"),)),
    Mutation(
        "share-mac-kind", "python/ettkit/startup/cache_seal.py",
        'head = context + b"\\0" + share_key.encode() + b"\\0" + kind',
        'head = context + b"\\0" + share_key.encode() + b"\\0"',
        "the compile-share HMAC leaves out the payload's kind: whoever writes the Store turns rank 0's file "
        "into a fallback reason (or a reason into a file) under a valid MAC (#68)",
        (Test(pytest="tests/python/test_compile_cache_mac.py::test_a_genuine_payload_with_its_kind_flipped_does_not_unseal"),
         Test(pytest="tests/python/test_compile_cache_mac.py::"
                     "test_rank_0s_file_with_its_kind_flipped_in_the_store_is_refused_not_read_as_a_fallback"),
         Test(pytest="tests/python/test_compile_cache_mac.py::"
                     "test_rank_0s_fallback_with_its_kind_flipped_is_refused_not_written_as_a_file"))),
    Mutation(
        "share-mac-context", "python/ettkit/startup/cache_seal.py",
        'head = context + b"\\0" + share_key.encode() + b"\\0" + kind',
        'head = share_key.encode() + b"\\0" + kind',
        "the HMAC leaves out its context: a payload sealed for a job's Store passes for a shared-cache file "
        "under the same secret and key, and the reverse (#68)",
        (Test(pytest="tests/python/test_compile_cache_mac.py::"
                     "test_a_payload_sealed_in_one_context_does_not_unseal_in_the_other_under_the_same_secret_and_key"),
         Test(pytest="tests/python/test_compile_cache_mac.py::"
                     "test_a_store_payload_planted_in_the_shared_cache_is_untrusted_under_the_same_secret"),
         Test(pytest="tests/python/test_compile_cache_mac.py::"
                     "test_a_shared_cache_file_offered_through_the_store_is_untrusted_under_the_same_secret"))),
    Mutation(
        "extra-int-list-count", "python/ettkit/checkpoint/_skeleton_codec.py",
        "self.nodes += n\n            return list(struct.unpack_from(",
        "return list(struct.unpack_from(",
        "the .extra decoder stops counting packed int lists toward its value limit: a record of many lists, "
        "each under it, is built whole (#68)",
        (Test(pytest="tests/python/test_extra_value_count.py::test_values_spread_over_int_lists_count_toward_the_limit"),)),
    Mutation(
        "failure-cause-rule", "src/ett/report_timeline.cpp",
        "last_alive(*other->ledger) + kPeerClockSkewUs < last_alive(*outside->ledger);",
        "last_alive(*other->ledger) + kPeerClockSkewUs > last_alive(*outside->ledger);",
        "the failure category's rule read the wrong way round: a kill names a peer's later exception, an "
        "exception raised while the dead rank lived names the kill (report_passes_test compiles this file "
        "itself: the harness relinks it)",
        (Test("report_passes_test", "ReportPasses.CollectAttemptsNamesTheFirstRankToStopAsTheFailure"),
         Test("report_passes_test", "ReportPasses.CollectAttemptsNamesAKilledRankOverAPeersLaterException"))),
    Mutation(
        "memory-tier-root-group-writable", "src/checkpoint/memory_tier.cpp",
        "ETTKIT_CHECK((st.st_mode & (S_IWGRP | S_IWOTH)) == 0 || (st.st_mode & S_ISVTX) != 0, InvalidArgument,",
        "ETTKIT_CHECK((st.st_mode & S_IWOTH) == 0 || (st.st_mode & S_ISVTX) != 0, InvalidArgument,",
        "the memory tier's root check looks at the world's write bit only: a root the group may write, not "
        "sticky, lets any member rename the tier away and plant another (#68 audit)",
        (Test("checkpoint_memory_tier_security_test",
              "MemoryTierSecurity.ARootItsGroupCanWriteWithoutTheStickyBitIsRefused"),)),
    Mutation(
        "extra-listed-int-count", "python/ettkit/checkpoint/_skeleton_codec.py",
        "self.nodes += 1\n                    append(I64.unpack_from(buf, pos + 1)[0])",
        "append(I64.unpack_from(buf, pos + 1)[0])",
        "the .extra decoder's inline path for a list's int items stops counting them (#68 audit)",
        (Test(pytest="tests/python/test_extra_value_count.py::test_values_spread_over_int_lists_count_toward_the_limit"),)),
    Mutation(
        "extra-dict-int-count", "python/ettkit/checkpoint/_skeleton_codec.py",
        "self.nodes += 1\n                    out[k] = I64.unpack_from(buf, pos + 1)[0]",
        "out[k] = I64.unpack_from(buf, pos + 1)[0]",
        "the .extra decoder's inline path for a dict's int values stops counting them (#68 audit)",
        (Test(pytest="tests/python/test_extra_value_count.py::test_values_spread_over_int_lists_count_toward_the_limit"),)),
    Mutation(
        "extra-dict-room", "python/ettkit/checkpoint/_skeleton_codec.py",
        'n = self.length("dict\'s count", 2)\n        self.room(2 * n)',
        'n = self.length("dict\'s count", 2)\n        self.room(n)',
        "the .extra decoder reserves one value per dict entry instead of two (key and value): a dict of more "
        "than half the limit's entries is built whole, over the limit (#68 audit)",
        (Test(pytest="tests/python/test_extra_value_count.py::"
                     "test_a_dict_whose_keys_and_values_are_over_the_limit_is_refused_at_its_count"),)),
    Mutation(
        "extra-key-set-room", "python/ettkit/checkpoint/_skeleton_codec.py",
        'n = self.length("key count", 5)\n        self.room(2 * n)',
        'n = self.length("key count", 5)\n        self.room(n)',
        "the same for a key set (tag K): its keys are built, over the limit, before they are counted (#68 audit)",
        (Test(pytest="tests/python/test_extra_value_count.py::"
                     "test_a_dict_whose_keys_and_values_are_over_the_limit_is_refused_at_its_count"),)),
    Mutation(
        "stale-tier-own-job", "src/checkpoint/memory_tier.cpp",
        "if (kind == TierName::kCurrent && other == job_id) continue;",
        "if (kind == TierName::kLegacy && other == job_id) continue;",
        "the stale-tier sweep spares the job's own tier only under its legacy name: a restart whose ranks' "
        "locks are free loses its memory snapshots (#68 audit)",
        (Test("checkpoint_memory_tier_test", "MemoryTier.TheJobsOwnTierIsNeverRemovedAsStaleEvenWithItsLocksFree"),)),
    Mutation(
        "untrusted-escapes-del", "src/checkpoint/identifiers.cpp",
        "if (c < 0x20 || c == 0x7f || c == '\\\\' || c == '\\'') {",
        "if (c < 0x20 || c == '\\\\' || c == '\\'') {",
        "a refused value is quoted with DEL unescaped (#68 audit)",
        (Test("checkpoint_path_safety_test",
              "PathSafety.AnUntrustedValueIsShownWithQuotesBackslashesAndControlBytesEscaped"),)),
    Mutation(
        "untrusted-escapes-quote", "src/checkpoint/identifiers.cpp",
        "if (c < 0x20 || c == 0x7f || c == '\\\\' || c == '\\'') {",
        "if (c < 0x20 || c == 0x7f) {",
        "a refused value is quoted with its quotes and backslashes as they are: it can close the quote and "
        "append a verdict of its own to the message (#68 audit)",
        (Test("checkpoint_path_safety_test",
              "PathSafety.AnUntrustedValueIsShownWithQuotesBackslashesAndControlBytesEscaped"),)),
    Mutation(
        "fused-digest-sync-copy-reported-first", "src/checkpoint/copy_engine.cpp",
        "copy_now(t, e, dst);\n      state.verdict[i] = kClean;  // copied before save() returns: nothing could overlap it\n"
        "      if (state.hashes()) state.report(dst, static_cast<size_t>(e.nbytes), /*hash_now=*/false);",
        "if (state.hashes()) state.report(dst, static_cast<size_t>(e.nbytes), /*hash_now=*/true);\n"
        "      copy_now(t, e, dst);\n      state.verdict[i] = kClean;",
        "a tensor copied on the caller's thread is reported (and hashed at once) before its copy: the disk tier's "
        "whole-tensor digest is of the arena's previous bytes (#68 audit)",
        (Test(FUSED, "FusedDigestStager.TensorsCopiedOnTheCallersThreadAreHashedAsCopiedEveryRound"),)),
    # The load's sharded check skips its walk only when neither side holds a sharded tensor (#64).
    Mutation(
        "sharded-check-skips-one-sided", "python/ettkit/checkpoint/_restore.py",
        "if not live_slots and not saved_slots:",
        "if not live_slots or not saved_slots:",
        "the sharded check is skipped when only one side holds sharded tensors: a table the state lost, or one "
        "the checkpoint lacks, is loaded without the refusal that names it",
        (Test(pytest="tests/python/test_checkpoint_layout_rules.py::"
                     "test_a_sharded_tensor_is_checked_when_only_one_side_holds_any_and_a_state_without_any_passes"),
         Test(pytest="tests/python/test_checkpoint_layout_rules.py::"
                     "test_a_layout_alone_is_not_a_mismatch_but_a_size_or_dtype_is"))),
    # The bound save (#65): each check that keeps a stale binding from saving the wrong tensors or skeleton.
    Mutation(
        "bound-entry-identity", "python/ettkit/checkpoint/_state_binding.py",
        "checked.append(type(child) is not Hole)\n            out[k] = child",
        "checked.append(False)\n            out[k] = child",
        "a bound dict's values are not compared: a tensor replaced in the state is saved as the old one",
        (Test(pytest=BOUND + "test_a_plain_state_changed_between_saves_is_saved_as_a_walk_would[tensor_replaced]"),
         Test(pytest=BOUND + "test_a_plain_state_changed_between_saves_is_saved_as_a_walk_would"
                             "[value_where_a_tensor_was]"))),
    Mutation(
        "bound-island-grew-tensors", "python/ettkit/checkpoint/_state_binding.py",
        "if walk.names:  # a tensor where there was none",
        "if False:  # a tensor where there was none",
        "a tensor-free part of a bound state that now holds a tensor is encoded as a placeholder of no tensor",
        (Test(pytest=BOUND + "test_a_plain_state_changed_between_saves_is_saved_as_a_walk_would"
                             "[tensor_where_a_value_was]"),)),
    Mutation(
        "bound-module-persistent-set", "python/ettkit/checkpoint/_state_binding.py",
        "self.guard.set(tables[3], list(tables[3]))",
        "pass",
        "a module's non-persistent buffer names are not pinned: a buffer made persistent is left out of saves",
        (Test(pytest=BOUND + "test_a_module_and_optimizer_changed_between_saves_are_saved_as_a_walk_would"
                             "[buffer_made_persistent]"),)),
    Mutation(
        "bound-module-hooks", "python/ettkit/checkpoint/_state_binding.py",
        "for hooks in tables[4:]:",
        "for hooks in tables[6:]:",
        "a module's state-dict hook tables are not pinned: a hook registered after the state was bound is never run",
        (Test(pytest=BOUND + "test_a_state_dict_hook_registered_later_unbinds_the_state_for_good[module_hook]"),)),
    Mutation(
        "bound-optimizer-params", "python/ettkit/checkpoint/_state_binding.py",
        "self.guard.sequence(params, list(params), [True] * len(params))",
        "pass",
        "an optimizer group's parameter list is not pinned: its packed parameter numbers go stale",
        (Test(pytest=BOUND + "test_a_module_and_optimizer_changed_between_saves_are_saved_as_a_walk_would"
                             "[params_list_edited]"),)),
    Mutation(
        "skeleton-reuse-ignores-order", "python/ettkit/checkpoint/__init__.py",
        "self._skeleton_comparable and names == self._names and skeleton == self._skeleton",
        "self._skeleton_comparable and skeleton == self._skeleton",
        "keys reordered around tensors keep the previous skeleton's order (dict == ignores order)",
        (Test(pytest=BOUND + "test_a_plain_state_changed_between_saves_is_saved_as_a_walk_would[keys_reordered]"),)),
    # The C++ side of the bound save (#65, SaveBinding): a names token spares the name compares, a held list
    # the per-tensor references.
    Mutation(
        "bound-names-token-any", "src/checkpoint/stager_save.cpp",
        "const bool names_known = binding.names_token != 0 && binding.names_token == plan_token;",
        "const bool names_known = binding.names_token != 0;",
        "any names token skips the name compares: a list of other names (same count, dtypes, shapes) is saved "
        "under the plan's old names",
        (Test("checkpoint_save_repeat_test", "SaveBinding.NewNamesUnderANewTokenAreSavedUnderTheNewNames"),)),
    Mutation(
        "bound-names-token-kept-on-replan", "src/checkpoint/stager.cpp",
        "plan_names_token = names_token;  // the plan's names are this list's",
        "(void)names_token;",
        "a replan for another list keeps the previous list's token: that list's next save skips the name "
        "compares against a plan of other names",
        (Test("checkpoint_save_repeat_test", "SaveBinding.ATokenIsForgottenOnceAnotherListIsPlanned"),)),
    Mutation(
        "bound-held-list-not-kept", "src/checkpoint/stager_save.cpp",
        "      state->held = held;",
        "      (void)held;",
        "a bound save holds neither its list nor its tensors: a strided copy reads a source nobody keeps alive",
        (Test("checkpoint_save_repeat_test",
              "SaveBinding.AHeldListIsKeptUntilItsCopiesAreDoneAndAConjViewIsSavedResolved"),)),
    Mutation(
        "undecided-versions-not-kept", "src/checkpoint/snapshot.cpp",
        "    st.keep_undecided_versions();",
        "    (void)st;",
        "save() holds no reference to the version counters (#65): sources dropped on another thread than the "
        "save's leave the later verdicts reading counters through tensors nobody holds",
        (Test("checkpoint_stager_test",
              "StagerVersions.EntriesLeftUndecidedByADropOnAnotherThreadAreJudgedByTheirCountersLater"),)),
    Mutation(
        "read-storages-not-held", "src/checkpoint/copy_engine.cpp",
        "      state.read_storages.push_back(t.storage());",
        "      (void)0;",
        "the pool's jobs read a storage nobody holds: `p.data = x` right after save() frees it under the copy",
        (Test("checkpoint_save_repeat_test", "SaveRepeat.AStorageSwappedRightAfterSaveReturnsIsReadAsItWasAtSave"),)),
    # The memory tier's arena files, the spare the writer thread makes included, and its locks (#65's audit).
    Mutation(
        "memory-tier-arena-exclusive", "src/checkpoint/memory_tier_arenas.cpp",
        "O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC",
        "O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC",
        "an arena (the spare too) opens whatever is at its name: a stale file is sized and written over, a "
        "planted link fails the arena instead of another name being taken",
        (Test(ARENA_SEC, "MemoryTierArenaSecurity.TakenArenaNamesAreNeverOpenedAndTheArenaTakesAFreshOne"),
         Test(ARENA_SEC, "MemoryTierArenaSecurity.TheSpareArenaPassesOverPlantedEntriesAndTheSavesStayExact"))),
    Mutation(
        "memory-tier-arena-follows-links", "src/checkpoint/memory_tier_arenas.cpp",
        "O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC",
        "O_RDWR | O_CREAT | O_CLOEXEC",
        "an arena is opened through a link planted at its name: the link's target is truncated to the arena's "
        "size and the save's bytes written into it",
        (Test(ARENA_SEC, "MemoryTierArenaSecurity.TakenArenaNamesAreNeverOpenedAndTheArenaTakesAFreshOne"),)),
    Mutation(
        "directory-lock-one-link", "src/checkpoint/directory_lock.cpp",
        "if (st.st_nlink != 1) {",
        "if (false) {",
        "a lock file that is a hard link is emptied and written with the holder's record: the file it shares "
        "its inode with is overwritten",
        (Test(ARENA_SEC, "MemoryTierArenaSecurity.ALockThatIsAHardLinkIsRefusedAndItsOtherFileKept"),)),
    Mutation(
        "memory-tier-lock-probe-nonblock", "src/checkpoint/memory_tier_entries.cpp",
        'const int fd = ::openat(dir.fd(), ".lock", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);',
        'const int fd = ::openat(dir.fd(), ".lock", O_RDONLY | O_NOFOLLOW | O_CLOEXEC);',
        "the stale-tier sweep probes a lock without O_NONBLOCK: a FIFO planted as a stale tier's lock blocks "
        "every start of the job",
        (Test(ARENA_SEC, "MemoryTierArenaSecurity.AFifoAsAStaleTiersLockOrOwnerRecordDoesNotBlockTheStart"),)),
    Mutation(
        "arena-populate-skipped", "src/checkpoint/host_arena.cpp",
        "if (!ptr || populated) return;",
        "if (!ptr || populated || size > 0) return;",
        "prepare() and the spare's backing leave the arena's pages to the first save's copies (the page faults "
        "they were meant to take off that save)",
        (Test(ARENA, "MemoryTierArena.AnArenaAStepStillLinksIsReplacedByOneBackedAfterTheCommitNotInTheSave"),
         Test(ARENA, "MemoryTierArena.PrepareBacksBothTierArenasBeforeTheFirstSave"),
         Test(pytest=PREPARE + "test_the_first_save_after_prepare_uses_the_arena_prepare_backed"),
         Test(pytest=PREPARE + "test_the_memory_tiers_second_arena_is_backed_by_prepare_too"))),
    # The replica rule and the pieces of a step (#64, step_pieces.h: the one function the resharding load, the
    # DCP reader and export read a step through).
    Mutation(
        "step-pieces-replicas-kept", "src/checkpoint/step_pieces.cpp",
        "  auto [it, fresh] = c.at[key].emplace(piece.offsets, t.pieces.size());",
        "  auto [it, fresh] = std::make_pair(c.at[key].end(), true);",
        "every copy of a replicated box is kept: a step of a mesh with a replicated dimension reads as pieces "
        "that overlap (refused), and a replica of another size passes",
        (Test("checkpoint_step_pieces_test",
              "StepPieces.AReplicatedBoxIsReadOnceFromTheLowestRankAndPiecesTileTheTensor"),
         Test(pytest="tests/python/test_step_pieces_rule.py::"
                     "test_both_readers_read_the_boxes_and_copies_the_bound_rule_chose"))),
    Mutation(
        "step-pieces-overlap-unchecked", "src/checkpoint/step_pieces.cpp",
        "  if (t.shape.empty()) return;",
        "  return;",
        "boxes that hold as many elements as the tensor are taken as its tiling: two that overlap leave a hole "
        "nobody reads",
        (Test("checkpoint_step_pieces_test", "StepPieces.OverlappingBoxesAreRefusedNamingBoth"),)),
    Mutation(
        "step-pieces-whole-differs-ignored", "src/checkpoint/step_pieces.cpp",
        "  if (!same && !t.differs) t.differs.emplace(first.rank, piece.rank);",
        "  (void)same;",
        "copies of a tensor saved whole that differ are taken as replicas: per-rank state is replaced by old rank "
        "0's at another world size",
        (Test("checkpoint_step_pieces_test",
              "StepPieces.AWholeTensorIsTheLowestRanksCopyAndDigestsSayWhetherItIsAReplica"),
         Test("reshard_test", "Reshard.PerRankStateSavedWholeIsRefusedNotReplacedByOldRankZerosCopy"))),
    # The bound save's fast path (#65, bound_entries.h): each compare of its one pass, and the path itself.
    Mutation(
        "bound-storage-data-unchecked", "src/checkpoint/bound_entries.cpp",
        "if (si != e.storage || si->data() != e.data || si->nbytes() != e.storage_nbytes) return false;",
        "if (si != e.storage) return false;",
        "an untyped storage resize_ moves a tensor's bytes under the same StorageImpl: the fast path copies "
        "from the freed old bytes",
        (Test(BOUND_CPP, "BoundSave.AnUntypedStorageResizeThatMovesTheBytesIsSeen"),)),
    Mutation(
        "bound-strides-unchecked", "src/checkpoint/bound_entries.cpp",
        "std::memcmp(ti->strides().data(), d + e.ndim, bytes) != 0)) {",
        "false)) {",
        "as_strided_ to a same-shape transposed view goes through the cache: the storage's bytes are staged "
        "in their old order",
        (Test(BOUND_CPP, "BoundSave.AsStridedToATransposedSameShapeViewIsSeen"),)),
    Mutation(
        "bound-keys-unchecked", "src/checkpoint/bound_entries.cpp",
        "if (ti->key_set().raw_repr() != e.keys) return false;",
        "(void)e.keys;",
        "a tensor that became a negative-bit (or conjugate) view keeps the fast path: its storage's bytes are "
        "saved instead of the values it shows",
        (Test(BOUND_CPP, "BoundSave.ANegativeBitViewIsSeenAndSavedResolved"),)),
    Mutation(
        "bound-fast-path-never", "src/checkpoint/stager_save.cpp",
        "return detail::bound_matches(*cache, tensors, versions) ? cache : nullptr;",
        "return nullptr;",
        "the fast path is never taken: every bound save silently pays the full path",
        (Test(BOUND_CPP, "BoundSave.RepeatSavesTakeTheFastPathAndStageTheValuesAtSaveTime"),
         Test(BOUND_CPP, "BoundSave.AWriteRightAfterAFastSaveReturnsIsRefusedAsTorn"))),
)

# A subset for CI, one per integrity layer that compiles fastest (file_checksums.cpp, step_files.cpp and
# in_order_digest.cpp have no torch headers): the load's chunk checks, the commit vote, the fused digest and
# a trust check of the memory tier (#68: at least one digest and one security mutation; 2 and 10 s more).
CI_SUBSET = ("prefetch-group-loop", "normal-load-chunk-loop", "manifest-commit-result",
             "fused-digest-unreported-tail", "memory-tier-mode-exact")


class Refused(Exception):
    """The check cannot give a verdict (stale build, missing snippet, failed compile, failed baseline)."""


def run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


class Build:
    """The build directory's library and test binaries: how ninja compiles each of their sources and links them."""

    def __init__(self, build_dir: str):
        self.dir = os.path.abspath(build_dir)
        if not os.path.exists(os.path.join(self.dir, "build.ninja")):
            raise Refused(f"--build-dir {build_dir}: no build.ninja there (run `make build` first)")
        libs = sorted(glob.glob(os.path.join(self.dir, "src", "libettkit.so.*.*.*")))
        if not libs:
            raise Refused(f"--build-dir {build_dir}: no src/libettkit.so.X.Y.Z (run `make build` first)")
        self.ninja = self._ninja()
        self.lib_target = os.path.relpath(libs[-1], self.dir)  # src/libettkit.so.0.1.0
        self.lib = self._target(self.lib_target, "")
        if "-shared" not in self.lib.link:
            raise Refused(f"no link command for {self.lib_target} in ninja's commands")
        m = re.search(r"-Wl,-soname,(\S+)", self.lib.link)
        if not m:
            raise Refused(f"the link command of {self.lib_target} names no soname")
        self.soname = m.group(1)
        self._binaries: dict[str, Target] = {}

    def _ninja(self) -> str:
        """The ninja that made this build (CMake's CMAKE_MAKE_PROGRAM, e.g. .venv's pip ninja): another version
        reads its log as foreign (its command hashes differ) and would call every object out of date."""
        try:
            with open(os.path.join(self.dir, "CMakeCache.txt")) as f:
                m = re.search(r"^CMAKE_MAKE_PROGRAM:\w+=(.+)$", f.read(), re.M)
        except OSError:
            m = None
        if m and os.access(m.group(1).strip(), os.X_OK):
            return m.group(1).strip()
        return shutil.which("ninja") or "ninja"

    def _target(self, target: str, own_dir: str) -> "Target":
        """`target`'s commands: the compiles of its own objects (those under `own_dir`, every one when empty)
        and its link."""
        out = run([self.ninja, "-C", self.dir, "-t", "commands", target])
        if out.returncode != 0:
            raise Refused(f"ninja -t commands {target} failed: {out.stderr.strip()}")
        t = Target(target)
        for line in out.stdout.splitlines():
            m = re.search(r" -o (\S+\.o) -c (\S+)$", line)
            if m and m.group(1).startswith(own_dir):
                t.compile[m.group(2)] = line
                t.objects[m.group(2)] = m.group(1)
            elif f" -o {target} " in line:
                t.link = line
        if not t.link:
            raise Refused(f"no link command for {target} in ninja's commands")
        return t

    def binary(self, name: str) -> "Target":
        """A test binary's own compiles (tests/cpp/CMakeFiles/<name>.dir: its test file, and the library
        sources it compiles itself, INTERNAL in tests/cpp/CMakeLists.txt) and its link."""
        if name not in self._binaries:
            self._binaries[name] = self._target(f"tests/cpp/{name}", f"tests/cpp/CMakeFiles/{name}.dir/")
        return self._binaries[name]

    def check_up_to_date(self, targets: list[str]) -> str:
        """Refuses a build that is not up to date with the sources for `targets` (and the library). What
        matters is whether an object is older than a file it was compiled from: a "command line changed"
        that ninja gives for every object when its log was written by another ninja version is checked
        against the objects' recorded inputs instead. Returns a note when it had to."""
        out = run([self.ninja, "-C", self.dir, "-n", "-d", "explain", self.lib_target, *targets])
        if "no work to do" in out.stdout:
            return ""
        explained = [ln.split("ninja explain: ", 1)[1] for ln in out.stderr.splitlines() if "ninja explain: " in ln]
        changed = [e[len("command line changed for "):] for e in explained if e.startswith("command line changed for ")]
        other = [e for e in explained if not e.startswith("command line changed for ") and not e.endswith(" is dirty")]
        pending = [ln for ln in out.stdout.splitlines() if re.match(r"\[\d+/\d+\]", ln)]
        if other or not changed:
            raise Refused(
                f"{self.dir} is not up to date with the sources ({len(pending)} step(s) pending, e.g. "
                f"{(other or pending or [out.stdout.strip()[:200]])[0]}): the relinked library would mix two "
                "source trees. Run `make build` (or ninja -C on the build directory) first.")
        stale = self._older_than_inputs([c for c in changed if c.endswith(".o")])
        if stale:
            raise Refused(f"{self.dir} is not up to date with the sources: {stale[0]}. Run `make build` first.")
        return (f"ninja ({self.ninja}) finds {len(changed)} command line(s) changed (a log of another ninja "
                "version?); every object among them is newer than each file it was compiled from")

    def _older_than_inputs(self, objects: list[str]) -> list[str]:
        """The objects among `objects` that are missing, have no recorded inputs, or are older than one."""
        stale = []
        for i in range(0, len(objects), 200):
            out = run([self.ninja, "-C", self.dir, "-t", "deps", *objects[i:i + 200]])
            if out.returncode != 0:
                return [f"ninja -t deps failed: {out.stderr.strip()[:200]}"]
            obj, deps = None, {}
            for line in out.stdout.splitlines():
                if line and not line.startswith(" "):
                    obj = line.split(":", 1)[0]
                    deps[obj] = []
                elif line.strip() and obj:
                    deps[obj].append(line.strip())
            for o in objects[i:i + 200]:
                path = os.path.join(self.dir, o)
                if not os.path.exists(path) or not deps.get(o):
                    stale.append(f"{o} is missing or has no recorded inputs")
                    continue
                t = os.stat(path).st_mtime_ns
                newer = [d for d in deps[o] if not os.path.exists(os.path.join(self.dir, d))
                         or os.stat(os.path.join(self.dir, d)).st_mtime_ns > t]
                if newer:
                    stale.append(f"{o} is older than {newer[0]}")
        return stale

    def test_binary(self, name: str) -> str:
        path = os.path.join(self.dir, "tests", "cpp", name)
        if not os.access(path, os.X_OK):
            raise Refused(f"test binary {path} is missing (is ETTKIT_BUILD_TESTS on in this build?)")
        return path


@dataclasses.dataclass
class Target:
    """One ninja target: its own objects' compile commands (absolute source -> command, and -> object path
    relative to the build directory) and its link command."""

    name: str
    compile: dict = dataclasses.field(default_factory=dict)
    objects: dict = dataclasses.field(default_factory=dict)
    link: str = ""


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

    def compile(self, target: Target, rel: str, text: str, tag: str) -> str:
        """Compiles `text` as the source `rel` with `target`'s command for it (under obj/<tag>/); returns the
        object's path."""
        src_abs = os.path.join(ROOT, rel)
        cmd = target.compile[src_abs]
        copy = os.path.join(self.dir, "src", rel)
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        with open(copy, "w") as f:
            f.write(text)
        obj = os.path.join(self.dir, "obj", tag, rel + ".o")
        os.makedirs(os.path.dirname(obj), exist_ok=True)
        cmd = cmd.replace(f" -o {target.objects[src_abs]} -c {src_abs}", f" -o {obj} -c {copy}")
        # The dependency file goes to the scratch directory, not beside the build's object; quoted includes
        # of the original directory stay found (the copy's directory holds only the copy).
        cmd = re.sub(r" -MF \S+", f" -MF {obj}.d", cmd)
        cmd = cmd.replace(" -c ", f" -iquote {os.path.dirname(src_abs)} -c ", 1)
        out = run(["bash", "-c", cmd], cwd=self.build.dir)
        if out.returncode != 0:
            raise Refused(f"compiling the mutated {rel} for {target.name} failed:\n{out.stderr[-3000:]}")
        return obj

    def _relink(self, target: Target, out_path: str, replace: dict[str, str]) -> None:
        cmd = target.link.replace(f" -o {target.name} ", f" -o {out_path} ")
        for src_abs, obj in replace.items():
            old = f" {target.objects[src_abs]} "
            if old not in cmd:
                raise Refused(f"the link command of {target.name} does not name {target.objects[src_abs]}")
            cmd = cmd.replace(old, f" {obj} ")
        # ninja's form ": && g++ ... && :"; a test binary's adds "&& cd ... && cmake -P ..._discovery.cmake"
        # (gtest_discover_tests runs the build's binary and rewrites its test list in the build directory):
        # only the linker runs.
        linker = [part for part in cmd.split(" && ") if f" -o {out_path} " in f"{part} "]
        if len(linker) != 1:
            raise Refused(f"the link command of {target.name} has {len(linker)} linker steps, not 1: {cmd[:300]}")
        out = run(["bash", "-c", linker[0]], cwd=self.build.dir)
        if out.returncode != 0:
            raise Refused(f"relinking {target.name} failed:\n{out.stderr[-3000:]}")

    def link(self, replace: dict[str, str]) -> None:
        """Relinks the library into lib/, with the objects of `replace` (source -> object) swapped in."""
        out_path = os.path.join(self.lib_dir, os.path.basename(self.build.lib_target))
        self._relink(self.build.lib, out_path, replace)
        soname = os.path.join(self.lib_dir, self.build.soname)
        if os.path.lexists(soname):
            os.remove(soname)
        os.symlink(os.path.basename(out_path), soname)

    def link_binary(self, name: str, replace: dict[str, str], tag: str) -> str:
        """Relinks the test binary `name` into bin/<tag>/ with the objects of `replace` swapped in: a binary
        that compiles a library source itself never sees a relinked library's copy of it."""
        out_path = os.path.join(self.dir, "bin", tag, name)
        os.makedirs(os.path.dirname(out_path), exist_ok=True)
        self._relink(self.build.binary(name), out_path, replace)
        return out_path

    def python_override(self, rel: str, text: str | None) -> None:
        """site/<rel> (rel: python/ettkit/...py) becomes a file holding `text`; with None, a link to the
        tree's file again. The directories on its way become real ones of links, so nothing else changes."""
        parts = os.path.relpath(os.path.join(ROOT, rel), os.path.join(ROOT, "python")).split(os.sep)
        here, src = self.site_dir, os.path.join(ROOT, "python")
        for part in parts[:-1]:
            here, src = os.path.join(here, part), os.path.join(src, part)
            if os.path.islink(here):
                os.remove(here)
                os.makedirs(here)
                for name in os.listdir(src):
                    if name != "__pycache__":
                        os.symlink(os.path.join(src, name), os.path.join(here, name))
        here, src = os.path.join(here, parts[-1]), os.path.join(src, parts[-1])
        if os.path.lexists(here):
            os.remove(here)
        if text is None:
            os.symlink(src, here)
        else:
            with open(here, "w") as f:
                f.write(text)
        shutil.rmtree(os.path.join(os.path.dirname(here), "__pycache__"), ignore_errors=True)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = self.lib_dir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env["PYTHONPATH"] = self.site_dir + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return env


def run_test(t: Test, build: Build, scratch: Scratch, timeout_s: float,
             relinked: dict[str, str] | None = None) -> tuple[bool, float, str]:
    """Runs one test against the scratch library (a gtest binary: its relinked copy where `relinked` names
    one). Returns (passed, seconds, the tail of its output)."""
    if t.gtest:
        binary = (relinked or {}).get(t.gtest) or build.test_binary(t.gtest)
        cmd = [binary, f"--gtest_filter={t.filter}"]
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
        note = build.check_up_to_date([os.path.join("tests", "cpp", b) for b in binaries])
        if note:
            print(f"mutation_check: {note}", flush=True)
        # Every snippet is checked before anything is compiled, and where each mutation goes: a C++ source
        # into the library and into each named test binary that compiles it itself; a Python file into the
        # package the tests import.
        texts, into_lib, into_binaries = {}, {}, {}
        for m in chosen:
            path = os.path.join(ROOT, m.path)
            with open(path) as f:
                text = f.read()
            n = text.count(m.original)
            if n != 1:
                raise Refused(f"{m.name}: the snippet occurs {n} times in {m.path} (exactly 1 needed): {m.original!r}")
            texts[m.name] = text.replace(m.original, m.replacement)
            if m.python:
                if not m.path.startswith("python/ettkit/"):
                    raise Refused(f"{m.name}: {m.path} is not a file of the ettkit package (python/ettkit/)")
                continue
            into_lib[m.name] = path in build.lib.compile
            into_binaries[m.name] = [b for b in sorted({t.gtest for t in m.tests if t.gtest})
                                     if path in build.binary(b).compile]
            if not into_lib[m.name] and not into_binaries[m.name]:
                raise Refused(f"{m.name}: {m.path} is compiled neither into {build.lib_target} nor by a test binary "
                              "it names")
        scratch = Scratch(args.scratch, build)

        # Baseline: the unmutated library, and the binaries that compile a mutated source themselves,
        # relinked the same way; every named test must pass against them.
        t0 = time.monotonic()
        scratch.link({})
        baseline = {b: scratch.link_binary(b, {}, "baseline") for b in sorted({b for v in into_binaries.values() for b in v})}
        for b in binaries:
            binary = baseline.get(b) or build.test_binary(b)
            if not resolves_to_scratch(binary, scratch):
                raise Refused(f"{binary} does not load libettkit from {scratch.lib_dir} under LD_LIBRARY_PATH (RPATH?)")
        seen = []
        for t in (t for m in chosen for t in m.tests):
            if t in seen:
                continue
            seen.append(t)
            ok, secs, tail = run_test(t, build, scratch, args.timeout, baseline)
            if not ok:
                raise Refused(f"baseline: {t.label()} fails without any mutation:\n{tail}")
        print(f"baseline: {len(seen)} test run(s) pass against the relinked library"
              f"{' and ' + ', '.join(baseline) if baseline else ''} ({time.monotonic() - t0:.0f} s)", flush=True)

        lib_mutated = False
        for m in chosen:
            t0 = time.monotonic()
            src_abs = os.path.join(ROOT, m.path)
            relinked = {}
            if m.python:
                if lib_mutated:
                    scratch.link({})
                    lib_mutated = False
                scratch.python_override(m.path, texts[m.name])
                t_compile = 0.0
            else:
                objects = {}
                if into_lib[m.name]:
                    objects[""] = scratch.compile(build.lib, m.path, texts[m.name], m.name)
                for b in into_binaries[m.name]:
                    objects[b] = scratch.compile(build.binary(b), m.path, texts[m.name], f"{m.name}/{b}")
                t_compile = time.monotonic() - t0
                if into_lib[m.name] or lib_mutated:
                    scratch.link({src_abs: objects[""]} if into_lib[m.name] else {})
                    lib_mutated = into_lib[m.name]
                for b in into_binaries[m.name]:
                    relinked[b] = scratch.link_binary(b, {src_abs: objects[b]}, m.name)
            t_build = time.monotonic() - t0
            tests = []
            try:
                for t in m.tests:
                    ok, secs, tail = run_test(t, build, scratch, args.timeout, relinked)
                    # The output's tail either way: a caught mutation's shows what failed (the assertion,
                    # not an import error the harness caused).
                    tests.append({"test": t.label(), "failed": not ok, "seconds": round(secs, 1), "output": tail})
            finally:
                if m.python:
                    scratch.python_override(m.path, None)
            caught = all(x["failed"] for x in tests)
            r = {"mutation": m.name, "file": m.path, "caught": caught, "compile_s": round(t_compile, 1),
                 "build_s": round(t_build, 1), "total_s": round(time.monotonic() - t0, 1), "tests": tests,
                 **({"relinked": sorted(relinked)} if relinked else {})}
            results.append(r)
            print(f"{'CAUGHT  ' if caught else 'SURVIVED'} {m.name:26s} {r['total_s']:6.0f} s "
                  f"(compile {t_compile:.0f} s, link {t_build - t_compile:.0f} s, tests "
                  f"{sum(x['seconds'] for x in tests):.0f} s)"
                  + (f"; relinked {', '.join(sorted(relinked))}" if relinked else ""), flush=True)
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
