// The Stager: the arena pool and the cached snapshot plan, and prepare(). stage(), which runs one save's
// steps (check the tensors, reuse or rebuild the plan, take a free arena, hand the copies to the copy engine),
// is stager_save.cpp; their shared state stager_impl.h. The plan itself is stage_plan.h, the arenas' memory
// host_arena.h, the Snapshot's fences snapshot.cpp.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <unistd.h>

#include <algorithm>
#include <thread>

#include "checkpoint/stager_impl.h"
#include "common/logging.h"

namespace ettkit::checkpoint {

OnBusy parse_on_busy(const std::string& s) {
  if (s == "wait") return OnBusy::kWait;
  if (s == "skip") return OnBusy::kSkip;
  if (s == "error") return OnBusy::kError;
  ETTKIT_THROW(InvalidArgument, "on_busy='", s, "' is not one of 'wait', 'skip', 'error'");
}

Stager::Stager(StagerOptions options) : impl_(std::make_unique<Impl>()) {
  ETTKIT_EXPECTS(options.num_arenas == 1 || options.num_arenas == 2, "num_arenas=", options.num_arenas,
                 " must be 1 or 2 (2 = double-buffering)");
  ETTKIT_EXPECTS(options.copy_threads >= 0 && options.copy_threads <= 64, "copy_threads=", options.copy_threads,
                 " must be in [0, 64]");
  ETTKIT_EXPECTS(options.cuda_gather_max_bytes >= 0 && options.cuda_gather_max_bytes <= (int64_t{1} << 20),
                 "cuda_gather_max_bytes=", options.cuda_gather_max_bytes, " must be in [0, 1048576] (0: no gather kernel)");
  ETTKIT_EXPECTS(options.pin_memory >= -1 && options.pin_memory <= 1, "pin_memory=", options.pin_memory,
                 " must be -1 (auto), 0 or 1");
  impl_->opt = options;
  impl_->pin = options.pin_memory == 1 || (options.pin_memory == -1 && ETTKIT_WITH_CUDA && torch::cuda::is_available());
  int threads = options.copy_threads > 0 ? options.copy_threads
                                         : std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 4);
  impl_->pool = std::make_unique<detail::CopyPool>(threads);
  impl_->device = detail::make_device_stager(options.cuda_copy, options.device_copy_backend);
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

void Stager::publish_arena(int arena, int64_t step) {
  std::unique_lock<std::mutex> lk(impl_->mu);
  Arena& a = impl_->arenas[static_cast<size_t>(arena)];
  a.busy = false;
  a.published = a.fd >= 0;
  a.published_step = step;
  a.published_seq = ++impl_->publish_seq;
  impl_->cv.notify_all();
  // On the writer's thread, after the commit: whatever the next save's reclaim will need is made now, not
  // inside that save (#65).
  impl_->back_spare(lk);
}

void Stager::set_arena_files(std::shared_ptr<detail::ArenaFiles> files) {
  std::unique_lock<std::mutex> lk(impl_->mu);
  // Not wait_busy: this is no save waiting for an arena (busy_wait_s counts those).
  impl_->cv.wait(lk, [&] {
    return !impl_->spare_backing &&
           std::none_of(impl_->arenas.begin(), impl_->arenas.end(), [](const Arena& a) { return a.busy; });
  });
  for (Arena& a : impl_->arenas) a.free();
  impl_->arenas.clear();
  impl_->spare.free();
  impl_->files = std::move(files);
}

void Stager::set_disk_header_planner(std::function<DiskHeaderPlan(const std::vector<PlanEntry>&)> planner) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->disk_header_planner = std::move(planner);
  impl_->plan_disk_header();
}

const detail::Arena* Snapshot::arena_file() const {
  if (!stager_ || released_) return nullptr;
  std::lock_guard<std::mutex> lk(stager_->impl_->mu);
  const Arena& a = stager_->impl_->arenas[static_cast<size_t>(arena_)];
  return a.fd >= 0 ? &a : nullptr;
}

