// Stager::stage(): one save's steps. Check the tensors against the cached plan (in one pass), reuse it or
// rebuild it, take a free arena, then hand the copies to the copy engine (copy_engine.h). What a save needs
// per tensor beyond the copies is in arrays kept from the save before (ArenaScratch, StatePool, the arena's
// whole-tensor digest): a repeated save of an unchanged state allocates nothing proportional to its tensor
// count on the caller's thread (issue #65).
#include <ATen/ATen.h>

#include <algorithm>

#include "checkpoint/stager_impl.h"

namespace ettkit::checkpoint {

detail::InOrderDigest* Snapshot::file_digest() const { return state_ ? state_->digest.get() : nullptr; }
detail::InOrderDigest* Snapshot::tensor_digest() const { return state_ ? state_->tensor_digest.get() : nullptr; }

std::shared_ptr<detail::InOrderDigest> Stager::Impl::tensor_digest_for(int arena, const PlanPtr& plan,
                                                                      const uint8_t* base, bool take) {
  ArenaScratch& s = scratch_of(arena);
  if (!s.tensor_digest || s.digest_plan != plan || s.tensor_digest->data() != base) {
    s.tensor_digest = detail::InOrderDigest::for_tensors(base, disk_ranges);
    s.digest_plan = plan;
  }
  // The arena's save before finished it (its writer did before handing the arena back: nothing to reset) or
  // failed (every segment is reset now).
  if (take) s.tensor_digest->reuse();
  return s.tensor_digest;
}

void Stager::Impl::warm_scratch(int arena, size_t n) {
  ArenaScratch& s = scratch_of(arena);
  s.order.order.reserve(n);
  s.pending.contiguous.reserve(n);
  const Arena& a = arenas[static_cast<size_t>(arena)];
  if (plan && disk_header.bytes > 0 && plan_total > 0) tensor_digest_for(arena, plan, a.ptr, /*take=*/false);
}

void Stager::Impl::copy(const NamedTensors& tensors, const std::vector<PlanEntry>& plan, const CopyPriority& priority,
                        uint8_t* base, int64_t sync_max, Snapshot& snap,
                        const std::shared_ptr<Snapshot::State>& state,
                        const std::shared_ptr<const NamedTensors>& held, ArenaScratch& scratch,
                        const std::shared_ptr<const detail::BoundEntries>& fast) {
  // Small and inference tensors now, synchronously; big CPU tensors by the pool; CUDA tensors on the copy
  // stream. The order and the pending copies in the arena's vectors, kept from its save before.
  detail::CopyOrder& order = scratch.order;
  detail::PendingCopies& pending = scratch.pending;
  detail::copy_order(tensors, priority, order);
  try {
    if (fast) {
      detail::bound_copy_small_now(*fast, tensors, order, base, sync_max, *state, pending);
    } else {
      detail::copy_small_now(tensors, plan, order, base, sync_max, *state, pending,
                             device ? device->device_type() : c10::kCUDA);
    }
    // The batched device path: one device call here; the device stager's thread queues the copies.
    if (device && !pending.cuda.empty())
      device->submit(snap.arena_, snap.shared_plan(), tensors, order, pending.cuda, base, *state);
  } catch (...) {
    snap.release();
    throw;
  }
  if (!pending.empty()) {
    detail::hold_strided_views(tensors, pending, *state);
    if (held && held.get() == &tensors) {
      // The caller's list, unchanged while held (SaveBinding::held): one reference keeps every tensor, not
      // 20,001 reference counts up now and down at drop_sources (issue #65).
      state->held = held;
      // The fast path took no storage reference per tensor: the cache's stand for them until drop_sources.
      if (fast) state->bound = fast;
    } else {
      state->sources.reserve(tensors.size());
      for (const auto& item : tensors) state->sources.push_back(item.second);
    }
  }
  if (!pending.cuda.empty() && !device) {
#if ETTKIT_WITH_CUDA
    std::lock_guard<std::mutex> g(stream_mu);
    detail::issue_cuda_copies(tensors, plan, order, pending.cuda, base, opt.cuda_gather_max_bytes, copy_stream, *state);
#else
    snap.release();
    ETTKIT_THROW(InvalidArgument, "state dict entry '", tensors[pending.cuda[0]].first,
                 "' is a CUDA tensor but ettkit was built without CUDA");
#endif
  }
  auto groups = detail::cut_into_jobs(pending.contiguous, pending.contiguous_bytes, pool->size(), *state);
  const bool cpu_jobs = !groups.empty() || !pending.strided.empty();
  // state->undecided: counted by copy_small_now.
  detail::submit_cpu_copies(*pool, std::move(groups), pending.strided, plan, base, state);
  if (!cpu_jobs && pending.cuda.empty()) state->staged_us = epoch_us();
}

namespace {
/// `cache` when the save of `tensors` may take the bound fast path: the held list and names token it was
/// built for, the current plan, and every tensor still as the cache recorded it (bound_matches, which reads
/// the versions into `versions`); else nullptr.
std::shared_ptr<const detail::BoundEntries> fast_path(const std::shared_ptr<const detail::BoundEntries>& cache,
                                                      const PlanPtr& plan, const NamedTensors& tensors,
                                                      const SaveBinding& binding, bool names_known,
                                                      std::vector<uint32_t>& versions) {
  if (!names_known || !cache || !plan || cache->plan != plan || binding.held.get() != &tensors ||
      cache->list != &tensors || cache->names_token != binding.names_token) {
    return nullptr;
  }
  return detail::bound_matches(*cache, tensors, versions) ? cache : nullptr;
}
}  // namespace

void Stager::Impl::rebuild_bound(const NamedTensors& tensors, const SaveBinding& binding, const PlanPtr& staged) {
  if (binding.names_token == 0 || binding.held.get() != &tensors) return;
  {
    std::lock_guard<std::mutex> g(mu);
    // Only for the current plan, and names the plan's under this token (stage() compared or vouched them).
    if (plan != staged || plan_names_token != binding.names_token) return;
  }
  std::shared_ptr<const detail::BoundEntries> made =
      detail::build_bound_entries(tensors, binding, staged, device ? device->device_type() : c10::kCUDA);
  std::unique_lock<std::mutex> g(mu);
  if (plan != staged) return;
  made.swap(bound);
  g.unlock();
  // `made` now holds the old cache: its storage references go here, on the caller's thread, outside mu.
}

std::shared_ptr<Snapshot> Stager::stage(const NamedTensors& tensors, OnBusy on_busy, const CopyPriority& priority,
                                        int64_t sync_copy_max_bytes, StageHashing hashing, const SaveBinding& binding) {
  Impl& im = *impl_;
  int64_t begin_us = epoch_us();
  // The copies read storage; they must not become autograd history (callers pass parameters as they are).
  at::NoGradGuard no_grad;
  // 1) Plan: reuse the cached one unless the structure changed. The tensors are checked against it in one
  // pass, outside mu (the plan is immutable; a prepare() that replaced it meanwhile is seen below).
  PlanPtr plan;
  uint64_t plan_token = 0;
  std::shared_ptr<const detail::BoundEntries> cache;
  {
    std::lock_guard<std::mutex> g(im.mu);
    plan = im.plan;
    plan_token = im.plan_names_token;
    cache = im.bound;
  }
  const bool names_known = binding.names_token != 0 && binding.names_token == plan_token;
  // The bound save's fast path, one pass (versions per thread: two may stage at once). A miss when the caller
  // skipped its checks: nothing is done yet; it checks and comes back (bound_entries.h).
  thread_local std::vector<uint32_t> versions;
  std::shared_ptr<const detail::BoundEntries> fast = fast_path(cache, plan, tensors, binding, names_known, versions);
  detail::BoundCall* call = detail::current_bound_call();
  if (!fast && call && call->caller_skipped_checks) throw detail::BoundMiss{};
  const bool same = fast || detail::check_and_match(plan.get(), tensors, names_known);
  std::unique_lock<std::mutex> lk(im.mu);
  if (!same || plan != im.plan || im.arenas.empty()) {
    fast = nullptr;  // the cache is of the plan replaced now
    plan = im.replan(tensors, on_busy, lk, binding.names_token);
    if (!plan) return nullptr;
  } else {
    // The names were compared (or vouched for by this very token): later saves with it need not compare them.
    if (binding.names_token != 0) im.plan_names_token = binding.names_token;
  }
  // 2) A free arena.
  const int arena = im.take_free_arena(on_busy, lk);
  if (arena < 0) return nullptr;
  const Arena& taken = im.arenas[static_cast<size_t>(arena)];
  uint8_t* base = taken.ptr;
  ArenaScratch& scratch = im.scratch_of(arena);
  std::unique_ptr<detail::InOrderDigest> digest;
  std::shared_ptr<detail::InOrderDigest> tensor_digest;
  if (hashing == StageHashing::kMemoryTier && taken.fd >= 0 && im.plan_total > 0 &&
      taken.size == static_cast<size_t>(im.plan_total)) {
    // The file the memory tier will link: header room, then exactly the staged bytes (an empty state's
    // one-byte arena is no such file; the writer copies it). The room is the map's start: no header bytes
    // apart from it.
    digest = detail::InOrderDigest::for_file(taken.map, 0, taken.reserve + taken.size);
  } else if (hashing == StageHashing::kDiskTier && im.disk_header.bytes > 0 && im.plan_total > 0) {
    // The disk data file: the header, then the staged bytes, in chunks of disk_chunk_bytes (in_order_digest.h
    // says why); and the whole tensors' digests.
    const uint64_t file = im.disk_header.bytes + static_cast<uint64_t>(im.plan_total);
    digest = detail::InOrderDigest::for_file(base, im.disk_header.bytes, static_cast<uint64_t>(im.plan_total),
                                             detail::disk_chunk_bytes(file));
    tensor_digest = im.tensor_digest_for(arena, plan, base, /*take=*/true);
  }
  lk.unlock();

  std::shared_ptr<Snapshot> snap(new Snapshot());
  snap->stager_ = this;
  snap->arena_ = arena;
  snap->data_ = base;
  snap->plan_ = plan;
  snap->stage_begin_us_ = begin_us;
  // A recycled state, started for these tensors (its vectors keep their capacity).
  std::shared_ptr<Snapshot::State> state = im.states->take(tensors.size());
  snap->state_ = state;
  state->digest = std::move(digest);
  state->tensor_digest = std::move(tensor_digest);
  if (fast) {
    state->version_at_save.swap(versions);  // read by the fast path's pass; the state's vector goes back
    detail::count_bound_fast_save();
  }
  // 3) The copies, in the order `priority` gives.
  im.copy(tensors, *plan, priority, base, std::max(im.opt.sync_copy_max_bytes, sync_copy_max_bytes), *snap, state,
          binding.held, scratch, fast);
  if (!fast) im.rebuild_bound(tensors, binding, plan);
  return snap;
}

}  // namespace ettkit::checkpoint
