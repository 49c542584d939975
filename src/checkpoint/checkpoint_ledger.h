#pragma once
// The checkpointer's ledger adaptor (in the manner of rmm's statistics_resource_adaptor): the one unit that
// writes the checkpointer's ETT records (docs/ett.md, "checkpoint tiers") and keeps its counters and means.
// The writer, the facade and the loader report what happened (a save blocked, was durable, failed, a load
// restored); this adaptor knows which phase of which tier that is and what the report's figures count.
//
// Ownership: the Recorder is borrowed (CheckpointerOptions::recorder: it outlives the checkpointer); null
// records nothing and still counts. Threading: every member may be called from any thread; the counters
// are guarded by one mutex, the Recorder is thread-safe itself. attach() comes first, before any thread
// records (the Session is opened before the writer thread starts).
#include <cstdint>
#include <mutex>

#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/checkpoint/schedule.h"

namespace ettkit::ett {
class Recorder;
}

namespace ettkit::checkpoint::detail {

/// The interval policy's fixed intervals as the report's configured interval: a config record per tier whose
/// interval is a number of steps (checkpoint_interval_steps; checkpoint_memory_interval_steps) or a duration
/// (checkpoint_interval_s; checkpoint_memory_interval_s). "auto" and "never" record nothing. Written here,
/// beside the checkpointer's other records, for CheckpointSchedule::record_intervals (C++ trainers and the
/// Python AsyncCheckpointer alike).
void record_interval_config(ett::Recorder& recorder, const Every& disk, const Every& memory);

class CheckpointLedger {
 public:
  /// Resolves the phase ids in `recorder` (null: no records, the counters still count). Once, before use.
  void attach(ett::Recorder* recorder);

  /// save() queued a save of `tier`: it counts toward that tier's mean blocking time, and the fences' waits
  /// that follow count against that tier too.
  void count_save(Tier tier);
  /// Training was blocked from `begin_us` to `end_us` by save() or a fence of the latest save (`step`).
  void record_blocking(int64_t begin_us, int64_t end_us, int64_t step);
  /// The copy of a save into its arena, from the first copy to the last.
  void record_staging(int64_t begin_us, int64_t end_us, int64_t step);
  /// A save is durable (committed in its tier): from save()'s call to now.
  void record_durable(Tier tier, int64_t call_us, int64_t end_us, int64_t step);
  /// A save failed: refused as torn (`torn`), or any other error (a write error, a lost peer). The report
  /// counts both, so that a job whose saves all fail does not read as a job that checkpoints.
  void record_failure(Tier tier, bool torn, int64_t call_us, int64_t end_us, int64_t step);
  /// close() waited for the saves still queued (the job's last checkpointing after its last step). Not
  /// recorded into a closed Recorder.
  void record_drain(int64_t begin_us, int64_t end_us);
  /// load_latest restored `step` from `tier`; the copy took from `begin_us` to `end_us`.
  void record_restore(int64_t step, Tier tier, int64_t begin_us, int64_t end_us);
  /// The restore of `step` was verified ahead (prefetch) in `verify_s`; `reverified_bytes` were hashed
  /// again at load. A note (the report's attempts[].notes), so a short restore is not read as unchecked.
  void note_prefetched_restore(int64_t step, Tier tier, double verify_s, uint64_t reverified_bytes);

  double mean_blocking_s() const;
  double mean_blocking_s(Tier tier) const;
  double mean_time_to_durable_s(Tier tier) const;
  int64_t saves_committed(Tier tier) const;
  int64_t saves_failed() const;
  int64_t saves_refused() const;

 private:
  // Per tier (index: Tier).
  struct TierFigures {
    double blocking_sum = 0;
    int64_t saves = 0;  // the saves the blocking time is summed over
    double durable_sum = 0;
    int64_t committed = 0;
  };
  struct PhaseIds {
    uint32_t blocking = 0, refused = 0, failed = 0, restore = 0;
  };

  /// `read()` under the figures' mutex.
  template <class Read>
  auto locked(Read read) const {
    std::lock_guard<std::mutex> lk(mu_);
    return read();
  }

  ett::Recorder* recorder_ = nullptr;
  PhaseIds tier_ids_[2];
  uint32_t persist_id_ = 0, memory_id_ = 0, staging_id_ = 0, drain_id_ = 0;

  mutable std::mutex mu_;  // guards everything below
  TierFigures tier_[2];
  double blocking_sum_ = 0;  // over both tiers, summed in the order it happened
  int64_t saves_ = 0;
  Tier last_tier_ = Tier::kDisk;
  int64_t failed_ = 0;
  int64_t refused_ = 0;
};

}  // namespace ettkit::checkpoint::detail
