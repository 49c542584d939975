// AsyncCheckpointer, the facade: the constructor opens the Session (session.cpp) and starts the Writer
// (writer.cpp); save() checks its arguments, stages and queues; the fences, close() and the figures (the
// ledger adaptor's, checkpoint_ledger.cpp). Below "load": load_latest and prefetch.
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/checkpoint/safetensors_dtypes.h"

#include <fcntl.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/version.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <iterator>
#include <set>
#include <thread>

#include "checkpoint/memory_tier.h"
#include "checkpoint/peer_monitor.h"
#include "checkpoint/peer_replica.h"
#include "checkpoint/reshard.h"
#include "checkpoint/restore_prefetch.h"
#include "checkpoint/save_handle.h"
#include "checkpoint/session.h"
#include "checkpoint/step_writer.h"
#include "checkpoint/writer.h"
#include "checkpoint/storage.h"
#include "checkpoint/store_exchange.h"
#include "common/describe.h"
#include "common/logging.h"
#include "ettkit/common/clock.h"
#include "ettkit/ett/phases.h"
#include "ettkit/ett/recorder.h"

namespace fs = std::filesystem;
using nlohmann::json;

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

/// The torch dtype a safetensors dtype string names, or nullopt when ettkit does not read that dtype.
std::optional<at::ScalarType> scalar_type_of(const std::string& dtype) {
  if (const SafetensorsDtype* d = find_safetensors_dtype(std::string_view(dtype))) return d->type;
  return std::nullopt;
}

/// save()'s argument checks that need no stager: the step's range (step-<N> names have at most 18
/// digits), the name safetensors reserves for its metadata, and dtypes. The only place they are made: the
/// Python layer relies on them.
void check_save_arguments(int64_t step, const NamedTensors& tensors, bool read_only) {
  ETTKIT_EXPECTS(!read_only, "save(step=", step, ") on a read_only checkpointer: it only loads");
  ETTKIT_EXPECTS(step >= 0 && step <= kMaxStep, "step=", step,
                 " must be >= 0 and < 10^18 (step-<N> names have at most 18 digits)");
  for (const auto& [name, t] : tensors) {
    ETTKIT_EXPECTS(name != "__metadata__", "state dict key '__metadata__' is reserved: safetensors keeps the "
                   "file's metadata under that name, so a tensor saved as it could never be read back; rename it");
    safetensors_dtype(t.scalar_type(), name);
  }
}

bool shows_other_values(const at::Tensor& t) { return t.is_conj() || t.is_neg(); }

/// `tensors` with each conjugate or negative-bit view replaced by a resolved copy (its storage holds other
/// values than it shows, and staging copies storage bytes: the file must hold what it shows). The one place
/// that policy lives, for C++ and Python callers. Returns `tensors` itself, uncopied, when none is a view:
/// two bit tests per tensor, no copy of 10^4 names on every save.
const NamedTensors& with_views_resolved(const NamedTensors& tensors, NamedTensors& resolved) {
  if (std::none_of(tensors.begin(), tensors.end(), [](const auto& e) { return shows_other_values(e.second); })) {
    return tensors;
  }
  resolved.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    resolved.emplace_back(name, shows_other_values(t) ? t.detach().resolve_conj().resolve_neg() : t);
  }
  return resolved;
}

/// What a rank's report of its memory-tier steps for load_latest's vote is.
constexpr const char* kMemoryReportShape =
    "{\"held\": [[step, run id], ...], \"replica\": [...] (optional), \"disk\": step or -1}";

/// A rank's report of its memory-tier steps (StoreExchange decoded it from the Store key `source`), checked
/// before any of it is used: kMemoryReportShape. CorruptData naming the key for anything else: no run id
/// that is not one gets into the vote.
void check_memory_report(const json& r, const std::string& source) {
  ETTKIT_CHECK(r.is_object(), CorruptData, source, " is not a JSON object");
  auto step_ok = [](const json& v, int64_t lo) {
    return v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= kMaxStep;
  };
  for (const char* key : {"held", "replica"}) {
    if (!r.contains(key)) continue;
    ETTKIT_CHECK(r[key].is_array(), CorruptData, source, ": '", key, "' is not an array");
    for (const json& e : r[key]) {
      const bool ok = e.is_array() && e.size() == 2 && step_ok(e[0], 0) && e[1].is_string() &&
                      is_run_id(e[1].get<std::string>());
      ETTKIT_CHECK(ok, CorruptData, source, ": an entry of '", key, "' is not [step, run id] (a step in [0, ",
                   kMaxStep, "], a run id of 16 lowercase hex digits)");
    }
  }
  ETTKIT_CHECK(r.contains("disk") && step_ok(r["disk"], -1), CorruptData, source,
               ": 'disk' is not a step number or -1");
}

}  // namespace

// ---- AsyncCheckpointer ---------------------------------------------------------------------------------

// The Session (session.h) is what the writer and the loader share; the Writer owns the queue and the
// thread; the rest is the caller's side: the stager, the fences' state and the sources still held.
struct AsyncCheckpointer::Impl : detail::Session {
  std::unique_ptr<Stager> stager;
  // Verify-ahead of the steps load_latest is about to consider (prefetch()); the owner thread only.
  RestorePrefetch prefetch;

  std::mutex mu;  // guards closing, load_seq, last, active, priority
  bool closing = false;
  uint64_t load_seq = 0;
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

