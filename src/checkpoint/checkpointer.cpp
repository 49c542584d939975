// AsyncCheckpointer: the writer thread and the commit protocol over the c10d Store; load_latest is the Loader's
// (loader.h).
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/checkpoint/safetensors_dtypes.h"

#include <fcntl.h>
#include <sys/vfs.h>
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

#include "checkpoint/commit.h"
#include "checkpoint/loader.h"
#include "checkpoint/memory_tier.h"
#include "checkpoint/peer_monitor.h"
#include "checkpoint/peer_replica.h"
#include "checkpoint/reshard.h"
#include "checkpoint/session.h"
#include "checkpoint/storage.h"
#include "checkpoint/store_exchange.h"
#include "common/background_thread.h"
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

// ---- SaveHandle ----------------------------------------------------------------------------------------

struct SaveHandle::State {
  int64_t step = -1;
  Tier tier = Tier::kDisk;
  bool skipped = false;
  double blocking_s = 0;
  std::shared_ptr<Snapshot> snapshot;  // cleared by the writer once the data is on disk
  mutable std::mutex mu;               // guards durable, error, done, durable_us, snapshot
  std::condition_variable cv;
  bool done = false;
  bool durable = false;
  bool staged_seen = false;
  int64_t durable_us = 0;
  std::exception_ptr error;

  void finish(std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(mu);
      done = true;
      durable = !e;
      error = e;
      staged_seen = true;
      if (!e) durable_us = epoch_us();
    }
    cv.notify_all();
  }
};

int64_t SaveHandle::step() const { return state_->step; }
Tier SaveHandle::tier() const { return state_->tier; }
bool SaveHandle::skipped() const { return state_->skipped; }
bool SaveHandle::staged() const {
  std::shared_ptr<Snapshot> s;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    if (state_->skipped) return false;
    if (state_->staged_seen) return true;
    s = state_->snapshot;
  }
  return !s || s->staged();
}
bool SaveHandle::durable() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->durable;
}
std::exception_ptr SaveHandle::error() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->error;
}
int64_t SaveHandle::durable_us() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->durable_us;
}
double SaveHandle::blocking_s() const { return state_->blocking_s; }

bool SaveHandle::wait(double timeout_s) {
  if (state_->skipped) return false;
  std::unique_lock<std::mutex> lk(state_->mu);
  auto pred = [&] { return state_->done; };
  if (timeout_s < 0) {
    state_->cv.wait(lk, pred);
  } else if (!state_->cv.wait_for(lk, std::chrono::duration<double>(timeout_s), pred)) {
    ETTKIT_THROW(Timeout, "checkpoint step ", state_->step, " was not durable within ", timeout_s, " s");
  }
  if (state_->error) std::rethrow_exception(state_->error);
  return true;
}

void SaveHandle::wait_staged() {
  std::shared_ptr<Snapshot> s;
  {
    std::lock_guard<std::mutex> lk(state_->mu);
    if (state_->skipped || state_->staged_seen) return;
    s = state_->snapshot;
  }
  if (s) s->wait_staged();
}

// ---- helpers -------------------------------------------------------------------------------------------