int Stager::Impl::arenas_within_budget(int64_t need) const {
  const int64_t budget = opt.memory_budget_bytes;
  ETTKIT_EXPECTS(budget <= 0 || need <= budget, "the state dict needs a ", need,
                 "-byte host arena but memory_budget_bytes=", budget, "; raise the budget or save less state");
  if (opt.num_arenas == 2 && budget > 0 && 2 * need > budget) {
    ETTKIT_LOG_WARN("checkpoint: memory_budget_bytes=", budget, " fits one ", need,
                    "-byte arena, not two; double-buffering is off");
    return 1;
  }
  return opt.num_arenas;
}

bool Stager::Impl::as_files(int64_t need) const {
  const int64_t budget = opt.memory_budget_bytes;
  const int64_t file_bytes = need + static_cast<int64_t>(header_room);
  return files != nullptr && (budget <= 0 || 2 * file_bytes <= budget);
}

bool Stager::Impl::fit_arenas(int64_t need, OnBusy on_busy, std::unique_lock<std::mutex>& lk) {
  const bool file_backed = as_files(need);
  const int want = file_backed ? 2 : arenas_within_budget(need);
  if (!arenas.empty() && static_cast<int>(arenas.size()) == want && (arenas[0].fd >= 0) == file_backed) {
    // A file arena is exactly the step's data file: its size is the plan's, not at least it.
    const size_t exact = static_cast<size_t>(std::max<int64_t>(need, 1));
    if (file_backed ? arenas[0].size == exact && arenas[0].reserve >= header_room
                    : static_cast<int64_t>(arenas[0].size) >= need) {
      return true;
    }
  }
  // The state grew (an optimizer's lazy state appeared, new tensors): reallocation needs every arena
  // back, and frees the old ones before allocating, so the arenas never exceed the budget together.
  // While one is still persisting this is a busy save like any other: on_busy decides.
  auto all_free = [&] { return std::none_of(arenas.begin(), arenas.end(), [](const Arena& a) { return a.busy; }); };
  if (!all_free()) {
    if (on_busy == OnBusy::kSkip) return false;
    ETTKIT_CHECK(on_busy != OnBusy::kError, InvalidArgument, "checkpoint save requested while the previous "
                 "save is still persisting and the state grew, so the arena must be reallocated (on_busy="
                 "'error'); use on_busy='wait' or 'skip'");
    wait_busy(lk, all_free);
  }
  for (Arena& a : arenas) a.free();
  arenas.clear();
  // All or none: an arena left unallocated in the vector would be taken by the next save.
  auto allocate = [&](int count, bool in_files) {
    std::vector<Arena> made(static_cast<size_t>(count));
    try {
      for (Arena& a : made) {
        if (in_files) {
          a.allocate_file(files, static_cast<size_t>(need), header_room, pin);
        } else {
          a.allocate(static_cast<size_t>(need), pin);
        }
      }
    } catch (...) {
      for (Arena& a : made) a.free();
      throw;
    }
    arena_allocations += count;
    arenas = std::move(made);
  };
  if (file_backed) {
    try {
      allocate(want, true);
      return true;
    } catch (const Error& e) {
      // The memory tier's files could not be made or pinned: its saves copy the arena, as before.
      ETTKIT_LOG_WARN("checkpoint memory tier: the arenas cannot be the tier's files (", e.message(),
                      "); memory-tier saves copy the arena instead");
      files.reset();
    }
  }
  allocate(arenas_within_budget(need), false);
  return true;
}

namespace {
/// An upper bound of the bytes of the safetensors header StepWriter writes for `entries` without digests
/// (header_of): 8 for the length, the JSON with every name escaped at its worst (6 bytes a character),
/// 20 digits a number, the metadata, and the 8-byte padding; rounded up to whole pages so that the data
/// section after it stays page-aligned.
size_t header_room_for(const std::vector<PlanEntry>& entries) {
  size_t bytes = 8 + 64 + 8;
  for (const PlanEntry& e : entries) bytes += 6 * e.name.size() + 96 + 21 * (e.shape.size() + 2);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}
}  // namespace

