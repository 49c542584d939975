// AsyncCheckpointer, the facade: the constructor opens the Session (session.cpp) and starts the Writer
// (writer.cpp); save() checks its arguments, stages and queues; the fences, close() and the figures (the
// ledger adaptor's, checkpoint_ledger.cpp). Below "load": load_latest and prefetch.
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/checkpoint/safetensors_dtypes.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <atomic>
#include <deque>
#include <optional>

#include "checkpoint/bound_entries.h"
#include "checkpoint/host_arena.h"
#include "checkpoint/loader.h"
#include "checkpoint/memory_tier.h"
#include "checkpoint/peer_monitor.h"
#include "checkpoint/peer_replica.h"
#include "checkpoint/save_handle.h"
#include "checkpoint/session.h"
#include "checkpoint/step_writer.h"
#include "checkpoint/storage.h"
#include "checkpoint/store_exchange.h"
#include "checkpoint/writer.h"
#include "common/describe.h"
#include "common/logging.h"
#include "ettkit/common/clock.h"
#include "ettkit/ett/phases.h"
#include "ettkit/ett/recorder.h"

namespace ettkit::checkpoint {

using namespace detail;
using ::ettkit::detail::describe;

Overlap parse_overlap(const std::string& s) {
  if (s == "auto") return Overlap::kAuto;
  if (s == "on") return Overlap::kOn;
  if (s == "off") return Overlap::kOff;
  ETTKIT_THROW(InvalidArgument, "overlap='", s, "' is not one of 'auto', 'on', 'off' (Python also takes True for "
               "'on' and False for 'off')");
}

Tier parse_tier(const std::string& s) {
  if (s == "disk") return Tier::kDisk;
  if (s == "memory") return Tier::kMemory;
  ETTKIT_THROW(InvalidArgument, "tier='", s, "' is not one of 'disk', 'memory'");
}

const char* tier_name(Tier t) { return t == Tier::kMemory ? "memory" : "disk"; }

// ---- helpers -------------------------------------------------------------------------------------------

namespace {

bool check_save_names_and_dtypes(const NamedTensors& tensors);
bool shows_other_values(const at::Tensor& t) { return t.is_conj() || t.is_neg(); }

/// save()'s argument checks that need no stager: the step's range (step-<N> names have at most 18
/// digits), the name safetensors reserves for its metadata, and dtypes. The only place they are made: the
/// Python layer relies on them. Returns whether a tensor is a conjugate or negative-bit view
/// (with_views_resolved), found in the same pass.
/// `vouched`: the binding vouches for the list (bound_entries.h): its per-tensor checks are left to the
/// stager's fast path, or made by save() when that path is not taken (returns false then).
bool check_save_arguments(int64_t step, const NamedTensors& tensors, bool read_only, bool vouched = false) {
  ETTKIT_EXPECTS(!read_only, "save(step=", step, ") on a read_only checkpointer: it only loads");
  ETTKIT_EXPECTS(step >= 0 && step <= kMaxStep, "step=", step,
                 " must be >= 0 and < 10^18 (step-<N> names have at most 18 digits)");
  return !vouched && check_save_names_and_dtypes(tensors);
}

/// Returns whether a tensor shows other values than its storage holds (shows_other_values): one pass over
/// the tensors for both.
bool check_save_names_and_dtypes(const NamedTensors& tensors) {
  // Once per tensor per save (issue #65): a string == string compares sizes first (not a strlen and a
  // compare per name), and a dtype is looked up in the table only when it differs from the one before.
  static const std::string kReserved = "__metadata__";
  std::optional<at::ScalarType> checked;
  bool views = false;
  for (const auto& [name, t] : tensors) {
    ETTKIT_EXPECTS(!(name == kReserved), "state dict key '__metadata__' is reserved: safetensors keeps the "
                   "file's metadata under that name, so a tensor saved as it could never be read back; rename it");
    const at::ScalarType type = t.scalar_type();
    if (checked != type) {
      safetensors_dtype(type, name);
      checked = type;
    }
    views = views || shows_other_values(t);
  }
  return views;
}

/// `tensors` with each conjugate or negative-bit view replaced by a resolved copy (its storage holds other
/// values than it shows, and staging copies storage bytes: the file must hold what it shows). The one place
/// that policy lives, for C++ and Python callers. Returns `tensors` itself, uncopied, when `views` is false
/// (check_save_arguments found none): no copy of 10^4 names on every save.
const NamedTensors& with_views_resolved(const NamedTensors& tensors, bool views, NamedTensors& resolved) {
  if (!views) return tensors;
  resolved.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    resolved.emplace_back(name, shows_other_values(t) ? t.detach().resolve_conj().resolve_neg() : t);
  }
  return resolved;
}

}  // namespace

