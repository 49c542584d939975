// The memory tier's layout, budget, retention and stale-tier cleanup (memory_tier.h).
#include "checkpoint/memory_tier.h"

#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/logging.h"
#include "ettkit/common/error.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace ettkit::checkpoint::detail {

namespace {

constexpr const char* kTierPrefix = "ettkit-mem-";

std::string host_name() {
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

/// Whether some process holds the flock of `lock_path` (a missing file: nobody).
bool lock_held(const std::string& lock_path) {
  int fd = ::open(lock_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool held = ::flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
  ::close(fd);  // releases the probe's lock, if it got one
  return held;
}

/// The rank directories of a tier ("rank-<r>").
std::vector<std::string> rank_dirs(const std::string& job_dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(job_dir, ec)) {
    std::string n = de.path().filename().string();
    if (n.rfind("rank-", 0) == 0) out.push_back(de.path().string());
  }
  return out;
}

void retire(const std::string& dir, const std::string& name) {
  std::string from = dir + "/" + name;
  std::string to = dir + "/.trash-" + name + "-" + random_id();
  // Rename first, as on disk: a half-deleted step-<N> must never look committed.
  if (::rename(from.c_str(), to.c_str()) != 0) {
    ETTKIT_LOG_WARN("checkpoint memory tier: could not retire '", from, "': ", std::strerror(errno));
    return;
  }
  remove_tree_quietly(to);
}

}  // namespace

std::string MemoryTier::job_id_from_environment(const std::string& given) {
  if (!given.empty()) return given;
  // torchrun's default --rdzv-id is "none": every job launched without one would share it.
  if (const char* v = std::getenv("TORCHELASTIC_RUN_ID"); v && *v && std::string(v) != "none") return v;
  if (const char* v = std::getenv("SLURM_JOB_ID"); v && *v) return v;
  return "";
}

MemoryTier::MemoryTier(const std::string& root, const std::string& job_id, const std::string& directory, int rank,
                       int64_t budget_bytes)
    : job_id_(job_id), rank_(rank), budget_(budget_bytes) {
  ETTKIT_EXPECTS(!job_id.empty(), "the memory tier needs a job id, so that a restarted process finds its own "
                 "snapshots and never another job's: pass job_id=..., or run under torchrun (TORCHELASTIC_RUN_ID, "
                 "with --rdzv-id or --standalone) or SLURM (SLURM_JOB_ID)");
  ETTKIT_EXPECTS(!root.empty(), "memory_tier root must name a directory (e.g. /dev/shm)");
  struct stat st {};
  ETTKIT_CHECK(::stat(root.c_str(), &st) == 0 && S_ISDIR(st.st_mode), InvalidArgument, "memory tier root '", root,
               "' is not a directory (", std::strerror(errno), "); give a tmpfs mount such as /dev/shm");
  job_dir_ = root + "/" + kTierPrefix + xxh3_of(job_id + "\n" + directory);
  dir_ = job_dir_ + "/rank-" + std::to_string(rank);
  make_directories(dir_);
  // Checkpoint bytes are the job's data: not readable by other users of a shared /dev/shm.
  ::chmod(job_dir_.c_str(), 0700);
  std::string owner = job_dir_ + "/owner.json";
  if (!file_size(owner)) {
    std::string text = json{{"job", job_id}, {"directory", directory}, {"host", host_name()}}.dump() + "\n";
    std::string tmp = owner + ".tmp-" + random_id();
    try {
      write_file_durably(tmp, {ConstBuffer{text.data(), text.size()}});
      if (::rename(tmp.c_str(), owner.c_str()) != 0) ETTKIT_LOG_WARN("checkpoint memory tier: could not write '", owner, "'");
    } catch (const Error& e) {
      ETTKIT_LOG_WARN("checkpoint memory tier: could not write '", owner, "': ", e.message());
    }
    ::unlink(tmp.c_str());
  }
}

MemoryTier::~MemoryTier() = default;

std::optional<std::string> MemoryTier::try_lock() {
  auto holder = lock_.try_acquire(dir_);
  if (holder) return holder;
  // A killed process's temporaries and half-retired steps (the lock says no writer of this rank is alive).
  remove_stale_temporaries(dir_, "\n");
  for (const std::string& shelf : replica_shelves()) remove_stale_temporaries(shelf, "\n");
  return std::nullopt;
}

std::vector<MemoryStep> MemoryTier::committed_in(const std::string& shelf, bool warn) const {
  std::vector<MemoryStep> out;
  StepListing l = list_steps(shelf);
  for (const StepEntry& e : l.others) {
    if (!warn) break;
    // Everything in a rank directory is ettkit's: an entry that is not a committed step is removed by the
    // next retention (retire_if).
    ETTKIT_LOG_WARN("checkpoint memory tier: '", shelf, "/", e.name, "' is not usable (", e.problem,
                    "); the disk tier is used instead");
  }
  for (const StepEntry& e : l.committed) {
    std::string mpath = shelf + "/" + e.name + "/manifest.json";
    try {
      Manifest m = decode_manifest(read_small_file(mpath), mpath);
      MemoryStep s;
      s.step = m.step;
      s.world_size = m.world_size;
      auto it = m.metadata.find("ettkit.run_id");
      ETTKIT_CHECK(it != m.metadata.end(), CorruptData, "manifest '", mpath, "' has no ettkit.run_id");
      s.run_id = it->second;
      for (const auto& [name, d] : m.files) s.bytes += d.size;
      out.push_back(std::move(s));
    } catch (const Error& x) {
      if (warn) {
        ETTKIT_LOG_WARN("checkpoint memory tier: '", mpath, "' is not usable (", x.message(),
                        "); the disk tier is used instead");
      }
    }
  }
  return out;
}

std::string MemoryTier::replica_dir(int src) const { return dir_ + "/replica-of-rank-" + std::to_string(src); }

std::vector<std::string> MemoryTier::replica_shelves() const {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& de : fs::directory_iterator(dir_, ec)) {
    if (de.path().filename().string().rfind("replica-of-rank-", 0) == 0) out.push_back(de.path().string());
  }
  return out;
}