namespace {

/// The safetensors dtype string of a tensor's dtype, from the one table (ettkit/checkpoint/safetensors_dtypes.h).
std::string safetensors_dtype(at::ScalarType t, const std::string& key) {
  if (const SafetensorsDtype* d = find_safetensors_dtype(t)) return d->name;
  ETTKIT_THROW(InvalidArgument, "state dict entry '", key, "' has dtype ", t, ", which safetensors cannot store");
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

/// Why a save was refused, from the names of the tensors that changed while being copied.
std::string torn_message(int64_t step, const std::vector<std::string>& changed) {
  std::string names;
  size_t shown = std::min<size_t>(changed.size(), 8);
  for (size_t i = 0; i < shown; ++i) names += (i ? ", '" : "'") + changed[i] + "'";
  if (changed.size() > shown) names += ", ... (" + std::to_string(changed.size() - shown) + " more)";
  return ettkit::detail::concat("checkpoint step ", step, " was refused: ", changed.size(),
                " saved tensor(s) changed while they were being copied, so the snapshot could mix two steps: ",
                names, ". The previous committed step stays the latest. Fence the writers: in Python "
                "ck.attach(model=..., optimizer=...) (or ck.attach(module) for a module that updates its own "
                "weights), in C++ wait_for()/wait_staged_on_current_stream() before the write; or save with "
                "overlap='off' so that save() returns only once the copies are done");
}

/// The safetensors header of a staged snapshot (offsets relative to the arena, which is the data section).
/// With `arena` (a disk save), it also records the XXH3 of every tensor saved whole (storage.h,
/// kWholeTensorDigestPrefix), hashed from the staged bytes, so that a resharding load can tell a replica
/// from per-rank state; memory-tier steps are never resharded and skip that pass.
std::string header_of(const std::vector<PlanEntry>& plan, const uint8_t* arena) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(plan.size());
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  for (const PlanEntry& e : plan) {
    entries.push_back({e.name, safetensors_dtype(e.dtype, e.name), e.shape, static_cast<uint64_t>(e.offset),
                       static_cast<uint64_t>(e.offset + e.nbytes)});
    if (arena != nullptr && !split_shard_name(e.name).second) {
      metadata[kWholeTensorDigestPrefix + e.name] = xxh3_of(arena + e.offset, static_cast<size_t>(e.nbytes));
    }
  }
  return encode_safetensors_header(entries, metadata);
}

struct Job {
  int64_t step;
  Tier tier;
  uint64_t seq;
  int64_t call_us;
  std::shared_ptr<Snapshot> snapshot;
  std::string extra;
  std::shared_ptr<SaveHandle::State> handle;
};

}  // namespace

// ---- AsyncCheckpointer ---------------------------------------------------------------------------------

// The Session (session.h) is what the writer and the loader share; the rest is the writer's state.
struct AsyncCheckpointer::Impl : detail::Session {
  std::unique_ptr<Stager> stager;
  // The memory tier's figures (the tier itself is the Session's). Written by the writer thread only.
  int64_t memory_committed = 0;
  double memory_durable_sum = 0;
  // The load side: load_latest, and the verify-ahead of the steps it is about to consider (prefetch()).
  Loader loader{*this};
  // Per tier (index: Tier): what a save blocked training, and how many saves it was summed over. The fences'
  // waits count against the tier of the save they wait for.
  double tier_blocking_sum[2] = {0, 0};
  int64_t tier_blocking_n[2] = {0, 0};
  Tier last_tier = Tier::kDisk;

  std::mutex mu;  // guards queue, closing, in_flight, stats below
  std::condition_variable cv;
  std::deque<Job> queue;
  int in_flight = 0;
  // in_flight less the saves whose handle is finished (or about to be): close() records a drain only for
  // these. in_flight drops after the handle wakes its waiter, so a caller that waited for its save and then
  // closed could see it still in flight and record a drain of nothing (issue #48, a second drain record).
  int unfinished = 0;
  bool closing = false;
  uint64_t seq = 0;
  std::shared_ptr<SaveHandle::State> last;  // latest non-skipped save (for the step pre-hook)
  // The latest save while some of its entries are not yet fenced (wait_for / the step pre-hook); null once
  // a full fence has decided them all, so that the per-module hooks cost one lock when nothing is pending.
  std::shared_ptr<Snapshot> active;
  CopyPriority priority;
  int64_t refused = 0;
  bool hold_commits = false;  // tests: the writer waits before it releases the arena (wait_while_held)
  std::exception_ptr peer_lost;  // once set, every queued and later save fails with it at once
  double blocking_sum = 0;
  int64_t blocking_n = 0;
  double durable_sum = 0;
  int64_t committed = 0;
  int64_t failed = 0;
  std::thread writer;
  std::mutex close_mu;  // serializes close(); taken before mu, never by the writer
  std::atomic<bool> overlap{false};
  std::atomic<int64_t> unfenced_sync_max_bytes{0};
  DirectoryLock lock;     // rank 0 of a writer: held from the constructor to close()
  CommitHistory history;  // rank 0: commit sequence and retention (writer thread only)
  // Snapshots whose source tensors are still referenced. Only the caller's threads drop them
  // (collect_sources), never the writer or the copy pool: the last reference of a Python-owned tensor
  // needs the GIL, and a background thread waiting for the GIL while the caller holds it and waits for
  // that thread is the deadlock of an unclosed checkpointer.
  std::mutex sources_mu;
  std::deque<std::shared_ptr<Snapshot>> holding_sources;

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