  void collect_sources(bool all) {
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

  /// The save becomes the latest (the fences act on it while overlapped) and goes to the writer.
  void queue_save(WriteJob job, bool overlapped_save) {
    {
      std::lock_guard<std::mutex> lk(mu);
      last = job.handle;
      active = overlapped_save ? job.snapshot : nullptr;
    }
    ledger.count_save(job.tier);
    writer->enqueue(std::move(job));
  }

  /// What the ranks agreed to restore from the memory tier.
  struct MemoryChoice {
    int64_t step = -1;
    bool take = false;  ///< this rank lacks the step: its partner gives its replica back
    bool give = false;  ///< the rank this one keeps replicas for lacks it: this rank gives it back
  };

  /// The memory step load_latest tries first: the newest that every rank holds from one and the same run
  /// (a rank's snapshot of another run is another timeline), unless a step committed on disk has a larger
  /// number. With a peer replica a rank also "holds" a step its partner keeps a replica of. nullopt:
  /// restore from the disk tier. Every rank returns the same step.
  std::optional<MemoryChoice> agree_on_memory_step(const std::vector<MemoryStep>& held, uint64_t seq) {
    auto usable = [&](const std::vector<MemoryStep>& steps, const char* what) {
      json out = json::array();
      for (const MemoryStep& s : steps) {
        if (s.world_size == world) {
          out.push_back(json::array({s.step, s.run_id}));
        } else {
          ETTKIT_LOG_INFO("checkpoint memory tier: ", what, " step ", s.step, " in '", memory->dir(), "' was written by ",
                          s.world_size, " ranks; this job has ", world, ": not used");
        }
      }
      return out;
    };
    json report{{"held", usable(held, "")}};
    if (replica) {
      report["replica"] = usable(memory->committed_in(memory->replica_dir(replica->held_for()), /*warn=*/true),
                                 "the replica's");
    }
    int64_t disk_newest = -1;
    if (rank == 0) {
      StepListing l = list_steps(opt.directory);
      if (!l.committed.empty()) disk_newest = l.committed.front().step;
    }
    report["disk"] = disk_newest;
    std::vector<json> reports{report};
    if (world > 1) {
      reports = exchange->all_gather(key_prefix + "load/" + std::to_string(seq) + "/memory/", rank, world, report,
                                     "load_latest: the other ranks' memory-tier steps", kMemoryReportShape,
                                     check_memory_report);
    }
    using Held = std::set<std::pair<int64_t, std::string>>;
    auto steps_of = [](const json& report, const char* key) {
      Held out;
      if (!report.contains(key)) return out;
      for (const json& e : report.at(key)) out.emplace(e.at(0).get<int64_t>(), e.at(1).get<std::string>());
      return out;
    };
    // What rank r can restore: its own steps, and the replicas its partner keeps of them.
    auto available = [&](int r) {
      Held out = steps_of(reports[static_cast<size_t>(r)], "held");
      if (replica) {
        Held kept = steps_of(reports[static_cast<size_t>(replica->partner_of(r))], "replica");
        out.insert(kept.begin(), kept.end());
      }
      return out;
    };
    Held common = available(0);
    std::string missing;
    for (int r = 1; r < static_cast<int>(reports.size()) && !common.empty(); ++r) {
      Held theirs = available(r), both;
      std::set_intersection(common.begin(), common.end(), theirs.begin(), theirs.end(), std::inserter(both, both.end()));
      if (both.size() < common.size() && missing.empty()) missing = " (rank " + std::to_string(r) + " lacks it)";
      common = std::move(both);
    }
    disk_newest = reports[0].at("disk").get<int64_t>();
    if (common.empty()) {
      if (!held.empty()) {
        ETTKIT_LOG_WARN("checkpoint memory tier: this rank holds step ", held.front().step, " in memory, but not every "
                        "rank holds it", missing, ": all ranks restore from the disk tier");
      }
      return std::nullopt;
    }
    auto best = *common.rbegin();
    if (best.first < disk_newest) {
      ETTKIT_LOG_INFO("checkpoint memory tier: step ", best.first, " is older than step ", disk_newest,
                      " on disk: restoring from the disk tier");
      return std::nullopt;
    }
    MemoryChoice choice;
    choice.step = best.first;
    if (replica) {
      auto lacks = [&](int r) { return steps_of(reports[static_cast<size_t>(r)], "held").count(best) == 0; };
      choice.take = lacks(rank);
      choice.give = lacks(replica->held_for());
    }
    return choice;
  }

};

AsyncCheckpointer::AsyncCheckpointer(CheckpointerOptions options, c10::intrusive_ptr<c10d::Store> store)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  open_session(im, std::move(options), std::move(store));
  im.unfenced_sync_max_bytes = im.opt.unfenced_sync_max_bytes;
  im.stager = std::make_unique<Stager>(im.opt.stager);
  im.writer = std::make_unique<Writer>(im);
}

AsyncCheckpointer::~AsyncCheckpointer() {
  try {
    close(/*discard_memory_tier=*/false);
  } catch (...) {
  }
}

