#pragma once
// The bound save's hot path (issue #65): a flat per-plan cache of what each tensor of the caller's held list
// was when the cache was built (its TensorImpl, storage, offset, dtype, sizes, strides, dispatch keys) and
// the copy class derived from it. A save of the same held list under the plan's names token compares every
// live tensor with its entry in ONE pass and reads its version; anything different and the save takes the
// full path (which checks, replans when needed, and rebuilds the cache): a stale cache costs a replan, never
// a wrong or torn snapshot. Private to the stager and AsyncCheckpointer.
#include <c10/core/DispatchKeySet.h>
#include <c10/core/StorageImpl.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "checkpoint/copy_engine.h"
#include "checkpoint/snapshot_state.h"
#include "checkpoint/stage_plan.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/export.h"

namespace ettkit::checkpoint::detail {

/// How a cached entry is copied (the sync_max cut is made per save: it varies with overlap).
enum class BoundClass : uint8_t { kDevice, kInference, kContiguous, kStrided };

/// One tensor as it was when the cache was built. Compared field by field with the live TensorImpl.
struct BoundEntry {
  const c10::TensorImpl* impl = nullptr;
  const c10::StorageImpl* storage = nullptr;  // owned by BoundEntries::storages
  const void* data = nullptr;                 // the storage's data pointer (moves on an untyped resize_)
  size_t storage_nbytes = 0;
  int64_t storage_offset = 0;
  uint64_t keys = 0;     // the dispatch key set's bits: conj, neg, Python, inference, layout all live there
  uint32_t dims_at = 0;  // sizes, then strides, in BoundEntries::dims
  uint32_t ndim = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Device device{c10::kCPU};
  BoundClass cls = BoundClass::kContiguous;
  bool contiguous = true;
  const uint8_t* src = nullptr;  // the first byte the tensor shows
  int64_t nbytes = 0;            // the plan entry's
  int64_t offset = 0;            // the plan entry's arena offset
};

/// The cache of one plan and one held list. Immutable once built; shared by the stager (its current one)
/// and each in-flight save's state (SnapshotState::bound), so that a rebuild while a save is in flight cannot
/// let go of a storage its copies read. Let go only on a caller's thread (a storage's last reference may
/// run a Python deleter): the stager's stage() and Snapshot::drop_sources.
struct BoundEntries {
  std::shared_ptr<const std::vector<PlanEntry>> plan;
  // The held list it was built from, by address only: holding it would make the Python list's copy-on-write
  // copy it at every change. Never dereferenced, nor are the entries' impl pointers: a list or TensorImpl
  // at a reused address passes only if every field of every tensor is as recorded, which describes the same
  // bytes (the storages are held here, so no other storage can have their data pointers).
  const NamedTensors* list = nullptr;
  uint64_t names_token = 0;
  c10::DeviceType device_type = c10::kCUDA;  // the tensors that went to the device path
  std::vector<BoundEntry> entries;
  std::vector<int64_t> dims;
  // One reference per storage, taken once per cache, not per save: what the pool's jobs read, as it was at
  // save() (the role of SnapshotState::read_storages on the full path).
  std::vector<c10::intrusive_ptr<c10::StorageImpl>> storages;
};

/// The cache for `tensors` (the held list of `binding`, already staged through `plan` by the full path, no
/// conjugate or negative view in it); nullptr when a tensor has no cacheable form (an undefined one, a
/// CUDA inference tensor, a device other than CPU and `device_type`).
std::shared_ptr<const BoundEntries> build_bound_entries(const NamedTensors& tensors, const SaveBinding& binding,
                                                        std::shared_ptr<const std::vector<PlanEntry>> plan,
                                                        c10::DeviceType device_type);

/// Whether every tensor of `tensors` is still exactly as `b` recorded it (the fused pass); the version of
/// each tensor that has one goes to `versions` (resized to the count) in the same pass.
bool bound_matches(const BoundEntries& b, const NamedTensors& tensors, std::vector<uint32_t>& versions);

/// copy_small_now() for a save that bound_matches() admitted: the classes, sources and offsets from the
/// cache, no per-tensor read of the tensors (except the strided small copies), no storage reference per
/// save (the state holds the cache). Versions were read by bound_matches().
void bound_copy_small_now(const BoundEntries& b, const NamedTensors& tensors, const CopyOrder& order, uint8_t* base,
                          int64_t sync_max, SnapshotState& state, PendingCopies& pending);

/// What AsyncCheckpointer::save() tells the stage() it calls on this thread: it skipped its per-tensor name
/// and dtype checks because the binding vouches for the list (the same held list under a names token). Then
/// stage() must take the fast path or throw BoundMiss before doing anything, and save() checks and stages
/// again the full way. Set for the duration of one stage() call (BoundCallScope).
struct BoundCall {
  bool caller_skipped_checks = false;
};
/// The calling thread's BoundCall, or nullptr outside AsyncCheckpointer::save().
BoundCall* current_bound_call();
class BoundCallScope {
 public:
  explicit BoundCallScope(BoundCall& call);
  ~BoundCallScope();
  BoundCallScope(const BoundCallScope&) = delete;
  BoundCallScope& operator=(const BoundCallScope&) = delete;

 private:
  BoundCall* prev_;
};
/// Thrown by stage() when the caller skipped its checks and the fast path is not taken (nothing done yet).
struct BoundMiss : std::exception {
  const char* what() const noexcept override { return "bound save cache miss"; }
};

/// Tests only: how many saves took the fast path in this process (a broken fast path must not silently
/// fall back), and how many caches were built.
ETTKIT_API int64_t bound_fast_saves_for_testing();
ETTKIT_API int64_t bound_cache_builds_for_testing();
void count_bound_fast_save();

}  // namespace ettkit::checkpoint::detail
