// The batched device path (device_stager.h).
#include "checkpoint/device_stager.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>

#include "checkpoint/snapshot_state.h"
#include "common/background_thread.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

/// One arena's batch: sized for a plan by bind(), filled by the save that holds the arena (caller's thread),
/// read by the staging thread after the hand-over (mu_ orders the two), untouched by anyone once the save
/// is done until the arena's next save.
struct DeviceStager::Slot {
  std::shared_ptr<const std::vector<PlanEntry>> plan;  // what the arrays are sized for (kept: no address reuse)
  bool has_device = false;  // stream and events made for `device`
  c10::DeviceIndex device = -1;
  DeviceStream stream;
  DeviceEvent ready;                            // recorded on the caller's stream by save()
  std::array<DeviceEvent, kClasses> completion;  // recorded on the copy stream after each class
  // The contiguous copies, in copy order; [batch_end[c-1], batch_end[c]) is class c's batch.
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  std::vector<c10::Storage> held;  // the sources' storages, until release_held() or the next save (mu_)
  size_t n_held = 0;
  // Non-contiguous sources (rare in a state dict): an alias each, so that a later set_data() on the caller's
  // tensor does not change what is copied; [strided_end[c-1], strided_end[c]) is class c's.
  std::vector<at::Tensor> strided;
  std::vector<void*> strided_dst;
  std::array<size_t, kClasses> batch_end{};
  std::array<size_t, kClasses> strided_end{};
  int classes = 0;
  uint64_t generation = 0;          // mu_: the save that holds the slot
  bool releasing = false;           // mu_: release_held() is letting the storages go outside mu_
  SnapshotState* state = nullptr;   // mu_: the save handed over (alive until it is done)
};

DeviceStager::DeviceStager(std::shared_ptr<DeviceCopyBackend> backend)
    : backend_(std::move(backend)), slots_(std::make_unique<std::array<Slot, kSlots>>()) {
  ETTKIT_EXPECTS(backend_ != nullptr, "the batched device path needs a backend");
  type_ = backend_->device_type();
  thread_ = std::thread([this] { run(); });
}

DeviceStager::~DeviceStager() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  for (Slot& s : *slots_) {
    if (!s.has_device) continue;
    backend_->destroy_event(s.ready);
    for (DeviceEvent& ev : s.completion) backend_->destroy_event(ev);
  }
}

void DeviceStager::bind(int slot, const std::shared_ptr<const std::vector<PlanEntry>>& plan) {
  ETTKIT_EXPECTS(slot >= 0 && slot < kSlots, "device stager slot ", slot, " is not in [0, ", kSlots, ")");
  Slot& s = (*slots_)[static_cast<size_t>(slot)];
  if (s.plan == plan) return;
  size_t n = 0;
  const PlanEntry* first = nullptr;
  for (const PlanEntry& e : *plan) {
    if (e.device.type() != type_) continue;
    if (!first) first = &e;
    ++n;
  }
  if (first && (!s.has_device || s.device != first->device.index())) {
    // A rank's device does not change between saves in practice; when it does, the slot is not in use
    // (its arena is free), so its events may go.
    if (s.has_device) {
      backend_->destroy_event(s.ready);
      for (DeviceEvent& ev : s.completion) backend_->destroy_event(ev);
      s.has_device = false;
    }
    const c10::DeviceIndex dev = first->device.index();
    s.stream = backend_->copy_stream(dev);
    s.ready = backend_->create_event(dev);
    for (DeviceEvent& ev : s.completion) ev = backend_->create_event(dev);
    s.device = dev;
    s.has_device = true;
    backend_->warm(s.stream);
  }
  s.dsts.assign(n, nullptr);
  s.srcs.assign(n, nullptr);
  s.sizes.assign(n, 0);
  s.strided_dst.reserve(n);
  std::vector<c10::Storage> old(n);
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return !s.releasing; });  // an earlier save's storages, being let go
    s.held.swap(old);
    s.n_held = 0;
    s.strided.reserve(n);
    ++s.generation;  // that earlier save's release_held() leaves the new arrays alone
    ++bindings_;
  }
  s.plan = plan;
  // `old` (a previous plan's storages) dies here, on the calling thread.
}