  void record_blocking(int64_t b, int64_t e, int64_t step) {
    {
      std::lock_guard<std::mutex> lk(mu);
      blocking_sum += static_cast<double>(e - b) * 1e-6;
      tier_blocking_sum[static_cast<int>(last_tier)] += static_cast<double>(e - b) * 1e-6;
    }
    if (opt.recorder) opt.recorder->record_phase(blocking_id[static_cast<int>(last_tier)], b, e, step);
  }

  void run_writer() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait(lk, [&] { return closing || !queue.empty(); });
        if (queue.empty()) return;
        job = std::move(queue.front());
        queue.pop_front();
      }
      std::exception_ptr err;
      {
        std::lock_guard<std::mutex> lk(mu);
        err = peer_lost;
      }
      if (!err) {
        try {
          if (job.tier == Tier::kMemory) {
            persist_memory(job);
          } else {
            persist(job);
            // A durable step supersedes the memory snapshots up to it, and those of other runs (another
            // timeline: this run's saves are what a restart must come back to).
            if (memory) {
              auto superseded = [&](const MemoryStep& s) { return s.step <= job.step || !memory->in_lineage(s.run_id); };
              memory->retire_if(superseded);
              for (const std::string& shelf : memory->replica_shelves()) memory->retire_in(shelf, superseded);
            }
          }
        } catch (const PeerLost&) {
          err = std::current_exception();
          std::lock_guard<std::mutex> lk(mu);
          if (!peer_lost) peer_lost = err;
        } catch (...) {
          err = std::current_exception();
        }
        if (err) ETTKIT_LOG_ERROR("checkpoint step ", job.step, " failed: ", describe(err));
      }
      if (job.snapshot) job.snapshot->release();
      {
        std::lock_guard<std::mutex> lk(job.handle->mu);
        job.handle->snapshot.reset();
      }
      int64_t end = epoch_us();
      if (!err && opt.recorder) {
        opt.recorder->record_background(job.tier == Tier::kMemory ? memory_id : persist_id, job.call_us, end, job.step);
      }
      bool torn = false;
      if (err) {
        try {
          std::rethrow_exception(err);
        } catch (const TornSnapshot&) {
          torn = true;
        } catch (...) {
        }
      }
      if (err && opt.recorder) {
        // A refused (torn) save and a failed one (a write error, a lost peer): the report counts both, so that
        // a job whose saves all fail does not read as a job that checkpoints.
        const int t = static_cast<int>(job.tier);
        opt.recorder->record_background(torn ? refused_id[t] : failed_id[t], job.call_us, end, job.step);
      }
      {
        // Statistics first, so a caller woken by the handle sees them.
        std::lock_guard<std::mutex> lk(mu);
        --unfinished;
        if (err) {
          ++failed;
          if (torn) ++refused;
        } else if (job.tier == Tier::kMemory) {
          ++memory_committed;
          memory_durable_sum += static_cast<double>(end - job.call_us) * 1e-6;
        } else {
          ++committed;
          durable_sum += static_cast<double>(end - job.call_us) * 1e-6;
        }
      }
      job.handle->finish(err);
      {
        std::lock_guard<std::mutex> lk(mu);
        --in_flight;
      }
      cv.notify_all();
    }
  }

  void await_staging(Job& job) {
    job.snapshot->wait_staged();
    {
      std::lock_guard<std::mutex> lk(job.handle->mu);
      job.handle->staged_seen = true;
    }
    if (opt.recorder) {
      opt.recorder->record_background(staging_id, job.snapshot->stage_begin_us(),
                                      std::max(job.snapshot->staged_us(), job.snapshot->stage_begin_us()), job.step);
    }
  }

  /// Tests only (hold_commits_for_testing): the writer waits here with a save's bytes written and its arena
  /// still held, so that a test can write a saved tensor "during" the save (the verdict follows) or find the
  /// arena busy, deterministically. close() ends a hold: it must see the held save as unfinished, and a test
  /// cannot release a hold from inside close().
  void wait_while_held() {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return !hold_commits || closing; });
  }

  /// The integrity verdict, as late as possible: entries no fence decided are judged after the (slow)
  /// write, so that a write that overlapped a copy has had every chance to finish and bump its counter
  /// (docs/checkpoint.md: what detection can and cannot see).
  void refuse_if_torn(Job& job) {
    std::vector<std::string> changed = job.snapshot->changed_entries();
    if (!changed.empty()) throw TornSnapshot(torn_message(job.step, changed), __FILE__, __LINE__);
  }

  /// A memory-tier save: this rank's snapshot into its memory directory, committed on its own (the load
  /// vote, not the save, makes the ranks agree). Same order as the disk commit: data and checksums, the
  /// verdict, the manifest, the rename.
  void persist_memory(Job& job) {
    await_staging(job);
    std::string header = header_of(job.snapshot->plan(), nullptr);
    uint64_t bytes = header.size() + static_cast<uint64_t>(job.snapshot->total_bytes()) + job.extra.size();
    std::string tmp = memory->begin(job.step, run_id, bytes);
    try {
      Manifest m;
      std::string base = "rank-" + std::to_string(rank);
      m.files[base + ".safetensors"] = write_file_durably(
          tmp + "/" + base + ".safetensors",
          {ConstBuffer{header.data(), header.size()},
           ConstBuffer{job.snapshot->data(), static_cast<size_t>(job.snapshot->total_bytes())}},
          MemoryTier::kFileMode);
      wait_while_held();
      job.snapshot->release();
      m.files[base + ".extra"] = write_file_durably(tmp + "/" + base + ".extra", {ConstBuffer{job.extra.data(), job.extra.size()}},
                                                    MemoryTier::kFileMode);
      refuse_if_torn(job);
      m.step = job.step;
      m.world_size = world;
      m.created_unix_us = epoch_us();
      m.metadata = opt.metadata;
      m.metadata["ettkit.run_id"] = run_id;
      m.metadata["ettkit.job"] = job_id;
      m.metadata["ettkit.tier"] = "memory";
      m.torch_version = TORCH_VERSION;
      memory->commit(tmp, std::move(m));
    } catch (...) {
      memory->abort(tmp);
      throw;
    }
    if (replica) {
      std::string why = replica->send(memory->dir() + "/" + step_dir_name(job.step), job.step);
      if (!why.empty()) {
        ETTKIT_LOG_WARN("checkpoint memory tier: step ", job.step, " is held by this rank only; rank ",
                        replica->partner(), " keeps no replica of it: ", why);
      }
    }
  }

  /// Opens this rank's memory tier (after the run id is agreed): its lock, then the stale tiers of earlier
  /// jobs of this directory go.
  void open_memory_tier() {
    const MemoryTierOptions& mt = opt.memory_tier;
    ETTKIT_EXPECTS(!opt.read_only, "memory_tier on a read_only checkpointer: only the job that saves has one");
    job_id = MemoryTier::job_id_from_environment(mt.job_id);
    memory = std::make_unique<MemoryTier>(mt.root, job_id, opt.directory, rank, mt.budget_bytes);
    memory_dir = memory->dir();
    if (auto holder = memory->try_lock()) {
      throw checkpoint::DirectoryLocked(
          ettkit::detail::concat("the memory tier '", memory->dir(), "' of job '", job_id, "' is in use: ", *holder,
                                 " holds it. Two processes of one job and rank would overwrite each other's "
                                 "snapshots: stop the other one, or give this one another job_id"),
          __FILE__, __LINE__);
    }
    remove_stale_memory_tiers(mt.root, job_id, opt.directory);
    struct statfs sfs {};
    constexpr long kTmpfsMagic = 0x01021994;
    if (::statfs(mt.root.c_str(), &sfs) == 0 && static_cast<long>(sfs.f_type) != kTmpfsMagic) {
      ETTKIT_LOG_INFO("checkpoint memory tier: '", mt.root, "' is not a tmpfs mount; its snapshots are written "
                      "to that file system (give /dev/shm for memory speed)");
    }
  }

  void persist(Job& job) {
    const std::string& dir = opt.directory;
    await_staging(job);
    const std::string tmp_name = temp_dir_name(job.step, run_id);
    const std::string tmp = dir + "/" + tmp_name;
    std::string prefix = key_prefix + "save/" + std::to_string(job.seq) + "/";
    std::map<std::string, FileDigest> mine;
    std::exception_ptr local_error;
    const std::string base = "rank-" + std::to_string(rank);
    // Every file of the save is created and removed relative to this handle (mkdirat, openat, unlinkat): an
    // entry of the checkpoint directory swapped for a link meanwhile redirects nothing.
    std::optional<Dir> tmp_dir;
    try {
      tmp_dir = make_subdirectory(open_directory(dir), tmp_name, 0777);  // the directory's usual mode, as before
      std::string header = header_of(job.snapshot->plan(), job.snapshot->data());
      // A leftover from an earlier failed attempt at the same step in this run.
      for (const char* ext : {".safetensors", ".extra"}) ::unlinkat(tmp_dir->fd(), (base + ext).c_str(), 0);
      mine[base + ".safetensors"] = write_file_durably(
          *tmp_dir, base + ".safetensors",
          {ConstBuffer{header.data(), header.size()},
           ConstBuffer{job.snapshot->data(), static_cast<size_t>(job.snapshot->total_bytes())}});
      wait_while_held();
      // The arena is free as soon as its bytes are on disk; the commit below does not need it.
      job.snapshot->release();
      mine[base + ".extra"] =
          write_file_durably(*tmp_dir, base + ".extra", {ConstBuffer{job.extra.data(), job.extra.size()}});
      refuse_if_torn(job);
      // Other ranks make their directory entries durable before reporting; rank 0's are covered by the
      // directory fsync that follows its manifest.
      if (rank != 0) fsync_directory(*tmp_dir);
    } catch (...) {
      local_error = std::current_exception();
    }
    if (local_error) {
      // Nothing of a failed or refused save stays behind (a refused one holds mixed bytes).
      if (world == 1) {
        remove_tree_quietly(tmp);
      } else if (tmp_dir) {
        for (const char* ext : {".safetensors", ".extra"}) ::unlinkat(tmp_dir->fd(), (base + ext).c_str(), 0);
      }
    }
    std::optional<CommitVote> vote;
    if (world > 1) {
      vote.emplace(*store, *peers, prefix, job.step, opt.commit_timeout_s);
      if (local_error) {
        vote->report_failure(rank, local_error);
      } else {
        vote->report(rank, mine);
      }
    }
    if (local_error && (world == 1 || rank != 0)) std::rethrow_exception(local_error);
    if (rank != 0) {
      vote->await_result();
      return;
    }
    // Rank 0: gather, write the manifest, rename, fsync, latest, retention.
    try {
      if (local_error) std::rethrow_exception(local_error);
      Manifest m;
      m.step = job.step;
      m.world_size = world;
      m.created_unix_us = epoch_us();
      m.metadata = opt.metadata;
      m.torch_version = TORCH_VERSION;
      m.files = mine;
      if (vote) {
        for (auto& [name, d] : vote->gather(world)) m.files[name] = std::move(d);
      }
      m.commit_seq = history.next_seq(dir);
      std::string text = encode_manifest(m);
      write_file_durably(*tmp_dir, "manifest.json", {ConstBuffer{text.data(), text.size()}});
      fsync_directory(*tmp_dir);
      commit_step_directory(dir, tmp, job.step);
    } catch (...) {
      remove_tree_quietly(tmp);
      if (vote) vote->publish_failure(std::current_exception());
      throw;
    }
    // Committed and durable: `latest` and retention cannot fail the step (they warn instead).
    history.after_commit(dir, job.step, opt.keep_last);
    if (vote) vote->publish_ok();
  }
};