// ---- AsyncCheckpointer ---------------------------------------------------------------------------------

// The Session (session.h) is what the writer and the loader share; the Writer owns the queue and the
// thread; the rest is the caller's side: the stager, the fences' state and the sources still held.
namespace {
/// The stager's arenas as files of `tier` (host_arena.h): a memory-tier save then commits its arena by a
/// link. Borrows the tier until close() takes the files away from the stager.
std::shared_ptr<detail::ArenaFiles> arena_files_of(detail::MemoryTier& tier) {
  auto files = std::make_shared<detail::ArenaFiles>();
  files->create = [&tier](uint64_t bytes, std::string& name) { return tier.create_arena(bytes, name); };
  files->remove = [&tier](const std::string& name) { tier.remove_arena(name); };
  files->reclaim = [&tier](int64_t step) {
    tier.retire_if([step](const detail::MemoryStep& m) { return m.step == step; });
  };
  return files;
}
}  // namespace

struct AsyncCheckpointer::Impl : detail::Session {
  std::unique_ptr<Stager> stager;
  // load_latest and prefetch (loader.h): the caller's thread only, after the writer is drained.
  detail::Loader loader{*this};

  std::mutex mu;  // guards closing, last, active, priority
  bool closing = false;
  std::shared_ptr<SaveHandle::State> last;  // latest non-skipped save (for the step pre-hook)
  // The latest save while some of its entries are not yet fenced (wait_for / the step pre-hook); null once
  // a full fence has decided them all, so that the per-module hooks cost one lock when nothing is pending.
  std::shared_ptr<Snapshot> active;
  CopyPriority priority;
  std::mutex close_mu;  // serializes close(); taken before mu, never by the writer
  std::atomic<bool> overlap{false};
  std::atomic<int64_t> unfenced_sync_max_bytes{0};
  // Snapshots whose source tensors are still referenced. Only the caller's threads drop them
  // (collect_sources), never the writer or the copy pool: the last reference of a Python-owned tensor
  // needs the GIL, and a background thread waiting for the GIL while the caller holds it and waits for
  // that thread is the deadlock of an unclosed checkpointer.
  std::mutex sources_mu;
  std::deque<std::shared_ptr<Snapshot>> holding_sources;
  std::unique_ptr<Writer> writer;  // last: its thread stops before the state above goes

  bool overlapped() const {
    return opt.overlap == Overlap::kOn || (opt.overlap == Overlap::kAuto && overlap.load());
  }

  /// The save the fences act on (null once every entry is decided) and its step.
  std::pair<std::shared_ptr<Snapshot>, int64_t> active_save() {
    std::lock_guard<std::mutex> lk(mu);
    return {active, last ? last->step : -1};
  }
  /// Once every entry of `snap` is decided, later hooks have nothing to wait for.
  void retire_if_decided(const std::shared_ptr<Snapshot>& snap) {
    if (!snap->all_decided()) return;
    std::lock_guard<std::mutex> lk(mu);
    if (active == snap) active = nullptr;
  }

