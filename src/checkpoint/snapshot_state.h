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

struct BoundEntries;  // bound_entries.h

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

  // Each entry's version at save(), read from its tensor's own counter: no reference to the counter is taken
  // per tensor (20,001 of them a save, issue #65). A verdict reads the counter through the source tensor,
  // held until drop_sources(), which keeps in `versions` the counters of the entries it leaves undecided.
  std::vector<uint32_t> version_at_save;
  std::vector<c10::VariableVersion> versions;  // empty until drop_sources() leaves an entry undecided
  std::unique_ptr<std::atomic<int32_t>[]> remaining;  // CPU slices still to copy per entry (0: copied)
  size_t remaining_capacity = 0;
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
  // Or, on the bound save's fast path, the cache whose storage references play read_storages' role: one
  // reference per save instead of one per tensor (bound_entries.h). Let go with the sources.
  std::shared_ptr<const BoundEntries> bound;
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
  std::shared_ptr<InOrderDigest> tensor_digest;  // the stager's, kept per arena and plan (InOrderDigest::reuse)
  /// The `n` bytes at `p` in the arena are copied: hashed now into each digest (`hash_now`) or left waiting.
  void report(const uint8_t* p, size_t n, bool hash_now = true) {
    if (digest) digest->covered(p, n, hash_now);
    if (tensor_digest) tensor_digest->covered(p, n, hash_now);
  }
  bool hashes() const { return digest || tensor_digest; }
  bool indexed = false;  // mu: by_storage is built (on the first wait_for()), and constant from then on
  std::unordered_map<const void*, std::vector<int>> by_storage;

  /// Sizes the per-entry vectors for `n` entries, every one undecided, owned by the calling thread; every
  /// other field as a new state's. A recycled state (StatePool) keeps its vectors' capacity: no allocation
  /// per save proportional to the tensor count once the pool holds states of that size.
  void start(size_t n) {
    owner = std::this_thread::get_id();
    entry_waiters.store(0);
    pending_jobs = 0;
    error = nullptr;
    staged_us.store(0);
    version_at_save.assign(n, 0);
    versions.clear();
    if (remaining_capacity < n) {
      remaining = std::make_unique<std::atomic<int32_t>[]>(n);
      remaining_capacity = n;
    }
    verdict.assign(n, kUndecided);
    undecided = 0;
    cuda_class.assign(n, -1);
    storages.assign(n, nullptr);
    clear_held();
#if ETTKIT_WITH_CUDA
    cuda_events.clear();
#endif
    device = DeviceProgress{};
    digest.reset();
    tensor_digest.reset();
    indexed = false;
    by_storage.clear();
  }
  /// Lets go of everything the save held (sources, storages, digests), keeping the vectors' capacity.
  void clear_held() {
    sources.clear();
    held.reset();
    read_storages.clear();
    bound.reset();
    strided_views.clear();
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
    verdict[i] = version_now(i) == version_at_save[i] ? kClean : kChanged;
    --undecided;
  }
  /// Entry i's version counter now (mu held, entry undecided): through its source while the sources are
  /// held (an undecided entry's are: save() holds them whenever a copy is left), else the counter
  /// drop_sources() kept.
  uint32_t version_now(size_t i) const {
    if (!versions.empty()) return versions[i].current_version();
    return source(i).unsafeGetTensorImpl()->version_counter().current_version();
  }
  /// Before the sources go (mu held): the counters of the entries still undecided, for their verdicts later.
  void keep_undecided_versions() {
    if (undecided == 0 || !versions.empty() || (!held && sources.size() != verdict.size())) return;
    versions.resize(verdict.size());
    for (size_t i = 0; i < verdict.size(); ++i) {
      if (verdict[i] == kUndecided) versions[i] = source(i).unsafeGetTensorImpl()->version_counter();
    }
  }
};

}  // namespace ettkit::checkpoint::detail

namespace ettkit::checkpoint {
// The name checkpointer.h declares; its body lives in detail so that the copy engine can take it.
struct Snapshot::State : detail::SnapshotState {};
}  // namespace ettkit::checkpoint

namespace ettkit::checkpoint::detail {

/// The states of a stager's finished saves, kept for its next ones with their per-entry vectors' capacity
/// (SnapshotState::start): a save of 20,001 tensors otherwise allocated and faulted in a dozen arrays of
/// 20,001 entries on the caller's thread (issue #65). A state comes back when its last reference goes, on
/// whichever thread that is, having let go of what it held (as its destructor would have there).
/// `State`: Snapshot::State (named by the stager, which may).
template <typename State>
class StatePool : public std::enable_shared_from_this<StatePool<State>> {
 public:
  /// A state started for `n` entries, owned by the calling thread (SnapshotState::start).
  std::shared_ptr<State> take(size_t n) {
    std::unique_ptr<State> s;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!free_.empty()) {
        s = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!s) s = std::make_unique<State>();
    s->start(n);
    std::weak_ptr<StatePool> pool = this->weak_from_this();
    return std::shared_ptr<State>(s.release(), [pool](State* p) {
      std::unique_ptr<State> back(p);
      if (auto to = pool.lock()) to->give_back(std::move(back));
    });
  }

 private:
  // Two arenas, a save or two beyond (handles the caller keeps): more are freed.
  static constexpr size_t kKept = 4;
  void give_back(std::unique_ptr<State> s) {
    s->clear_held();
    s->digest.reset();
    s->tensor_digest.reset();
    s->versions.clear();
    s->error = nullptr;
    std::lock_guard<std::mutex> lk(mu_);
    if (free_.size() < kKept) free_.push_back(std::move(s));
  }
  std::mutex mu_;
  std::vector<std::unique_ptr<State>> free_;
};

}  // namespace ettkit::checkpoint::detail
