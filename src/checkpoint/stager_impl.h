#pragma once
// The Stager's state (Stager::Impl), shared by its units: stager.cpp (the arenas, the plan, prepare()) and
// stager_save.cpp (stage(): one save's steps). Private to them.
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "checkpoint/bound_entries.h"
#include "checkpoint/copy_engine.h"
#include "checkpoint/device_stager.h"
#include "checkpoint/host_arena.h"
#include "checkpoint/in_order_digest.h"
#include "checkpoint/snapshot_state.h"
#include "checkpoint/stage_plan.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace ettkit::checkpoint {

/// What a save into one arena reuses from the arena's save before (no allocation per save proportional to
/// the tensor count, issue #65): the copy order, the pending copies, and the disk tier's whole-tensor digest
/// of the plan it was made for. Only the save holding the arena touches it (the digest fields: under mu).
struct ArenaScratch {
  detail::CopyOrder order;
  detail::PendingCopies pending;
  std::shared_ptr<const std::vector<PlanEntry>> digest_plan;
  std::shared_ptr<detail::InOrderDigest> tensor_digest;
};

using detail::Arena;
using PlanPtr = std::shared_ptr<const std::vector<PlanEntry>>;

struct Stager::Impl {
  StagerOptions opt;
  bool pin = false;
  std::unique_ptr<detail::CopyPool> pool;
  std::unique_ptr<detail::DeviceStager> device;  // the "batched" CUDA path (StagerOptions::cuda_copy), else none
  mutable std::mutex mu;  // guards arenas[].busy, plan, counters
  std::condition_variable cv;
  std::vector<Arena> arenas;
  PlanPtr plan;
  // The names token (SaveBinding) of the last list whose names were found to be the plan's: a save with that
  // token does not compare names. 0: none. Reset with every new plan.
  uint64_t plan_names_token = 0;
  // The bound save's cache (bound_entries.h) of `plan` and the last held list staged through it; null until
  // a bound save of the plan took the full path. Replaced (let go) only in stage(), on a caller's thread.
  std::shared_ptr<const detail::BoundEntries> bound;
  int64_t plan_total = 0;
  int64_t plan_builds = 0;
  int64_t arena_allocations = 0;
  double busy_wait_s = 0;
  // With a memory tier: the arenas are its files (set_arena_files), each with header room for the plan.
  std::shared_ptr<detail::ArenaFiles> files;
  size_t header_room = 0;
  // The disk tier's header of the current plan (set_disk_header_planner), asked once per plan.
  std::function<DiskHeaderPlan(const std::vector<PlanEntry>&)> disk_header_planner;
  DiskHeaderPlan disk_header;
  // The arena ranges of disk_header.whole: the same for every save of the plan, so made once per plan, not
  // per save on the caller's thread (issue #65).
  std::vector<std::pair<uint64_t, uint64_t>> disk_ranges;
  /// disk_header for `plan` (mu held); nothing planned when there is no planner or it fails.
  void plan_disk_header() {
    disk_header = {};
    disk_ranges.clear();
    if (!disk_header_planner || !plan) return;
    try {
      disk_header = disk_header_planner(*plan);
    } catch (const std::exception&) {
      // A dtype the header cannot name: the writer reports it as the save's error, as before.
      disk_header = {};
    }
    disk_ranges.reserve(disk_header.whole.size());
    for (size_t i : disk_header.whole) {
      const PlanEntry& e = (*plan)[i];
      disk_ranges.emplace_back(static_cast<uint64_t>(e.offset), static_cast<uint64_t>(e.offset + e.nbytes));
    }
  }
  uint64_t publish_seq = 0;
  // Recycled per-save states (snapshot_state.h) and, per arena, what a save on it reuses (ArenaScratch).
  std::shared_ptr<detail::StatePool<Snapshot::State>> states = std::make_shared<detail::StatePool<Snapshot::State>>();
  std::vector<std::unique_ptr<ArenaScratch>> scratch;  // mu: the vector; an entry: the save holding its arena
  /// Arena `arena`'s scratch (mu held).
  ArenaScratch& scratch_of(int arena) {
    if (scratch.size() <= static_cast<size_t>(arena)) scratch.resize(static_cast<size_t>(arena) + 1);
    auto& s = scratch[static_cast<size_t>(arena)];
    if (!s) s = std::make_unique<ArenaScratch>();
    return *s;
  }
  /// The disk tier's whole-tensor digest of `plan` (the current one) over arena `arena` at `base` (mu held):
  /// the arena's own, made once per plan and reused (InOrderDigest::reuse, with `take`: for a save), since a
  /// save holds its arena until its writer has finished the digest.
  std::shared_ptr<detail::InOrderDigest> tensor_digest_for(int arena, const PlanPtr& plan, const uint8_t* base,
                                                           bool take);
  /// Makes now (mu held) what the first save of the plan into arena `arena` would: its whole-tensor digest
  /// and its copy arrays for `n` tensors (prepare()).
  void warm_scratch(int arena, size_t n);
  // A memory-tier arena backed after a commit for the next save's reclaim, when the arena that save will
  // reclaim is linked by more than its step and so stays linked (back_spare). Guarded by mu; freed by
  // set_arena_files() (the tier's callbacks must outlive it) or taken by free_or_reclaimed().
  Arena spare;
  bool spare_backing = false;  // a thread is backing the spare with mu released: set_arena_files() waits
#if ETTKIT_WITH_CUDA
  std::mutex stream_mu;  // guards copy_stream: stage() uses it outside mu, prepare() warms it under mu
  std::optional<c10::cuda::CUDAStream> copy_stream;
#endif