PlanPtr Stager::Impl::replan(const NamedTensors& tensors, OnBusy on_busy, std::unique_lock<std::mutex>& lk,
                             uint64_t names_token) {
  detail::Layout fresh = detail::lay_out(tensors);
  const size_t room_before = header_room;
  header_room = header_room_for(*fresh.entries);
  if (!fit_arenas(fresh.total_bytes, on_busy, lk)) {
    header_room = room_before;
    return nullptr;
  }
  plan = fresh.entries;
  plan_names_token = names_token;  // the plan's names are this list's
  plan_total = fresh.total_bytes;
  ++plan_builds;
  plan_disk_header();
  return plan;
}

int Stager::Impl::free_or_reclaimed() {
  // An arena is free once no step links it (the tier retired the one that did); its bytes are then nobody's.
  // A linked arena is never staged into, whatever else is known of it.
  if (spare.fd >= 0 && (arenas.empty() || spare.size != arenas[0].size || spare.reserve != arenas[0].reserve)) {
    spare.free();  // backed for arenas the state has outgrown (fit_arenas replaced them)
  }
  for (size_t i = 0; i < arenas.size(); ++i) {
    Arena& a = arenas[i];
    if (a.busy || a.linked()) continue;
    a.published = false;
    return static_cast<int>(i);
  }
  // Every arena is busy or holds a memory step. The newest memory step stays (it is what a restart
  // restores); an older one is retired now, as the tier's retention would at the next memory save.
  const int oldest = detail::reclaim_candidate(arenas);
  if (oldest < 0) return -1;
  Arena& a = arenas[static_cast<size_t>(oldest)];
  files->reclaim(a.published_step);
  if (a.linked()) {
    // The step could not be retired (or another link holds the file): leave the file to it and stage into
    // another. back_spare() made and backed one after the last commit when it saw the extra link; without
    // it (a link made since, a retire that failed) a new file, whose pages this save's copies fault in.
    Arena other;
    if (spare.fd >= 0 && spare.size == a.size && spare.reserve == a.reserve) {
      other = spare;
      spare = Arena{};
    } else {
      ETTKIT_LOG_INFO("checkpoint memory tier: step ", a.published_step, " still links arena '", a.file,
                      "'; a new arena is allocated for the next save");
      other.allocate_file(files, a.size, a.reserve, pin);  // throws with `a` untouched (still linked, never taken)
      ++arena_allocations;
    }
    a.free();
    a = other;
  }
  a.published = false;
  return oldest;
}

void Stager::Impl::back_spare(std::unique_lock<std::mutex>& lk) {
  const int next = detail::reclaim_candidate(arenas);
  if (!files || spare_backing || next < 0) return;
  const Arena& a = arenas[static_cast<size_t>(next)];
  // Its arena name and its step's data file are two links; a third (a hard link made by someone else, a
  // step of another name) survives the reclaim.
  if (a.links() <= 2) return;
  if (spare.fd >= 0) {
    if (spare.size == a.size && spare.reserve == a.reserve) return;  // made for this one already
    spare.free();  // the state was replanned since: of another size
  }
  const std::shared_ptr<detail::ArenaFiles> from = files;
  const Arena like = a;
  spare_backing = true;
  lk.unlock();
  // mu released: the next save stages meanwhile (into the free arena, or, reclaiming this one, into a new
  // file as before). The writer's thread pays for the pages, after the step it committed.
  Arena made;
  try {
    made.allocate_file(from, like.size, like.reserve, pin);
    made.populate();
  } catch (const std::exception& e) {
    made.free();
    ETTKIT_LOG_WARN("checkpoint memory tier: backing an arena for the next save failed (", e.what(),
                    "); that save stages into a new one");
  }
  lk.lock();
  spare_backing = false;
  if (made.fd >= 0) {
    spare = made;
    ++arena_allocations;
  }
  cv.notify_all();
}