uint64_t MemoryTier::held_bytes_locked() const {
  uint64_t held = 0;
  for (const MemoryStep& s : committed_in(dir_, /*warn=*/false)) held += s.bytes;
  for (const std::string& shelf : replica_shelves()) {
    for (const MemoryStep& s : committed_in(shelf, /*warn=*/false)) held += s.bytes;
  }
  return held;
}

std::string MemoryTier::begin(int64_t step, const std::string& run_id, uint64_t bytes) {
  ETTKIT_EXPECTS(!discarded_, "the memory tier was discarded");
  ETTKIT_EXPECTS(budget_ <= 0 || bytes <= static_cast<uint64_t>(budget_), "a memory-tier snapshot of step ", step,
                 " needs ", bytes, " bytes; memory_tier_budget_bytes=", budget_, " is smaller: raise it, or save "
                 "this state to the disk tier only");
  adopt(run_id);
  std::lock_guard<std::mutex> lk(mu_);
  // Newest commit first: the first step of the lineage is the one kept.
  bool kept = false;
  retire_locked(dir_, [&](const MemoryStep& s) {
    if (!in_lineage(s.run_id) || kept) return true;
    kept = true;
    return false;
  });
  if (budget_ > 0) {
    uint64_t held = held_bytes_locked();
    if (held + bytes > static_cast<uint64_t>(budget_)) {
      // Two snapshots do not fit: the old one goes first, so a crash while this one is written leaves the
      // disk tier as the only copy (said once per run at info level: it is the configured trade-off).
      ETTKIT_LOG_INFO("checkpoint memory tier: step ", step, " (", bytes, " bytes) and the held snapshots (", held,
                      " bytes) exceed memory_tier_budget_bytes=", budget_, "; the held one is retired first");
      retire_locked(dir_, [](const MemoryStep&) { return true; });
      if (held_bytes_locked() + bytes > static_cast<uint64_t>(budget_)) {
        // This rank's own snapshot comes before the partner's copy: the partner still has its own.
        ETTKIT_LOG_WARN("checkpoint memory tier: step ", step, " does not fit next to the peer replicas held; "
                        "they are retired (the partner keeps its own snapshot)");
        for (const std::string& shelf : replica_shelves()) retire_locked(shelf, [](const MemoryStep&) { return true; });
      }
    }
  }
  std::string tmp = dir_ + "/" + temp_dir_name(step, run_id);
  remove_tree_quietly(tmp);  // a failed attempt at the same step of this run
  make_directories(tmp);
  return tmp;
}

