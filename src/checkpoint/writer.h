#pragma once
// Writer: the checkpointer's writer thread and its queue. save() hands it a staged (or staging) snapshot;
// the thread waits for the staging, writes the step through StepWriter in the save's tier (the disk tier
// then commits through DiskCommit, and a durable disk step retires the memory-tier snapshots it
// supersedes), gives the integrity verdict (torn or not) as late as possible, reports to the ledger and
// finishes the save's handle.
//
// Ownership: borrows the Session (it outlives the Writer); owns the queue, the thread and the DiskCommit.
// Threading: enqueue(), wait_idle(), stop() and the figures are the caller's; the thread is the only one
// that writes files. The writer thread never drops a snapshot's source tensors (the last reference of a
// Python-owned tensor needs the GIL; only the caller's threads drop them, checkpointer.cpp).
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "checkpoint/commit.h"
#include "checkpoint/save_handle.h"
#include "checkpoint/session.h"
#include "checkpoint/step_writer.h"

namespace ettkit::checkpoint::detail {

/// One queued save.
struct WriteJob {
  int64_t step = -1;
  Tier tier = Tier::kDisk;
  uint64_t seq = 0;      // the save's number in this checkpointer: its Store keys
  int64_t call_us = 0;   // when save() was called (time to durable counts from it)
  std::shared_ptr<Snapshot> snapshot;
  std::string extra;
  std::shared_ptr<SaveHandle::State> handle;
  // Earlier saves' snapshots the caller's thread let go of (their sources already dropped there): when one
  // is the last reference, its per-entry state (10^4 version counters, digest segments) is freed with this
  // job, on the writer's thread, not inside the caller's next save() (issue #65).
  std::vector<std::shared_ptr<Snapshot>> retired;
};

class Writer {
 public:
  /// Starts the writer thread.
  explicit Writer(Session& session);
  /// Stops the thread (stop()) if the caller did not.
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  /// Rethrows the peer loss that ended this checkpointer's saves, if one did.
  void rethrow_peer_loss() const;
  bool peer_lost() const;
  /// Queues a save (its seq is assigned here) and wakes the thread.
  void enqueue(WriteJob job);
  /// The saves queued so far.
  uint64_t saves_queued() const;
  /// Returns once no save is queued or being written.
  void wait_idle();
  /// Tests only: while held, the writer waits with a save's data file written and its arena held.
  void hold(bool hold);
  /// Tests only: returns once the writer waits in a hold (or stops).
  void wait_until_held();
  /// Ends the thread once the queue is written (a hold ends too) and joins it. Returns whether a save was
  /// unfinished when it was called (close() records that wait as the drain). Idempotent; the caller
  /// serializes calls (close_mu).
  bool stop();
  bool stopped() const { return !thread_.joinable(); }

 private:
  void run();
  std::optional<WriteJob> next_job();
  /// Writes and commits `job`; returns its error (null: durable).
  std::exception_ptr write(WriteJob& job);
  /// Releases the job's arena, reports it to the ledger and wakes its handle.
  void finish(WriteJob& job, std::exception_ptr err);
  void await_staging(WriteJob& job);
  void wait_while_held();
  StepHooks hooks_for(WriteJob& job);
  void persist_disk(WriteJob& job);
  void persist_memory(WriteJob& job);
  void send_replica(int64_t step);
  void retire_superseded_memory(int64_t step);

  Session& s_;
  DiskCommit commit_;
  // The memory tier's safetensors header for the last plan, and its padding to the arenas' room
  // (StepWriter::use_cached_header): the writer thread's alone.
  std::shared_ptr<const std::vector<PlanEntry>> header_plan_;
  std::string memory_header_;
  std::string memory_header_padded_;

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<WriteJob> queue_;
  int in_flight_ = 0;
  // in_flight_ less the saves whose handle is finished (or about to be): stop() reports a drain only for
  // these. in_flight_ drops after the handle wakes its waiter, so a caller that waited for its save and then
  // closed could see it still in flight and record a drain of nothing (issue #48, a second drain record).
  int unfinished_ = 0;
  bool stopping_ = false;
  uint64_t seq_ = 0;
  bool hold_ = false;            // tests: the writer waits before it releases the arena (wait_while_held)
  bool holding_ = false;         // tests: the writer is waiting in that hold now
  std::exception_ptr peer_lost_;  // once set, every queued and later save fails with it at once
  std::thread thread_;            // last: started once everything above is constructed
};

/// Why a save was refused, from the names of the tensors that changed while being copied.
std::string torn_message(int64_t step, const std::vector<std::string>& changed);

}  // namespace ettkit::checkpoint::detail
