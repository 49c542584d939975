// The memory tier's layout, budget, retention and stale-tier cleanup (memory_tier.h). Everything the tier
// creates, renames or removes goes through the handles of its verified directories (memory_tier.h, "created,
// never adopted").
#include "checkpoint/memory_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

#include "checkpoint/memory_tier_entries.h"
#include "common/logging.h"
#include "ettkit/common/error.h"

using nlohmann::json;

namespace ettkit::checkpoint::detail {

namespace {

using tier_entries::Entry;
using tier_entries::entries_of;
using tier_entries::lock_held;
using tier_entries::open_directory_at;
using tier_entries::rank_dirs;
using tier_entries::read_bounded_file_at;
using tier_entries::remove_quietly_at;

constexpr const char* kTierPrefix = "ettkit-mem-";
constexpr const char* kReplicaPrefix = "replica-of-rank-";
// owner.json is one short JSON line; anything larger is not a record this code wrote.
constexpr size_t kMaxOwnerRecordBytes = 64 << 10;
// A sibling rank's discard() removes the job directory once it holds no rank directory; a rank opening the
// tier at that moment creates it again. A few rounds settle any such interleaving.
constexpr int kCreateAttempts = 8;

std::string host_name() {
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

std::string mode_text(mode_t mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

bool is_hex16(const std::string& s) {
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
  return s.size() == 16 && std::all_of(s.begin(), s.end(), hex);
}

/// The refusal of a directory this user did not create (memory_tier.h: created, never adopted).
[[noreturn]] void refuse_directory(const std::string& path, const std::string& found) {
  ETTKIT_THROW(IoError, "checkpoint memory tier: '", path, "' is ", found, "; the memory tier only uses a "
               "directory this user created: one owned by uid ", ::geteuid(), " with mode 0700, not a symbolic "
               "link. Another user may have made it to plant a snapshot for this job's restart or to read the "
               "ones written into it, so it is not used and nothing in it is touched. Remove it (its owner or an "
               "administrator can), or give memory_tier another root or the job another job_id");
}

/// What an entry that is not a directory (or is a link) is, for the refusal: its kind, owner and mode.
std::string describe_entry(const Dir& parent, const std::string& name) {
  struct stat st {};
  if (::fstatat(parent.fd(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return "not a directory";
  const char* kind = S_ISLNK(st.st_mode) ? "a symbolic link" : S_ISDIR(st.st_mode) ? "a directory" : "not a directory";
  return std::string(kind) + " (owner uid " + std::to_string(st.st_uid) + ", mode " + mode_text(st.st_mode) + ")";
}

/// The directory `name` of `parent`, created with mode 0700 or, when it exists, verified on its handle: a
/// directory, not a link, owned by this uid, mode exactly 0700 (else refuse_directory). A directory this call
/// created gets its mode set to exactly 0700 (a umask or a setgid parent may have changed it). nullopt when
/// `parent` was removed meanwhile (ENOENT: the caller starts over).
std::optional<Dir> private_directory_at(const Dir& parent, const std::string& name) {
  const std::string path = parent.path_of(name);
  const bool created = ::mkdirat(parent.fd(), name.c_str(), MemoryTier::kDirectoryMode) == 0;
  if (!created && errno == ENOENT) return std::nullopt;
  ETTKIT_CHECK(created || errno == EEXIST, IoError, "checkpoint memory tier: creating '", path,
               "' failed: ", std::strerror(errno));
  const int fd = open_directory_at(parent.fd(), name);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return std::nullopt;
    if (err == ELOOP || err == ENOTDIR) refuse_directory(path, describe_entry(parent, name));
    ETTKIT_THROW(IoError, "checkpoint memory tier: opening '", path, "' failed: ", std::strerror(err));
  }
  Dir dir(fd, path);
  struct stat st {};
  ETTKIT_CHECK(::fstat(dir.fd(), &st) == 0, IoError, "checkpoint memory tier: stat of '", path,
               "' failed: ", std::strerror(errno));
  if (created && st.st_uid == ::geteuid() && (st.st_mode & 07777) != MemoryTier::kDirectoryMode) {
    ETTKIT_CHECK(::fchmod(dir.fd(), MemoryTier::kDirectoryMode) == 0, IoError, "checkpoint memory tier: setting "
                 "mode 0700 on '", path, "' (created with mode ", mode_text(st.st_mode),
                 ") failed: ", std::strerror(errno));
    ETTKIT_CHECK(::fstat(dir.fd(), &st) == 0, IoError, "checkpoint memory tier: stat of '", path,
                 "' failed: ", std::strerror(errno));
  }
  if (st.st_uid != ::geteuid() || (st.st_mode & 07777) != MemoryTier::kDirectoryMode) {
    refuse_directory(path,
                     "a directory owned by uid " + std::to_string(st.st_uid) + " with mode " + mode_text(st.st_mode));
  }
  return dir;
}

/// Checks the directories above the root (as the path resolves now): none may let another user rename the
/// root, or a directory above it, away and put their own in its place. Each must be owned by root or this
/// user, and writable by others only with the sticky bit (/dev/shm, /tmp). InvalidArgument names the first
/// that fails.
void check_root_ancestors(const std::string& root) {
  std::error_code ec;
  const std::filesystem::path resolved = std::filesystem::canonical(root, ec);
  if (ec) return;  // the root itself was opened: what it resolves to cannot be named now; nothing to check
  for (std::filesystem::path p = resolved.parent_path(); !p.empty(); p = p.parent_path()) {
    struct stat st {};
    ETTKIT_CHECK(::stat(p.c_str(), &st) == 0, IoError, "stat of '", p.string(), "', above the memory tier root '",
                 root, "', failed: ", std::strerror(errno));
    const bool owner_ok = st.st_uid == 0 || st.st_uid == ::geteuid();
    const bool others_may_rename = (st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0;
    ETTKIT_CHECK(owner_ok && !others_may_rename, InvalidArgument, "memory tier root '", root, "': the directory '",
                 p.string(), "' above it (owner uid ", st.st_uid, ", mode ", mode_text(st.st_mode),
                 ") lets another user rename what is in it, and so replace the root. Every directory above the "
                 "root must be owned by root or this user and writable by others only with the sticky bit; give "
                 "a root such as /dev/shm or a directory of your own under it");
    if (p == p.root_path()) break;
  }
}

/// The root, opened as the user named it. Others must not be able to rename its entries: the tier's
/// readers and writers use dir()'s path, which names the verified directory only while nobody else can
/// move it away and put another in its place (nor the root itself: check_root_ancestors).
Dir open_root(const std::string& root) {
  ETTKIT_EXPECTS(!root.empty(), "memory_tier root must name a directory (e.g. /dev/shm)");
  const int fd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ETTKIT_CHECK(fd >= 0, InvalidArgument, "memory tier root '", root, "' is not a directory (",
               std::strerror(errno), "); give a tmpfs mount such as /dev/shm");
  Dir dir(fd, root);
  struct stat st {};
  ETTKIT_CHECK(::fstat(dir.fd(), &st) == 0, IoError, "stat of memory tier root '", root,
               "' failed: ", std::strerror(errno));
  ETTKIT_CHECK((st.st_mode & (S_IWGRP | S_IWOTH)) == 0 || (st.st_mode & S_ISVTX) != 0, InvalidArgument,
               "memory tier root '", root, "' (mode ", mode_text(st.st_mode), ") is writable by other users "
               "without the sticky bit: any of them could rename this job's tier away and put their own in its "
               "place. Give a directory only this user can write, or a sticky one such as /dev/shm (mode 1777)");
  check_root_ancestors(root);
  return dir;
}

/// Writes `text` into the new file `name` of `dir`: mode 0600, never through a link (write_file_durably's
/// O_CREAT | O_EXCL | O_NOFOLLOW relative to the handle), fsynced. Throws IoError.
void write_private_file_at(const Dir& dir, const std::string& name, const std::string& text) {
  write_file_durably(dir, name, {ConstBuffer{text.data(), text.size()}}, MemoryTier::kFileMode);
}

/// Rename first, as on disk: a half-deleted step-<N> must never look committed.
void retire(const Dir& shelf, const std::string& name) {
  const std::string trash = ".trash-" + name + "-" + random_id();
  if (::renameat(shelf.fd(), name.c_str(), shelf.fd(), trash.c_str()) != 0) {
    ETTKIT_LOG_WARN("checkpoint memory tier: could not retire '", shelf.path_of(name), "': ", std::strerror(errno));
    return;
  }
  remove_quietly_at(shelf, trash);
}

/// Whether `name` is a job directory name of this user's tiers (current: ettkit-mem-<euid>-<key>) or of the
/// layout before the uid was in the name (legacy: ettkit-mem-<key>, any user's).
enum class TierName { kNone, kCurrent, kLegacy };
TierName classify_tier_name(const std::string& name) {
  if (name.rfind(kTierPrefix, 0) != 0) return TierName::kNone;
  const std::string rest = name.substr(std::strlen(kTierPrefix));
  if (is_hex16(rest)) return TierName::kLegacy;
  const std::string mine = std::to_string(::geteuid()) + "-";
  if (rest.rfind(mine, 0) == 0 && is_hex16(rest.substr(mine.size()))) return TierName::kCurrent;
  return TierName::kNone;
}

}  // namespace

std::string MemoryTier::job_id_from_environment(const std::string& given) {
  if (!given.empty()) return given;
  // torchrun's default --rdzv-id is "none": every job launched without one would share it.
  if (const char* v = std::getenv("TORCHELASTIC_RUN_ID"); v && *v && std::string(v) != "none") return v;
  if (const char* v = std::getenv("SLURM_JOB_ID"); v && *v) return v;
  return "";
}

std::string MemoryTier::job_dir_name(const std::string& job_id, const std::string& directory) {
  // The uid keeps two users' tiers of one job and directory apart (each refuses the other's: no sharing).
  return kTierPrefix + std::to_string(::geteuid()) + "-" + xxh3_of(job_id + "\n" + directory);
}

MemoryTier::MemoryTier(const std::string& root, const std::string& job_id, const std::string& directory, int rank,
                       int64_t budget_bytes)
    : job_id_(job_id), rank_(rank), budget_(budget_bytes) {
  ETTKIT_EXPECTS(!job_id.empty(), "the memory tier needs a job id, so that a restarted process finds its own "
                 "snapshots and never another job's: pass job_id=..., or run under torchrun (TORCHELASTIC_RUN_ID, "
                 "with --rdzv-id or --standalone) or SLURM (SLURM_JOB_ID)");
  ETTKIT_EXPECTS(rank >= 0, "memory tier rank=", rank, " must be >= 0");
  root_ = open_root(root);
  job_name_ = job_dir_name(job_id, directory);
  job_dir_ = root_.path_of(job_name_);
  const std::string rank_name = "rank-" + std::to_string(rank);
  dir_ = job_dir_ + "/" + rank_name;
  for (int attempt = 0; rank_dir_.fd() < 0; ++attempt) {
    ETTKIT_CHECK(attempt < kCreateAttempts, IoError, "checkpoint memory tier: '", job_dir_, "' kept vanishing while "
                 "this rank created its directory in it (", kCreateAttempts, " attempts)");
    std::optional<Dir> job = private_directory_at(root_, job_name_);
    if (!job) continue;
    job_ = std::move(*job);
    if (std::optional<Dir> mine = private_directory_at(job_, rank_name)) rank_dir_ = std::move(*mine);
  }
  struct stat st {};
  if (::fstatat(job_.fd(), "owner.json", &st, AT_SYMLINK_NOFOLLOW) != 0) {
    const std::string text = json{{"job", job_id}, {"directory", directory}, {"host", host_name()}}.dump() + "\n";
    const std::string tmp = "owner.json.tmp-" + random_id();
    try {
      write_private_file_at(job_, tmp, text);
      if (::renameat(job_.fd(), tmp.c_str(), job_.fd(), "owner.json") != 0) {
        ETTKIT_LOG_WARN("checkpoint memory tier: could not write '", job_.path_of("owner.json"),
                        "': ", std::strerror(errno));
      }
    } catch (const Error& e) {
      ETTKIT_LOG_WARN("checkpoint memory tier: could not write '", job_.path_of("owner.json"), "': ", e.message());
    }
    ::unlinkat(job_.fd(), tmp.c_str(), 0);
  }
}

MemoryTier::~MemoryTier() = default;

std::optional<std::string> MemoryTier::try_lock() {
  auto holder = lock_.try_acquire(dir_, kFileMode);
  if (holder) return holder;
  // A killed process's temporaries and half-retired steps (the lock says no writer of this rank is alive).
  std::vector<std::string> shelves = replica_shelves();
  shelves.push_back(dir_);
  for (const std::string& shelf : shelves) {
    try {
      remove_temporaries_in(open_shelf(shelf));
    } catch (const Error& e) {
      ETTKIT_LOG_WARN("checkpoint memory tier: ", e.message());
    }
  }
  return std::nullopt;
}

void MemoryTier::remove_temporaries_in(const Dir& shelf) noexcept {
  try {
    for (const Entry& e : entries_of(shelf)) {
      if (e.name.rfind(".tmp-step-", 0) == 0 || e.name.rfind(".trash-", 0) == 0 || e.name.rfind(".arena-", 0) == 0) {
        remove_quietly_at(shelf, e.name);
      }
    }
  } catch (const std::exception& e) {
    ETTKIT_LOG_WARN("checkpoint memory tier: removing what a killed writer left in '", shelf.path(),
                    "' failed: ", e.what());
  }
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
      // Checked like every run id read from a file (storage.h): it goes into the load vote and the lineage.
      s.run_id = manifest_run_id(m, "manifest '" + mpath + "'");
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

std::string MemoryTier::replica_dir(int src) const { return dir_ + "/" + kReplicaPrefix + std::to_string(src); }

std::vector<std::string> MemoryTier::replica_shelves() const {
  std::vector<std::string> out;
  try {
    for (const Entry& e : entries_of(rank_dir_)) {
      if (e.directory && e.name.rfind(kReplicaPrefix, 0) == 0) out.push_back(rank_dir_.path_of(e.name));
    }
  } catch (const Error& e) {
    ETTKIT_LOG_WARN(e.message());
  }
  return out;
}

Dir MemoryTier::open_shelf(const std::string& shelf) const {
  if (shelf == dir_) {
    // A handle of its own, so that the caller may close it.
    const int fd = ::openat(rank_dir_.fd(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    ETTKIT_CHECK(fd >= 0, IoError, "checkpoint memory tier: opening '", dir_, "' failed: ", std::strerror(errno));
    return Dir(fd, dir_);
  }
  const std::string name = entry_of(dir_, shelf);
  ETTKIT_EXPECTS(name.rfind(kReplicaPrefix, 0) == 0, "'", shelf, "' is not a shelf of the memory tier '", dir_,
                 "' (its own directory or a ", kReplicaPrefix, "<s> directory in it)");
  const int fd = open_directory_at(rank_dir_.fd(), name);
  ETTKIT_CHECK(fd >= 0, IoError, "checkpoint memory tier: opening '", shelf, "' failed: ", std::strerror(errno));
  return Dir(fd, shelf);
}

std::string MemoryTier::entry_of(const std::string& shelf, const std::string& path) {
  const std::string prefix = shelf + "/";
  std::string name = path.rfind(prefix, 0) == 0 ? path.substr(prefix.size()) : std::string();
  ETTKIT_EXPECTS(is_plain_file_name(name), "'", path, "' is not an entry of the memory tier's '", shelf, "'");
  return name;
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
  const std::string name = temp_dir_name(step, run_id);  // checks the step and the run id
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
  remove_quietly_at(rank_dir_, name);  // a failed attempt at the same step of this run
  ETTKIT_CHECK(::mkdirat(rank_dir_.fd(), name.c_str(), kDirectoryMode) == 0, IoError, "checkpoint memory tier: "
               "creating '", rank_dir_.path_of(name), "' failed: ", std::strerror(errno));
  return rank_dir_.path_of(name);
}

std::string MemoryTier::begin_replica(int src, int64_t step, const std::string& run_id, uint64_t bytes) {
  ETTKIT_EXPECTS(!discarded_, "the memory tier was discarded");
  ETTKIT_EXPECTS(src >= 0, "replica source rank ", src, " must be >= 0");
  const std::string name = temp_dir_name(step, run_id);  // checks the step and the run id
  const std::string shelf = replica_dir(src);
  std::lock_guard<std::mutex> lk(mu_);
  std::optional<Dir> shelf_dir = private_directory_at(rank_dir_, entry_of(dir_, shelf));
  ETTKIT_CHECK(shelf_dir.has_value(), IoError, "checkpoint memory tier: '", dir_, "' vanished");
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
  remove_quietly_at(*shelf_dir, name);
  ETTKIT_CHECK(::mkdirat(shelf_dir->fd(), name.c_str(), kDirectoryMode) == 0, IoError, "checkpoint memory tier: "
               "creating '", shelf_dir->path_of(name), "' failed: ", std::strerror(errno));
  return shelf_dir->path_of(name);
}

void MemoryTier::commit_in(const std::string& shelf, const std::string& tmp, Manifest manifest) {
  const std::string final_name = step_dir_name(manifest.step);  // checks the step
  const std::string tmp_name = entry_of(shelf, tmp);
  const Dir shelf_dir = open_shelf(shelf);
  {
    const int fd = open_directory_at(shelf_dir.fd(), tmp_name);
    ETTKIT_CHECK(fd >= 0, IoError, "checkpoint memory tier: opening '", tmp, "' failed: ", std::strerror(errno));
    write_private_file_at(Dir(fd, tmp), "manifest.json", encode_manifest(manifest));
  }
  std::lock_guard<std::mutex> lk(mu_);
  // The commit point, as commit_step_directory on disk: an older step-<N> (a re-save) is retired by rename
  // first, then the temporary directory becomes step-<N>.
  struct stat st {};
  if (::fstatat(shelf_dir.fd(), final_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    const std::string trash = ".trash-" + final_name + "-" + random_id();
    ETTKIT_CHECK(::renameat(shelf_dir.fd(), final_name.c_str(), shelf_dir.fd(), trash.c_str()) == 0, IoError,
                 "checkpoint memory tier: retiring '", shelf_dir.path_of(final_name),
                 "' failed: ", std::strerror(errno));
    remove_quietly_at(shelf_dir, trash);
  }
  ETTKIT_CHECK(::renameat(shelf_dir.fd(), tmp_name.c_str(), shelf_dir.fd(), final_name.c_str()) == 0, IoError,
               "checkpoint memory tier: renaming '", tmp, "' to '", shelf_dir.path_of(final_name), "' failed: ",
               std::strerror(errno));
  fsync_directory(shelf_dir);
}

void MemoryTier::abort(const std::string& tmp) noexcept {
  try {
    // A temporary directory of this rank's own shelf, or of a replica shelf in it: nothing else.
    const auto slash = tmp.rfind('/');
    const std::string shelf = slash == std::string::npos ? std::string() : tmp.substr(0, slash);
    remove_quietly_at(open_shelf(shelf), entry_of(shelf, tmp));
  } catch (const std::exception& e) {
    ETTKIT_LOG_WARN("checkpoint memory tier: could not remove '", tmp, "': ", e.what());
  }
}

void MemoryTier::retire_everywhere(const std::function<bool(const MemoryStep&)>& drop) {
  retire_if(drop);
  for (const std::string& shelf : replica_shelves()) retire_in(shelf, drop);
}

void MemoryTier::retire_in(const std::string& shelf, const std::function<bool(const MemoryStep&)>& drop) noexcept {
  std::lock_guard<std::mutex> lk(mu_);
  retire_locked(shelf, drop);
}

void MemoryTier::retire_locked(const std::string& shelf, const std::function<bool(const MemoryStep&)>& drop) noexcept {
  try {
    const Dir shelf_dir = open_shelf(shelf);
    // Unusable entries (a manifest that does not decode) go too: they could only be warned about again.
    for (const StepEntry& e : list_steps(shelf).others) retire(shelf_dir, e.name);
    for (const MemoryStep& s : committed_in(shelf, /*warn=*/false)) {
      if (drop(s)) retire(shelf_dir, step_dir_name(s.step));
    }
  } catch (const std::exception& e) {
    ETTKIT_LOG_WARN("checkpoint memory tier: retention in '", shelf, "' failed: ", e.what());
  }
}

void MemoryTier::discard() noexcept {
  if (discarded_) return;
  discarded_ = true;
  const std::string rank_name = "rank-" + std::to_string(rank_);
  const std::string trash = ".trash-" + rank_name + "-" + random_id();
  if (::renameat(job_.fd(), rank_name.c_str(), job_.fd(), trash.c_str()) == 0) {
    remove_quietly_at(job_, trash);
  } else if (errno != ENOENT) {  // ENOENT: removed already (by hand, or a reboot's empty /dev/shm)
    ETTKIT_LOG_WARN("checkpoint memory tier: could not remove '", dir_, "': ", std::strerror(errno));
  }
  lock_.release();
  try {
    if (!rank_dirs(job_).empty()) return;
    // The last rank of this node to leave removes the job's directory (owner.json with it). A rank that
    // opens the tier concurrently creates both again. The root's entry is removed only while it is still
    // the directory this tier verified (nobody else can rename it; this is the check that says so).
    ::unlinkat(job_.fd(), "owner.json", 0);
    struct stat mine {}, there {};
    if (::fstat(job_.fd(), &mine) == 0 &&
        ::fstatat(root_.fd(), job_name_.c_str(), &there, AT_SYMLINK_NOFOLLOW) == 0 && mine.st_dev == there.st_dev &&
        mine.st_ino == there.st_ino) {
      ::unlinkat(root_.fd(), job_name_.c_str(), AT_REMOVEDIR);  // ENOTEMPTY: a rank arrived meanwhile
    }
  } catch (const std::exception& e) {
    ETTKIT_LOG_WARN("checkpoint memory tier: ", e.what());
  }
}

std::vector<std::string> remove_stale_memory_tiers(const std::string& root, const std::string& job_id,
                                                   const std::string& directory) noexcept {
  std::vector<std::string> removed;
  try {
    const int rfd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (rfd < 0) return removed;
    const Dir root_dir(rfd, root);
    for (const Entry& e : entries_of(root_dir)) {
      const TierName kind = classify_tier_name(e.name);
      if (kind == TierName::kNone) continue;  // another user's tier (its uid is in its name), or not a tier
      const int jfd = open_directory_at(root_dir.fd(), e.name);
      if (jfd < 0) continue;
      const Dir job(jfd, root_dir.path_of(e.name));
      struct stat st {};
      // Judged on the handle: this user's own directory, whatever its name or its owner.json say.
      if (::fstat(job.fd(), &st) != 0 || st.st_uid != ::geteuid()) continue;
      auto text = read_bounded_file_at(job, "owner.json", kMaxOwnerRecordBytes);
      if (!text) continue;  // being created or removed by its own job: not ours to judge
      json owner = json::parse(*text, nullptr, /*allow_exceptions=*/false);
      if (!owner.is_object() || !owner.contains("directory") || !owner["directory"].is_string() ||
          owner["directory"].get<std::string>() != directory) {
        continue;
      }
      const std::string other =
          owner.contains("job") && owner["job"].is_string() ? owner["job"].get<std::string>() : std::string();
      // This job's own tier is in use; a legacy-named one is never used again, whichever job wrote it.
      if (kind == TierName::kCurrent && other == job_id) continue;
      bool alive = false;
      for (const std::string& r : rank_dirs(job)) alive = alive || lock_held(job, r);
      if (alive) {
        ETTKIT_LOG_WARN("checkpoint memory tier: '", job.path(), "' of job '", other, "' for the same checkpoint "
                        "directory is left alone: a process of that job still holds it");
        continue;
      }
      // Renamed first: the other ranks of this node look for stale tiers at the same moment, and only one
      // rename wins. The name carries the uid, as the tiers' names do.
      const std::string trash = ".ettkit-mem-trash-" + std::to_string(::geteuid()) + "-" + random_id();
      if (::renameat(root_dir.fd(), e.name.c_str(), root_dir.fd(), trash.c_str()) != 0) continue;
      ETTKIT_LOG_WARN("checkpoint memory tier: removed '", job.path(), "', left by job '", other,
                      "' for the same checkpoint directory (this is job '", job_id, "')");
      remove_quietly_at(root_dir, trash);
      removed.push_back(job.path());
    }
  } catch (const std::exception& e) {
    ETTKIT_LOG_WARN("checkpoint memory tier: looking for stale tiers in '", root, "' failed: ", e.what());
  }
  return removed;
}

}  // namespace ettkit::checkpoint::detail