  /// Drops the sources of the saves whose copies are done (`all`: of every save, waiting). `retired`: where
  /// the snapshots go afterwards (to be freed on the writer's thread), instead of being let go here.
  void collect_sources(bool all, std::vector<std::shared_ptr<Snapshot>>* retired = nullptr) {
    std::deque<std::shared_ptr<Snapshot>> done;
    {
      std::lock_guard<std::mutex> lk(sources_mu);
      while (!holding_sources.empty()) {
        if (!all && !holding_sources.front()->staged()) break;
        done.push_back(std::move(holding_sources.front()));
        holding_sources.pop_front();
      }
    }
    for (auto& s : done) s->drop_sources();
    if (retired) {
      for (auto& s : done) retired->push_back(std::move(s));
    }
  }

  /// save() may go on: not closed, no peer lost. Returns the copy priority of this save.
  CopyPriority admit(int64_t step) {
    CopyPriority p;
    {
      std::lock_guard<std::mutex> lk(mu);
      ETTKIT_EXPECTS(!closing, "save(step=", step, ") after close()");
      p = priority;
    }
    writer->rethrow_peer_loss();
    return p;
  }

  /// This call is a program point of the owner thread: the previous save's entries that no fence has
  /// decided yet are decided now if their copies are done (a later write would otherwise count against
  /// them at their commit and refuse a consistent snapshot).
  void decide_previous_save() {
    std::shared_ptr<Snapshot> prev;
    {
      std::lock_guard<std::mutex> lk(mu);
      prev = active;
    }
    if (prev && prev->staged()) {
      try {
        prev->wait_staged();
      } catch (...) {  // a copy error: that save's handle reports it
      }
    }
  }

  /// Without overlap nobody fences the writes that follow: the copies must be done before the caller can
  /// write, and on this thread the wait is also the fence that decides every entry. With overlap, the
  /// sources stay referenced until the copies are done (collect_sources drops them on a caller's thread).
  void hand_over_sources(const std::shared_ptr<Snapshot>& snap, bool overlapped_save) {
    if (!overlapped_save) {
      try {
        snap->wait_staged();
      } catch (...) {
        snap->release();
        throw;
      }
      snap->drop_sources();
    } else {
      std::lock_guard<std::mutex> lk(sources_mu);
      holding_sources.push_back(snap);
    }
  }

  /// The stage of save(): `vouched` (see save()) tries the stager's fast path first, with the per-tensor
  /// checks skipped; on its miss, or unvouched, the checks, conjugate and negative views resolved, and the
  /// full path.
  std::shared_ptr<Snapshot> stage_checked(const NamedTensors& tensors, const CopyPriority& priority, bool overlap,
                                          Tier tier, const SaveBinding& binding, bool vouched) {
    const int64_t sync_max = overlap ? unfenced_sync_max_bytes.load() : 0;
    const StageHashing hashing = tier == Tier::kMemory ? StageHashing::kMemoryTier : StageHashing::kDiskTier;
    if (vouched) {
      detail::BoundCall call{/*caller_skipped_checks=*/true};
      detail::BoundCallScope scope(call);
      try {
        return stager->stage(tensors, opt.on_busy, priority, sync_max, hashing, binding);
      } catch (const detail::BoundMiss&) {
        // Nothing was staged: the checks, and the full path.
      }
    }
    const bool views = check_save_names_and_dtypes(tensors);
    NamedTensors resolved;
    const NamedTensors& staged = with_views_resolved(tensors, views, resolved);
    // The names are the same in `resolved`; its tensors are not the caller's list (no `held`).
    const SaveBinding bound = views ? SaveBinding{binding.names_token, nullptr} : binding;
    return stager->stage(staged, opt.on_busy, priority, sync_max, hashing, bound);
  }

  /// The save becomes the latest (the fences act on it while overlapped) and goes to the writer.
  void queue_save(WriteJob job, bool overlapped_save) {
    {
      std::lock_guard<std::mutex> lk(mu);
      last = job.handle;
      // The previous save's snapshot goes with this job: freed on the writer's thread if it is the last holder.
      if (active) job.retired.push_back(std::move(active));
      active = overlapped_save ? job.snapshot : nullptr;
    }
    ledger.count_save(job.tier);
    writer->enqueue(std::move(job));
  }

};