AsyncCheckpointer::AsyncCheckpointer(CheckpointerOptions options, c10::intrusive_ptr<c10d::Store> store)
    : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  ETTKIT_EXPECTS(!options.directory.empty(), "directory must name the checkpoint directory");
  ETTKIT_EXPECTS(options.keep_last >= 0, "keep_last=", options.keep_last, " must be >= 0 (0 keeps every step)");
  ETTKIT_EXPECTS(options.commit_timeout_s > 0, "commit_timeout_s=", options.commit_timeout_s, " must be > 0");
  ETTKIT_EXPECTS(options.unfenced_sync_max_bytes >= 0, "unfenced_sync_max_bytes=", options.unfenced_sync_max_bytes, " must be >= 0");
  im.opt = std::move(options);
  im.opt.recorder = ett::recorder_for("AsyncCheckpointer", im.opt.recorder, im.opt.use_current_recorder);
  im.unfenced_sync_max_bytes = im.opt.unfenced_sync_max_bytes;
  im.store = std::move(store);
  im.world = im.opt.world_size > 0 ? im.opt.world_size : 1;
  im.rank = im.opt.rank >= 0 ? im.opt.rank : 0;
  ETTKIT_EXPECTS(im.rank < im.world, "rank=", im.rank, " must be < world_size=", im.world);
  ETTKIT_EXPECTS(im.world == 1 || im.store, "world_size=", im.world, " needs a c10d Store to coordinate the commit");
  make_directories(im.opt.directory);
  im.opt.directory = fs::canonical(im.opt.directory).string();
  // The run id the ranks agree on: the n-th AsyncCheckpointer that the ranks open on this directory shares
  // one. Counted before the lock, so that rank 0 can hand a lock failure to the other ranks instead of
  // leaving them waiting for a run id.
  std::string base = "ettkit_ckpt:" + im.opt.directory + "/";
  std::string run_key;
  // No heartbeat runs before the ranks share a run id: rank 0's answer is awaited for commit_timeout_s.
  std::optional<StoreExchange> before_run;
  if (im.world > 1) {
    int64_t n = im.store->add(base + "opens", 1);
    run_key = base + "gen/" + std::to_string((n - 1) / im.world) + "/run_id";
    before_run.emplace(*im.store, nullptr, im.opt.commit_timeout_s);
  }
  // Before anything below touches the directory: a second job must not remove this one's temporaries.
  if (im.rank == 0 && !im.opt.read_only) {
    if (auto holder = im.lock.try_acquire(im.opt.directory)) {
      std::string why = ettkit::detail::concat(
          "checkpoint directory '", im.opt.directory, "' is in use by another checkpointer: ", *holder, " holds '",
          im.opt.directory, "/.lock'. Two jobs writing one directory delete each other's saves: give this job its "
          "own directory, or stop the other one (a dead holder's lock is released by the kernel); to only load, "
          "open it read-only (read_only=True in Python, CheckpointerOptions::read_only in C++)");
      if (before_run) before_run->publish(run_key, "locked:" + why);
      throw checkpoint::DirectoryLocked(why, __FILE__, __LINE__);
    }
  }
  if (im.world > 1) {
    if (im.rank == 0) {
      im.run_id = random_id();
      if (!im.opt.read_only) remove_stale_temporaries(im.opt.directory, im.run_id);
    }
    im.run_id = before_run->from_rank0(run_key, im.rank, im.run_id, "rank 0's run id for this checkpointer");
    if (im.rank != 0) {
      if (im.run_id.rfind("locked:", 0) == 0) {
        throw checkpoint::DirectoryLocked("rank 0: " + im.run_id.substr(7), __FILE__, __LINE__);
      }
      // It names this run's temporary directories and Store keys: rank 0's random_id(), or refused.
      checked_run_id(im.run_id, "the Store key '" + run_key + "' (rank 0's run id for this checkpointer)");
    }
    im.key_prefix = base + im.run_id + "/";
    ETTKIT_EXPECTS(im.opt.peer_timeout_s > 0, "peer_timeout_s=", im.opt.peer_timeout_s, " must be > 0");
    im.peers = std::make_unique<PeerMonitor>(im.store, im.key_prefix, im.rank, im.world, im.opt.peer_timeout_s);
    im.exchange = std::make_unique<StoreExchange>(*im.store, im.peers.get(), im.opt.commit_timeout_s);
  } else {
    im.run_id = random_id();
    if (!im.opt.read_only) remove_stale_temporaries(im.opt.directory, im.run_id);
  }
  if (im.opt.recorder) {
    auto& rec = *im.opt.recorder;
    const std::string memory(ett::phase::kMemoryTierSuffix);
    for (Tier t : {Tier::kDisk, Tier::kMemory}) {
      const std::string suffix = t == Tier::kMemory ? memory : std::string();
      const int i = static_cast<int>(t);
      im.blocking_id[i] = rec.phase_id(std::string(ett::phase::kCheckpointBlocking) + suffix);
      im.refused_id[i] = rec.phase_id(std::string(ett::phase::kCheckpointRefused) + suffix);
      im.failed_id[i] = rec.phase_id(std::string(ett::phase::kCheckpointFailed) + suffix);
      im.restore_id[i] = rec.phase_id(std::string(ett::phase::kCheckpointRestore) + suffix);
    }
    im.persist_id = rec.phase_id(ett::phase::kCheckpointPersist);
    im.memory_id = rec.phase_id(ett::phase::kCheckpointMemoryPersist);
    im.staging_id = rec.phase_id("checkpoint_staging");
    im.drain_id = rec.phase_id(std::string(ett::phase::kShutdown) + "/checkpoint_drain");
  }
  if (!im.opt.memory_tier.root.empty()) im.open_memory_tier();
  im.stager = std::make_unique<Stager>(im.opt.stager);
  im.writer = std::thread([this] {
    ettkit::detail::mark_background_thread();
    impl_->run_writer();
  });
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
  CopyPriority priority;
  {
    std::lock_guard<std::mutex> lk(im.mu);
    ETTKIT_EXPECTS(!im.closing, "save(step=", step, ") after close()");
    if (im.peer_lost) std::rethrow_exception(im.peer_lost);
    priority = im.priority;
  }
  check_save_arguments(step, tensors, im.opt.read_only);
  NamedTensors resolved;
  const NamedTensors& staged = with_views_resolved(tensors, resolved);
  ETTKIT_EXPECTS(extra.size() <= kMaxExtraBytes, "save(step=", step, "): extra holds ", extra.size(),
                 " bytes; at most ", kMaxExtraBytes, " (256 MiB) are kept, since a load reads them whole: put "
                 "large state in tensors");
  // Training has started without a load of the prefetched step: its open files would keep a retired
  // memory-tier snapshot's pages alive (tmpfs frees them at the last close).
  im.loader.cancel_prefetch();
  {
    // This call is a program point of the owner thread: the previous save's entries that no fence has
    // decided yet are decided now if their copies are done (a later write would otherwise count against
    // them at their commit and refuse a consistent snapshot).
    std::shared_ptr<Snapshot> prev;
    {
      std::lock_guard<std::mutex> lk(im.mu);
      prev = im.active;
    }
    if (prev && prev->staged()) {
      try {
        prev->wait_staged();
      } catch (...) {  // a copy error: that save's handle reports it
      }
    }
  }
  im.collect_sources(/*all=*/false);
  auto hs = std::make_shared<SaveHandle::State>();
  hs->step = step;
  hs->tier = tier;
  bool overlap = im.opt.overlap == Overlap::kOn || (im.opt.overlap == Overlap::kAuto && im.overlap.load());
  std::shared_ptr<Snapshot> snap =
      im.stager->stage(staged, im.opt.on_busy, priority, overlap ? im.unfenced_sync_max_bytes.load() : 0);
  if (!snap) {
    hs->skipped = true;
    ETTKIT_LOG_INFO("checkpoint step ", step, " skipped: the previous save is still persisting (on_busy='skip')");
    return SaveHandle(hs);
  }
  if (!overlap) {
    // Nobody fences the writes that follow: the copies must be done before the caller can write. On this
    // thread the wait is also the fence that decides every entry.
    try {
      snap->wait_staged();
    } catch (...) {
      snap->release();
      throw;
    }
    snap->drop_sources();
  } else {
    std::lock_guard<std::mutex> lk(im.sources_mu);
    im.holding_sources.push_back(snap);
  }
  hs->snapshot = snap;
  {
    std::lock_guard<std::mutex> lk(im.mu);
    im.queue.push_back(Job{step, tier, im.seq++, b, snap, extra, hs});
    ++im.in_flight;
    ++im.unfinished;
    im.last = hs;
    im.active = overlap ? snap : nullptr;
    ++im.blocking_n;
    ++im.tier_blocking_n[static_cast<int>(tier)];
    im.last_tier = tier;
  }
  im.cv.notify_all();
  int64_t e = epoch_us();
  hs->blocking_s = static_cast<double>(e - b) * 1e-6;
  im.record_blocking(b, e, step);
  return SaveHandle(hs);
}