int DeviceStager::fill(Slot& s, const NamedTensors& tensors, const std::vector<PlanEntry>& plan,
                       const CopyOrder& order, const std::vector<size_t>& entries, uint8_t* base,
                       SnapshotState& state) {
  const c10::Device dev = tensors[entries[0]].second.device();
  s.strided.clear();  // a previous save's aliases, dropped on this (the caller's) thread
  s.strided_dst.clear();
  size_t n = 0;
  int c = -1;
  int cls = -1;
  for (size_t i : entries) {
    const at::Tensor& t = tensors[i].second;
    ETTKIT_EXPECTS(t.device() == dev, "state dict entry '", tensors[i].first, "' is on ", t.device(),
                   " but others are on ", dev, "; one CUDA device per rank");
    if (order.class_of(i) != cls) {
      // Entries come in copy order, so a class's entries are consecutive.
      if (c >= 0) {
        s.batch_end[static_cast<size_t>(c)] = n;
        s.strided_end[static_cast<size_t>(c)] = s.strided.size();
      }
      ++c;
      cls = order.class_of(i);
    }
    state.cuda_class[i] = static_cast<int8_t>(c);
    const PlanEntry& e = plan[i];
    if (e.nbytes == 0) continue;  // nothing to copy (its data pointer may be null)
    uint8_t* dst = base + e.offset;
    if (t.is_contiguous()) {
      s.dsts[n] = dst;
      s.srcs[n] = t.const_data_ptr();
      s.sizes[n] = static_cast<size_t>(e.nbytes);
      s.held[n] = t.storage();  // a reference count, no allocation; the previous save's goes here
      ++n;
    } else {
      s.strided.push_back(t.alias());
      s.strided_dst.push_back(dst);
    }
  }
  s.batch_end[static_cast<size_t>(c)] = n;
  s.strided_end[static_cast<size_t>(c)] = s.strided.size();
  for (size_t j = n; j < s.n_held; ++j) s.held[j] = {};
  s.n_held = n;
  return c + 1;
}

void DeviceStager::submit(int slot, const std::shared_ptr<const std::vector<PlanEntry>>& plan,
                          const NamedTensors& tensors, const CopyOrder& order, const std::vector<size_t>& entries,
                          uint8_t* base, SnapshotState& state) {
  if (entries.empty()) return;
  bind(slot, plan);  // nothing to do when prepare() or an earlier save bound the slot to this plan
  Slot& s = (*slots_)[static_cast<size_t>(slot)];
  ETTKIT_CHECK(s.dsts.size() >= entries.size(), Error, "device stager slot ", slot, " holds ", s.dsts.size(),
               " entries, the save has ", entries.size());
  uint64_t generation = 0;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return !s.releasing; });  // an earlier save's storages, being let go
    generation = ++s.generation;
  }
  s.classes = fill(s, tensors, *plan, order, entries, base, state);
  {
    std::lock_guard<std::mutex> lk(state.mu);
    state.device = DeviceProgress{this, slot, generation, s.classes, 0, false};
  }
  try {
    backend_->record_on_current_stream(s.ready);  // the one device call of the caller's thread
  } catch (...) {
    std::lock_guard<std::mutex> lk(state.mu);
    state.device = DeviceProgress{};
    throw;
  }
  {
    std::lock_guard<std::mutex> lk(mu_);
    s.state = &state;
    queue_[static_cast<size_t>(queued_++)] = slot;
  }
  cv_.notify_all();
}

void DeviceStager::run() {
  ettkit::detail::mark_background_thread();
  for (;;) {
    Slot* s = nullptr;
    SnapshotState* st = nullptr;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || queued_ > 0; });
      if (queued_ == 0) return;
      s = &(*slots_)[static_cast<size_t>(queue_[0])];
      for (int j = 1; j < queued_; ++j) queue_[static_cast<size_t>(j - 1)] = queue_[static_cast<size_t>(j)];
      --queued_;
      st = s->state;
    }
    stage_slot(*s, *st);
  }
}

