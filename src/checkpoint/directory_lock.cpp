// The checkpoint directory's writer lock (directory_lock.h).
#include "checkpoint/directory_lock.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <nlohmann/json.hpp>
#include <vector>

#include "checkpoint/file_io.h"
#include "common/logging.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

using nlohmann::json;

namespace {
std::string this_host() {
  char host[256] = {0};
  if (::gethostname(host, sizeof host - 1) != 0) return "?";
  return host;
}

std::string this_job() {
  for (const char* var : {"TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID"}) {
    const char* v = std::getenv(var);
    if (v && *v) return v;
  }
  return "";
}

std::string describe_holder(const std::string& record) {
  json h = json::parse(record, nullptr, /*allow_exceptions=*/false);
  if (!h.is_object()) return "an unknown holder (the lock file records none yet)";
  auto text = [&](const char* k) {
    auto it = h.find(k);
    return it == h.end() ? std::string("?") : it->is_string() ? it->get<std::string>() : it->dump();
  };
  // One noun phrase (the callers go on with "holds ..."): what is known of the holder in parentheses.
  std::vector<std::string> notes;
  if (!text("job").empty() && text("job") != "?") notes.push_back("job '" + text("job") + "'");
  if (h.contains("pid") && h["pid"].is_number_integer() && h["pid"].get<int64_t>() == ::getpid() &&
      text("host") == this_host()) {
    notes.emplace_back("that is another checkpointer of this process, which must be closed before a new one opens");
  }
  std::string out = "pid " + text("pid") + " on host '" + text("host") + "'";
  for (size_t i = 0; i < notes.size(); ++i) out += (i == 0 ? " (" : "; ") + notes[i];
  if (!notes.empty()) out += ")";
  return out;
}

// A forked child (a DataLoader worker, say) inherits the lock's file descriptor, and a flock lives until
// every descriptor of its open file is closed: the child would keep the directory locked after its parent
// closed the checkpointer or died. Children close their copies at fork (close() is async-signal-safe and
// the slots are lock-free atomics, as a fork handler needs). Slots hold fd + 1; 0 is free.
constexpr int kLockSlots = 64;
std::atomic<int> g_lock_slots[kLockSlots];

void close_locks_in_child() {
  for (auto& slot : g_lock_slots) {
    int v = slot.exchange(0);
    if (v > 0) ::close(v - 1);
  }
}

void remember_lock_fd(int fd) {
  static std::once_flag once;
  std::call_once(once, [] { ::pthread_atfork(nullptr, nullptr, close_locks_in_child); });
  for (auto& slot : g_lock_slots) {
    int free_slot = 0;
    if (slot.compare_exchange_strong(free_slot, fd + 1)) return;
  }
  // More than kLockSlots locks at once: a forked child may then hold this one until it exits.
}

void forget_lock_fd(int fd) {
  for (auto& slot : g_lock_slots) {
    int mine = fd + 1;
    if (slot.compare_exchange_strong(mine, 0)) return;
  }
}
}  // namespace

DirectoryLock& DirectoryLock::operator=(DirectoryLock&& o) noexcept {
  if (this != &o) {
    release();
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

std::optional<std::string> DirectoryLock::try_acquire(const std::string& dir, unsigned mode) {
  release();
  std::string path = dir + "/.lock";
  // Never unlinked: removing a lock file while another process waits on its inode would let two holders
  // lock two different files.
  // O_NOFOLLOW, and a regular file only: the holder's record is written into this file (after emptying
  // it), so a link planted under its name in a shared directory would truncate whatever file it names.
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, static_cast<mode_t>(mode));
  if (fd < 0 && (errno == ELOOP || errno == EMLINK)) {
    ETTKIT_THROW(CorruptData, "the checkpoint directory lock '", path, "' is a symbolic link; ettkit never writes "
                 "through one: remove it (the lock is a plain file that the next checkpointer creates)");
  }
  if (fd < 0) throw_errno("opening the checkpoint directory lock", path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    ETTKIT_THROW(CorruptData, "the checkpoint directory lock '", path, "' is not a regular file: remove it (the lock "
                 "is a plain file that the next checkpointer creates)");
  }
  // One link only: the lock is never linked, so a second name means a hard link planted under ".lock" (or a
  // backup made with hard links), and emptying it for the holder's record below would empty the other file.
  if (st.st_nlink != 1) {
    ::close(fd);
    ETTKIT_THROW(CorruptData, "the checkpoint directory lock '", path, "' is a hard link (", st.st_nlink,
                 " links): ettkit never writes through one. Remove it (the lock is a plain file of one link that "
                 "the next checkpointer creates); the file it is linked to is left as it is");
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    if (err == EWOULDBLOCK) {
      std::string record;
      try {
        record = ReadFile(fd, path).read_all(uint64_t{64} << 10);  // closes fd; a holder line is short
      } catch (const Error&) {
      }
      return describe_holder(record);
    }
    ::close(fd);
    if (err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS || err == EINVAL) {
      ETTKIT_LOG_WARN("checkpoint: the file system of '", dir, "' does not support flock (", std::strerror(err),
                      "); nothing prevents a second job from writing this directory");
      return std::nullopt;
    }
    throw_errno("locking", path, err);
  }
  std::string record = json{{"job", this_job()}, {"host", this_host()}, {"pid", ::getpid()},
                            {"since_unix_us", epoch_us()}}.dump() + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, record.data(), record.size(), 0) != static_cast<ssize_t>(record.size())) {
    ETTKIT_LOG_WARN("checkpoint: could not record the holder in '", path, "': ", std::strerror(errno));
  }
  fd_ = fd;
  remember_lock_fd(fd);
  return std::nullopt;
}

void DirectoryLock::release() {
  if (fd_ < 0) return;
  forget_lock_fd(fd_);
  // Emptied while still held: a later holder's record is never clobbered.
  if (::ftruncate(fd_, 0) != 0) ETTKIT_LOG_DEBUG("checkpoint: could not empty the directory lock record");
  // LOCK_UN releases the lock even if a descriptor of this open file survives elsewhere (a child forked
  // between the registration and now).
  ::flock(fd_, LOCK_UN);
  ::close(fd_);
  fd_ = -1;
}

}  // namespace ettkit::checkpoint::detail