int Stager::Impl::take_free_arena(OnBusy on_busy, std::unique_lock<std::mutex>& lk) {
  int arena = free_or_reclaimed();
  if (arena < 0) {
    if (on_busy == OnBusy::kSkip) return -1;
    ETTKIT_CHECK(on_busy != OnBusy::kError, InvalidArgument,
                 "checkpoint save requested while the previous save is still persisting (on_busy='error'); "
                 "use on_busy='wait' or 'skip', or a memory budget that allows two arenas");
    wait_busy(lk, [&] { return (arena = free_or_reclaimed()) >= 0; });
  }
  Arena& taken = arenas[static_cast<size_t>(arena)];
  taken.busy = true;
  taken.populated = true;  // the copies write every planned byte
  return arena;
}

int64_t Stager::prepare(const NamedTensors& tensors) {
  Impl& im = *impl_;
  detail::check_stageable(tensors);
  // mu is held until one arena is backed: a stage() that comes meanwhile waits for it, rather than taking
  // one half faulted in (the others are backed after it, each marked busy: below).
  std::unique_lock<std::mutex> lk(im.mu);
  // Pinned arenas are resident from their allocation on: when replan() allocates them in this call, this
  // call backed them (the first GPU run found prepare() answering 0 there). fit_arenas() reallocates all
  // arenas or none.
  const int64_t allocations_before = im.arena_allocations;
  if (!im.plan || !detail::same_structure(*im.plan, tensors) || im.arenas.empty()) {
    im.replan(tensors, OnBusy::kWait, lk);
  }
  const bool allocated_now = im.arena_allocations != allocations_before;
  for (size_t k = 0; im.device && im.plan && k < im.arenas.size(); ++k) {  // the batch arrays, sized now
    if (!im.arenas[k].busy) im.device->bind(static_cast<int>(k), im.plan);
  }
  for (size_t k = 0; im.plan && k < im.arenas.size(); ++k) {  // the first save's digest and arrays, made now
    if (!im.arenas[k].busy) im.warm_scratch(static_cast<int>(k), tensors.size());
  }
#if ETTKIT_WITH_CUDA
  if (im.pin && im.plan) detail::warm_gather_table(*im.plan, im.opt.cuda_gather_max_bytes);
  if (im.plan) {
    std::lock_guard<std::mutex> g(im.stream_mu);
    detail::warm_copy_stream(*im.plan, im.copy_stream);
  }
#endif
  // One arena a save can take is backed under mu (a save that comes meanwhile waits for it, as before); every
  // further one (double-buffering, the memory tier's second file) with mu released and the arena marked busy,
  // so that the first save takes the backed arena instead of waiting for the other's pages: the memory tier's
  // two 1 GB tmpfs files took 3.6 s to back on the loaded VM, and the first save waited for both (#65).
  // busy keeps fit_arenas(), set_arena_files() and the destructor off the arena meanwhile.
  bool one_ready = std::any_of(im.arenas.begin(), im.arenas.end(), [](const Arena& a) { return !a.busy && a.populated; });
  int64_t backed = 0;
  for (size_t i = 0; i < im.arenas.size(); ++i) {
    Arena& a = im.arenas[i];
    if (a.busy) continue;  // being written by a save: its copies back it
    if (a.populated) {
      if (a.pinned && allocated_now) backed += static_cast<int64_t>(a.size);
      continue;
    }
    backed += static_cast<int64_t>(a.size);
    if (!one_ready) {
      a.populate();
      one_ready = true;
      continue;
    }
    a.busy = true;
    Arena pages = a;  // a plain value: the same mapping, touched without mu while the arena is busy
    auto give_back = [&] {
      im.arenas[i].busy = false;
      im.cv.notify_all();
    };
    lk.unlock();
    try {
      pages.populate();
    } catch (...) {
      lk.lock();
      give_back();
      throw;
    }
    lk.lock();
    im.arenas[i].populated = true;
    give_back();
  }
  return backed;
}

}  // namespace ettkit::checkpoint
