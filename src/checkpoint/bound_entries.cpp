// The bound save's hot path (bound_entries.h).
#include "checkpoint/bound_entries.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace ettkit::checkpoint::detail {

namespace {

std::atomic<int64_t> fast_saves{0};
std::atomic<int64_t> cache_builds{0};
thread_local BoundCall* bound_call = nullptr;

/// Copies a CPU tensor of entry `e` into `dst` now (copy_engine.cpp's copy_now, from the cache).
void copy_entry_now(const BoundEntry& e, const at::Tensor& t, uint8_t* dst) {
  if (e.nbytes == 0) return;  // an empty tensor's data pointer may be null: no memcpy even of 0 bytes
  if (e.contiguous) {
    std::memcpy(dst, e.src, static_cast<size_t>(e.nbytes));
  } else {
    at::from_blob(dst, t.sizes(), t.options()).copy_(t);
  }
}

}  // namespace

std::shared_ptr<const BoundEntries> build_bound_entries(const NamedTensors& tensors, const SaveBinding& binding,
                                                        std::shared_ptr<const std::vector<PlanEntry>> plan,
                                                        c10::DeviceType device_type) {
  if (!plan || plan->size() != tensors.size()) return nullptr;
  auto b = std::make_shared<BoundEntries>();
  b->entries.reserve(tensors.size());
  b->storages.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].second;
    if (!t.defined() || !t.has_storage()) return nullptr;
    const bool device = t.device().type() == device_type;
    if (!device && !t.device().is_cpu()) return nullptr;
    const bool inference = t.is_inference();
    if (device && inference) return nullptr;  // the full path refuses it, naming it
    const c10::TensorImpl* ti = t.unsafeGetTensorImpl();
    const c10::Storage& s = t.storage();
    const PlanEntry& p = (*plan)[i];
    BoundEntry e;
    e.impl = ti;
    e.storage = s.unsafeGetStorageImpl();
    e.data = s.data();
    e.storage_nbytes = s.nbytes();
    e.storage_offset = t.storage_offset();
    e.keys = ti->key_set().raw_repr();
    e.dims_at = static_cast<uint32_t>(b->dims.size());
    e.ndim = static_cast<uint32_t>(t.dim());
    b->dims.insert(b->dims.end(), t.sizes().begin(), t.sizes().end());
    b->dims.insert(b->dims.end(), t.strides().begin(), t.strides().end());
    e.dtype = t.scalar_type();
    e.device = t.device();
    e.contiguous = t.is_contiguous();
    e.cls = device      ? BoundClass::kDevice
            : inference ? BoundClass::kInference
            : e.contiguous ? BoundClass::kContiguous
                           : BoundClass::kStrided;
    e.src = p.nbytes > 0 && !device ? static_cast<const uint8_t*>(t.const_data_ptr()) : nullptr;
    e.nbytes = p.nbytes;
    e.offset = p.offset;
    // Neighbours often share one storage (flat parameters): one reference for the run.
    if (b->storages.empty() || b->storages.back().get() != e.storage) {
      b->storages.push_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s.unsafeGetStorageImpl()));
    }
    b->entries.push_back(e);
  }
  b->plan = std::move(plan);
  b->list = binding.held.get();
  b->names_token = binding.names_token;
  b->device_type = device_type;
  cache_builds.fetch_add(1, std::memory_order_relaxed);
  return b;
}

bool bound_matches(const BoundEntries& b, const NamedTensors& tensors, std::vector<uint32_t>& versions) {
  const size_t n = b.entries.size();
  if (tensors.size() != n) return false;
  versions.resize(n);
  const int64_t* dims = b.dims.data();
  for (size_t i = 0; i < n; ++i) {
    const BoundEntry& e = b.entries[i];
    const c10::TensorImpl* ti = tensors[i].second.unsafeGetTensorImpl();
    if (ti != e.impl) return false;
    // The key set first: a Python wrapper or a functional tensor (whose sizes() may throw) differs there.
    if (ti->key_set().raw_repr() != e.keys) return false;
    const c10::StorageImpl* si = ti->unsafe_storage().unsafeGetStorageImpl();
    // The storage, and where its bytes are now: an untyped resize_ moves them under the same StorageImpl.
    if (si != e.storage || si->data() != e.data || si->nbytes() != e.storage_nbytes) return false;
    if (ti->storage_offset() != e.storage_offset || ti->dtype().toScalarType() != e.dtype ||
        ti->device() != e.device || static_cast<uint32_t>(ti->dim()) != e.ndim) {
      return false;
    }
    const int64_t* d = dims + e.dims_at;
    const size_t bytes = e.ndim * sizeof(int64_t);
    if (e.ndim > 0 && (std::memcmp(ti->sizes().data(), d, bytes) != 0 ||
                       std::memcmp(ti->strides().data(), d + e.ndim, bytes) != 0)) {
      return false;
    }
    // The version now (inference tensors have none: they are copied at once).
    versions[i] = e.cls == BoundClass::kInference ? 0 : ti->version_counter().current_version();
  }
  return true;
}

void bound_copy_small_now(const BoundEntries& b, const NamedTensors& tensors, const CopyOrder& order, uint8_t* base,
                          int64_t sync_max, SnapshotState& state, PendingCopies& pending) {
  pending.clear();
  pending.contiguous.reserve(b.entries.size());
  size_t undecided = 0;
  for (size_t i : order.order) {
    const BoundEntry& e = b.entries[i];
    uint8_t* dst = base + e.offset;
    state.storages[i] = e.data;  // storage_key()
    state.remaining[i].store(0, std::memory_order_relaxed);
    if (e.cls == BoundClass::kDevice) {
      pending.cuda.push_back(i);
      ++undecided;
    } else if (e.cls == BoundClass::kInference || e.nbytes <= sync_max) {
      copy_entry_now(e, tensors[i].second, dst);
      state.verdict[i] = kClean;  // copied before save() returns: nothing could overlap it
      if (state.hashes()) state.report(dst, static_cast<size_t>(e.nbytes), /*hash_now=*/false);
    } else if (e.cls == BoundClass::kContiguous) {
      pending.contiguous.push_back({e.src, dst, static_cast<size_t>(e.nbytes), i});
      pending.contiguous_bytes += static_cast<size_t>(e.nbytes);
      ++undecided;
    } else {
      state.remaining[i].store(1, std::memory_order_relaxed);
      pending.strided.push_back(i);
      ++undecided;
    }
  }
  state.undecided = undecided;
}

BoundCall* current_bound_call() { return bound_call; }

BoundCallScope::BoundCallScope(BoundCall& call) : prev_(bound_call) { bound_call = &call; }
BoundCallScope::~BoundCallScope() { bound_call = prev_; }

int64_t bound_fast_saves_for_testing() { return fast_saves.load(); }
int64_t bound_cache_builds_for_testing() { return cache_builds.load(); }
void count_bound_fast_save() { fast_saves.fetch_add(1, std::memory_order_relaxed); }

}  // namespace ettkit::checkpoint::detail