SaveHandle AsyncCheckpointer::save(int64_t step, const NamedTensors& tensors, const std::string& extra, Tier tier) {
  Impl& im = *impl_;
  ETTKIT_EXPECTS(tier != Tier::kMemory || im.memory, "save(step=", step, ", tier='memory') needs a memory tier: "
                 "construct the checkpointer with memory_tier (e.g. root \"/dev/shm\")");
  int64_t b = epoch_us();
  CopyPriority priority = im.admit(step);
  check_save_arguments(step, tensors, im.opt.read_only);
  NamedTensors resolved;
  const NamedTensors& staged = with_views_resolved(tensors, resolved);
  ETTKIT_EXPECTS(extra.size() <= kMaxExtraBytes, "save(step=", step, "): extra holds ", extra.size(),
                 " bytes; at most ", kMaxExtraBytes, " (256 MiB) are kept, since a load reads them whole: put "
                 "large state in tensors");
  // Training has started without a load of the prefetched step: its open files would keep a retired
  // memory-tier snapshot's pages alive (tmpfs frees them at the last close).
  im.prefetch.cancel();
  im.decide_previous_save();
  im.collect_sources(/*all=*/false);
  auto hs = std::make_shared<SaveHandle::State>();
  hs->step = step;
  hs->tier = tier;
  const bool overlap = im.overlapped();
  std::shared_ptr<Snapshot> snap =
      im.stager->stage(staged, im.opt.on_busy, priority, overlap ? im.unfenced_sync_max_bytes.load() : 0);
  if (!snap) {
    hs->skipped = true;
    ETTKIT_LOG_INFO("checkpoint step ", step, " skipped: the previous save is still persisting (on_busy='skip')");
    return SaveHandle(hs);
  }
  im.hand_over_sources(snap, overlap);
  hs->snapshot = snap;
  im.queue_save(WriteJob{step, tier, 0, b, snap, extra, hs}, overlap);
  int64_t e = epoch_us();
  hs->blocking_s = static_cast<double>(e - b) * 1e-6;
  im.ledger.record_blocking(b, e, step);
  return SaveHandle(hs);
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
  im.prefetch.cancel();  // closes the files it holds open (some may be the memory tier's, removed next)
  if (im.memory) {
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
    ETTKIT_EXPECTS(im.writer->saves_queued() == 0 && im.load_seq == 0 && !im.closing,
                   "enable_peer_replica() must come before the first save() and load_latest(), on every rank");
  }
  im.replica = std::make_unique<PeerReplica>(std::move(group), im.store, im.key_prefix + "replica/", im.run_id,
                                             im.peers.get(), im.rank, im.world, ranks_per_host, *im.memory,
                                             im.opt.commit_timeout_s);
}
int64_t AsyncCheckpointer::replicas_sent() const { return impl_->replica ? impl_->replica->sent() : 0; }
int64_t AsyncCheckpointer::replicas_received() const { return impl_->replica ? impl_->replica->received() : 0; }
int64_t AsyncCheckpointer::replica_failures() const { return impl_->replica ? impl_->replica->failed() : 0; }

// ---- load ----------------------------------------------------------------------------------------------

namespace {

// kVanished: retention (another process's, or a later commit's) removed the step while it was being
// considered; not a corruption, and the directory is listed again.
enum class Verdict { kOk, kBad, kMismatch, kVanished };

/// How verdicts combine across ranks: the worst wins.
int severity(Verdict v) {
  switch (v) {
    case Verdict::kOk: return 0;
    case Verdict::kVanished: return 1;
    case Verdict::kBad: return 2;
    case Verdict::kMismatch: return 3;
  }
  return 2;
}

struct Candidate {
  Verdict verdict = Verdict::kBad;
  std::string reason;
  std::optional<OpenedStep> files;  // open: retention may remove the step, these still read whole
  SafetensorsIndex index;
  std::string extra;
  std::vector<const SafetensorsEntry*> to_read;  // into `index`: no destination, under a read prefix
  // A step written at another world size (docs/checkpoint.md, "Elastic restore"): every old rank's files,
  // their indexes, and per destination tensor (in the state's order) the reads that fill it.
  bool reshard = false;
  int saved_world = 0;
  std::vector<OpenedStep> old;
  std::vector<SafetensorsIndex> old_index;
  std::vector<std::vector<CopyRange>> plans;
  uint64_t planned = 0, verified = 0;
  // Verified ahead by RestorePrefetch (check_candidate's `pre`), and the bytes hashed again at load time.
  bool prefetched = false;
  uint64_t reverified = 0;
};

/// Whether `name` is one of `prefixes` or starts with one followed by '.' ("" covers every name).
bool under_prefix(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes) {
    if (p.empty()) return true;
    if (name.size() >= p.size() && name.compare(0, p.size(), p) == 0 &&
        (name.size() == p.size() || name[p.size()] == '.')) {
      return true;
    }
  }
  return false;
}

/// "'a', 'b', ... (n more)": enough names to act on, bounded so a wrong model does not print 10^4 keys.
std::string quoted_list(const std::vector<std::string>& names) {
  constexpr size_t kShown = 12;
  std::string out;
  for (size_t i = 0; i < std::min(names.size(), kShown); ++i) out += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > kShown) out += ", ... (" + std::to_string(names.size() - kShown) + " more)";
  return out;
}
std::string plain_list(const std::vector<std::string>& items) {
  constexpr size_t kShown = 12;
  std::string out;
  for (size_t i = 0; i < std::min(items.size(), kShown); ++i) out += (i ? "; " : "") + items[i];
  if (items.size() > kShown) out += "; ... (" + std::to_string(items.size() - kShown) + " more)";
  return out;
}

/// Threads that verify and read a step: the stager's copy threads (a restore runs before training, when
/// those cores are idle).
int load_threads(const CheckpointerOptions& opt) {
  return opt.stager.copy_threads > 0 ? opt.stager.copy_threads
                                     : std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 4);
}

/// Runs the caller's `validate_extra` (the decoder of the non-tensor state) on a candidate's extra bytes. It is
/// called last, once the step's manifest, file sizes, checksums and safetensors index have been checked and its
/// tensor names compared with the state's: the decoder sees only bytes the manifest vouches for, of a step that
/// is otherwise loadable or a mismatch (still decoded then, so that the message can name a sharded tensor's
/// plan; Python's decoder runs no code from the bytes, docs/security.md). An InvalidArgument is the caller
/// saying its state does not match the step: its message goes to `mismatch` (no fallback). Returns why the bytes
/// do not decode ("" when they do): the step is then corrupt, and the load falls back.
std::string undecodable_extra(const std::function<void(const std::string&)>& validate_extra, const std::string& extra,
                              const std::string& path, std::string& mismatch) {
  if (!validate_extra) return {};
  try {
    validate_extra(extra);
  } catch (const InvalidArgument& e) {
    mismatch = e.message();
  } catch (const std::exception& e) {
    std::string why = e.what();
    if (const auto* err = dynamic_cast<const Error*>(&e)) why = err->message();
    return "'" + path + "' cannot be decoded: " + why;
  }
  return {};
}