  /// A new plan for `tensors`, with arenas that hold it (mu held through `lk`); nullptr: on_busy is kSkip
  /// and the arenas, which must be reallocated, are still in use.
  PlanPtr replan(const NamedTensors& tensors, OnBusy on_busy, std::unique_lock<std::mutex>& lk,
                 uint64_t names_token = 0);
  /// How many arenas of `need` bytes the budget allows (InvalidArgument when not even one).
  int arenas_within_budget(int64_t need) const;
  /// Whether the arenas for `need` bytes are memory-tier files: a tier is set and two of them fit the budget
  /// (with one, a memory save would have to retire the only memory step before staging the next).
  bool as_files(int64_t need) const;
  /// Makes the arenas for `need` bytes (mu held): as_files(), two files of exactly `need` bytes and header
  /// room; otherwise arenas_within_budget() anonymous ones of at least `need`. false: kSkip while one is in
  /// use.
  bool fit_arenas(int64_t need, OnBusy on_busy, std::unique_lock<std::mutex>& lk);
  /// A free arena, marked busy (mu held); -1: kSkip while every arena is in use.
  int take_free_arena(OnBusy on_busy, std::unique_lock<std::mutex>& lk);
  /// An arena a new save may stage into (mu held), reclaiming a published one that is not the newest
  /// memory step when no other is free; -1 when none.
  int free_or_reclaimed();
  /// After a commit (mu held through `lk`, released while it works): when the arena the next save will
  /// reclaim has a link besides its name and its step's data file, the reclaim leaves it linked and that
  /// save needs another file; it is made and backed here, so that the save's copies fault nothing in.
  void back_spare(std::unique_lock<std::mutex>& lk);
  /// Waits on cv (mu held through `lk`) until `ready`, counting the time as busy_wait_s.
  template <typename Ready>
  void wait_busy(std::unique_lock<std::mutex>& lk, Ready ready) {
    int64_t w0 = steady_ns();
    cv.wait(lk, ready);
    busy_wait_s += static_cast<double>(steady_ns() - w0) * 1e-9;
  }
  /// After a bound save of `tensors` (the held list of `binding`) took the full path through `staged`: the
  /// bound cache made anew for them, when `staged` is still the plan and its names are the token's.
  void rebuild_bound(const NamedTensors& tensors, const SaveBinding& binding, const PlanPtr& staged);
  /// Starts every copy of `tensors` into `base`; releases `snap` when a copy cannot be started. `scratch`:
  /// the arena's (the save holds it).
  void copy(const NamedTensors& tensors, const std::vector<PlanEntry>& plan, const CopyPriority& priority,
            uint8_t* base, int64_t sync_max, Snapshot& snap, const std::shared_ptr<Snapshot::State>& state,
            const std::shared_ptr<const NamedTensors>& held, ArenaScratch& scratch,
            const std::shared_ptr<const detail::BoundEntries>& fast = nullptr);
};

}  // namespace ettkit::checkpoint
