#pragma once
// Torch-free file I/O of the checkpoint: durable writes that hash as they go, bounded and parallel reads, and
// directories held open so that every name is resolved relative to a handle, never through a symbolic link
// that a co-tenant of a shared directory planted. What is hashed is checksums.h; what is verified on disk is
// file_checksums.h.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checksums.h"

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// A byte range to write (not owned).
struct ConstBuffer {
  const void* data;
  size_t size;
};

/// A descriptor and the path that messages name it by (Dir, ReadFile). Move-only; closes its descriptor.
class NamedFd {
 public:
  NamedFd() = default;
  NamedFd(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~NamedFd();
  NamedFd(NamedFd&& o) noexcept : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)) {}
  NamedFd& operator=(NamedFd&& o) noexcept;
  NamedFd(const NamedFd&) = delete;
  NamedFd& operator=(const NamedFd&) = delete;
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

/// A directory held open, so that what is created, opened, renamed or removed in it goes by name relative to
/// this handle: once it is open, renaming its path or swapping a directory of that path for a symbolic link
/// redirects nothing.
class Dir : public NamedFd {
 public:
  using NamedFd::NamedFd;
  /// `name` inside this directory, as messages name it.
  std::string path_of(const std::string& name) const { return path() + "/" + name; }
};
/// Opens the directory `path`. Links in `path` are followed: it is the caller's own directory (the
/// checkpoint directory the user named, a memory-tier root). Throws IoError.
Dir open_directory(const std::string& path);
/// Opens the entry `name` of `parent` as a directory without ever following a symbolic link. nullopt when
/// it does not exist; CorruptData when it is a symbolic link or not a directory; IoError otherwise.
std::optional<Dir> open_subdirectory(const Dir& parent, const std::string& name);
/// mkdirat(parent, name, mode) (less the umask), then open_subdirectory. An existing directory is used
/// (the ranks of one save on one host create the same temporary directory); an existing symbolic link or
/// file under that name is refused with CorruptData. IoError for other failures.
Dir make_subdirectory(const Dir& parent, const std::string& name, unsigned mode);

/// Writes `buffers` back to back into a new file `path` (O_CREAT|O_EXCL|O_NOFOLLOW: never through a link),
/// hashing the bytes as they go, then fsyncs it. Throws IoError naming the file and the errno text (ENOSPC,
/// EFBIG, EEXIST for any existing entry, a link included); a failed write leaves a partial file that the
/// caller's temp directory owns. `mode`: the new file's mode before the umask (the memory tier's files are
/// 0600: MemoryTier::kFileMode).
FileDigest write_file_durably(const std::string& path, const std::vector<ConstBuffer>& buffers, unsigned mode = 0644);
/// The same for the new file `name` of `dir` (openat with O_NOFOLLOW: immune to a swap of `dir`'s path).
FileDigest write_file_durably(const Dir& dir, const std::string& name, const std::vector<ConstBuffer>& buffers,
                              unsigned mode = 0644);
/// The same without hashing, for bytes whose digest the caller has already (the copies hashed them as they
/// staged them: in_order_digest.h). Returns the bytes written.
uint64_t write_file_durably_unhashed(const Dir& dir, const std::string& name, const std::vector<ConstBuffer>& buffers,
                                     unsigned mode);
/// fsync of a directory (so a rename or create inside it is durable). Throws IoError.
void fsync_directory(const std::string& path);
void fsync_directory(const Dir& dir);
/// mkdir -p. Throws IoError.
void make_directories(const std::string& path);
/// rm -rf that never throws (logs a warning instead).
void remove_tree_quietly(const std::string& path);
/// Size of a regular file, or nullopt when it does not exist.
std::optional<uint64_t> file_size(const std::string& path);
/// Reads `size` bytes at `offset` into `dst`; throws CorruptData when the file is shorter, IoError otherwise.
void read_exact(int fd, void* dst, uint64_t size, uint64_t offset, const std::string& path);
/// A byte range of a file to read into memory (`dst` not owned).
struct ReadRange {
  void* dst;
  uint64_t size;
  uint64_t offset;
};
/// Reads every range on up to `threads` threads (ranges are split into pieces of a few MiB, so that one
/// large tensor is read by all of them). Throws like read_exact (the first error of any thread).
void read_ranges(int fd, const std::vector<ReadRange>& ranges, int threads, const std::string& path);
/// What read_small_file reads at most: a manifest of thousands of ranks' chunk checksums is a few MiB.
inline constexpr uint64_t kMaxSmallFileBytes = uint64_t{256} << 20;
/// Reads a whole (small) file, never through a symbolic link at its last component (CorruptData for a
/// link, a non-regular file or one larger than `max_bytes`). Throws IoError otherwise.
std::string read_small_file(const std::string& path, uint64_t max_bytes = kMaxSmallFileBytes);

/// A file opened read-only; closed by its owner. Reading through it is immune to a rename or unlink of
/// the path afterwards (the open inode outlives its directory entry).
class ReadFile : public NamedFd {
 public:
  using NamedFd::NamedFd;
  /// Size from fstat. Throws IoError.
  uint64_t size() const;
  /// The whole file, or at most `max_bytes` + 1 of it (a caller that gets more than it allowed knows the
  /// file is too large without holding it: a hostile file may be huge or sparse). Throws IoError.
  std::string read_all(uint64_t max_bytes = kMaxSmallFileBytes) const;
};

// ---- building blocks of the other storage units (step files, directory layout, lock) --------------------

/// A descriptor closed by its owner (-1: none).
struct OwnedFd {
  int fd = -1;
  OwnedFd() = default;
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd();
};
/// IoError "<what> '<path>' failed: <strerror> (errno <err>)".
[[noreturn]] void throw_errno(const char* what, const std::string& path, int err);
/// Why the entry `name` of `dirfd`, which an O_NOFOLLOW open refused with `err`, is not what was asked for
/// (a symbolic link; not a directory); "" when it is neither (the caller reports `err` itself).
std::string refused_entry(int dirfd, const std::string& name, int err);
/// Opens the entry `name` of `dirfd` (AT_FDCWD: a path) for reading: never through a symbolic link at the
/// last component, and only a regular file (O_NONBLOCK: a FIFO planted under a step file's name cannot block
/// the open). CorruptData for a link or a non-regular file (`path` names it), IoError for other failures.
/// ENOENT is returned as -ENOENT when `missing_ok`.
int open_regular_or_throw(int dirfd, const std::string& name, const std::string& path, bool missing_ok);
/// The whole of the open file `fd`, at most `max_bytes` of it (CorruptData naming `path` beyond).
std::string read_bounded(int fd, const std::string& path, uint64_t max_bytes);
/// The names in the directory open as `dirfd` (its own descriptor is left open; "." and ".." left out).
/// Empty when it cannot be read: a listing is a snapshot that its callers take again later anyway.
std::vector<std::string> entry_names(int dirfd);
/// Whether the entry `name` of `dirfd` is gone (retired by the writer while it was being read).
bool entry_gone(int dirfd, const std::string& name);
/// Runs body(i) for i in [0, n) on up to `threads` threads (the calling thread is one of them); rethrows
/// the first exception after every thread has stopped. The others stop taking work once one has failed.
void run_parallel(size_t n, int threads, const std::function<void(size_t)>& body);
/// The size of the pieces parallel reads and buffered hashing go by. Why a few MiB: large enough that
/// pread's per-call cost vanishes, small enough that a 1 GiB tensor is spread over every thread and a
/// chunk's bytes are still in cache when they are hashed.
inline constexpr uint64_t kReadPiece = uint64_t{4} << 20;

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