AsyncCheckpointer::AsyncCheckpointer(CheckpointerOptions options, c10::intrusive_ptr<c10d::Store> store)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  open_session(im, std::move(options), std::move(store));
  im.unfenced_sync_max_bytes = im.opt.unfenced_sync_max_bytes;
  im.stager = std::make_unique<Stager>(im.opt.stager);
  if (im.memory) im.stager->set_arena_files(arena_files_of(*im.memory));
  im.stager->set_disk_header_planner(detail::plan_disk_header);
  im.writer = std::make_unique<Writer>(im);
}

AsyncCheckpointer::~AsyncCheckpointer() {
  try {
    close(/*discard_memory_tier=*/false);
  } catch (...) {
  }
}

uint64_t new_names_token() {
  static std::atomic<uint64_t> next{0};
  return ++next;  // never 0 (no token)
}

SaveHandle AsyncCheckpointer::save(int64_t step, const NamedTensors& tensors, const std::string& extra, Tier tier,
                                   int64_t call_begin_us, const SaveBinding& binding) {
  Impl& im = *impl_;
  ETTKIT_EXPECTS(tier != Tier::kMemory || im.memory, "save(step=", step, ", tier='memory') needs a memory tier: "
                 "construct the checkpointer with memory_tier (e.g. root \"/dev/shm\")");
  const int64_t now = epoch_us();
  // The caller's start, when it is a plausible one (not in the future, at most an hour back: a clock step
  // or a wrong value must not book an hour of blocking).
  const bool caller = call_begin_us >= 0 && call_begin_us <= now && now - call_begin_us < 3'600'000'000LL;
  int64_t b = caller ? call_begin_us : now;
  CopyPriority priority = im.admit(step);
  // The same held list under a names token: the names and dtypes were checked when the stager's cache of
  // them was built, and its one pass sees any change (bound_entries.h); on a miss they are checked below.
  const bool vouched = binding.names_token != 0 && binding.held.get() == &tensors;
  (void)check_save_arguments(step, tensors, im.opt.read_only, vouched);
  ETTKIT_EXPECTS(extra.size() <= kMaxExtraBytes, "save(step=", step, "): extra holds ", extra.size(),
                 " bytes; at most ", kMaxExtraBytes, " (256 MiB) are kept, since a load reads them whole: put "
                 "large state in tensors");
  // Training has started without a load of the prefetched step: its open files would keep a retired
  // memory-tier snapshot's pages alive (tmpfs frees them at the last close).
  im.loader.cancel_prefetch();
  im.decide_previous_save();
  std::vector<std::shared_ptr<Snapshot>> retired;
  im.collect_sources(/*all=*/false, &retired);
  auto hs = std::make_shared<SaveHandle::State>();
  hs->step = step;
  hs->tier = tier;
  const bool overlap = im.overlapped();
  std::shared_ptr<Snapshot> snap = im.stage_checked(tensors, priority, overlap, tier, binding, vouched);
  if (!snap) {
    hs->skipped = true;
    ETTKIT_LOG_INFO("checkpoint step ", step, " skipped: the previous save is still persisting (on_busy='skip')");
    return SaveHandle(hs);
  }
  im.hand_over_sources(snap, overlap);
  hs->snapshot = snap;
  im.queue_save(WriteJob{step, tier, 0, b, snap, extra, hs, std::move(retired)}, overlap);
  int64_t e = epoch_us();
  hs->blocking_s = static_cast<double>(e - b) * 1e-6;
  im.ledger.record_blocking(b, e, step);
  return SaveHandle(hs);
}

int64_t AsyncCheckpointer::prepare(const NamedTensors& tensors) {
  ETTKIT_EXPECTS(!impl_->opt.read_only, "prepare() on a read_only checkpointer: it only loads");
  // What save() would refuse is refused now, before arenas are sized for it. A conjugate or negative-bit view
  // is staged as a resolved copy of the same dtype and shape, so the plan is the same without resolving it.
  (void)check_save_names_and_dtypes(tensors);
  return impl_->stager->prepare(tensors);
}

