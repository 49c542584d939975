#pragma once
// The stager's copy engine: how one save's bytes reach the arena. Small and inference CPU tensors are copied
// at once on the caller's thread; big contiguous CPU tensors by a pool of threads in byte-balanced slices;
// strided CPU tensors by one pool job each; CUDA tensors on a copy stream ordered after the caller's stream.
// Every copy reports its progress to the save's SnapshotState (snapshot_state.h), which the fences read.
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "checkpoint/snapshot_state.h"
#include "checkpoint/stage_plan.h"
#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace ettkit::checkpoint::detail {

/// Fixed pool of copy threads; jobs are closures. Owns its threads and joins them in its destructor,
/// after the jobs already queued have run.
class CopyPool {
 public:
  explicit CopyPool(int n);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;
  void submit(std::function<void()> job);
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void run();
  std::mutex mu_;  // guards jobs_, stop_
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

/// A run of bytes one pool job copies; every slice counts towards its entry's `remaining`.
struct Slice {
  const uint8_t* src;
  uint8_t* dst;
  size_t n;
  size_t entry;
};

/// The copies of one save left after copy_small_now().
struct PendingCopies {
  std::vector<Slice> contiguous;  // big contiguous CPU tensors, one slice each, in copy order
  size_t contiguous_bytes = 0;
  std::vector<size_t> strided;  // indices of non-contiguous CPU tensors
  std::vector<size_t> cuda;     // in copy order
  bool empty() const { return contiguous.empty() && strided.empty() && cuda.empty(); }
  /// Empty again, keeping the capacity (the stager keeps one per arena: SaveScratch).
  void clear() {
    contiguous.clear();
    contiguous_bytes = 0;
    strided.clear();
    cuda.clear();
  }
};

/// Records each entry's storage and version in `state`, holds the storage of each contiguous CPU entry left to
/// the pool (SnapshotState::read_storages: what its job reads, as it is now), and copies, now, the CPU tensors
/// of at most `sync_max` bytes and the inference tensors (which have no version counter to check); when
/// `state` hashes, it reports them without hashing (the training thread does not pay for it). Sets
/// `state.undecided` to the entries left to copy. Leaves the rest in `pending` (emptied first). One pass
/// over the tensors.
/// InvalidArgument for a CUDA inference tensor. `device_type`: the tensors that go to `cuda` (kCUDA; a test of
/// the batched device path, device_stager.h, sends its fake backend's kCPU tensors there).
void copy_small_now(const NamedTensors& tensors, const std::vector<PlanEntry>& plan, const CopyOrder& order,
                    uint8_t* base, int64_t sync_max, SnapshotState& state, PendingCopies& pending,
                    c10::DeviceType device_type = c10::kCUDA);

#if ETTKIT_WITH_CUDA
/// Queues the copies of the CUDA entries `cuda` (in copy order) on `copy_stream` (taken from the pool on
/// first use or when the device changes), after everything already queued on the caller's stream; records
/// one event per copy class in `state`. Into a page-locked arena, contiguous tensors of at most
/// `gather_max` bytes go by one gather kernel per class (cuda_gather.h), the others by a cudaMemcpyAsync each.
/// InvalidArgument when the entries are on more than one device.
void issue_cuda_copies(const NamedTensors& tensors, const std::vector<PlanEntry>& plan, const CopyOrder& order,
                       const std::vector<size_t>& cuda, uint8_t* base, int64_t gather_max,
                       std::optional<c10::cuda::CUDAStream>& copy_stream, SnapshotState& state);
/// Takes now, into torch's host cache, the page-locked buffer the first save of `plan` passes its gather
/// table through (Stager::prepare): that allocation would otherwise wait for the GPU inside save().
void warm_gather_table(const std::vector<PlanEntry>& plan, int64_t gather_max);
/// Takes the copy stream for `plan`'s CUDA device (none: nothing) and puts a first piece of work on it,
/// waiting for it, so that the first save's copies find the stream ready (Stager::prepare). Why: on an H200
/// the first stage() of a structure blocked the host 536 ms even with its arena allocated in advance, and a
/// stream's first use is the one first-time cost left in that path (not yet measured on a GPU).
void warm_copy_stream(const std::vector<PlanEntry>& plan, std::optional<c10::cuda::CUDAStream>& copy_stream);
#endif

/// Cuts the byte stream of `contiguous` (in copy order) into `workers` equal ranges of at least 1 MiB (big
/// tensors are split across threads), counting each slice in its entry's `remaining`. With `state.digest`,
/// each cut moves on to the next chunk boundary of the file, so that one job writes each chunk, in order, and
/// hashes it as it goes.
#pragma GCC visibility push(default)  // its test cuts jobs itself
std::vector<std::vector<Slice>> cut_into_jobs(const std::vector<Slice>& contiguous, size_t bytes, int workers,
                                              SnapshotState& state);
#pragma GCC visibility pop

/// The bytes a copy job writes between reports to `state.digest`: small enough to be hashed from the
/// core's cache right after the copy (256 KiB measured best, checkpoint_hash_bench).
inline constexpr size_t kFusedPieceBytes = size_t{256} << 10;

/// Holds in `state` an alias of each strided entry of `pending` as it is now (SnapshotState::strided_views):
/// what its job reads. Called on the caller's thread before the jobs are submitted.
void hold_strided_views(const NamedTensors& tensors, const PendingCopies& pending, SnapshotState& state);

/// Submits one pool job per group and per strided entry; `state` counts them as pending first. When
/// `state` hashes, a group job copies kFusedPieceBytes at a time and hashes each piece after its copy, and
/// a strided job reports its entry when copied. Jobs hold
/// the state (not the tensors: a job's closure may die on the pool thread, and the last reference of a
/// Python-owned tensor must not); a strided job reads its source from `state->strided_views`.
void submit_cpu_copies(CopyPool& pool, std::vector<std::vector<Slice>> groups, const std::vector<size_t>& strided,
                       const std::vector<PlanEntry>& plan, uint8_t* base, const std::shared_ptr<SnapshotState>& state);

}  // namespace ettkit::checkpoint::detail
