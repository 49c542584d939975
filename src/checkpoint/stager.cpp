// Host arenas, the cached snapshot plan and the copy engine (CPU worker threads, CUDA copy stream).
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <torch/cuda.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>
#include <unordered_map>

#include "common/background_thread.h"
#include "common/logging.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

namespace ettkit::checkpoint {

OnBusy parse_on_busy(const std::string& s) {
  if (s == "wait") return OnBusy::kWait;
  if (s == "skip") return OnBusy::kSkip;
  if (s == "error") return OnBusy::kError;
  ETTKIT_THROW(InvalidArgument, "on_busy='", s, "' is not one of 'wait', 'skip', 'error'");
}

namespace {

#if ETTKIT_WITH_CUDA
/// A CUDA event owned by its creator (timing disabled: used for ordering only). ATen's CUDAEvent would
/// pull in ATen/cuda headers that need the full CUDA toolkit (cusparse, cublas) at compile time.
class CudaEvent {
 public:
  explicit CudaEvent(c10::DeviceIndex device) : device_(device) {
    c10::cuda::CUDAGuard g(device_);
    ETTKIT_CUDA_CHECK(cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming));
  }
  ~CudaEvent() {
    if (ev_) cudaEventDestroy(ev_);
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  void record(const c10::cuda::CUDAStream& s) { ETTKIT_CUDA_CHECK(cudaEventRecord(ev_, s.stream())); }
  void block(const c10::cuda::CUDAStream& s) { ETTKIT_CUDA_CHECK(cudaStreamWaitEvent(s.stream(), ev_, 0)); }
  bool query() const { return cudaEventQuery(ev_) == cudaSuccess; }
  void synchronize() { ETTKIT_CUDA_CHECK(cudaEventSynchronize(ev_)); }
  c10::DeviceIndex device() const { return device_; }

 private:
  c10::DeviceIndex device_;
  cudaEvent_t ev_ = nullptr;
};
#endif

/// One host allocation, exact size (rounded to pages), pinned or plain. Owned by Stager::Impl.
struct Arena {
  uint8_t* ptr = nullptr;
  size_t size = 0;
  bool pinned = false;
  bool busy = false;  // guarded by Stager::Impl::mu

