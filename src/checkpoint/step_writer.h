#pragma once
// StepWriter: the one way a rank writes its part of a step, for both tiers (the disk tier's temporary step
// directory and the memory tier's): rank-<r>.safetensors (the safetensors header, then the staged arena as
// its data section), then rank-<r>.extra, and the manifest fields every step carries. What differs between
// the tiers is given, not branched on: the directory, the files' mode, and whether the header records the
// whole-tensor digests a resharding load needs (the disk tier's; memory-tier steps are never resharded).
//
// Ownership: borrows the Session (for the rank, world and options) and the snapshot; one StepWriter per
// save, on the writer thread. It releases the snapshot's arena as soon as the data file is durable.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/session.h"
#include "checkpoint/storage.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace ettkit::checkpoint::detail {

/// The safetensors dtype string of a tensor's dtype, from the one table (ettkit/checkpoint/safetensors_dtypes.h);
/// InvalidArgument naming the state dict entry `key` for a dtype safetensors cannot store.
std::string safetensors_dtype(at::ScalarType t, const std::string& key);

/// The safetensors header of a staged snapshot (offsets relative to the arena, which is the data section).
/// With `arena` (a disk save), it also records the XXH3 of every tensor saved whole (storage.h,
/// kWholeTensorDigestPrefix), hashed from the staged bytes, so that a resharding load can tell a replica
/// from per-rank state; memory-tier steps are never resharded and skip that pass.
std::string header_of(const std::vector<PlanEntry>& plan, const uint8_t* arena);
/// The same with the whole tensors' digests given: `digests[k]` (hex) for entry `whole[k]`.
std::string header_of(const std::vector<PlanEntry>& plan, const std::vector<size_t>& whole,
                      const std::vector<std::string>& digests);
/// The disk tier's header of `plan` as the copies need it (Stager::set_disk_header_planner): its length,
/// which the digests' bytes do not change (16 hex digits each), and the entries saved whole. Throws
/// InvalidArgument for a dtype safetensors cannot store.
DiskHeaderPlan plan_disk_header(const std::vector<PlanEntry>& plan);

/// What the writer does between the files of a step: the writer owns the test hold and the torn verdict.
struct StepHooks {
  std::function<void()> after_data;  // the data file is durable and the arena not yet released
  std::function<void()> verdict;     // every file is durable: throws TornSnapshot to refuse the step
};

class StepWriter {
 public:
  /// `whole_tensor_digests`: the header records them (the disk tier). `snapshot` is staged already.
  StepWriter(const Session& session, int64_t step, Snapshot& snapshot, const std::string& extra,
             bool whole_tensor_digests);

  /// The memory tier's header cache (Writer): `header` is header_of(plan) without digests for this
  /// snapshot's plan, and `padded` holds its padding to an arena's room from an earlier save of the same plan
  /// (or is empty, and is filled here). Both outlive this StepWriter. Why: for 2,001 tensors, encoding the
  /// header took a tenth of a memory save's CPU, and it is the same for every save of one plan.
  void use_cached_header(const std::string& header, std::string& padded);
  /// The bytes this rank's files take (what the memory tier reserves before begin()); with links_arena(),
  /// the arena's header room counts instead of the header.
  uint64_t bytes();
  /// Writes this rank's files into `dir` (a leftover of an earlier failed attempt at the same step goes
  /// first), each created with `mode` and made durable; releases the arena after the data file. Returns
  /// their digests by file name. Throws what the writes and the hooks throw.
  std::map<std::string, FileDigest> write_rank_files(const Dir& dir, unsigned mode, const StepHooks& hooks);
  /// Whether the snapshot's arena is a file of the memory tier (Snapshot::arena_file) with room for this
  /// header and exactly the staged bytes: then link_rank_files() commits it without a copy.
  bool links_arena();
  /// The memory tier without a copy (links_arena()): writes the header into the arena's room, hashes the
  /// whole file once, has `link` make the arena `dir`'s data file (given the file's name), then writes the
  /// extra and runs the hooks as write_rank_files() does. Returns the files' digests. The arena stays held:
  /// the caller publishes it (Snapshot::publish) once the step is committed, not before (until then the
  /// step it would let the stager reclaim is the newest committed one).
  std::map<std::string, FileDigest> link_rank_files(const Dir& dir, unsigned mode, const StepHooks& hooks,
                                                    const std::function<void(const std::string&)>& link);
  /// Removes this rank's files from `dir` (a failed or refused attempt: they may hold mixed bytes). Quiet.
  void remove_rank_files(const Dir& dir) noexcept;
  /// The manifest fields every step carries (step, world size, creation time now, the options' metadata,
  /// torch version); the caller adds the files and its tier's fields.
  Manifest manifest() const;

 private:
  const std::string& header();
  /// The disk tier with the copies' digests (Stager::stage with kDiskTier): makes the header from the
  /// whole tensors' digests and the data file's digest from the chunks; false (nothing done) when there
  /// are none or the header is not the length they were planned with.
  bool use_fused_digests();
  /// The part both ways of writing share: rank-<r>.extra into `dir`, then the verdict hook.
  void write_extra(const Dir& dir, unsigned mode, const StepHooks& hooks, std::map<std::string, FileDigest>& files);

  const Session& session_;
  int64_t step_;
  Snapshot& snapshot_;
  const std::string& extra_;
  bool whole_tensor_digests_;
  std::string base_;  // "rank-<r>"
  std::string header_;
  bool header_made_ = false;
  const std::string* cached_header_ = nullptr;  // use_cached_header()
  std::string* cached_padded_ = nullptr;
  FileDigest fused_file_;  // use_fused_digests()
};

}  // namespace ettkit::checkpoint::detail