/// The candidate for a step written by `saved_world` ranks when this job has another number: every old
/// rank's files are opened and indexed (their headers only), each destination tensor gets the reads that
/// fill it (reshard.h), and, with `verify`, the checksum chunks those reads touch are checked. The
/// non-tensor state is old rank 0's (at another world size there is no rank it belongs to: it is taken as
/// the same on every rank, like a whole tensor).
Candidate check_reshard_candidate(const std::string& dir, int64_t step, int saved_world, bool verify, int threads,
                                  const NamedTensors& tensors,
                                  const std::function<void(const std::string&)>& validate_extra,
                                  const std::vector<std::string>& read_prefixes, bool whole_from_rank0) {
  Candidate c;
  c.reshard = true;
  c.saved_world = saved_world;
  std::string extra_mismatch;
  std::vector<std::set<size_t>> chunks(static_cast<size_t>(saved_world));
  try {
    for (int r = 0; r < saved_world; ++r) {
      std::optional<OpenedStep> f = open_step(dir, step, r);
      if (!f) {
        c.verdict = Verdict::kVanished;
        c.reason = "step " + std::to_string(step) + " was removed while it was being loaded";
        return c;
      }
      ETTKIT_CHECK(f->manifest.world_size == saved_world, CorruptData, "manifest '", f->manifest_path,
                   "' changed while it was being read");
      listed_digest(*f, f->data);  // listed, and of its size; its chunks are checked as they are read
      c.old_index.push_back(read_safetensors_index(f->data));
      c.old.push_back(std::move(*f));
    }
    c.extra = read_checked_extra(c.old.front(), verify);
  } catch (const Error& e) {
    c.verdict = Verdict::kBad;
    c.reason = e.message();
    c.old.clear();
    return c;
  }
  std::vector<const SafetensorsIndex*> indexes;
  for (const SafetensorsIndex& i : c.old_index) indexes.push_back(&i);
  std::vector<std::string> problems;
  std::set<std::string> wanted_keys;
  for (const auto& [name, t] : tensors) {
    wanted_keys.insert(split_shard_name(name).first);
    try {
      c.plans.push_back(plan_destination(name, t.sizes().vec(), safetensors_dtype(t.scalar_type(), name), indexes));
      c.planned += planned_bytes(c.plans.back());
    } catch (const InvalidArgument& e) {
      problems.push_back(e.message());
      c.plans.emplace_back();
    }
  }
  // A tensor saved whole is read from one old rank's copy, which is right only for a replica: the same bytes
  // on every old rank that saved it. The digests in the old headers prove it (or show per-rank state, which
  // is refused rather than silently replaced by old rank 0's values). Steps saved before the digests
  // existed cannot prove it: they load as before, with a warning.
  std::vector<std::string> unproven;
  std::vector<std::string> differing;  // taken from old rank 0 anyway (whole_from_rank0)
  auto check_replicated = [&](const std::string& name) {
    const std::string key = kWholeTensorDigestPrefix + name;
    std::optional<std::pair<size_t, std::string>> first;
    for (size_t r = 0; r < c.old_index.size(); ++r) {
      if (!c.old_index[r].tensors.count(name)) continue;
      auto d = c.old_index[r].metadata.find(key);
      if (d == c.old_index[r].metadata.end()) {
        unproven.push_back(name);
        return;
      }
      if (!first) {
        first.emplace(r, d->second);
      } else if (d->second != first->second) {
        if (whole_from_rank0) {
          differing.push_back(name);
        } else {
          problems.push_back(ettkit::detail::concat(
              "'", name, "' was saved whole and differs between old ranks ", first->first, " and ", r,
              ": per-rank state cannot be mapped onto another number of ranks (only a tensor every rank holds the "
              "same, such as a DDP replica, can); save it as a DTensor or ShardedTensor, keep it out of the "
              "checkpoint, or, when old rank 0's copy is the right one (a DDP model's buffers with "
              "broadcast_buffers), load with reshard_whole_from_rank0"));
        }
        return;
      }
    }
  };
  for (const auto& [name, t] : tensors) {
    if (!split_shard_name(name).second) check_replicated(name);
  }
  // What no destination asks for. A piece of a sharded tensor: another rank's now (a rank may hold no shard
  // of a table; the caller checks that the state has the sharded tensor). A whole tensor under a read prefix
  // (lazily created state): old rank 0's copy. Any other whole tensor: a mismatch, as at the same world size.
  std::vector<std::string> unexpected;
  for (size_t r = 0; r < c.old_index.size(); ++r) {
    for (const auto& [name, entry] : c.old_index[r].tensors) {
      auto [key, offsets] = split_shard_name(name);
      if (wanted_keys.count(key) || offsets) continue;
      if (under_prefix(name, read_prefixes) && scalar_type_of(entry.dtype)) {
        if (r == 0) {
          c.to_read.push_back(&entry);
          c.planned += entry.end - entry.begin;
          check_replicated(name);
        }
      } else if (std::find(unexpected.begin(), unexpected.end(), key) == unexpected.end()) {
        unexpected.push_back(key);
      }
    }
  }
  if (!unexpected.empty()) problems.push_back("unexpected in the checkpoint (the state dict lacks them): " + quoted_list(unexpected));
  // The names are checked: the non-tensor state may be decoded now.
  if (std::string why = undecodable_extra(validate_extra, c.extra, c.old.front().extra.path(), extra_mismatch);
      !why.empty()) {
    c.verdict = Verdict::kBad;
    c.reason = std::move(why);
    c.old.clear();
    return c;
  }
  if (!differing.empty() && problems.empty()) {
    ETTKIT_LOG_WARN("checkpoint: step ", step, " was written by ", saved_world, " ranks whose copies of ",
                    differing.size(), " tensor(s) saved whole differ (", quoted_list(differing),
                    "); old rank 0's copy is used (reshard_whole_from_rank0)");
  }
  if (!unproven.empty() && problems.empty()) {
    ETTKIT_LOG_WARN("checkpoint: step ", step, " was saved without per-tensor digests (by an older ettkit), so ",
                    unproven.size(), " tensor(s) saved whole (", quoted_list(unproven),
                    ") cannot be proven the same on every old rank; old rank 0's copy is used");
  }
  if (!problems.empty() || !extra_mismatch.empty()) {
    c.verdict = Verdict::kMismatch;
    c.reason = ettkit::detail::concat("the state dict cannot be loaded from checkpoint step ", step, " (written by ",
                                      saved_world, " ranks) by resharding");
    if (!extra_mismatch.empty()) c.reason += ": " + extra_mismatch;
    if (!problems.empty()) c.reason += "; " + plain_list(problems);
    return c;
  }
  if (verify) {
    // The chunks that hold a header or a byte this rank reads, per old file.
    try {
      for (size_t r = 0; r < c.old.size(); ++r) {
        const FileDigest& d = c.old[r].manifest.files.at("rank-" + std::to_string(r) + ".safetensors");
        auto touch = [&](uint64_t begin, uint64_t length) {
          if (length == 0 || d.chunk_bytes == 0) return;
          for (uint64_t k = begin / d.chunk_bytes; k <= (begin + length - 1) / d.chunk_bytes; ++k) chunks[r].insert(k);
        };
        touch(0, c.old_index[r].data_offset);
        for (const auto& plan : c.plans) {
          for (const CopyRange& x : plan) {
            if (x.source == static_cast<int>(r)) touch(x.src_offset, x.length);
          }
        }
        if (r == 0) {
          for (const SafetensorsEntry* e : c.to_read) touch(c.old_index[0].data_offset + e->begin, e->end - e->begin);
        }
        if (chunks[r].empty()) continue;
        if (d.chunks.empty()) {
          // A manifest from before chunk checksums: the whole file.
          std::string h = file_xxh3(c.old[r].data);
          ETTKIT_CHECK(h == d.xxh3, CorruptData, "'", c.old[r].data.path(), "' has XXH3 ", h, "; the manifest says ", d.xxh3);
          c.verified += d.size;
          continue;
        }
        std::vector<size_t> which(chunks[r].begin(), chunks[r].end());
        verify_file_chunks(c.old[r].data, d, threads, which);
        for (size_t k : which) c.verified += std::min(d.chunk_bytes, d.size - k * d.chunk_bytes);
      }
    } catch (const Error& e) {
      c.verdict = Verdict::kBad;
      c.reason = e.message();
      c.old.clear();
      return c;
    }
  }
  c.verdict = Verdict::kOk;
  return c;
}