  void allocate(size_t bytes, bool pin) {
    size = std::max<size_t>(bytes, 1);
    pinned = pin;
#if ETTKIT_WITH_CUDA
    if (pin) {
      void* p = nullptr;
      // cudaHostAlloc, not the CachingHostAllocator: exact size, no power-of-two rounding.
      ETTKIT_CUDA_CHECK(cudaHostAlloc(&p, size, cudaHostAllocPortable), "allocating a ", size,
                        "-byte pinned checkpoint arena (pin_memory=False stages into plain host memory)");
      ptr = static_cast<uint8_t*>(p);
      return;
    }
#else
    ETTKIT_EXPECTS(!pin, "pin_memory=1 needs ettkit built with CUDA");
#endif
    // mmap: page-aligned, returned to the OS on munmap (malloc might keep it and inflate RSS).
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ETTKIT_CHECK(p != MAP_FAILED, IoError, "mmap of a ", size, "-byte checkpoint arena failed: ", std::strerror(errno));
#ifdef MADV_HUGEPAGE
    ::madvise(p, size, MADV_HUGEPAGE);
#endif
    ptr = static_cast<uint8_t*>(p);
  }
  void free() noexcept {
    if (!ptr) return;
#if ETTKIT_WITH_CUDA
    if (pinned) {
      cudaFreeHost(ptr);
      ptr = nullptr;
      return;
    }
#endif
    ::munmap(ptr, size);
    ptr = nullptr;
  }
};

/// Fixed pool of copy threads; jobs are closures. Joined by its owner.
class CopyPool {
 public:
  explicit CopyPool(int n) {
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
  }
  ~CopyPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  void submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void run() {
    ettkit::detail::mark_background_thread();
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }
  std::mutex mu_;  // guards jobs_, stop_
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

bool same_structure(const std::vector<PlanEntry>& plan, const NamedTensors& tensors) {
  if (plan.size() != tensors.size()) return false;
  for (size_t i = 0; i < plan.size(); ++i) {
    const at::Tensor& t = tensors[i].second;
    const PlanEntry& e = plan[i];
    if (e.name != tensors[i].first || e.dtype != t.scalar_type() || e.device != t.device()) return false;
    if (!std::equal(e.shape.begin(), e.shape.end(), t.sizes().begin(), t.sizes().end())) return false;
  }
  return true;
}

/// Whether `t` is a Python tensor subclass wrapper (DTensor, ShardedTensor, a Parameter around either,
/// FSDP2's parameters, any `_make_wrapper_subclass` type): its dispatch keys include Python, and its storage
/// is an empty placeholder whose data pointer is null. Its values live in the tensors it wraps.
bool is_python_wrapper(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) || t.key_set().has(c10::DispatchKey::PythonTLSSnapshot);
}

/// The bytes of its storage that `t`'s elements reach: the view's extent from the storage's start.
size_t storage_extent(const at::Tensor& t) {
  const size_t item = t.dtype().itemsize();
  if (t.is_contiguous()) {  // the common case, without a loop over the dimensions
    return t.numel() == 0 ? 0 : (static_cast<size_t>(t.storage_offset()) + static_cast<size_t>(t.numel())) * item;
  }
  return at::detail::computeStorageNbytes(t.sizes(), t.strides(), item, static_cast<size_t>(t.storage_offset()));
}

/// Whether the values of `t` can be staged by copying bytes out of its storage. The copy engine reads
/// `nbytes()` from the data pointer (or strided elements of the storage), which is right only for a plain
/// dense tensor whose own storage holds every element it shows. Anything else is refused (with
/// why_not_plain_dense()), so that no mistake of a caller (Python handing over a wrapper instead of its
/// local tensor) can become a read of memory the tensor does not own. Runs once per tensor per save.
bool is_plain_dense(const at::Tensor& t) {
  static const c10::DispatchKeySet kNotPlain{c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                             c10::DispatchKey::Functionalize};
  if (t.key_set().has_any(kNotPlain) || t.is_nested() || t.is_quantized() || t.layout() != c10::kStrided ||
      !t.has_storage()) {
    return false;
  }
  const size_t need = storage_extent(t);
  const c10::Storage& storage = t.storage();
  return need == 0 || (storage.data() != nullptr && need <= storage.nbytes());
}

/// Why is_plain_dense(t) is false, for the error message.
std::string why_not_plain_dense(const at::Tensor& t) {
  if (is_python_wrapper(t)) {
    return "a Python tensor subclass (its dispatch keys include Python: a DTensor, a ShardedTensor, a "
           "Parameter wrapping either, or another __torch_dispatch__ wrapper) whose storage does not hold its "
           "values; stage its local tensor(s) instead";
  }
  if (t.key_set().has(c10::DispatchKey::Functionalize)) return "a functional tensor (torch.compile tracing)";
  if (t.is_nested()) return "a nested tensor";
  if (t.is_quantized()) return "a quantized tensor";
  if (t.layout() != c10::kStrided) return "not a dense strided tensor";
  if (!t.has_storage()) return "a tensor without storage";
  const c10::Storage& storage = t.storage();
  const size_t need = storage_extent(t);
  if (storage.data() == nullptr) return "a tensor whose storage has no data";
  return ettkit::detail::concat("a view reaching byte ", need, " of a storage of ", storage.nbytes(), " bytes");
}

/// The key CopyPriority and wait_for() match tensors by: their storage. A parameter and the detached
/// tensor a state dict holds share it; so do the per-table views of a fused embedding storage. A Python
/// subclass wrapper has no storage of its own to match (its local tensors do): nullptr.
const void* storage_key(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || is_python_wrapper(t)) return nullptr;
  return t.storage().data();
}

/// How an entry's copy is judged: its version counter compared with the one recorded at save().
enum Verdict : uint8_t { kUndecided = 0, kClean = 1, kChanged = 2 };

/// The copy class of entries not named in a CopyPriority: after every named class.
constexpr int kRestClass = 2;

}  // namespace