void AsyncCheckpointer::wait_staged_on_current_stream() {
  Impl& im = *impl_;
  auto [snap, step] = im.active_save();
  if (!snap) return;
  bool waited = !snap->staged();
  int64_t b = epoch_us();
  snap->wait_staged_on_current_stream();
  if (waited) im.ledger.record_blocking(b, epoch_us(), step);
  im.retire_if_decided(snap);
}

void AsyncCheckpointer::wait_for(const std::vector<at::Tensor>& tensors) {
  Impl& im = *impl_;
  auto [snap, step] = im.active_save();
  if (!snap) return;
  int64_t b = epoch_us();
  if (snap->wait_for(tensors)) im.ledger.record_blocking(b, epoch_us(), step);
  im.retire_if_decided(snap);
}

bool AsyncCheckpointer::fence_pending() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->active && !impl_->active->all_decided();
}

void AsyncCheckpointer::enable_overlap() { impl_->overlap = true; }

void AsyncCheckpointer::set_unfenced_sync_max_bytes(int64_t bytes) {
  ETTKIT_EXPECTS(bytes >= 0, "unfenced_sync_max_bytes=", bytes, " must be >= 0");
  impl_->unfenced_sync_max_bytes = bytes;
}

void AsyncCheckpointer::hold_commits_for_testing(bool hold) { impl_->writer->hold(hold); }
void AsyncCheckpointer::wait_until_held_for_testing() { impl_->writer->wait_until_held(); }

bool AsyncCheckpointer::overlapped() const { return impl_->overlapped(); }

void AsyncCheckpointer::set_copy_priority(CopyPriority priority) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->priority = std::move(priority);
}

void AsyncCheckpointer::wait_all() {
  impl_->writer->wait_idle();
  impl_->collect_sources(/*all=*/true);
}

void AsyncCheckpointer::close(bool discard_memory_tier) {
  Impl& im = *impl_;
  // Several threads may close at once (make tsan's stress test; two Python threads): without this lock each
  // saw a joinable writer and joined it, and std::thread::join() raced with itself (a data race on the
  // thread handle, then std::system_error from the second join). A later closer waits here until the first
  // has finished, so that no close() returns before every queued save is finished.
  std::lock_guard<std::mutex> closing(im.close_mu);
  {
    std::lock_guard<std::mutex> lk(im.mu);
    if (im.closing && im.writer->stopped()) return;
    im.closing = true;
  }
  const int64_t drain_begin = epoch_us();
  // The wait for the last saves to commit is time the job spends on checkpointing after its last step; a
  // phase records it (else the report would show it as unattributed).
  if (im.writer->stop()) im.ledger.record_drain(drain_begin, epoch_us());
  // Before the heartbeat stops: the replica's receiver waits for its sender's count with the monitor.
  if (im.replica) im.replica->close();
  if (im.peers) im.peers->close(/*clean=*/!im.writer->peer_lost());
  im.collect_sources(/*all=*/true);
  im.loader.cancel_prefetch();  // closes the files it holds open (some may be the memory tier's, removed next)
  if (im.memory) {
    // The arenas are the tier's files: they go before it does (the steps that link them keep their bytes).
    im.stager->set_arena_files(nullptr);
    if (discard_memory_tier) im.memory->discard();
    im.memory.reset();  // releases the rank's memory-tier lock
  }
  im.lock.release();
  std::lock_guard<std::mutex> lk(im.mu);
  im.active.reset();
  im.last.reset();
}