/// Fills `tensors` from a resharding candidate's reads, then reads the whole tensors without a destination
/// (Candidate::to_read, from old rank 0) into new CPU tensors.
NamedTensors copy_resharded(const Candidate& c, const NamedTensors& tensors, int threads) {
  at::NoGradGuard no_grad;
  std::vector<std::vector<ReadRange>> direct(c.old.size());
  std::vector<std::pair<const at::Tensor*, at::Tensor>> staged;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].second;
    at::Tensor dst = t;
    if (!(t.device().is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg())) {
      dst = at::empty(t.sizes(), t.options().device(c10::kCPU).memory_format(at::MemoryFormat::Contiguous));
      staged.emplace_back(&t, dst);
    }
    char* base = static_cast<char*>(dst.data_ptr());
    for (const CopyRange& r : c.plans[i]) {
      direct[static_cast<size_t>(r.source)].push_back({base + r.dst_offset, r.length, r.src_offset});
    }
  }
  for (size_t r = 0; r < c.old.size(); ++r) {
    if (!direct[r].empty()) read_ranges(c.old[r].data.fd(), direct[r], threads, c.old[r].data.path());
  }
  for (auto& [t, tmp] : staged) t->copy_(tmp);
  NamedTensors read;
  for (const SafetensorsEntry* e : c.to_read) {
    at::Tensor t = at::empty(e->shape, at::TensorOptions().dtype(*scalar_type_of(e->dtype)));
    read_exact(c.old[0].data.fd(), t.data_ptr(), e->end - e->begin, c.old_index[0].data_offset + e->begin,
               c.old[0].data.path());
    read.emplace_back(e->name, std::move(t));
  }
  return read;
}

/// Whether the prefetch's step is still the one committed under its name: a re-save of the same step number
/// commits another snapshot (another manifest) in its place.
bool same_commit(const PrefetchedStep& pre) {
  try {
    std::string mpath = pre.dir + "/" + step_dir_name(pre.step) + "/manifest.json";
    Manifest now = decode_manifest(read_small_file(mpath), mpath);
    const Manifest& then = pre.files->manifest;
    return now.commit_seq == then.commit_seq && now.created_unix_us == then.created_unix_us &&
           now.world_size == then.world_size && now.files.size() == then.files.size() &&
           std::equal(now.files.begin(), now.files.end(), then.files.begin(),
                      [](const auto& a, const auto& b) { return a.first == b.first && a.second.xxh3 == b.second.xxh3; });
  } catch (const Error&) {
    return false;  // gone or unreadable now: checked from scratch
  }
}