// One save's copies. Shared by the Snapshot, the copy jobs (CPU) and nobody else. Per-entry vectors are
// sized in stage() and not resized afterwards; `remaining` and `staged_us` are atomics; everything else
// that changes is guarded by `mu`.
struct Snapshot::State {
  mutable std::mutex mu;  // guards pending_jobs, error, verdict, sources
  std::condition_variable cv;
  std::atomic<int> waiters{0};  // threads blocked in cv (copy jobs notify only when someone waits)
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
#if ETTKIT_WITH_CUDA
  std::vector<std::unique_ptr<CudaEvent>> cuda_events;  // one per copy class, in stream order
#endif
  std::once_flag index_once;
  std::unordered_map<const void*, std::vector<int>> by_storage;  // built on the first wait_for()

  void notify_waiters() {
    if (waiters.load() > 0) {
      { std::lock_guard<std::mutex> lk(mu); }
      cv.notify_all();
    }
  }
  void entry_copied(size_t i) {
    if (remaining[i].fetch_sub(1) == 1) notify_waiters();
  }
  void job_done(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (e && !error) error = e;
      --pending_jobs;
    }
    cv.notify_all();
  }
  /// Blocks until `pred` holds (called with `lk` on mu held).
  template <typename Pred>
  void wait(std::unique_lock<std::mutex>& lk, Pred pred) {
    waiters.fetch_add(1);
    cv.wait(lk, pred);
    waiters.fetch_sub(1);
  }
  bool cuda_finished() const {
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

struct Stager::Impl {
  StagerOptions opt;
  bool pin = false;
  std::unique_ptr<CopyPool> pool;
  mutable std::mutex mu;  // guards arenas[].busy, plan, counters
  std::condition_variable cv;
  std::vector<Arena> arenas;
  std::shared_ptr<const std::vector<PlanEntry>> plan;
  int64_t plan_total = 0;
  int64_t plan_builds = 0;
  int64_t arena_allocations = 0;
  double busy_wait_s = 0;
#if ETTKIT_WITH_CUDA
  std::optional<c10::cuda::CUDAStream> copy_stream;
#endif
};

Stager::Stager(StagerOptions options) : impl_(std::make_unique<Impl>()) {
  ETTKIT_EXPECTS(options.num_arenas == 1 || options.num_arenas == 2, "num_arenas=", options.num_arenas,
                 " must be 1 or 2 (2 = double-buffering)");
  ETTKIT_EXPECTS(options.copy_threads >= 0 && options.copy_threads <= 64, "copy_threads=", options.copy_threads,
                 " must be in [0, 64]");
  ETTKIT_EXPECTS(options.pin_memory >= -1 && options.pin_memory <= 1, "pin_memory=", options.pin_memory,
                 " must be -1 (auto), 0 or 1");
  impl_->opt = options;
  impl_->pin = options.pin_memory == 1 || (options.pin_memory == -1 && ETTKIT_WITH_CUDA && torch::cuda::is_available());
  int threads = options.copy_threads > 0 ? options.copy_threads
                                         : std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 4);
  impl_->pool = std::make_unique<CopyPool>(threads);
}

Stager::~Stager() {
  {
    // Snapshots still out keep pointers into the arenas: wait until they are returned.
    std::unique_lock<std::mutex> lk(impl_->mu);
    impl_->cv.wait(lk, [&] {
      return std::none_of(impl_->arenas.begin(), impl_->arenas.end(), [](const Arena& a) { return a.busy; });
    });
  }
  impl_->pool.reset();
  for (Arena& a : impl_->arenas) a.free();
}

