// The layout of a checkpoint directory, its commit order and its retention (directory_layout.h).
#include "checkpoint/directory_layout.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <string_view>

#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"
#include "common/logging.h"
#include "common/remove_tree.h"
#include "ettkit/common/durable_file.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

std::string step_dir_name(int64_t step) {
  ETTKIT_EXPECTS(is_step(step), "step ", step, " cannot name a step directory: it must be in [0, ", kMaxStep, "]");
  return "step-" + std::to_string(step);
}

std::string temp_dir_name(int64_t step, const std::string& run_id) {
  ETTKIT_EXPECTS(is_step(step), "step ", step, " cannot name a temporary directory: it must be in [0, ", kMaxStep, "]");
  ETTKIT_EXPECTS(is_run_id(run_id), "run id ", shown_untrusted(run_id), " cannot name a temporary directory: a run id is 16 "
                 "lowercase hex digits");
  return ".tmp-step-" + std::to_string(step) + "-" + run_id;
}

bool committed_after(const StepEntry& a, const StepEntry& b) {
  if (a.commit_seq != b.commit_seq) return a.commit_seq > b.commit_seq;
  if (a.created_unix_us != b.created_unix_us) return a.created_unix_us > b.created_unix_us;
  return a.step > b.step;
}

namespace {
/// N when `name` is exactly step_dir_name(N) for 0 <= N <= kMaxStep (no sign, no leading zero), else -1.
int64_t canonical_step(const std::string& name) {
  if (name.rfind("step-", 0) != 0) return -1;
  std::string digits = name.substr(5);
  if (digits.empty() || digits.size() > 18 || (digits.size() > 1 && digits[0] == '0')) return -1;
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return -1;
  return std::stoll(digits);
}
}  // namespace