void AsyncCheckpointer::wait_staged_on_current_stream() {
  Impl& im = *impl_;
  auto [snap, step] = im.active_save();
  if (!snap) return;
  bool waited = !snap->staged();
  int64_t b = epoch_us();
  snap->wait_staged_on_current_stream();
  if (waited) im.record_blocking(b, epoch_us(), step);
  im.retire_if_decided(snap);
}

void AsyncCheckpointer::wait_for(const std::vector<at::Tensor>& tensors) {
  Impl& im = *impl_;
  auto [snap, step] = im.active_save();
  if (!snap) return;
  int64_t b = epoch_us();
  if (snap->wait_for(tensors)) im.record_blocking(b, epoch_us(), step);
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

void AsyncCheckpointer::hold_commits_for_testing(bool hold) {
  {
    std::lock_guard<std::mutex> lk(impl_->mu);
    impl_->hold_commits = hold;
  }
  impl_->cv.notify_all();
}

bool AsyncCheckpointer::overlapped() const {
  return impl_->opt.overlap == Overlap::kOn || (impl_->opt.overlap == Overlap::kAuto && impl_->overlap.load());
}

void AsyncCheckpointer::set_copy_priority(CopyPriority priority) {
  std::lock_guard<std::mutex> lk(impl_->mu);
  impl_->priority = std::move(priority);
}

void AsyncCheckpointer::wait_all() {
  {
    std::unique_lock<std::mutex> lk(impl_->mu);
    impl_->cv.wait(lk, [&] { return impl_->in_flight == 0; });
  }
  impl_->collect_sources(/*all=*/true);
}

void AsyncCheckpointer::close(bool discard_memory_tier) {
  Impl& im = *impl_;
  // Several threads may close at once (make tsan's stress test; two Python threads): without this lock each
  // saw a joinable writer and joined it, and std::thread::join() raced with itself (a data race on the
  // thread handle, then std::system_error from the second join). A later closer waits here until the first
  // has finished, so that no close() returns before every queued save is finished.
  std::lock_guard<std::mutex> closing(im.close_mu);
  bool pending = false;
  {
    std::lock_guard<std::mutex> lk(im.mu);
    if (im.closing && !im.writer.joinable()) return;
    im.closing = true;
    pending = im.unfinished > 0;
  }
  const int64_t drain_begin = epoch_us();
  im.cv.notify_all();
  if (im.writer.joinable()) im.writer.join();
  // The wait for the last saves to commit is time the job spends on checkpointing after its last step; a
  // phase records it (else the report would show it as unattributed).
  if (pending && im.opt.recorder && !im.opt.recorder->closed()) {
    im.opt.recorder->record_phase(im.drain_id, drain_begin, epoch_us());
  }
  // Before the heartbeat stops: the replica's receiver waits for its sender's count with the monitor.
  if (im.replica) im.replica->close();
  if (im.peers) {
    bool lost;
    {
      std::lock_guard<std::mutex> lk(im.mu);
      lost = static_cast<bool>(im.peer_lost);
    }
    im.peers->close(/*clean=*/!lost);
  }
  im.collect_sources(/*all=*/true);
  im.loader.cancel_prefetch();  // closes the files it holds open (some may be the memory tier's, removed next)
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
double AsyncCheckpointer::mean_blocking_s() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->blocking_n ? impl_->blocking_sum / static_cast<double>(impl_->blocking_n) : 0.0;
}
double AsyncCheckpointer::mean_blocking_s(Tier tier) const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  int t = static_cast<int>(tier);
  return impl_->tier_blocking_n[t] ? impl_->tier_blocking_sum[t] / static_cast<double>(impl_->tier_blocking_n[t]) : 0.0;
}
double AsyncCheckpointer::mean_time_to_durable_s(Tier tier) const {
  if (tier == Tier::kDisk) return mean_time_to_durable_s();
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->memory_committed ? impl_->memory_durable_sum / static_cast<double>(impl_->memory_committed) : 0.0;
}
double AsyncCheckpointer::mean_time_to_durable_s() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->committed ? impl_->durable_sum / static_cast<double>(impl_->committed) : 0.0;
}
int64_t AsyncCheckpointer::saves_committed() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->committed;
}
int64_t AsyncCheckpointer::memory_saves_committed() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->memory_committed;
}
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
    ETTKIT_EXPECTS(im.seq == 0 && !im.loader.started() && !im.closing,
                   "enable_peer_replica() must come before the first save() and load_latest(), on every rank");
  }
  im.replica = std::make_unique<PeerReplica>(std::move(group), im.store, im.key_prefix + "replica/", im.run_id,
                                             im.peers.get(), im.rank, im.world, ranks_per_host, *im.memory,
                                             im.opt.commit_timeout_s);
}
int64_t AsyncCheckpointer::replicas_sent() const { return impl_->replica ? impl_->replica->sent() : 0; }
int64_t AsyncCheckpointer::replicas_received() const { return impl_->replica ? impl_->replica->received() : 0; }
int64_t AsyncCheckpointer::replica_failures() const { return impl_->replica ? impl_->replica->failed() : 0; }
int64_t AsyncCheckpointer::saves_failed() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->failed;
}
int64_t AsyncCheckpointer::saves_refused() const {
  std::lock_guard<std::mutex> lk(impl_->mu);
  return impl_->refused;
}

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
                                                        const std::vector<std::string>& read_prefixes) {
  wait_all();  // the writer is drained: the load reads the Session's memory tier and replica alone
  return impl_->loader.load_latest(tensors, validate_extra, read_prefixes);
}

}  // namespace ettkit::checkpoint