int64_t Stager::arena_bytes() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->arenas.empty() ? 0 : static_cast<int64_t>(impl_->arenas[0].size);
}
int Stager::num_arenas() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return static_cast<int>(impl_->arenas.size());
}
bool Stager::pinned() const { return impl_->pin; }
int64_t Stager::plan_builds() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->plan_builds;
}
int64_t Stager::arena_allocations() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->arena_allocations;
}
double Stager::busy_wait_s() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->busy_wait_s;
}

void Stager::release_arena(int arena) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->arenas[static_cast<size_t>(arena)].busy = false;
  }
  impl_->cv.notify_all();
}

std::shared_ptr<Snapshot> Stager::stage(const NamedTensors& tensors, OnBusy on_busy, const CopyPriority& priority,
                                        int64_t sync_copy_max_bytes) {
  Impl& im = *impl_;
  int64_t begin_us = epoch_us();
  // The copies read storage; they must not become autograd history (callers pass parameters as they are).
  at::NoGradGuard no_grad;
  for (const auto& [name, t] : tensors) {
    ETTKIT_EXPECTS(t.defined(), "state dict entry '", name, "' is an undefined tensor");
    ETTKIT_EXPECTS(t.device().is_cpu() || t.device().is_cuda(), "state dict entry '", name, "' is on device ",
                   t.device(), "; only CPU and CUDA tensors can be staged");
    ETTKIT_EXPECTS(is_plain_dense(t), "state dict entry '", name, "' cannot be staged: it is ",
                   why_not_plain_dense(t), "; ettkit stages plain dense CPU or CUDA tensors");
  }
  std::unique_lock<std::mutex> lk(im.mu);
  // 1) Plan: reuse the cached one unless the structure changed.
  std::shared_ptr<const std::vector<PlanEntry>> plan = im.plan;
  if (!plan || !same_structure(*plan, tensors)) {
    auto fresh = std::make_shared<std::vector<PlanEntry>>();
    fresh->reserve(tensors.size());
    int64_t off = 0;
    for (const auto& [name, t] : tensors) {
      PlanEntry e{name, t.scalar_type(), t.sizes().vec(), t.device(), static_cast<int64_t>(t.nbytes()), off};
      off += e.nbytes;
      fresh->push_back(std::move(e));
    }
    int64_t need = off;
    int64_t budget = im.opt.memory_budget_bytes;
    ETTKIT_EXPECTS(budget <= 0 || need <= budget, "the state dict needs a ", need,
                   "-byte host arena but memory_budget_bytes=", budget, "; raise the budget or save less state");
    int want = im.opt.num_arenas;
    if (want == 2 && budget > 0 && 2 * need > budget) {
      ETTKIT_LOG_WARN("checkpoint: memory_budget_bytes=", budget, " fits one ", need,
                      "-byte arena, not two; double-buffering is off");
      want = 1;
    }
    if (im.arenas.empty() || static_cast<int64_t>(im.arenas[0].size) < need ||
        static_cast<int>(im.arenas.size()) != want) {
      // The state grew (an optimizer's lazy state appeared, new tensors): reallocation needs every arena
      // back, and frees the old ones before allocating, so the arenas never exceed the budget together.
      // While one is still persisting this is a busy save like any other: on_busy decides.
      auto all_free = [&] {
        return std::none_of(im.arenas.begin(), im.arenas.end(), [](const Arena& a) { return a.busy; });
      };
      if (!all_free()) {
        if (on_busy == OnBusy::kSkip) return nullptr;
        ETTKIT_CHECK(on_busy != OnBusy::kError, InvalidArgument, "checkpoint save requested while the previous "
                     "save is still persisting and the state grew, so the arena must be reallocated (on_busy="
                     "'error'); use on_busy='wait' or 'skip'");
        int64_t w0 = steady_ns();
        im.cv.wait(lk, all_free);
        im.busy_wait_s += static_cast<double>(steady_ns() - w0) * 1e-9;
      }
      for (Arena& a : im.arenas) a.free();
      im.arenas.assign(static_cast<size_t>(want), Arena{});
      for (Arena& a : im.arenas) {
        a.allocate(static_cast<size_t>(need), im.pin);
        ++im.arena_allocations;
      }
    }
    im.plan = fresh;
    im.plan_total = need;
    ++im.plan_builds;
    plan = fresh;
  }
  // 2) A free arena.
  auto free_arena = [&]() -> int {
    for (size_t i = 0; i < im.arenas.size(); ++i)
      if (!im.arenas[i].busy) return static_cast<int>(i);
    return -1;
  };
  int arena = free_arena();
  if (arena < 0) {
    if (on_busy == OnBusy::kSkip) return nullptr;
    ETTKIT_CHECK(on_busy != OnBusy::kError, InvalidArgument,
                 "checkpoint save requested while the previous save is still persisting (on_busy='error'); "
                 "use on_busy='wait' or 'skip', or a memory budget that allows two arenas");
    int64_t w0 = steady_ns();
    im.cv.wait(lk, [&] { return (arena = free_arena()) >= 0; });
    im.busy_wait_s += static_cast<double>(steady_ns() - w0) * 1e-9;
  }
  im.arenas[static_cast<size_t>(arena)].busy = true;
  uint8_t* base = im.arenas[static_cast<size_t>(arena)].ptr;
  lk.unlock();

  std::shared_ptr<Snapshot> snap(new Snapshot());
  snap->stager_ = this;
  snap->arena_ = arena;
  snap->data_ = base;
  snap->plan_ = plan;
  snap->stage_begin_us_ = begin_us;
  auto state = std::make_shared<Snapshot::State>();
  snap->state_ = state;
  const size_t n = tensors.size();
  state->owner = std::this_thread::get_id();
  state->versions.resize(n);
  state->version_at_save.assign(n, 0);
  state->remaining = std::make_unique<std::atomic<int32_t>[]>(n);
  state->verdict.assign(n, kUndecided);
  state->cuda_class.assign(n, -1);
  state->storages.resize(n);

  // 3) Copy order: the classes of `priority` first, then the rest; within a class, plan order.
  std::vector<uint8_t> cls;
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  if (!priority.empty()) {
    std::unordered_map<const void*, int> rank_of;
    rank_of.reserve(priority.size());
    for (const auto& [key, c] : priority) {
      if (key) rank_of.emplace(key, std::clamp(c, 0, kRestClass));
    }
    cls.assign(n, kRestClass);
    for (size_t i = 0; i < n; ++i) {
      auto it = rank_of.find(storage_key(tensors[i].second));
      if (it != rank_of.end()) cls[i] = static_cast<uint8_t>(it->second);
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cls[a] < cls[b]; });
  }
  auto class_of = [&](size_t i) -> int { return cls.empty() ? 0 : cls[i]; };

  // 4) Copies. Small and inference tensors now, synchronously (inference tensors have no version counter
  // to check); big CPU tensors by the pool in byte-balanced slices; CUDA tensors on the copy stream.
  const int64_t sync_max = std::max(im.opt.sync_copy_max_bytes, sync_copy_max_bytes);
  struct Slice {
    const uint8_t* src;
    uint8_t* dst;
    size_t n;
    size_t entry;
  };
  std::vector<Slice> contiguous;
  std::vector<size_t> strided;  // indices of non-contiguous CPU tensors
  std::vector<size_t> cuda;     // in copy order
  size_t big_bytes = 0;
  try {
    for (size_t i : order) {
      const at::Tensor& t = tensors[i].second;
      const PlanEntry& e = (*plan)[i];
      uint8_t* dst = base + e.offset;
      state->storages[i] = storage_key(t);
      state->remaining[i].store(0, std::memory_order_relaxed);
      bool inference = t.is_inference();
      if (!inference) {
        state->versions[i] = t.unsafeGetTensorImpl()->version_counter();
        state->version_at_save[i] = state->versions[i].current_version();
      }
      if (t.device().is_cuda()) {
        ETTKIT_EXPECTS(!inference, "state dict entry '", tensors[i].first,
                       "' is a CUDA inference tensor; clone it outside inference mode to checkpoint it");
        cuda.push_back(i);
      } else if (inference || e.nbytes <= sync_max) {
        if (e.nbytes == 0) {
          // An empty tensor's data pointer may be null, and memcpy's arguments must not be even for 0 bytes.
        } else if (t.is_contiguous()) {
          std::memcpy(dst, t.const_data_ptr(), static_cast<size_t>(e.nbytes));
        } else {
          at::from_blob(dst, e.shape, t.options()).copy_(t);
        }
        state->verdict[i] = kClean;  // copied before save() returns: nothing could overlap it
      } else if (t.is_contiguous()) {
        contiguous.push_back({static_cast<const uint8_t*>(t.const_data_ptr()), dst, static_cast<size_t>(e.nbytes), i});
        big_bytes += static_cast<size_t>(e.nbytes);

      } else {
        state->remaining[i].store(1, std::memory_order_relaxed);
        strided.push_back(i);
      }
    }
  } catch (...) {
    snap->release();
    throw;
  }
  if (!contiguous.empty() || !strided.empty() || !cuda.empty()) state->sources.reserve(n);
  if (!contiguous.empty() || !strided.empty() || !cuda.empty()) {
    for (const auto& item : tensors) state->sources.push_back(item.second);
  }
  if (!cuda.empty()) {
#if ETTKIT_WITH_CUDA
    c10::Device dev = tensors[cuda[0]].second.device();
    for (size_t i : cuda) {
      ETTKIT_EXPECTS(tensors[i].second.device() == dev, "state dict entry '", tensors[i].first, "' is on ",
                     tensors[i].second.device(), " but others are on ", dev, "; one CUDA device per rank");
    }
    c10::cuda::CUDAGuard guard(dev);
    if (!im.copy_stream || im.copy_stream->device() != dev) im.copy_stream = c10::cuda::getStreamFromPool(false, dev.index());
    c10::cuda::CUDAStream stream = *im.copy_stream;
    // Stream order: the copies see everything already queued on the caller's stream (the optimizer step).
    CudaEvent ready(dev.index());
    ready.record(c10::cuda::getCurrentCUDAStream(dev.index()));
    ready.block(stream);
    {
      c10::cuda::CUDAStreamGuard sg(stream);
      for (size_t k = 0; k < cuda.size(); ++k) {
        size_t i = cuda[k];
        const at::Tensor& t = tensors[i].second;
        const PlanEntry& e = (*plan)[i];
        uint8_t* dst = base + e.offset;
        if (t.is_contiguous()) {
          ETTKIT_CUDA_CHECK(cudaMemcpyAsync(dst, t.const_data_ptr(), static_cast<size_t>(e.nbytes),
                                         cudaMemcpyDeviceToHost, stream.stream()));
        } else {
          at::from_blob(dst, e.shape, t.options().device(c10::kCPU)).copy_(t, /*non_blocking=*/true);
        }
        // The caching allocator must not hand this memory to another stream before the copy is done.
        c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
        state->cuda_class[i] = static_cast<int8_t>(state->cuda_events.size());
        // One event per copy class, so a fence on the first class does not wait for the rest.
        if (k + 1 == cuda.size() || class_of(cuda[k + 1]) != class_of(i)) {
          state->cuda_events.push_back(std::make_unique<CudaEvent>(dev.index()));
          state->cuda_events.back()->record(stream);
        }
      }
    }
#else
    snap->release();
    ETTKIT_THROW(InvalidArgument, "state dict entry '", tensors[cuda[0]].first,
                 "' is a CUDA tensor but ettkit was built without CUDA");
#endif
  }
  int workers = im.pool->size();
  std::vector<std::vector<Slice>> groups;
  if (!contiguous.empty()) {
    // Cut the byte stream (in copy order) into `workers` equal ranges (big tensors are split across
    // threads); every slice counts towards its entry's `remaining`.
    size_t per = std::max<size_t>((big_bytes + static_cast<size_t>(workers) - 1) / static_cast<size_t>(workers), 1 << 20);
    groups.emplace_back();
    size_t room = per;
    for (Slice s : contiguous) {
      while (s.n > 0) {
        size_t take = std::min(s.n, room);
        groups.back().push_back({s.src, s.dst, take, s.entry});
        state->remaining[s.entry].fetch_add(1, std::memory_order_relaxed);
        s.src += take;
        s.dst += take;
        s.n -= take;
        room -= take;
        if (room == 0) {
          groups.emplace_back();
          room = per;
        }
      }
    }
    if (groups.back().empty()) groups.pop_back();
  }
  {
    std::lock_guard<std::mutex> slk(state->mu);
    state->pending_jobs = static_cast<int>(groups.size() + strided.size());
  }
  // Jobs hold the state (not the tensors: a job's closure may die on the pool thread, and the last
  // reference of a Python-owned tensor must not).
  for (auto& g : groups) {
    im.pool->submit([state, g = std::move(g)] {
      for (const Slice& s : g) {
        std::memcpy(s.dst, s.src, s.n);
        state->entry_copied(s.entry);
      }
      state->job_done(nullptr);
    });
  }
  for (size_t i : strided) {
    const PlanEntry& e = (*plan)[i];
    uint8_t* dst = base + e.offset;
    im.pool->submit([state, i, dst, shape = e.shape] {
      std::exception_ptr err;
      try {
        at::NoGradGuard no_grad;
        const at::Tensor& src = state->sources[i];  // not touched by the owner while jobs are pending
        at::from_blob(dst, shape, src.options()).copy_(src);
      } catch (...) {
        err = std::current_exception();
      }
      state->entry_copied(i);
      state->job_done(err);
    });
  }
  state->undecided = static_cast<size_t>(std::count(state->verdict.begin(), state->verdict.end(), kUndecided));
  if (groups.empty() && strided.empty() && cuda.empty()) state->staged_us = epoch_us();
  return snap;
}