/// `pre`: what RestorePrefetch verified of this step ahead of the load (or nullopt). When it is still the
/// committed snapshot, its open files and extra bytes are used and only the chunks that have left the
/// page cache since are hashed again (`reverified` counts their bytes).
Candidate check_candidate(const std::string& dir, int64_t step, int rank, int world, bool verify, int threads,
                          const NamedTensors& tensors, const std::function<void(const std::string&)>& validate_extra,
                          const std::vector<std::string>& read_prefixes, bool whole_from_rank0 = false,
                          std::optional<PrefetchedStep> pre = std::nullopt) {
  if (pre && !(pre->verified && pre->files && same_commit(*pre))) pre.reset();
  {
    // A step of another world size is loaded by resharding (its own rank's files may not even exist).
    int saved_world = 0;
    try {
      std::string mpath = dir + "/" + step_dir_name(step) + "/manifest.json";
      saved_world = decode_manifest(read_small_file(mpath), mpath).world_size;
    } catch (const Error&) {  // missing or bad: the checks below say which, as for any step
    }
    if (saved_world > 0 && saved_world != world) {
      return check_reshard_candidate(dir, step, saved_world, verify, threads, tensors, validate_extra, read_prefixes,
                                     whole_from_rank0);
    }
  }
  Candidate c;
  std::string extra_mismatch;
  try {
    if (pre) {
      c.files = std::move(pre->files);
      c.prefetched = true;
    } else {
      c.files = open_step(dir, step, rank);
    }
    if (!c.files) {
      c.verdict = Verdict::kVanished;
      c.reason = "step " + std::to_string(step) + " was removed while it was being loaded";
      return c;
    }
    const OpenedStep& f = *c.files;
    ETTKIT_CHECK(f.manifest.world_size == world, CorruptData, "step ", step, " was written by ", f.manifest.world_size,
                 " ranks; this job has ", world, " (the manifest changed while it was being read)");
    if (c.prefetched) {
      // Verified by the prefetch (check_step_files): the extra bytes in memory as they were hashed; of the
      // data, the chunks whose pages the page cache has dropped since (a re-read from the device) are
      // hashed again. Sizes are checked again: the files are the same open files, but cheap to ask.
      const FileDigest& d = listed_digest(f, f.data);
      listed_digest(f, f.extra);
      c.extra = std::move(pre->extra);
      if (verify && !d.chunks.empty()) {
        std::vector<size_t> again = nonresident_chunks(f.data, d);
        if (!again.empty()) verify_file_chunks(f.data, d, threads, again);
        for (size_t i : again) c.reverified += std::min(d.size - i * d.chunk_bytes, d.chunk_bytes);
      }
    } else {
      c.extra = *check_step_files(f, verify, threads);
    }
    c.index = read_safetensors_index(f.data);
  } catch (const Error& e) {
    c.verdict = Verdict::kBad;
    c.reason = e.message();
    c.files.reset();
    return c;
  }
  // The caller's state dict must match the checkpoint exactly (a user error, not a corrupt step), except
  // for the tensors under `read_prefixes` that have no destination: those are read into new tensors. Every
  // difference is collected, so that one message names all the keys to fix.
  std::vector<std::string> missing, unexpected, different;
  std::set<std::string> have;
  for (const auto& [name, t] : tensors) {
    have.insert(name);
    auto it = c.index.tensors.find(name);
    if (it == c.index.tensors.end()) {
      missing.push_back(name);
      continue;
    }
    std::string want;
    try {
      want = safetensors_dtype(t.scalar_type(), name);
    } catch (const InvalidArgument& e) {
      different.push_back(e.message());  // a verdict all ranks vote on, not an exception out of one rank
      continue;
    }
    bool same_shape =
        std::equal(it->second.shape.begin(), it->second.shape.end(), t.sizes().begin(), t.sizes().end());
    if (it->second.dtype != want || !same_shape) {
      different.push_back(ettkit::detail::concat("'", name, "' is ", want, " ", t.sizes(), " in the state dict, ",
                                                 it->second.dtype, " ", c10::IntArrayRef(it->second.shape),
                                                 " in the checkpoint (dtype or shape differs)"));
    }
  }
  for (const auto& [name, entry] : c.index.tensors) {
    if (have.count(name)) continue;
    if (!under_prefix(name, read_prefixes)) {
      unexpected.push_back(name);
    } else if (!scalar_type_of(entry.dtype)) {
      different.push_back(ettkit::detail::concat("'", name, "' has dtype ", entry.dtype,
                                                 " in the checkpoint, which ettkit cannot read"));
    } else {
      c.to_read.push_back(&entry);
    }
  }
  // The non-tensor state is decoded only now that the names are checked, and still before any tensor is
  // overwritten: a step whose extra is unreadable falls back like any corrupt step (checksums off, this is
  // the only check that would see it). A mismatch it reports (InvalidArgument) is reported below together
  // with the tensors that differ.
  if (std::string why = undecodable_extra(validate_extra, c.extra, c.files->extra.path(), extra_mismatch);
      !why.empty()) {
    c.verdict = Verdict::kBad;
    c.reason = std::move(why);
    c.files.reset();
    return c;
  }
  if (!missing.empty() || !unexpected.empty() || !different.empty() || !extra_mismatch.empty()) {
    c.verdict = Verdict::kMismatch;
    c.reason = ettkit::detail::concat("the state dict does not match checkpoint step ", step, " ('",
                                      c.files->data.path(), "')");
    if (!extra_mismatch.empty()) c.reason += ": " + extra_mismatch;
    if (!missing.empty()) c.reason += "; missing in the checkpoint: " + quoted_list(missing);
    if (!unexpected.empty()) {
      c.reason += "; unexpected in the checkpoint (the state dict lacks them): " + quoted_list(unexpected);
    }
    if (!different.empty()) c.reason += "; " + plain_list(different);
    return c;
  }
  c.verdict = Verdict::kOk;
  return c;
}

