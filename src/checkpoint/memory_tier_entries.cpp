// The memory tier's directory entries (memory_tier_entries.h).
#include "checkpoint/memory_tier_entries.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "checkpoint/file_io.h"
#include "common/logging.h"
#include "common/remove_tree.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail::tier_entries {

int open_directory_at(int parent, const std::string& name) {
  return ::openat(parent, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
}

std::vector<Entry> entries_of(const Dir& dir) {
  int fd = ::openat(dir.fd(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ETTKIT_CHECK(fd >= 0, IoError, "checkpoint memory tier: listing '", dir.path(), "' failed: ", std::strerror(errno));
  DIR* d = ::fdopendir(fd);
  if (d == nullptr) {
    const int err = errno;
    ::close(fd);
    ETTKIT_THROW(IoError, "checkpoint memory tier: listing '", dir.path(), "' failed: ", std::strerror(err));
  }
  std::vector<Entry> out;
  while (const dirent* e = ::readdir(d)) {
    Entry entry{e->d_name, e->d_type == DT_DIR};
    if (entry.name == "." || entry.name == "..") continue;
    if (e->d_type == DT_UNKNOWN) {
      struct stat st {};
      entry.directory = ::fstatat(dir.fd(), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
    }
    out.push_back(std::move(entry));
  }
  ::closedir(d);
  return out;
}

std::optional<std::string> read_bounded_file_at(const Dir& dir, const std::string& name, uint64_t limit) {
  // O_NONBLOCK: a FIFO under the name (a tier of this uid whose mode let others in) cannot block the open;
  // fstat then refuses it as not a regular file.
  const int fd = ::openat(dir.fd(), name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  ReadFile f(fd, dir.path_of(name));
  struct stat st {};
  if (::fstat(f.fd(), &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) > limit) {
    return std::nullopt;
  }
  try {
    return f.read_all(limit);
  } catch (const Error&) {
    return std::nullopt;
  }
}

void remove_quietly_at(const Dir& dir, const std::string& name) noexcept {
  if (int err = ettkit::detail::remove_tree_at(dir.fd(), name.c_str()); err != 0) {
    ETTKIT_LOG_WARN("checkpoint memory tier: could not remove '", dir.path_of(name), "': ", std::strerror(err));
  }
}

bool lock_held(const Dir& job, const std::string& rank) {
  const int dfd = open_directory_at(job.fd(), rank);
  if (dfd < 0) return false;
  Dir dir(dfd, job.path_of(rank));
  // O_NONBLOCK: a FIFO planted as the lock (in a stale tier whose mode let another user in) would block
  // this probe, and with it every start of this job, for good. Only a regular file is a lock.
  const int fd = ::openat(dir.fd(), ".lock", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  ReadFile lock(fd, dir.path_of(".lock"));  // closing it releases the probe's lock, if it got one
  struct stat st {};
  if (::fstat(lock.fd(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  return ::flock(lock.fd(), LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK;
}

std::vector<std::string> rank_dirs(const Dir& job) {
  std::vector<std::string> out;
  for (const Entry& e : entries_of(job)) {
    if (e.name.rfind("rank-", 0) == 0) out.push_back(e.name);
  }
  return out;
}

}  // namespace ettkit::checkpoint::detail::tier_entries