Snapshot::~Snapshot() {
  try {
    release();
  } catch (...) {
  }
  // The caller's thread, or whoever held the snapshot last; the checkpointer drops sources on its owner
  // thread before that (AsyncCheckpointer::Impl::collect_sources).
  drop_sources();
}

bool Snapshot::staged() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->pending_jobs == 0 && state_->cuda_finished();
}

void Snapshot::wait_copies() const {
  State& st = *state_;
  {
    std::unique_lock<std::mutex> lk(st.mu);
    st.wait(lk, [&] { return st.pending_jobs == 0; });
  }
#if ETTKIT_WITH_CUDA
  if (!st.cuda_events.empty()) st.cuda_events.back()->synchronize();
#endif
  if (st.staged_us.load() == 0) st.staged_us = epoch_us();
}

void Snapshot::wait_staged() {
  wait_copies();
  State& st = *state_;
  bool owner = std::this_thread::get_id() == st.owner;
  std::lock_guard<std::mutex> lk(st.mu);
  for (size_t i = 0; i < st.verdict.size(); ++i) {
    // CUDA entries: the copy is observed complete, so a write queued from now on runs after it. CPU
    // entries: on the owner thread every write issued before this call has returned (program order);
    // on another thread a write may still be running, so they stay undecided until changed_entries().
    if (st.cuda_class[i] >= 0 || owner) st.decide(i);
  }
  if (st.error) std::rethrow_exception(st.error);
}