std::string MemoryTier::begin_replica(int src, int64_t step, const std::string& run_id, uint64_t bytes) {
  ETTKIT_EXPECTS(!discarded_, "the memory tier was discarded");
  std::string shelf = replica_dir(src);
  std::lock_guard<std::mutex> lk(mu_);
  make_directories(shelf);
  // The newest replica stays while this one is received (the partner may die mid-send); older ones go.
  bool kept = false;
  retire_locked(shelf, [&](const MemoryStep&) {
    if (kept) return true;
    kept = true;
    return false;
  });
  if (budget_ > 0 && held_bytes_locked() + bytes > static_cast<uint64_t>(budget_)) {
    retire_locked(shelf, [](const MemoryStep&) { return true; });
    uint64_t held = held_bytes_locked();
    ETTKIT_EXPECTS(held + bytes <= static_cast<uint64_t>(budget_), "rank ", src, "'s replica of step ", step,
                   " needs ", bytes, " bytes; this rank's own snapshots hold ", held,
                   " of memory_tier_budget_bytes=", budget_, ": raise the budget to hold both");
  }
  std::string tmp = shelf + "/" + temp_dir_name(step, run_id);
  remove_tree_quietly(tmp);
  make_directories(tmp);
  return tmp;
}

void MemoryTier::commit_in(const std::string& shelf, const std::string& tmp, Manifest manifest) {
  int64_t step = manifest.step;
  std::string text = encode_manifest(manifest);
  write_file_durably(tmp + "/manifest.json", {ConstBuffer{text.data(), text.size()}});
  std::lock_guard<std::mutex> lk(mu_);
  commit_step_directory(shelf, tmp, step);
}

void MemoryTier::abort(const std::string& tmp) noexcept { remove_tree_quietly(tmp); }

void MemoryTier::retire_in(const std::string& shelf, const std::function<bool(const MemoryStep&)>& drop) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  retire_locked(shelf, drop);
}

void MemoryTier::retire_locked(const std::string& shelf, const std::function<bool(const MemoryStep&)>& drop) noexcept {
  try {
    // Unusable entries (a manifest that does not decode) go too: they could only be warned about again.
    for (const StepEntry& e : list_steps(shelf).others) retire(shelf, e.name);
    for (const MemoryStep& s : committed_in(shelf, /*warn=*/false)) {
      if (drop(s)) retire(shelf, step_dir_name(s.step));
    }
  } catch (const std::exception& e) {
    ETTKIT_LOG_WARN("checkpoint memory tier: retention in '", shelf, "' failed: ", e.what());
  }
}

void MemoryTier::discard() noexcept {
  if (discarded_) return;
  discarded_ = true;
  std::string trash = job_dir_ + "/.trash-rank-" + std::to_string(rank_) + "-" + random_id();
  if (::rename(dir_.c_str(), trash.c_str()) == 0) remove_tree_quietly(trash);
  lock_.release();
  if (rank_dirs(job_dir_).empty()) {
    // The last rank of this node to leave removes the job's directory (owner.json with it). A rank that
    // opens the tier concurrently recreates both.
    ::unlink((job_dir_ + "/owner.json").c_str());
    ::rmdir(job_dir_.c_str());
  }
}

std::vector<std::string> remove_stale_memory_tiers(const std::string& root, const std::string& job_id,
                                                   const std::string& directory) noexcept {
  std::vector<std::string> removed;
  try {
    std::error_code ec;
    for (const auto& de : fs::directory_iterator(root, ec)) {
      std::string n = de.path().filename().string();
      if (n.rfind(kTierPrefix, 0) != 0) continue;
      std::string job_dir = de.path().string();
      std::string text;
      try {
        text = read_small_file(job_dir + "/owner.json");
      } catch (const Error&) {
        continue;  // being created or removed by its own job: not ours to judge
      }
      json owner = json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (!owner.is_object() || owner.value("directory", std::string()) != directory) continue;
      std::string other = owner.value("job", std::string());
      if (other == job_id) continue;
      bool alive = false;
      for (const std::string& r : rank_dirs(job_dir)) alive = alive || lock_held(r + "/.lock");
      if (alive) {
        ETTKIT_LOG_WARN("checkpoint memory tier: '", job_dir, "' of job '", other, "' for the same checkpoint "
                        "directory is left alone: a process of that job still holds it");
        continue;
      }
      // Renamed first: the other ranks of this node look for stale tiers at the same moment, and only one
      // rename wins.
      std::string trash = root + "/.ettkit-mem-trash-" + random_id();
      if (::rename(job_dir.c_str(), trash.c_str()) != 0) continue;
      ETTKIT_LOG_WARN("checkpoint memory tier: removed '", job_dir, "', left by job '", other,
                      "' for the same checkpoint directory (this is job '", job_id, "')");
      remove_tree_quietly(trash);
      removed.push_back(job_dir);
    }
  } catch (const std::exception& e) {
    ETTKIT_LOG_WARN("checkpoint memory tier: looking for stale tiers in '", root, "' failed: ", e.what());
  }
  return removed;
}

}  // namespace ettkit::checkpoint::detail
