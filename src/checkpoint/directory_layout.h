#pragma once
// The layout of a checkpoint directory, its commit order and its retention. Torch-free.
//
// Layout of CKPT_DIR:
//   step-<N>/manifest.json            written last by rank 0; its presence after the rename = committed
//   step-<N>/rank-<r>.safetensors     one per rank, readable by safetensors.torch.load_file
//   step-<N>/rank-<r>.extra           the rank's non-tensor state (opaque bytes)
//   .tmp-step-<N>-<run>/              a save in progress (removed at the next start of another run)
//   .trash-*                          a retired step being deleted (rename first, then delete)
//   latest                            "step-<N>\n", replaced atomically (tmp + rename + dir fsync); a hint:
//                                     loaders never read it, and it may lag when its write failed
//   .lock                             the writer's advisory lock (flock) and who holds it (one JSON line:
//                                     directory_lock.h)
//
// Commit order: every manifest carries commit_seq, one more than the highest in the directory when it was
// written (manifests from before commit_seq: 0, then ordered by created_unix_us). "Newest" always means
// the latest commit, never the largest step number: a job restarted from step 1 into a directory holding
// step 300 makes step 1 the newest. Retention and load_latest both follow this order.

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/identifiers.h"

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// "step-<N>". InvalidArgument unless is_step(step).
std::string step_dir_name(int64_t step);
/// ".tmp-step-<N>-<run id>". InvalidArgument unless is_step(step) and is_run_id(run_id).
std::string temp_dir_name(int64_t step, const std::string& run_id);

/// An entry of CKPT_DIR whose name starts with "step-".
struct StepEntry {
  std::string name;
  int64_t step = -1;       ///< N when the name is exactly step_dir_name(N) with N <= kMaxStep; else -1
  bool directory = false;  ///< a directory (a symbolic link is never followed: listed with its problem)
  bool committed = false;  ///< a directory whose manifest decodes and names step N
  uint64_t commit_seq = 0;
  int64_t created_unix_us = 0;
  std::string problem;  ///< why it is not committed
};
/// Whether `a` was committed after `b`: by commit_seq, then created_unix_us, then step.
bool committed_after(const StepEntry& a, const StepEntry& b);
struct StepListing {
  std::vector<StepEntry> committed;  ///< newest commit first
  std::vector<StepEntry> others;     ///< everything else named step-*, by name (never ettkit's to delete)
};
/// Classifies every step-* entry of `dir`, reading each step directory's manifest (not its data files).
/// An entry that vanishes while being read is left out.
StepListing list_steps(const std::string& dir);
/// Committed steps, newest commit first.
std::vector<int64_t> list_step_dirs(const std::string& dir);
/// What load_latest tries, in order: step-<N> directories that are not committed (each is reported as not
/// loadable), then the committed steps, newest commit first.
std::vector<int64_t> load_candidates(const std::string& dir);

/// Removes what a dead writer left in `dir`: the temporary directories of runs other than `run_id`
/// (.tmp-step-<N>-<run id>; `run_id` need not be a run id: "" keeps none), retired steps being deleted
/// (.trash-<name>-<id>) and `latest` temporaries (latest.tmp-<id>). Only names of exactly these forms are
/// touched, each through remove_tree_at relative to the opened directory: a symbolic link is removed as a
/// link, never followed. Returns how many were removed.
int remove_stale_temporaries(const std::string& dir, const std::string& run_id);
/// Points `latest` at step-<N>: write latest.tmp, fsync, rename, fsync dir. Throws IoError (and removes its
/// temporary file).
void update_latest(const std::string& dir, int64_t step);
/// The commit point: retires an existing step-<N> (a re-save) by rename, renames `tmp` (an entry of `dir`)
/// to step-<N>, fsyncs `dir`; every rename relative to the opened `dir`. Throws IoError.
void commit_step_directory(const std::string& dir, const std::string& tmp, int64_t step);

/// The directory's commit history as its one writer sees it (rank 0 of the job holding the lock; only the
/// writer thread calls it): the next commit's sequence number, and what happens after a commit.
class CommitHistory {
 public:
  /// 1 + the highest commit_seq in `dir` (read from the manifests at the first call, counted in memory
  /// afterwards: the directory lock makes this writer the only one).
  uint64_t next_seq(const std::string& dir);
  /// After step `step` was committed: points `latest` at it, then keeps the `keep_last` newest committed
  /// steps (by commit order; <= 0 keeps all) and retires the other committed ones (rename to .trash-*, then
  /// delete). Never touches the step just committed or an entry that is not a committed step (those get a
  /// warning, once per name). Never throws: failures are logged, the step stays committed. Returns the
  /// names retired.
  std::vector<std::string> after_commit(const std::string& dir, int64_t step, int keep_last);

 private:
  /// The steps of `committed` (newest first) beyond the `keep_last` newest (never `step`), renamed away and deleted.
  std::vector<std::string> retire_old_steps(const std::string& dir, const std::vector<StepEntry>& committed,
                                            int64_t step, int keep_last);
  bool scanned_ = false;
  uint64_t last_seq_ = 0;
  std::vector<std::string> warned_;
};

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