/// Copies the candidate's tensors into `tensors` in place, then reads the ones without a destination
/// (Candidate::to_read) into new CPU tensors.
NamedTensors copy_in_place(const Candidate& c, const NamedTensors& tensors, int threads) {
  const ReadFile& data = c.files->data;
  at::NoGradGuard no_grad;
  // Contiguous CPU tensors are read straight into their storage, on several threads at once (one thread's
  // pread from the page cache runs well below memory bandwidth). The others go through a contiguous CPU
  // copy: a conjugate or negative view's storage holds other values than it shows, and copy_ writes what
  // it shows.
  std::vector<ReadRange> direct;
  std::vector<std::pair<const at::Tensor*, const SafetensorsEntry*>> staged;
  for (const auto& [name, t] : tensors) {
    const SafetensorsEntry& e = c.index.tensors.at(name);
    if (t.device().is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg()) {
      direct.push_back({t.data_ptr(), e.end - e.begin, c.index.data_offset + e.begin});
    } else {
      staged.emplace_back(&t, &e);
    }
  }
  read_ranges(data.fd(), direct, threads, data.path());
  for (const auto& [t, e] : staged) {
    at::Tensor tmp = at::empty(t->sizes(), t->options().device(c10::kCPU).memory_format(at::MemoryFormat::Contiguous));
    read_exact(data.fd(), tmp.data_ptr(), e->end - e->begin, c.index.data_offset + e->begin, data.path());
    t->copy_(tmp);
  }
  NamedTensors read;
  read.reserve(c.to_read.size());
  for (const SafetensorsEntry* e : c.to_read) {
    // read_safetensors_index() checked that the byte range matches dtype and shape.
    at::Tensor t = at::empty(e->shape, at::TensorOptions().dtype(*scalar_type_of(e->dtype)));
    read_exact(data.fd(), t.data_ptr(), e->end - e->begin, c.index.data_offset + e->begin, data.path());
    read.emplace_back(e->name, std::move(t));
  }
  return read;
}

}  // namespace

std::optional<int64_t> latest_step(const std::string& directory) {
  StepListing listing = list_steps(directory);
  if (listing.committed.empty()) return std::nullopt;
  return listing.committed.front().step;
}

std::vector<int64_t> AsyncCheckpointer::prefetch() {
  Impl& im = *impl_;
  {
    std::lock_guard<std::mutex> lk(im.mu);
    ETTKIT_EXPECTS(!im.closing, "prefetch() after close()");
  }
  // The steps load_latest will most likely take, in the order it considers them: this rank's newest memory
  // step when no disk step has a larger number (agree_on_memory_step's rule), then the newest disk step.
  // The worker stops at the first that verifies; a step the ranks do not agree on is simply checked again.
  std::vector<PrefetchTarget> targets;
  int64_t disk_newest = -1;
  StepListing l = list_steps(im.opt.directory);
  if (!l.committed.empty()) disk_newest = l.committed.front().step;
  if (im.memory) {
    int64_t best = -1;
    for (const MemoryStep& s : im.memory->committed(/*warn=*/false)) {
      if (s.world_size == im.world) best = std::max(best, s.step);
    }
    if (best >= 0 && best >= disk_newest) targets.push_back({im.memory->dir(), best});
  }
  if (disk_newest >= 0) targets.push_back({im.opt.directory, disk_newest});
  std::vector<int64_t> steps;
  for (const PrefetchTarget& t : targets) steps.push_back(t.step);
  im.prefetch.start(std::move(targets), im.rank, im.world, load_threads(im.opt));
  return steps;
}

bool AsyncCheckpointer::wait_prefetch(double timeout_s) { return impl_->prefetch.wait(timeout_s); }

std::pair<double, uint64_t> AsyncCheckpointer::prefetch_figures() const {
  return {impl_->prefetch.seconds(), impl_->prefetch.bytes_verified()};
}

