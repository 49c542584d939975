#pragma once
// What one save's copies share: the progress and the per-entry verdicts that the copy engine (copy_engine.h)
// writes and the Snapshot's fences (snapshot.cpp) read. Private to the stager's units.
#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "checkpoint/cuda_event.h"
#include "checkpoint/device_copy_backend.h"
#include "checkpoint/in_order_digest.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/config.h"

namespace ettkit::checkpoint::detail {

/// How an entry's copy is judged: its version counter compared with the one recorded at save().
enum CopyVerdict : uint8_t { kUndecided = 0, kClean = 1, kChanged = 2 };

/// One save's copies. Shared by the Snapshot, the copy jobs (CPU) and nobody else. Per-entry vectors are
/// sized in Stager::stage() and not resized afterwards; `remaining` and `staged_us` are atomics; everything
/// else that changes is guarded by `mu`.
struct SnapshotState {
  mutable std::mutex mu;  // guards pending_jobs, error, verdict, sources
  std::condition_variable cv;
  // Threads blocked in cv for single entries (Snapshot::wait_for): a copied entry notifies only when one
  // waits. The waits for every job (wait_staged, the writer) are woken by job_done alone: notified for each
  // of 2,001 small entries, the writer thread was woken 2,001 times a save (a quarter of a memory save's
  // CPU in perf, scheduler and futex).
  std::atomic<int> entry_waiters{0};
  int pending_jobs = 0;         // CPU copy jobs not finished
  std::exception_ptr error;
  std::atomic<int64_t> staged_us{0};
  std::thread::id owner;  // the thread that called stage()

  std::vector<c10::VariableVersion> versions;  // shares each source's counter (disabled: copied in save())
  std::vector<uint32_t> version_at_save;
  std::unique_ptr<std::atomic<int32_t>[]> remaining;  // CPU slices still to copy per entry (0: copied)
  std::vector<uint8_t> verdict;
  size_t undecided = 0;                // entries whose verdict is kUndecided
  std::vector<int8_t> cuda_class;      // index into cuda_events; -1 for CPU entries
  std::vector<const void*> storages;   // storage_key per entry
  std::vector<at::Tensor> sources;     // the caller's tensors, until drop_sources() on the owner thread
  // Or, instead of `sources`, the caller's own list (SaveBinding::held, unchanged while held), until then.
  std::shared_ptr<const NamedTensors> held;
  /// Entry i's source tensor, while the sources are held.
  const at::Tensor& source(size_t i) const { return held ? (*held)[i].second : sources[i]; }
  // What the pool's jobs read, as it was at save(): the storages of the contiguous entries and an alias of
  // each strided one (hold_read_storages). A tensor keeps the storage it has now, not the one save() saw:
  // `p.data = x` or `set_` right after save() would free the storage a job still reads. Until
  // drop_sources(), on the owner thread (a storage's last reference may run a Python deleter).
  std::vector<c10::Storage> read_storages;
  std::vector<at::Tensor> strided_views;  // in the order of PendingCopies::strided
#if ETTKIT_WITH_CUDA
  std::vector<std::unique_ptr<CudaEvent>> cuda_events;  // one per copy class, in stream order
#endif
  // Or the batched device path's progress (device_stager.h; mu): cuda_class then indexes its classes.
  DeviceProgress device;
  // What the copies hash as they write (Stager::stage's `digests`; in_order_digest.h), for the writer to
  // finish: the data file's chunks (`digest`), and on the disk tier the whole tensors' digests. Set before
  // any copy starts, never reset.
  std::unique_ptr<InOrderDigest> digest;
  std::unique_ptr<InOrderDigest> tensor_digest;
  /// The `n` bytes at `p` in the arena are copied: hashed now into each digest (`hash_now`) or left waiting.
  void report(const uint8_t* p, size_t n, bool hash_now = true) {
    if (digest) digest->covered(p, n, hash_now);
    if (tensor_digest) tensor_digest->covered(p, n, hash_now);
  }
  bool hashes() const { return digest || tensor_digest; }
  std::once_flag index_once;
  std::unordered_map<const void*, std::vector<int>> by_storage;  // built on the first wait_for()

  /// Sizes the per-entry vectors for `n` entries, every one undecided, owned by the calling thread.
  void start(size_t n) {
    owner = std::this_thread::get_id();
    versions.resize(n);
    version_at_save.assign(n, 0);
    remaining = std::make_unique<std::atomic<int32_t>[]>(n);
    verdict.assign(n, kUndecided);
    cuda_class.assign(n, -1);
    storages.resize(n);
  }
  void entry_copied(size_t i) {
    if (remaining[i].fetch_sub(1) == 1 && entry_waiters.load() > 0) {
      { std::lock_guard<std::mutex> lk(mu); }
      cv.notify_all();
    }
  }
  void job_done(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (e && !error) error = e;
      --pending_jobs;
    }
    cv.notify_all();
  }
  /// Blocks until `pred`, which reads pending_jobs only, holds (called with `lk` on mu held).
  template <typename Pred>
  void wait(std::unique_lock<std::mutex>& lk, Pred pred) {
    cv.wait(lk, pred);
  }
  /// Blocks until `pred`, which reads entries' `remaining`, holds (called with `lk` on mu held).
  template <typename Pred>
  void wait_entries(std::unique_lock<std::mutex>& lk, Pred pred) {
    entry_waiters.fetch_add(1);
    cv.wait(lk, pred);
    entry_waiters.fetch_sub(1);
  }
  bool cuda_finished() const {
    if (!device.done) return false;  // mu held
#if ETTKIT_WITH_CUDA
    return cuda_events.empty() || cuda_events.back()->query();
#else
    return true;
#endif
  }
  /// Decides entry i from its counter now (mu held). Only valid once no write that overlapped the copy
  /// can still be running unseen: see the callers.
  void decide(size_t i) {
    if (verdict[i] != kUndecided) return;
    verdict[i] = versions[i].current_version() == version_at_save[i] ? kClean : kChanged;
    --undecided;
  }
};

}  // namespace ettkit::checkpoint::detail

namespace ettkit::checkpoint {
// The name checkpointer.h declares; its body lives in detail so that the copy engine can take it.
struct Snapshot::State : detail::SnapshotState {};
}  // namespace ettkit::checkpoint