int AsyncCheckpointer::rank() const { return impl_->rank; }
int AsyncCheckpointer::world_size() const { return impl_->world; }
const std::string& AsyncCheckpointer::directory() const { return impl_->opt.directory; }
const Stager& AsyncCheckpointer::stager() const { return *impl_->stager; }
double AsyncCheckpointer::mean_blocking_s() const { return impl_->ledger.mean_blocking_s(); }
double AsyncCheckpointer::mean_blocking_s(Tier tier) const { return impl_->ledger.mean_blocking_s(tier); }
double AsyncCheckpointer::mean_time_to_durable_s(Tier tier) const { return impl_->ledger.mean_time_to_durable_s(tier); }
double AsyncCheckpointer::mean_time_to_durable_s() const { return impl_->ledger.mean_time_to_durable_s(Tier::kDisk); }
int64_t AsyncCheckpointer::saves_committed() const { return impl_->ledger.saves_committed(Tier::kDisk); }
int64_t AsyncCheckpointer::memory_saves_committed() const { return impl_->ledger.saves_committed(Tier::kMemory); }
int64_t AsyncCheckpointer::saves_failed() const { return impl_->ledger.saves_failed(); }
int64_t AsyncCheckpointer::saves_refused() const { return impl_->ledger.saves_refused(); }
std::string AsyncCheckpointer::memory_tier_directory() const { return impl_->memory_dir; }
const std::string& AsyncCheckpointer::run_id() const { return impl_->run_id; }

void check_peer_replica(const CheckpointerOptions& options, std::optional<int> ranks_per_host) {
  ETTKIT_EXPECTS(!options.memory_tier.root.empty(), "peer_replica=True needs a memory tier (memory_tier=True for "
                 "/dev/shm; in C++ a MemoryTierOptions::root): the partner keeps the replica in its memory tier");
  const int world = options.world_size > 0 ? options.world_size : 1;
  ETTKIT_EXPECTS(world > 1, "peer_replica=True needs world_size > 1 (a partner on another node); this job has 1 rank");
  if (!ranks_per_host) return;
  ETTKIT_EXPECTS(*ranks_per_host >= 1 && *ranks_per_host < world, "ranks_per_host=", *ranks_per_host,
                 " leaves no partner on another node among world_size=", world, " ranks: it must be in [1, ",
                 world - 1, "] (the number of ranks each node runs, e.g. torchrun's LOCAL_WORLD_SIZE)");
}

void AsyncCheckpointer::enable_peer_replica(c10::intrusive_ptr<c10d::Backend> group, int ranks_per_host) {
  Impl& im = *impl_;
  check_peer_replica(im.opt, ranks_per_host);
  {
    std::lock_guard<std::mutex> lk(im.mu);
    ETTKIT_EXPECTS(!im.replica, "enable_peer_replica() was already called");
    ETTKIT_EXPECTS(im.writer->saves_queued() == 0 && !im.loader.started() && !im.closing,
                   "enable_peer_replica() must come before the first save() and load_latest(), on every rank");
  }
  im.replica = std::make_unique<PeerReplica>(std::move(group), im.store, im.key_prefix + "replica/", im.run_id,
                                             im.peers.get(), im.rank, im.world, ranks_per_host, *im.memory,
                                             im.opt.commit_timeout_s);
}
int64_t AsyncCheckpointer::replicas_sent() const { return impl_->replica ? impl_->replica->sent() : 0; }
int64_t AsyncCheckpointer::replicas_received() const { return impl_->replica ? impl_->replica->received() : 0; }
int64_t AsyncCheckpointer::replica_failures() const { return impl_->replica ? impl_->replica->failed() : 0; }

// ---- load (loader.h) -----------------------------------------------------------------------------

std::vector<int64_t> AsyncCheckpointer::prefetch() {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    ETTKIT_EXPECTS(!impl_->closing, "prefetch() after close()");
  }
  return impl_->loader.prefetch();
}

bool AsyncCheckpointer::wait_prefetch(double timeout_s) { return impl_->loader.wait_prefetch(timeout_s); }

std::pair<double, uint64_t> AsyncCheckpointer::prefetch_figures() const { return impl_->loader.prefetch_figures(); }

std::optional<LoadResult> AsyncCheckpointer::load_latest(const NamedTensors& tensors,
                                                        const std::function<void(const std::string&)>& validate_extra,
                                                        const std::vector<std::string>& read_prefixes, bool partial,
                                                        const std::map<std::string, std::vector<int64_t>>& global_shapes) {
  wait_all();  // the writer is drained: the load reads the Session's memory tier and replica alone
  return impl_->loader.load_latest(tensors, validate_extra, read_prefixes, partial, global_shapes);
}

}  // namespace ettkit::checkpoint