void Snapshot::wait_staged_on_current_stream() {
  State& st = *state_;
#if ETTKIT_WITH_CUDA
  if (!st.cuda_events.empty()) {
    // GPU-side wait: the compute stream waits on the copy completion; the host does not block.
    st.cuda_events.back()->block(c10::cuda::getCurrentCUDAStream(st.cuda_events.back()->device()));
  }
#endif
  std::unique_lock<std::mutex> lk(st.mu);
  st.wait(lk, [&] { return st.pending_jobs == 0; });
  // A fence: what this thread (or its stream) writes from now on is ordered after every copy.
  for (size_t i = 0; i < st.verdict.size(); ++i) st.decide(i);
  if (st.error) std::rethrow_exception(st.error);
}

bool Snapshot::wait_for(const std::vector<at::Tensor>& tensors) {
  State& st = *state_;
  std::call_once(st.index_once, [&] {
    // Under mu: `verdict` is written by decide() on other threads (the writer's changed_entries(), a fence
    // on the autograd thread) while this index is built; reading it unlocked was a data race (make tsan).
    std::lock_guard<std::mutex> lk(st.mu);
    for (size_t i = 0; i < st.storages.size(); ++i) {
      if (st.storages[i] && st.verdict[i] == kUndecided) st.by_storage[st.storages[i]].push_back(static_cast<int>(i));
    }
  });
  std::vector<int> entries;
  for (const at::Tensor& t : tensors) {
    auto it = st.by_storage.find(storage_key(t));
    if (it != st.by_storage.end()) entries.insert(entries.end(), it->second.begin(), it->second.end());
  }
  if (entries.empty()) return false;
  bool waited = false;
#if ETTKIT_WITH_CUDA
  int cls = -1;
  for (int i : entries) cls = std::max<int>(cls, st.cuda_class[static_cast<size_t>(i)]);
  if (cls >= 0) {
    CudaEvent& ev = *st.cuda_events[static_cast<size_t>(cls)];
    waited = !ev.query();
    ev.block(c10::cuda::getCurrentCUDAStream(ev.device()));
  }
#endif
  auto copied = [&] {
    return std::all_of(entries.begin(), entries.end(), [&](int i) { return st.remaining[static_cast<size_t>(i)].load() == 0; });
  };
  std::unique_lock<std::mutex> lk(st.mu);
  if (!copied()) {
    waited = true;
    st.wait(lk, copied);
  }
  for (int i : entries) st.decide(static_cast<size_t>(i));
  return waited;
}