void DeviceStager::stage_slot(Slot& s, SnapshotState& st) {
  std::exception_ptr err;
  try {
    backend_->stream_wait_event(s.stream, s.ready);
    size_t b = 0;
    size_t sb = 0;
    for (int c = 0; c < s.classes; ++c) {
      const size_t end = s.batch_end[static_cast<size_t>(c)];
      if (end > b) backend_->memcpy_batch(s.stream, s.dsts.data() + b, s.srcs.data() + b, s.sizes.data() + b, end - b);
      for (; sb < s.strided_end[static_cast<size_t>(c)]; ++sb) backend_->copy_strided(s.stream, s.strided[sb], s.strided_dst[sb]);
      backend_->record(s.completion[static_cast<size_t>(c)], s.stream);
      b = end;
      std::lock_guard<std::mutex> lk(st.mu);
      st.device.issued = c + 1;  // a fence of class c may now wait for its event
      st.cv.notify_all();
    }
    backend_->synchronize(s.completion[static_cast<size_t>(s.classes - 1)]);
  } catch (...) {
    err = std::current_exception();
    // Copies queued before the failure may still run: the arena and the sources stay until they did.
    try {
      backend_->record(s.completion[0], s.stream);
      backend_->synchronize(s.completion[0]);
    } catch (...) {  // the device is gone: nothing is left running on it either
    }
  }
  std::lock_guard<std::mutex> lk(st.mu);
  if (err && !st.error) st.error = err;
  st.device.issued = st.device.classes;
  st.device.done = true;
  if (st.pending_jobs == 0 && st.staged_us.load() == 0) st.staged_us = epoch_us();
  // Notified under mu: once it is released, the waiter may release the snapshot and the state with it.
  st.cv.notify_all();
}

bool DeviceStager::fence(SnapshotState& st, int cls) {
  std::unique_lock<std::mutex> lk(st.mu);
  DeviceProgress& d = st.device;
  if (!d.stager || d.done) return false;
  const int c = cls < 0 ? d.classes - 1 : std::min(cls, d.classes - 1);
  st.cv.wait(lk, [&] { return d.done || d.issued > c; });
  if (d.done) return false;
  // Still under mu: the save cannot be marked done meanwhile, so its slot, and the event, are still its own.
  const Slot& s = (*d.stager->slots_)[static_cast<size_t>(d.slot)];
  d.stager->backend_->current_stream_wait(s.completion[static_cast<size_t>(c)]);
  return true;
}

void DeviceStager::release_held(int slot, uint64_t generation) {
  Slot& s = (*slots_)[static_cast<size_t>(slot)];
  size_t n = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (s.generation != generation || s.releasing) return;
    s.releasing = true;  // the slot's next save waits for this
    n = s.n_held;
    s.n_held = 0;
  }
  // Outside mu_: a storage's last reference may free memory (or a Python object) on this thread.
  for (size_t j = 0; j < n; ++j) s.held[j] = {};
  s.strided.clear();
  {
    std::lock_guard<std::mutex> lk(mu_);
    s.releasing = false;
  }
  cv_.notify_all();
}

std::unique_ptr<DeviceStager> make_device_stager(const std::string& cuda_copy,
                                                 std::shared_ptr<DeviceCopyBackend> backend) {
  std::string mode = cuda_copy;
  if (mode.empty()) {
    const char* env = std::getenv("ETTKIT_CUDA_COPY");
    mode = env && *env ? env : "per_tensor";
  }
  ETTKIT_EXPECTS(mode == "per_tensor" || mode == "batched", "cuda_copy='", mode,
                 "' is not one of 'per_tensor', 'batched' (StagerOptions::cuda_copy or ETTKIT_CUDA_COPY)");
  if (mode == "per_tensor") return nullptr;
  if (!backend) backend = make_cuda_copy_backend();
  return backend ? std::make_unique<DeviceStager>(std::move(backend)) : nullptr;
}

int64_t DeviceStager::bindings() const {
  std::lock_guard<std::mutex> lk(mu_);
  return bindings_;
}

}  // namespace ettkit::checkpoint::detail
