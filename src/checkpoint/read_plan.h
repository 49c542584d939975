#pragma once
// One load candidate, planned: a committed step's manifest read and decoded once, its files opened and
// checked, the caller's state matched against it, and the reads that fill the state written down as data
// (a ReadPlan). A step of the job's own world size and a step of another one (elastic restore, reshard.h)
// are both plans of the same shape: per destination tensor the byte ranges of which source file fill it.
// run_read_plan is the one executor of both. Nothing here talks to other ranks: the Loader (loader.h) votes
// on each plan's verdict before it runs one.
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/reshard.h"
#include "checkpoint/restore_prefetch.h"
#include "checkpoint/step_writer.h"  // safetensors_dtype: the write side's, one copy
#include "checkpoint/storage.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace ettkit::checkpoint::detail {

/// A rank's verdict on a candidate. kVanished: retention (another process's, or a later commit's) removed
/// the step while it was being considered; not a corruption, and the directory is listed again.
enum class Verdict { kOk, kBad, kMismatch, kVanished };

/// How verdicts combine across ranks: the worst wins.
int severity(Verdict v);

/// What one load asks of every candidate it considers: the caller's state, and how to check a step against
/// it. Borrowed: the referenced objects outlive the load (they are load_latest's arguments).
struct LoadRequest {
  const NamedTensors& tensors;  ///< the destinations, filled in place
  const std::function<void(const std::string&)>& validate_extra;  ///< decoder of the non-tensor state (may be empty)
  const std::vector<std::string>& read_prefixes;  ///< tensors without a destination under these are read anew
  int rank = 0;
  int world = 1;
  bool verify = true;             ///< check the chunk checksums of what is read
  int threads = 1;                ///< threads that verify and read
  bool whole_from_rank0 = false;  ///< resharding: old rank 0's copy of a whole tensor that differs between ranks
  /// Every old rank's files can be opened (the disk tier): a step of this world size whose shards on this rank
  /// are of another layout than the state's is read by resharding. false for the memory tier, which holds this
  /// rank's files only: such a step is not loadable there (kBad), and the disk tier reshards it.
  bool reads_other_ranks = true;
  /// The state is a part of the step (AsyncCheckpointer::load_latest's `partial`): what no destination asks
  /// for and no read prefix covers is left unread instead of being a mismatch.
  bool partial = false;
  /// The global shape of each sharded tensor (key) the state holds shards of (may be null or lack keys): a
  /// shard read from a tensor the step saved whole needs it (reshard.h, plan_destination).
  const std::map<std::string, std::vector<int64_t>>* global_shapes = nullptr;
};

/// What a candidate check found, and, when it is loadable, how to load it. Owns the open files (a step that
/// retention removes meanwhile still reads whole) and the indexes that `to_read` points into.
struct ReadPlan {
  Verdict verdict = Verdict::kBad;
  std::string reason;  ///< why not loadable (empty for kOk)
  std::string extra;   ///< the non-tensor state's bytes, checked
  /// The files read: this rank's alone at the same world size; every old rank's (index = old rank) when
  /// resharding. A CopyRange's `source` indexes these and `indexes`.
  std::vector<OpenedStep> sources;
  std::vector<SafetensorsIndex> indexes;
  /// Per destination tensor (the state's order), the reads that fill it (src_offset: from the file's start).
  std::vector<std::vector<CopyRange>> fills;
  /// Tensors without a destination, under a read prefix: entries of indexes[0], read into new CPU tensors.
  std::vector<const SafetensorsEntry*> to_read;
  bool reshard = false;
  int saved_world = 0;
  /// The source whose non-tensor state, whole tensors and `to_read` entries are read: this rank's file, or
  /// when resharding from another world size old rank 0's (no rank is this one's there; such tensors are taken
  /// as replicas, proven by their digests). At the same world size a resharded step's home is still this rank:
  /// its per-rank state (RNG, data position, buffers) is its own.
  int home = 0;
  uint64_t planned = 0, verified = 0;  ///< resharding: bytes read, and bytes of the chunks checked for them
  bool prefetched = false;             ///< verified ahead by RestorePrefetch
  uint64_t reverified = 0;             ///< of a prefetched step: the bytes hashed again at load time
};

/// Plans the load of step-<step> of `dir` (a checkpoint directory or a memory-tier rank directory) for
/// `req`. Reads and decodes the step's manifest once, whatever the plan. `pre`: what RestorePrefetch verified
/// of this step (or nullopt); used when it is still the committed snapshot, in which case only the chunks
/// that have left the page cache since are hashed again. Never throws for what a step holds: every problem
/// is a verdict with its reason.
ReadPlan plan_read(const std::string& dir, int64_t step, const LoadRequest& req, std::optional<PrefetchedStep> pre);

/// Runs a loadable plan: fills `tensors` (the request's, in the same order) in place, then returns the
/// tensors without a destination (ReadPlan::to_read) read into new contiguous CPU tensors.
NamedTensors run_read_plan(const ReadPlan& plan, const NamedTensors& tensors, int threads);

// ---- the parts of a plan (read_plan.cpp, reshard_plan.cpp) ----------------------------------------------

/// The plan of a step written by another number of ranks than `req.world`, or by as many ranks with shards of
/// another layout (another sharding plan, mesh shape or placements; docs/checkpoint.md, "Elastic restore"),
/// from its directory opened once.
ReadPlan plan_reshard_read(const StepDirectory& step_dir, int64_t step, const LoadRequest& req);
/// Whether `name` is one of `prefixes` or starts with one followed by '.' ("" covers every name).
bool under_prefix(const std::string& name, const std::vector<std::string>& prefixes);
/// "'a', 'b', ... (n more)" and "a; b; ... (n more)": enough to act on, bounded so that a wrong model does
/// not print 10^4 keys.
std::string quoted_list(const std::vector<std::string>& names);
std::string plain_list(const std::vector<std::string>& items);
/// Runs the caller's `validate_extra` on a candidate's extra bytes (read_plan.cpp says when and why).
std::string undecodable_extra(const std::function<void(const std::string&)>& validate_extra, const std::string& extra,
                              const std::string& path, std::string& mismatch);
/// The torch dtype of a safetensors dtype string (nullopt when ettkit does not read it). The other way is
/// step_writer.h's safetensors_dtype.
std::optional<at::ScalarType> scalar_type_of(const std::string& dtype);
/// A plan that is not loadable: `verdict` with `why`, its files closed.
ReadPlan refused(ReadPlan p, Verdict verdict, std::string why);

}  // namespace ettkit::checkpoint::detail
