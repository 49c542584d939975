#pragma once
// Verify-ahead for load_latest: checks the steps a restart is about to load against their checksums on a
// background thread while the trainer does the rest of its start (imports, model construction, compile),
// so that load_latest is left with the copy into the tensors.
//
// Why it is sound: a committed step's files are never written again (a save writes a temporary directory
// and renames it; retention renames whole directories away), the prefetch keeps the files it verified
// open (the inodes, whatever happens to their names), and load_latest copies from those same open files.
// What load_latest still checks: the manifest on disk is the one that was verified (a re-save of the same
// step number is another snapshot), and every chunk that has left the page cache since is hashed again
// (its bytes will come from the storage device once more, not from the pages that were hashed). What it
// cannot see: a process writing into a committed file's pages in between (outside ettkit's protocol; a
// load without the prefetch has the same window, only shorter: verification, then the copy).
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/storage.h"

#pragma GCC visibility push(default)

namespace ettkit::checkpoint::detail {

/// One step to verify ahead: step-<step> of `dir` (a checkpoint directory or a memory-tier rank
/// directory), this rank's files.
struct PrefetchTarget {
  std::string dir;
  int64_t step = -1;
};

/// What the prefetch found for one step.
struct PrefetchedStep {
  std::string dir;
  int64_t step = -1;
  std::optional<OpenedStep> files;  ///< open while this lives: the very inodes that were verified
  std::string extra;                ///< the extra file's bytes, read and verified in memory
  bool verified = false;
  std::string error;  ///< why not (empty when verified, or when the step was not there)
};

/// Owns one background verification at a time and its results. Not thread-safe: one owner thread calls
/// start / wait / take / cancel (the checkpointer's owner thread); the worker only writes the results,
/// under the mutex, which take() reads after joining it.
class RestorePrefetch {
 public:
  RestorePrefetch() = default;
  ~RestorePrefetch() { cancel(); }
  RestorePrefetch(const RestorePrefetch&) = delete;
  RestorePrefetch& operator=(const RestorePrefetch&) = delete;

  /// Verifies `targets` in order, stopping after the first that verifies (rank `rank`'s files; a step
  /// written by another number of ranks than `world` is skipped: a resharding load reads other ranks'
  /// files), on one background thread that fans each file's chunks out to `threads` threads. Replaces the
  /// results of an earlier start (cancelling it). No targets: no thread (wait() is true at once).
  void start(std::vector<PrefetchTarget> targets, int rank, int world, int threads);
  /// Waits up to `timeout_s` (< 0: for ever) for the verification to end; true when it has (or none runs).
  bool wait(double timeout_s);
  /// Joins the worker, then hands out the result for (dir, step) when that step verified (once: a second
  /// take of the same step returns nullopt).
  std::optional<PrefetchedStep> take(const std::string& dir, int64_t step);
  /// Stops the worker at its next chunk group, joins it and drops every result (closing their files).
  void cancel();
  /// Seconds the worker ran, and the bytes it verified; 0 before it ends.
  double seconds() const;
  uint64_t bytes_verified() const;

 private:
  void run(std::vector<PrefetchTarget> targets, int rank, int world, int threads);
  void join();

  std::thread worker_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;  // guarded by mu_
  bool stop_ = false;      // guarded by mu_
  std::vector<PrefetchedStep> results_;
  double seconds_ = 0;
  uint64_t bytes_ = 0;
};

}  // namespace ettkit::checkpoint::detail

#pragma GCC visibility pop
