#pragma once
// The batched device path of the stager (issue #65): a save's CUDA tensors cost the caller's thread one
// backend call (an event recorded on its current stream) and a loop that notes each tensor's pointers, not a
// cudaMemcpyAsync and a recordStream per tensor (~5 us each on an H200: 20,001 tensors blocked ~95 ms).
// A staging thread then makes the copy stream wait on that event, queues each copy class's copies as one
// batch (cudaMemcpyBatchAsync where the runtime has it, else a loop of cudaMemcpyAsync on that thread), records
// a completion event per class and waits for the last one; the save's SnapshotState learns each step
// (DeviceProgress), and its fences read it.
//
// Rules it keeps:
// - No per-tensor device call on the caller's thread; exactly one backend call per save there.
// - No recordStream: the storages of the sources are held in the slot from save() until the copies were
//   observed complete and drop_sources() (or the slot's next save) lets them go, on a caller's thread (the
//   last reference of a Python-owned tensor must not die on the staging thread).
// - No allocation for the batch after the plan is bound (prepare(), or the first save of a plan): the
//   arrays the batch reads (destinations, sources, sizes, held storages) are sized once per plan and slot;
//   only a non-contiguous device tensor costs an alias per save.
// - One slot per arena: a slot is written only by the save that holds its arena, and that arena comes back
//   only once the slot's copies are done (Snapshot::release waits for them), so no two saves share a slot.
#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <array>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/device_copy_backend.h"
#include "checkpoint/stage_plan.h"

namespace ettkit::checkpoint::detail {

struct SnapshotState;

#pragma GCC visibility push(default)  // its test drives it directly
/// Owns the staging thread (joined in the destructor, after the saves queued ran), the per-slot batch arrays
/// and events, and a shared reference to the backend. Thread-safe for one save per slot at a time.
class DeviceStager {
 public:
  /// As many slots as a Stager has arenas at most.
  static constexpr int kSlots = 2;
  /// Copy classes (stage_plan.h: 0, 1 and the rest).
  static constexpr int kClasses = 3;

  explicit DeviceStager(std::shared_ptr<DeviceCopyBackend> backend);
  ~DeviceStager();
  DeviceStager(const DeviceStager&) = delete;
  DeviceStager& operator=(const DeviceStager&) = delete;

  c10::DeviceType device_type() const { return type_; }
  /// Sizes slot `slot`'s arrays and events for `plan`, takes and warms the copy stream (prepare(); the
  /// slot's arena must not be in use). A slot already bound to `plan` is left as it is.
  void bind(int slot, const std::shared_ptr<const std::vector<PlanEntry>>& plan);
  /// Hands the copies of `entries` (the device entries of `tensors`, in copy order) into `base` to the
  /// staging thread, as the save that holds slot `slot`'s arena; `state` learns their progress and must
  /// live until it reports them done (Snapshot::release waits for that). InvalidArgument, before any
  /// copy is queued, when the entries are on more than one device.
  void submit(int slot, const std::shared_ptr<const std::vector<PlanEntry>>& plan, const NamedTensors& tensors,
              const CopyOrder& order, const std::vector<size_t>& entries, uint8_t* base, SnapshotState& state);
  /// A fence for `state`'s device copies of class `cls` (-1: all): when they are not done, waits on the host
  /// until the staging thread queued them (the time to issue them, not to copy them), then makes the
  /// calling thread's current stream wait for them. Returns whether they were not done.
  static bool fence(SnapshotState& state, int cls);
  /// Lets go of the storages slot `slot` holds for save `generation` (a later save's are left alone), on
  /// the calling thread. Only after that save's copies are done.
  void release_held(int slot, uint64_t generation);
  /// How often a slot's arrays were sized (tests: no sizing after prepare()).
  int64_t bindings() const;

 private:
  struct Slot;
  void run();
  void stage_slot(Slot& s, SnapshotState& st);
  /// The slot's device entries in copy order, into its arrays (the caller's thread); returns the classes.
  int fill(Slot& s, const NamedTensors& tensors, const std::vector<PlanEntry>& plan, const CopyOrder& order,
           const std::vector<size_t>& entries, uint8_t* base, SnapshotState& state);

  std::shared_ptr<DeviceCopyBackend> backend_;
  c10::DeviceType type_;
  std::unique_ptr<std::array<Slot, kSlots>> slots_;
  mutable std::mutex mu_;  // guards queue_, queued_, stop_, bindings_, each slot's generation, state, held
  std::condition_variable cv_;
  std::array<int, kSlots> queue_{};  // slots handed over, oldest first
  int queued_ = 0;
  bool stop_ = false;
  int64_t bindings_ = 0;
  std::thread thread_;  // last: started after everything it reads
};

/// The device stager StagerOptions::cuda_copy asks for ("" reads ETTKIT_CUDA_COPY, then "per_tensor"):
/// nullptr for "per_tensor", or for "batched" without a backend (`backend` nullptr and no CUDA in the build).
/// InvalidArgument for another value.
std::unique_ptr<DeviceStager> make_device_stager(const std::string& cuda_copy,
                                                 std::shared_ptr<DeviceCopyBackend> backend);
#pragma GCC visibility pop

}  // namespace ettkit::checkpoint::detail
