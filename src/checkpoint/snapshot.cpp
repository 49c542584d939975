// The Snapshot: one staged copy of a state dict, and its fences (wait_staged, wait_for, changed_entries):
// what a writer may do with the source tensors, and when, while the copy engine (copy_engine.h) still runs.
#include <ATen/ATen.h>

#include <algorithm>

#include "checkpoint/bound_entries.h"
#include "checkpoint/device_stager.h"
#include "checkpoint/snapshot_state.h"
#include "checkpoint/stage_plan.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace ettkit::checkpoint {

using detail::kChanged;
using detail::kUndecided;
using detail::storage_key;
#if ETTKIT_WITH_CUDA
using detail::CudaEvent;
#endif

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
    // The batched device copies: the staging thread marks them done once it saw them complete.
    st.wait(lk, [&] { return st.pending_jobs == 0 && st.device.done; });
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
  for (size_t i = 0; st.undecided > 0 && i < st.verdict.size(); ++i) {
    // CUDA entries: the copy is observed complete, so a write queued from now on runs after it. CPU
    // entries: on the owner thread every write issued before this call has returned (program order);
    // on another thread a write may still be running, so they stay undecided until changed_entries().
    if (st.cuda_class[i] >= 0 || owner) st.decide(i);
  }
  if (st.error) std::rethrow_exception(st.error);
}

void Snapshot::wait_staged_on_current_stream() {
  State& st = *state_;
  detail::DeviceStager::fence(st, -1);  // the batched device copies, if any: a GPU-side wait too
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
  {
    // Under mu: `verdict` is written by decide() on other threads (the writer's changed_entries(), a fence
    // on the autograd thread) while this index is built; reading it unlocked was a data race (make tsan).
    // Built once, constant from then on: read below without the lock.
    std::lock_guard<std::mutex> lk(st.mu);
    if (!st.indexed) {
      for (size_t i = 0; i < st.storages.size(); ++i) {
        if (st.storages[i] && st.verdict[i] == kUndecided) st.by_storage[st.storages[i]].push_back(static_cast<int>(i));
      }
      st.indexed = true;
    }
  }
  std::vector<int> entries;
  for (const at::Tensor& t : tensors) {
    auto it = st.by_storage.find(storage_key(t));
    if (it != st.by_storage.end()) entries.insert(entries.end(), it->second.begin(), it->second.end());
  }
  if (entries.empty()) return false;
  bool waited = false;
  int cls = -1;
  for (int i : entries) cls = std::max<int>(cls, st.cuda_class[static_cast<size_t>(i)]);
  if (cls >= 0 && st.device.stager) {  // set before the snapshot was returned, constant since
    waited = detail::DeviceStager::fence(st, cls);
    cls = -1;
  }
#if ETTKIT_WITH_CUDA
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
    st.wait_entries(lk, copied);
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
  std::vector<at::Tensor> views;
  std::vector<c10::Storage> storages;
  std::shared_ptr<const NamedTensors> held;
  std::shared_ptr<const detail::BoundEntries> bound;
  detail::DeviceProgress device;
  {
    std::unique_lock<std::mutex> lk(st.mu);
    // CPU jobs read the sources until then, the batched device copies the storages their slot holds.
    st.wait(lk, [&] { return st.pending_jobs == 0 && st.device.done; });
    device = st.device;
    // On the owner thread this is a fence (program order): decide what is still undecided while here.
    if (std::this_thread::get_id() == st.owner && st.undecided > 0) {
      for (size_t i = 0; i < st.verdict.size(); ++i) st.decide(i);
    }
    // Elsewhere the verdicts come later (changed_entries()): they read the counters kept now.
    st.keep_undecided_versions();
    dropped.swap(st.sources);
    views.swap(st.strided_views);
    storages.swap(st.read_storages);
    held.swap(st.held);
    bound.swap(st.bound);
  }
  // The device copies' storages (unless a later save holds their slot) are let go on this thread too.
  if (device.stager) device.stager->release_held(device.slot, device.generation);
  // What was held dies here, outside the lock, on the calling thread; the emptied vectors go back to the
  // state with their capacity, for the next save that recycles it (StatePool).
  dropped.clear();
  views.clear();
  storages.clear();
  held.reset();
  bound.reset();
  std::lock_guard<std::mutex> lk(st.mu);
  if (st.sources.empty()) st.sources.swap(dropped);
  if (st.strided_views.empty()) st.strided_views.swap(views);
  if (st.read_storages.empty()) st.read_storages.swap(storages);
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

void Snapshot::publish(int64_t step) {
  if (!stager_ || released_.exchange(true)) return;
  wait_copies();
  stager_->publish_arena(arena_, step);
}

}  // namespace ettkit::checkpoint
