// The stager's copy engine (copy_engine.h).
#include "checkpoint/copy_engine.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include "common/background_thread.h"
#include "ettkit/common/config.h"
#include "ettkit/common/error.h"

#if ETTKIT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "checkpoint/cuda_gather.h"
#include "common/cuda_check.h"
#endif

namespace ettkit::checkpoint::detail {

CopyPool::CopyPool(int n) {
  for (int i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void CopyPool::submit(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void CopyPool::run() {
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

namespace {

/// Copies CPU tensor `t` into `dst` at once.
void copy_now(const at::Tensor& t, const PlanEntry& e, uint8_t* dst) {
  if (e.nbytes == 0) {
    // An empty tensor's data pointer may be null, and memcpy's arguments must not be even for 0 bytes.
  } else if (t.is_contiguous()) {
    std::memcpy(dst, t.const_data_ptr(), static_cast<size_t>(e.nbytes));
  } else {
    at::from_blob(dst, e.shape, t.options()).copy_(t);
  }
}

}  // namespace

void copy_small_now(const NamedTensors& tensors, const std::vector<PlanEntry>& plan, const CopyOrder& order,
                    uint8_t* base, int64_t sync_max, SnapshotState& state, PendingCopies& pending,
                    c10::DeviceType device_type) {
  pending.clear();
  pending.contiguous.reserve(tensors.size());
  // What the pool's jobs will read, held as it is now (SnapshotState::read_storages), in the same pass.
  state.read_storages.reserve(tensors.size());
  size_t undecided = 0;
  for (size_t i : order.order) {
    const at::Tensor& t = tensors[i].second;
    const PlanEntry& e = plan[i];
    uint8_t* dst = base + e.offset;
    state.storages[i] = storage_key(t);
    state.remaining[i].store(0, std::memory_order_relaxed);
    bool inference = t.is_inference();
    // The version now, read from the tensor's own counter (no reference to it: SnapshotState::versions).
    if (!inference) state.version_at_save[i] = t.unsafeGetTensorImpl()->version_counter().current_version();
    if (t.device().type() == device_type) {
      ETTKIT_EXPECTS(!inference, "state dict entry '", tensors[i].first,
                     "' is a CUDA inference tensor; clone it outside inference mode to checkpoint it");
      pending.cuda.push_back(i);
      ++undecided;
    } else if (inference || e.nbytes <= sync_max) {
      copy_now(t, e, dst);
      state.verdict[i] = kClean;  // copied before save() returns: nothing could overlap it
      if (state.hashes()) state.report(dst, static_cast<size_t>(e.nbytes), /*hash_now=*/false);
    } else if (t.is_contiguous()) {
      pending.contiguous.push_back(
          {static_cast<const uint8_t*>(t.const_data_ptr()), dst, static_cast<size_t>(e.nbytes), i});
      pending.contiguous_bytes += static_cast<size_t>(e.nbytes);
      state.read_storages.push_back(t.storage());
      ++undecided;
    } else {
      state.remaining[i].store(1, std::memory_order_relaxed);
      pending.strided.push_back(i);
      ++undecided;
    }
  }
  state.undecided = undecided;
}

#if ETTKIT_WITH_CUDA
namespace {

/// The address at which the GPU writes `base`, a stager arena: page-locked arenas are mapped into the
/// device's address space (the same address under unified addressing); nullptr for plain host memory,
/// which only a cudaMemcpyAsync can fill.
uint8_t* device_address_of_arena(uint8_t* base) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, base) != cudaSuccess) {
    (void)cudaGetLastError();  // not an error of this save: the arena is plain memory
    return nullptr;
  }
  return attr.type == cudaMemoryTypeHost ? static_cast<uint8_t*>(attr.devicePointer) : nullptr;
}

/// An upper bound of the gather table's int64 count for `plan`'s CUDA entries (for warm_gather_table).
int64_t gather_table_bound(const std::vector<PlanEntry>& plan, int64_t gather_max) {
  int64_t n = 0;
  for (const PlanEntry& e : plan) {
    if (e.device.is_cuda() && e.nbytes > 0 && e.nbytes <= gather_max)
      n += 3 * ((e.nbytes + kGatherPieceBytes - 1) / kGatherPieceBytes);
  }
  return n;
}

/// Queues the gather of `table` (source, destination, bytes per piece) on the current stream, which is
/// the copy stream. The table travels through a page-locked buffer of torch's host caching allocator: the
/// non-blocking copy records its event there, so the buffer is reused only after the copy read it; the
/// device copy is freed in the copy stream's order, after the kernel.
void queue_gather(const std::vector<int64_t>& table, c10::Device dev, c10::cuda::CUDAStream stream) {
  const auto n = static_cast<int64_t>(table.size());
  at::Tensor host = at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  std::memcpy(host.data_ptr<int64_t>(), table.data(), table.size() * sizeof(int64_t));
  at::Tensor device = at::empty({n}, at::TensorOptions().dtype(at::kLong).device(dev));
  device.copy_(host, /*non_blocking=*/true);
  launch_gather(device.const_data_ptr<int64_t>(), n / 3, stream.stream());
}

}  // namespace

void warm_gather_table(const std::vector<PlanEntry>& plan, int64_t gather_max) {
  const int64_t n = gather_table_bound(plan, gather_max);
  // A page-locked allocation waits for the device to go idle (CUDA's implicit synchronisation): taken here,
  // in prepare(), it is in torch's host cache when the first save needs it.
  if (n > 0) at::empty({n}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
}

void warm_copy_stream(const std::vector<PlanEntry>& plan, std::optional<c10::cuda::CUDAStream>& copy_stream) {
  const auto cuda = std::find_if(plan.begin(), plan.end(), [](const PlanEntry& e) { return e.device.is_cuda(); });
  if (cuda == plan.end()) return;
  const c10::Device dev = cuda->device;
  c10::cuda::CUDAGuard guard(dev);
  if (!copy_stream || copy_stream->device() != dev) copy_stream = c10::cuda::getStreamFromPool(false, dev.index());
  CudaEvent first(dev.index());
  first.record(*copy_stream);
  first.synchronize();
}

void issue_cuda_copies(const NamedTensors& tensors, const std::vector<PlanEntry>& plan, const CopyOrder& order,
                       const std::vector<size_t>& cuda, uint8_t* base, int64_t gather_max,
                       std::optional<c10::cuda::CUDAStream>& copy_stream, SnapshotState& state) {
  c10::Device dev = tensors[cuda[0]].second.device();
  for (size_t i : cuda) {
    ETTKIT_EXPECTS(tensors[i].second.device() == dev, "state dict entry '", tensors[i].first, "' is on ",
                   tensors[i].second.device(), " but others are on ", dev, "; one CUDA device per rank");
  }
  c10::cuda::CUDAGuard guard(dev);
  if (!copy_stream || copy_stream->device() != dev) copy_stream = c10::cuda::getStreamFromPool(false, dev.index());
  c10::cuda::CUDAStream stream = *copy_stream;
  // Stream order: the copies see everything already queued on the caller's stream (the optimizer step).
  CudaEvent ready(dev.index());
  ready.record(c10::cuda::getCurrentCUDAStream(dev.index()));
  ready.block(stream);
  c10::cuda::CUDAStreamGuard sg(stream);
  uint8_t* mapped = gather_max > 0 ? device_address_of_arena(base) : nullptr;
  std::vector<int64_t> table;
  // One copy class at a time (consecutive in `cuda`): its small contiguous tensors by one gather launch
  // (cuda_gather.h says why), the others by a cudaMemcpyAsync each, then the class's event.
  for (size_t k = 0; k < cuda.size();) {
    size_t end = k + 1;
    while (end < cuda.size() && order.class_of(cuda[end]) == order.class_of(cuda[k])) ++end;
    table.clear();
    for (size_t j = k; j < end; ++j) {
      const size_t i = cuda[j];
      const at::Tensor& t = tensors[i].second;
      const PlanEntry& e = plan[i];
      uint8_t* dst = base + e.offset;
      if (e.nbytes == 0) {
        // nothing to copy
      } else if (t.is_contiguous() && mapped && e.nbytes <= gather_max) {
        const auto src = reinterpret_cast<intptr_t>(t.const_data_ptr());
        const auto to = reinterpret_cast<intptr_t>(mapped + e.offset);
        for (int64_t off = 0; off < e.nbytes; off += kGatherPieceBytes) {
          table.insert(table.end(), {src + off, to + off, std::min(kGatherPieceBytes, e.nbytes - off)});
        }
      } else if (t.is_contiguous()) {
        ETTKIT_CUDA_CHECK(cudaMemcpyAsync(dst, t.const_data_ptr(), static_cast<size_t>(e.nbytes),
                                          cudaMemcpyDeviceToHost, stream.stream()));
      } else {
        at::from_blob(dst, e.shape, t.options().device(c10::kCPU)).copy_(t, /*non_blocking=*/true);
      }
      // The caching allocator must not hand this memory to another stream before the copy is done.
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
      state.cuda_class[i] = static_cast<int8_t>(state.cuda_events.size());
    }
    if (!table.empty()) queue_gather(table, dev, stream);
    // One event per copy class, so a fence on the first class does not wait for the rest.
    state.cuda_events.push_back(std::make_unique<CudaEvent>(dev.index()));
    state.cuda_events.back()->record(stream);
    k = end;
  }
}
#endif

std::vector<std::vector<Slice>> cut_into_jobs(const std::vector<Slice>& contiguous, size_t bytes, int workers,
                                              SnapshotState& state) {
  std::vector<std::vector<Slice>> groups;
  if (contiguous.empty()) return groups;
  const size_t w = static_cast<size_t>(workers);
  const size_t per = std::max<size_t>((bytes + w - 1) / w, 1 << 20);
  const InOrderDigest* digest = state.digest.get();
  // Hashing: each group ends at the chunk boundary of the file (whose header comes first) nearest to `per`
  // bytes, up to a quarter of a job away, so that one thread writes, and hashes, each chunk in order;
  // beyond that it ends at `per` (a big chunk in a small state), and the chunk's later part waits for its
  // start. Slices out of the file's order (a priority class first) end groups wherever they fall.
  const uint64_t align = digest ? digest->chunk_bytes() : 1;
  const size_t slack = digest ? per / 4 : 0;
  auto target_from = [&](const uint8_t* p) -> size_t {
    if (!digest) return per;
    const uint64_t off = digest->offset_of(p) + digest->head_bytes();
    const uint64_t nominal = off + per;
    const uint64_t nearest = (nominal + align / 2) / align * align;
    const uint64_t gap = nearest > nominal ? nearest - nominal : nominal - nearest;
    return nearest > off && gap <= slack ? static_cast<size_t>(nearest - off) : per;
  };
  size_t left = 0;  // bytes not yet in a group
  for (const Slice& s : contiguous) left += s.n;
  groups.emplace_back();
  size_t in_group = 0;
  size_t target = 0;  // this group's bytes; 0: not yet chosen
  for (Slice s : contiguous) {
    while (s.n > 0) {
      if (target == 0) target = target_from(s.dst);
      // What is left fits this group's window: it takes it all.
      const bool last = in_group + left <= target + slack;
      const size_t take = last ? s.n : std::min(s.n, target - in_group);
      groups.back().push_back({s.src, s.dst, take, s.entry});
      // Not yet shared with a job: a plain increment, not an atomic read-modify-write per slice.
      std::atomic<int32_t>& left_of_entry = state.remaining[s.entry];
      left_of_entry.store(left_of_entry.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      s.src += take;
      s.dst += take;
      s.n -= take;
      in_group += take;
      left -= take;
      if (!last && in_group >= target) {
        groups.emplace_back();
        in_group = 0;
        target = 0;
      }
    }
  }
  if (groups.back().empty()) groups.pop_back();
  return groups;
}

void hold_strided_views(const NamedTensors& tensors, const PendingCopies& pending, SnapshotState& state) {
  state.strided_views.reserve(pending.strided.size());
  for (size_t i : pending.strided) state.strided_views.push_back(tensors[i].second.alias());
}

void submit_cpu_copies(CopyPool& pool, std::vector<std::vector<Slice>> groups, const std::vector<size_t>& strided,
                       const std::vector<PlanEntry>& plan, uint8_t* base, const std::shared_ptr<SnapshotState>& state) {
  {
    std::lock_guard<std::mutex> slk(state->mu);
    state->pending_jobs = static_cast<int>(groups.size() + strided.size());
  }
  const bool hashes = state->hashes();
  for (auto& g : groups) {
    pool.submit([state, hashes, g = std::move(g)] {
      for (const Slice& s : g) {
        if (!hashes) {
          std::memcpy(s.dst, s.src, s.n);
        } else {
          // Copy a piece, hash it while it is in this core's cache (when it continues its chunk's hashed
          // prefix; else it waits for the piece in front of it).
          for (size_t off = 0; off < s.n; off += kFusedPieceBytes) {
            const size_t n = std::min(kFusedPieceBytes, s.n - off);
            std::memcpy(s.dst + off, s.src + off, n);
            state->report(s.dst + off, n);
          }
        }
        state->entry_copied(s.entry);
      }
      state->job_done(nullptr);
    });
  }
  for (size_t k = 0; k < strided.size(); ++k) {
    const size_t i = strided[k];
    const PlanEntry& e = plan[i];
    uint8_t* dst = base + e.offset;
    pool.submit([state, i, k, dst, shape = e.shape, nbytes = static_cast<size_t>(e.nbytes)] {
      std::exception_ptr err;
      try {
        at::NoGradGuard no_grad;
        // The alias made at save() (not touched by the owner while jobs are pending): the source's storage
        // then, whatever the caller swapped in since.
        const at::Tensor& src = state->strided_views[k];
        at::from_blob(dst, shape, src.options()).copy_(src);
        if (state->hashes()) state->report(dst, nbytes);
      } catch (...) {
        err = std::current_exception();
      }
      state->entry_copied(i);
      state->job_done(err);
    });
  }
}

}  // namespace ettkit::checkpoint::detail