std::vector<std::string> Snapshot::changed_entries() {
  State& st = *state_;
  std::vector<std::string> out;
  std::lock_guard<std::mutex> lk(st.mu);
  for (size_t i = 0; i < st.verdict.size(); ++i) {
    st.decide(i);
    if (st.verdict[i] == kChanged) out.push_back((*plan_)[i].name);
  }
  return out;
}

void Snapshot::drop_sources() {
  State& st = *state_;
  std::vector<at::Tensor> dropped;
  {
    std::unique_lock<std::mutex> lk(st.mu);
    st.wait(lk, [&] { return st.pending_jobs == 0; });  // CPU jobs read the sources until then
    // On the owner thread this is a fence (program order): decide what is still undecided while here.
    if (std::this_thread::get_id() == st.owner) {
      for (size_t i = 0; i < st.verdict.size(); ++i) st.decide(i);
    }
    dropped.swap(st.sources);
  }
  // `dropped` dies here, outside the lock, on the calling thread.
}

bool Snapshot::all_decided() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->undecided == 0;
}

int64_t Snapshot::staged_us() const { return state_->staged_us.load(); }

int64_t Snapshot::total_bytes() const {
  return plan_->empty() ? 0 : plan_->back().offset + plan_->back().nbytes;
}

NamedTensors Snapshot::tensors() {
  NamedTensors out;
  out.reserve(plan_->size());
  for (const PlanEntry& e : *plan_) {
    out.emplace_back(e.name, at::from_blob(data_ + e.offset, e.shape, at::TensorOptions().dtype(e.dtype)));
  }
  return out;
}

void Snapshot::release() {
  if (!stager_ || released_.exchange(true)) return;
  wait_copies();
  stager_->release_arena(arena_);
}

}  // namespace ettkit::checkpoint
