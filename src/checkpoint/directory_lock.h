#pragma once
// The lock that makes one job the writer of a checkpoint directory. Torch-free.

#include <optional>
#include <string>
#include <utility>

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// An advisory lock (flock) on CKPT_DIR/.lock that the directory's writer holds for its life; the file
/// names the holder (one JSON line: job, host, pid, since). The kernel releases it when the holder's
/// process dies, so a dead job's lock is taken over by the next one without any staleness rule.
class DirectoryLock {
 public:
  DirectoryLock() = default;
  ~DirectoryLock() { release(); }
  DirectoryLock(DirectoryLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  DirectoryLock& operator=(DirectoryLock&& o) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  /// Takes the lock of `dir` and records this process in it. Returns nullopt on success (also on a file
  /// system without flock support: a warning, and nothing is held), else the holder's description. `mode`:
  /// the lock file's mode when this call creates it (before the umask).
  std::optional<std::string> try_acquire(const std::string& dir, unsigned mode = 0644);
  /// Empties the record and releases the lock. Idempotent.
  void release();
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