namespace {
/// What the step directory `n` of `parent` holds: fills `e`'s commit fields from its manifest, or its
/// problem. false when the entry vanished while being read (retired by the writer: left out of the listing).
bool read_commit(const Dir& parent, const std::string& n, StepEntry& e) {
  const std::string mpath = parent.path_of(n) + "/manifest.json";
  try {
    std::optional<Dir> step_dir = open_subdirectory(parent, n);
    if (!step_dir) return false;
    OwnedFd m;
    m.fd = open_regular_or_throw(step_dir->fd(), "manifest.json", mpath, /*missing_ok=*/true);
    if (m.fd < 0) {
      if (entry_gone(parent.fd(), n)) return false;
      e.problem = "it has no manifest.json (never committed)";
      return true;
    }
    Manifest man = decode_manifest(read_bounded(m.fd, mpath, kMaxSmallFileBytes), mpath);
    ETTKIT_CHECK(man.step == e.step, CorruptData, "manifest '", mpath, "' says step ", man.step);
    e.committed = true;
    e.commit_seq = man.commit_seq;
    e.created_unix_us = man.created_unix_us;
  } catch (const Error& x) {
    if (entry_gone(parent.fd(), n)) return false;
    e.problem = x.message();
  }
  return true;
}

/// The entry `n` of `parent` (a name starting with "step-") classified; nullopt when it vanished.
std::optional<StepEntry> classify_step_entry(const Dir& parent, const std::string& n) {
  StepEntry e;
  e.name = n;
  e.step = canonical_step(n);
  // lstat: an entry is judged as what it is, never as what a link names (a link is never followed, so it
  // is never a step: a co-tenant's link to another directory must not make that directory look committed).
  struct stat st {};
  if (::fstatat(parent.fd(), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return std::nullopt;  // vanished
  e.directory = S_ISDIR(st.st_mode);
  if (S_ISLNK(st.st_mode)) {
    e.problem = "a symbolic link (never followed: a step is a directory of the checkpoint directory itself)";
  } else if (!e.directory) {
    e.problem = "not a directory";
  }
  if (e.step < 0 && e.problem.empty()) {
    e.problem = "not a step directory name this checkpointer writes (step-<N>, N without leading zeros, N < 10^18)";
  }
  if (e.problem.empty() && !read_commit(parent, n, e)) return std::nullopt;
  return e;
}
}  // namespace

StepListing list_steps(const std::string& dir) {
  StepListing out;
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return out;  // no directory: no steps (what an unreadable listing always gave)
  const Dir parent(fd, dir);
  std::vector<std::string> names;
  for (std::string& n : entry_names(parent.fd())) {
    if (n.rfind("step-", 0) == 0) names.push_back(std::move(n));
  }
  std::sort(names.begin(), names.end());
  for (const std::string& n : names) {
    std::optional<StepEntry> e = classify_step_entry(parent, n);
    if (e) (e->committed ? out.committed : out.others).push_back(std::move(*e));
  }
  std::sort(out.committed.begin(), out.committed.end(), committed_after);
  return out;
}

std::vector<int64_t> list_step_dirs(const std::string& dir) {
  std::vector<int64_t> steps;
  for (const StepEntry& e : list_steps(dir).committed) steps.push_back(e.step);
  return steps;
}

std::vector<int64_t> load_candidates(const std::string& dir) {
  StepListing l = list_steps(dir);
  std::vector<int64_t> steps;
  for (const StepEntry& e : l.others) {
    if (e.step >= 0 && e.directory) steps.push_back(e.step);
  }
  std::sort(steps.rbegin(), steps.rend());
  for (const StepEntry& e : l.committed) steps.push_back(e.step);
  return steps;
}

namespace {
/// The 16-hex-digit id that ends `name` after `prefix` and at least `min_middle` bytes and a '-' (what
/// random_id() appends to every temporary name ettkit makes), or "" when `name` is not of that form.
std::string_view id_suffix(std::string_view name, std::string_view prefix, size_t min_middle) {
  if (name.size() < prefix.size() + min_middle + 17 || name.substr(0, prefix.size()) != prefix) return {};
  std::string_view id = name.substr(name.size() - 16);
  if (name[name.size() - 17] != '-' || !is_run_id(id)) return {};
  return id;
}

/// Whether `name` is a temporary that a writer of `dir` made and that is not `run_id`'s:
/// .tmp-step-<N>-<run id> of another run, .trash-<name>-<id>, latest.tmp-<id>.
bool is_stale_temporary(std::string_view name, std::string_view run_id) {
  if (std::string_view run = id_suffix(name, ".tmp-step-", 1); !run.empty()) {
    std::string_view digits = name.substr(10, name.size() - 10 - 17);
    const bool step_ok = digits.size() <= 18 && std::all_of(digits.begin(), digits.end(), [](char c) {
      return c >= '0' && c <= '9';
    });
    return step_ok && run != run_id;
  }
  return !id_suffix(name, ".trash-", 1).empty() || !id_suffix(name, "latest.tmp", 0).empty();
}
}  // namespace

int remove_stale_temporaries(const std::string& dir, const std::string& run_id) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return 0;  // nothing to clean where nothing can be listed (the save itself reports the error)
  const Dir parent(fd, dir);
  int removed = 0;
  for (const std::string& n : entry_names(parent.fd())) {
    if (!is_stale_temporary(n, run_id)) continue;
    // Relative to the opened directory, never following a link: a link planted under a temporary's name
    // is removed as a link, and what it names stays.
    if (int err = ettkit::detail::remove_tree_at(parent.fd(), n.c_str()); err != 0) {
      ETTKIT_LOG_WARN("checkpoint: could not remove '", parent.path_of(n), "': ", std::generic_category().message(err));
      continue;
    }
    ++removed;
  }
  return removed;
}

void update_latest(const std::string& dir, int64_t step) {
  // The temporary's name is what remove_stale_temporaries recognises as a dead writer's (latest.tmp-*).
  replace_file_durably(dir + "/latest.tmp-" + random_id(), dir + "/latest", step_dir_name(step) + "\n");
}

void commit_step_directory(const std::string& dir, const std::string& tmp, int64_t step) {
  const std::string name = step_dir_name(step);
  const std::string final_dir = dir + "/" + name;
  const auto slash = tmp.rfind('/');
  ETTKIT_EXPECTS(slash != std::string::npos && tmp.compare(0, slash, dir) == 0 && slash == dir.size(),
                 "commit_step_directory: '", tmp, "' is not an entry of '", dir, "'");
  const std::string tmp_name = tmp.substr(slash + 1);
  const Dir parent = open_directory(dir);
  struct stat st {};
  if (::fstatat(parent.fd(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    // Saving a step again replaces it: retire the old one by rename (atomic) before the new rename.
    const std::string trash = ".trash-" + name + "-" + random_id();
    if (::renameat(parent.fd(), name.c_str(), parent.fd(), trash.c_str()) != 0) {
      throw_errno("retiring", final_dir, errno);
    }
    if (int err = ettkit::detail::remove_tree_at(parent.fd(), trash.c_str()); err != 0) {
      ETTKIT_LOG_WARN("checkpoint: could not remove '", parent.path_of(trash), "': ",
                      std::generic_category().message(err));
    }
  }
  if (::renameat(parent.fd(), tmp_name.c_str(), parent.fd(), name.c_str()) != 0) {
    ETTKIT_THROW(IoError, "renaming '", tmp, "' to '", final_dir, "' failed: ", std::strerror(errno));
  }
  fsync_directory(parent);
}

uint64_t CommitHistory::next_seq(const std::string& dir) {
  if (!scanned_) {
    for (const StepEntry& e : list_steps(dir).committed) last_seq_ = std::max(last_seq_, e.commit_seq);
    scanned_ = true;
  }
  return ++last_seq_;
}

std::vector<std::string> CommitHistory::after_commit(const std::string& dir, int64_t step, int keep_last) {
  // The step is committed: nothing here may turn that into a failure. `latest` is a hint for people and
  // tools (loaders find the newest commit themselves), and a step retention could not retire is retired by
  // a later commit.
  try {
    update_latest(dir, step);
  } catch (const Error& e) {
    ETTKIT_LOG_WARN("checkpoint step ", step, " is committed, but the 'latest' pointer in '", dir,
                    "' could not be updated (it may name an older step; loaders do not use it): ", e.message());
  }
  if (keep_last <= 0) return {};
  StepListing l = list_steps(dir);
  for (const StepEntry& e : l.others) {
    if (std::find(warned_.begin(), warned_.end(), e.name) != warned_.end()) continue;
    warned_.push_back(e.name);
    ETTKIT_LOG_WARN("checkpoint retention: leaving '", e.name, "' in '", dir, "' alone (not counted, never deleted): ",
                    e.problem);
  }
  return retire_old_steps(dir, l.committed, step, keep_last);
}

std::vector<std::string> CommitHistory::retire_old_steps(const std::string& dir,
                                                         const std::vector<StepEntry>& committed, int64_t step,
                                                         int keep_last) {
  std::vector<std::string> retired;
  int kept = 0;
  for (const StepEntry& e : committed) {
    if (e.step == step || kept < keep_last) {
      ++kept;
      continue;
    }
    std::string from = dir + "/" + e.name;
    std::string to = dir + "/.trash-" + e.name + "-" + random_id();
    // Rename first: a crash mid-delete must never leave a half-deleted step-<N> that looks committed.
    if (::rename(from.c_str(), to.c_str()) != 0) {
      ETTKIT_LOG_WARN("checkpoint retention: could not retire '", from, "': ", std::strerror(errno));
      continue;
    }
    retired.push_back(e.name);
    remove_tree_quietly(to);
  }
  if (!retired.empty()) {
    try {
      fsync_directory(dir);
    } catch (const Error& e) {
      ETTKIT_LOG_WARN("checkpoint retention: ", e.message());
    }
  }
  return retired;
}

}  // namespace ettkit::checkpoint::detail