std::optional<LoadResult> AsyncCheckpointer::load_latest(const NamedTensors& tensors,
                                                        const std::function<void(const std::string&)>& validate_extra,
                                                        const std::vector<std::string>& read_prefixes) {
  Impl& im = *impl_;
  wait_all();
  int64_t b = epoch_us();
  // The prefetch's open files and verdicts serve this load only: released on every way out.
  struct ReleasePrefetch {
    RestorePrefetch& p;
    ~ReleasePrefetch() { p.cancel(); }
  } release_prefetch{im.prefetch};
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(im.opt.commit_timeout_s * 1000));
  LoadResult out;
  std::string reasons;
  bool listed_any = false;
  // Every rank's verdict on its candidate for one step, combined: the worst wins, with its reason.
  auto vote = [&](const std::string& key, const Candidate& c) -> std::pair<Verdict, std::string> {
    if (im.world == 1) return {c.verdict, c.reason};
    // A verdict outside the enum or a missing reason is no rank's: StoreExchange refuses it.
    RankVerdict all = im.exchange->worst_verdict(
        im.key_prefix + key + "/", im.rank, im.world, {static_cast<int>(c.verdict), c.reason},
        static_cast<int>(Verdict::kVanished), [](int v) { return severity(static_cast<Verdict>(v)); },
        "load_latest: the other ranks' verdicts (" + key + ")");
    return {static_cast<Verdict>(all.verdict), all.why};
  };
  auto record_restore = [&](int64_t step, Tier tier) {
    im.ledger.record_restore(step, tier, b, epoch_us());
    // The restore phase above is only the copy: the note says where the verification went (the report's
    // attempts[].notes), so that a short checkpoint_restore is not read as a load without checksums.
    if (out.prefetched) im.ledger.note_prefetched_restore(step, tier, im.prefetch.seconds(), out.prefetch_reverified_bytes);
  };
  if (im.memory) {
    if (auto choice = im.agree_on_memory_step(im.memory->committed(), im.load_seq++)) {
      const int64_t step = choice->step;
      std::string taken;
      if (im.replica) {
        // Every rank takes part (the vote's sequence numbers must stay in step), most with nothing to do.
        taken = im.replica->restore_exchange(im.load_seq++, choice->give ? step : -1, choice->take ? step : -1);
      }
      Candidate c;
      if (!taken.empty()) {
        c.verdict = Verdict::kBad;
        c.reason = "its replica did not come back from rank " + std::to_string(im.replica->partner()) + ": " + taken;
      } else {
        c = check_candidate(im.memory->dir(), step, im.rank, im.world, im.opt.verify_on_load && im.opt.memory_tier.verify,
                            load_threads(im.opt), tensors, validate_extra, read_prefixes, false,
                            im.prefetch.take(im.memory->dir(), step));
      }
      auto [all, why] = vote("load/" + std::to_string(im.load_seq++) + "/memory-" + std::to_string(step), c);
      if (all == Verdict::kMismatch) ETTKIT_THROW(InvalidArgument, why);
      if (all == Verdict::kOk) {
        out.read = copy_in_place(c, tensors, load_threads(im.opt));
        out.step = step;
        out.extra = std::move(c.extra);
        out.tier = Tier::kMemory;
        out.saved_world_size = im.world;
        out.prefetched = c.prefetched;
        out.prefetch_reverified_bytes = c.reverified;
        if (choice->take) out.memory_from_rank = im.replica->partner();
        // The loaded step's run becomes this run's lineage; every other step is another timeline.
        std::string loaded_run;
        for (const MemoryStep& s : im.memory->committed(/*warn=*/false)) {
          if (s.step == step) loaded_run = s.run_id;
        }
        im.memory->adopt(loaded_run);
        auto other = [&](const MemoryStep& s) { return s.step != step; };
        im.memory->retire_if(other);
        for (const std::string& shelf : im.memory->replica_shelves()) im.memory->retire_in(shelf, other);
        ETTKIT_LOG_INFO("checkpoint: restored step ", step, " from the memory tier '", im.memory->dir(), "'",
                        choice->take ? " (given back by rank " + std::to_string(im.replica->partner()) + ")" : "");
        record_restore(step, Tier::kMemory);
        return out;
      }
      ETTKIT_LOG_WARN("checkpoint: memory-tier step ", step, " is not loadable, restoring from the disk tier '",
                      im.opt.directory, "': ", why);
      out.memory_fallback = "memory-tier step " + std::to_string(step) + ": " + why;
      reasons += "\n  " + out.memory_fallback;
    }
  }
  // A round tries every candidate of one listing. Only retention removing steps under the loader (a writer
  // in another job) makes a new round necessary: the steps it committed meanwhile are in the next listing.
  constexpr int kRounds = 8;
  for (int round = 0; round < kRounds; ++round) {
    std::vector<int64_t> steps;
    uint64_t lseq = im.load_seq++;
    if (im.rank == 0) steps = load_candidates(im.opt.directory);
    if (im.world > 1) {
      // Every rank must see the same candidate list: take rank 0's.
      std::string key = im.key_prefix + "load/" + std::to_string(lseq) + "/steps";
      std::string listed = im.exchange->from_rank0(key, im.rank, json(steps).dump(), "load_latest: rank 0's list of steps");
      if (im.rank != 0) {
        steps = decode_step_list(listed, "load_latest: rank 0's list of steps (the Store key '" + key + "')");
      }
    }
    listed_any = listed_any || !steps.empty();
    bool vanished = false;
    for (int64_t step : steps) {
      // Known bad from an earlier round (every rank agrees on it: the verdict was voted).
      if (std::find(out.skipped_steps.begin(), out.skipped_steps.end(), step) != out.skipped_steps.end()) continue;
      run_before_open_step_hook(step);
      Candidate c = check_candidate(im.opt.directory, step, im.rank, im.world, im.opt.verify_on_load,
                                    load_threads(im.opt), tensors, validate_extra, read_prefixes,
                                    im.opt.reshard_whole_from_rank0, im.prefetch.take(im.opt.directory, step));
      auto [all, why] = vote("load/" + std::to_string(lseq) + "/" + std::to_string(step), c);
      if (all == Verdict::kMismatch) ETTKIT_THROW(InvalidArgument, why);
      if (all == Verdict::kVanished) {
        ETTKIT_LOG_INFO("checkpoint load: ", why, "; trying the next one");
        vanished = true;
        continue;
      }
      if (all == Verdict::kBad) {
        ETTKIT_LOG_WARN("checkpoint step ", step, " in '", im.opt.directory, "' is not loadable, falling back: ", why);
        out.skipped_steps.push_back(step);
        reasons += "\n  step " + std::to_string(step) + ": " + why;
        continue;
      }
      out.read = c.reshard ? copy_resharded(c, tensors, load_threads(im.opt)) : copy_in_place(c, tensors, load_threads(im.opt));
      out.step = step;
      out.extra = std::move(c.extra);
      out.saved_world_size = im.world;
      out.prefetched = c.prefetched;
      out.prefetch_reverified_bytes = c.reverified;
      if (c.reshard) {
        out.saved_world_size = c.saved_world;
        out.reshard_bytes_read = c.planned;
        out.reshard_bytes_verified = c.verified;
        ETTKIT_LOG_INFO("checkpoint: step ", step, " was written by ", c.saved_world, " ranks; rank ", im.rank, " of ",
                        im.world, " resharded it, reading ", c.planned, " bytes (", c.verified, " verified)");
      }
      // The memory tier holds no step this one does not supersede: it is another timeline, or older.
      if (im.memory) {
        auto all_steps = [](const MemoryStep&) { return true; };
        im.memory->retire_if(all_steps);
        for (const std::string& shelf : im.memory->replica_shelves()) im.memory->retire_in(shelf, all_steps);
      }
      record_restore(step, Tier::kDisk);
      return out;
    }
    if (!vanished) break;
  }
  if ((!listed_any || out.skipped_steps.empty()) && out.memory_fallback.empty()) return std::nullopt;
  ETTKIT_THROW(checkpoint::CorruptCheckpoint, "no committed checkpoint in '", im.opt.directory, "'",
               im.memory ? " or its memory tier '" + im.memory->dir() + "'" : std::string(), " is valid:", reasons);
}

}  // namespace ettkit::checkpoint
