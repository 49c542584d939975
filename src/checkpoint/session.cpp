// open_session (session.h): what AsyncCheckpointer's constructor does before its writer starts.
#include "checkpoint/session.h"

#include <sys/vfs.h>

#include <filesystem>
#include <optional>

#include "checkpoint/storage.h"
#include "common/logging.h"
#include "ettkit/ett/recorder.h"

namespace fs = std::filesystem;

namespace ettkit::checkpoint::detail {
namespace {

/// The options' checks that need no Store and no directory.
void check_options(const CheckpointerOptions& o) {
  ETTKIT_EXPECTS(!o.directory.empty(), "directory must name the checkpoint directory");
  ETTKIT_EXPECTS(o.keep_last >= 0, "keep_last=", o.keep_last, " must be >= 0 (0 keeps every step)");
  ETTKIT_EXPECTS(o.commit_timeout_s > 0, "commit_timeout_s=", o.commit_timeout_s, " must be > 0");
  ETTKIT_EXPECTS(o.unfenced_sync_max_bytes >= 0, "unfenced_sync_max_bytes=", o.unfenced_sync_max_bytes, " must be >= 0");
}

/// Rank 0 of a writer: the directory lock, before anything touches the directory (a second job must not
/// remove this one's temporaries). A failure goes to the other ranks through `run_key` instead of leaving
/// them waiting for a run id.
void lock_directory(Session& s, std::optional<StoreExchange>& before_run, const std::string& run_key) {
  if (s.rank != 0 || s.opt.read_only) return;
  auto holder = s.lock.try_acquire(s.opt.directory);
  if (!holder) return;
  std::string why = ettkit::detail::concat(
      "checkpoint directory '", s.opt.directory, "' is in use by another checkpointer: ", *holder, " holds '",
      s.opt.directory, "/.lock'. Two jobs writing one directory delete each other's saves: give this job its "
      "own directory, or stop the other one (a dead holder's lock is released by the kernel); to only load, "
      "open it read-only (read_only=True in Python, CheckpointerOptions::read_only in C++)");
  if (before_run) before_run->publish(run_key, "locked:" + why);
  throw checkpoint::DirectoryLocked(why, __FILE__, __LINE__);
}

/// A new run id (rank 0, or the only rank), and the temporaries earlier runs left behind go.
std::string new_run(const Session& s) {
  std::string id = random_id();
  if (!s.opt.read_only) remove_stale_temporaries(s.opt.directory, id);
  return id;
}

/// The ranks agree on rank 0's run id and start the heartbeat and the exchange every later vote uses.
void join_run(Session& s, StoreExchange& before_run, const std::string& base, const std::string& run_key) {
  if (s.rank == 0) s.run_id = new_run(s);
  s.run_id = before_run.from_rank0(run_key, s.rank, s.run_id, "rank 0's run id for this checkpointer");
  if (s.rank != 0) {
    if (s.run_id.rfind("locked:", 0) == 0) {
      throw checkpoint::DirectoryLocked("rank 0: " + s.run_id.substr(7), __FILE__, __LINE__);
    }
    // It names this run's temporary directories and Store keys: rank 0's random_id(), or refused.
    checked_run_id(s.run_id, "the Store key '" + run_key + "' (rank 0's run id for this checkpointer)");
  }
  s.key_prefix = base + s.run_id + "/";
  ETTKIT_EXPECTS(s.opt.peer_timeout_s > 0, "peer_timeout_s=", s.opt.peer_timeout_s, " must be > 0");
  s.peers = std::make_unique<PeerMonitor>(s.store, s.key_prefix, s.rank, s.world, s.opt.peer_timeout_s);
  s.exchange = std::make_unique<StoreExchange>(*s.store, s.peers.get(), s.opt.commit_timeout_s);
}

/// The directory lock, then the run id the ranks agree on: the n-th AsyncCheckpointer that the ranks open
/// on this directory shares one. Counted before the lock, so that rank 0 can hand a lock failure to the
/// other ranks.
void agree_on_run(Session& s) {
  const std::string base = "ettkit_ckpt:" + s.opt.directory + "/";
  std::string run_key;
  // No heartbeat runs before the ranks share a run id: rank 0's answer is awaited for commit_timeout_s.
  std::optional<StoreExchange> before_run;
  if (s.world > 1) {
    int64_t n = s.store->add(base + "opens", 1);
    run_key = base + "gen/" + std::to_string((n - 1) / s.world) + "/run_id";
    before_run.emplace(*s.store, nullptr, s.opt.commit_timeout_s);
  }
  lock_directory(s, before_run, run_key);
  if (s.world > 1) {
    join_run(s, *before_run, base, run_key);
  } else {
    s.run_id = new_run(s);
  }
}

/// Opens this rank's memory tier (after the run id is agreed): its lock, then the stale tiers of earlier
/// jobs of this directory go.
void open_memory_tier(Session& s) {
  const MemoryTierOptions& mt = s.opt.memory_tier;
  ETTKIT_EXPECTS(!s.opt.read_only, "memory_tier on a read_only checkpointer: only the job that saves has one");
  s.job_id = MemoryTier::job_id_from_environment(mt.job_id);
  s.memory = std::make_unique<MemoryTier>(mt.root, s.job_id, s.opt.directory, s.rank, mt.budget_bytes);
  s.memory_dir = s.memory->dir();
  // This run's snapshots are this process's timeline from the start, not only from its first memory save:
  // the partner's replicas of this run can arrive before it, and a disk commit in between retires what is
  // not of the lineage (Writer::retire_superseded_memory).
  s.memory->adopt(s.run_id);
  if (auto holder = s.memory->try_lock()) {
    throw checkpoint::DirectoryLocked(
        ettkit::detail::concat("the memory tier '", s.memory->dir(), "' of job '", s.job_id, "' is in use: ", *holder,
                               " holds it. Two processes of one job and rank would overwrite each other's "
                               "snapshots: stop the other one, or give this one another job_id"),
        __FILE__, __LINE__);
  }
  remove_stale_memory_tiers(mt.root, s.job_id, s.opt.directory);
  struct statfs sfs {};
  constexpr long kTmpfsMagic = 0x01021994;
  if (::statfs(mt.root.c_str(), &sfs) == 0 && static_cast<long>(sfs.f_type) != kTmpfsMagic) {
    ETTKIT_LOG_INFO("checkpoint memory tier: '", mt.root, "' is not a tmpfs mount; its snapshots are written "
                    "to that file system (give /dev/shm for memory speed)");
  }
}

}  // namespace

void open_session(Session& s, CheckpointerOptions options, c10::intrusive_ptr<c10d::Store> store) {
  check_options(options);
  s.opt = std::move(options);
  s.opt.recorder = ett::recorder_for("AsyncCheckpointer", s.opt.recorder, s.opt.use_current_recorder);
  s.store = std::move(store);
  s.world = s.opt.world_size > 0 ? s.opt.world_size : 1;
  s.rank = s.opt.rank >= 0 ? s.opt.rank : 0;
  ETTKIT_EXPECTS(s.rank < s.world, "rank=", s.rank, " must be < world_size=", s.world);
  ETTKIT_EXPECTS(s.world == 1 || s.store, "world_size=", s.world, " needs a c10d Store to coordinate the commit");
  make_directories(s.opt.directory);
  s.opt.directory = fs::canonical(s.opt.directory).string();
  agree_on_run(s);
  s.ledger.attach(s.opt.recorder);
  if (!s.opt.memory_tier.root.empty()) open_memory_tier(s);
}

}  // namespace ettkit::checkpoint::detail
