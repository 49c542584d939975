// Torch-free file I/O of the checkpoint (file_io.h).
#include "checkpoint/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>

#include "common/logging.h"
#include "common/remove_tree.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

namespace {
// Large writes go out in slices: the kernel caps one write(2) at ~2 GiB, a failing write's error stays
// close to the bytes it concerns, and each slice's writeback is started as soon as it is written.
constexpr size_t kWriteSlice = size_t{16} << 20;
// Writeback pipeline depth: the writer waits for the slice this many slices back, so at most
// kWritebackDepth * kWriteSlice bytes of this file are dirty at a time.
constexpr size_t kWritebackDepth = 4;
}  // namespace

OwnedFd::~OwnedFd() {
  if (fd >= 0) ::close(fd);
}

void throw_errno(const char* what, const std::string& path, int err) {
  ETTKIT_THROW(IoError, what, " '", path, "' failed: ", std::strerror(err), " (errno ", err, ")");
}

NamedFd::~NamedFd() {
  if (fd_ >= 0) ::close(fd_);
}

NamedFd& NamedFd::operator=(NamedFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
  }
  return *this;
}

uint64_t ReadFile::size() const {
  struct stat st {};
  if (::fstat(fd(), &st) != 0) throw_errno("stat of", path(), errno);
  return static_cast<uint64_t>(st.st_size);
}

std::string ReadFile::read_all(uint64_t max_bytes) const {
  std::string out;
  char buf[65536];
  for (uint64_t off = 0; off <= max_bytes;) {
    const uint64_t want = std::min<uint64_t>(sizeof buf, max_bytes + 1 - off);
    ssize_t n = ::pread(fd(), buf, static_cast<size_t>(want), static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("reading", path(), errno);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    off += static_cast<uint64_t>(n);
  }
  return out;
}

Dir open_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_errno("opening directory", path, errno);
  return Dir(fd, path);
}

std::string refused_entry(int dirfd, const std::string& name, int err) {
  // O_DIRECTORY | O_NOFOLLOW answers ENOTDIR for a link, O_NOFOLLOW alone ELOOP.
  struct stat st {};
  if ((err == ENOTDIR || err == ELOOP || err == EMLINK) &&
      ::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (S_ISLNK(st.st_mode)) return "is a symbolic link (ettkit never follows one inside a checkpoint directory)";
    if (err == ENOTDIR) return "is not a directory";
  }
  return "";
}

std::optional<Dir> open_subdirectory(const Dir& parent, const std::string& name) {
  const std::string path = parent.path_of(name);
  int fd = ::openat(parent.fd(), name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd >= 0) return Dir(fd, path);
  const int err = errno;
  if (err == ENOENT) return std::nullopt;
  const std::string why = refused_entry(parent.fd(), name, err);
  ETTKIT_CHECK(why.empty(), CorruptData, "'", path, "' ", why);
  throw_errno("opening directory", path, err);
}

Dir make_subdirectory(const Dir& parent, const std::string& name, unsigned mode) {
  if (::mkdirat(parent.fd(), name.c_str(), static_cast<mode_t>(mode)) != 0 && errno != EEXIST) {
    throw_errno("creating directory", parent.path_of(name), errno);
  }
  std::optional<Dir> d = open_subdirectory(parent, name);
  // Removed between the mkdirat and the open: only a second writer of the same directory does that.
  ETTKIT_CHECK(d.has_value(), IoError, "directory '", parent.path_of(name), "' vanished right after it was created");
  return std::move(*d);
}

void fsync_directory(const Dir& dir) {
  if (::fsync(dir.fd()) != 0) throw_errno("fsync of directory", dir.path(), errno);
}

namespace {

/// Starts each written slice's writeback at once and waits for the slice kWritebackDepth back.
/// Why not plain write + one fsync: the kernel would start writeback only when dirty limits are hit, and the
/// final fsync would then wait for most of the file at once. Starting each slice's writeback right after its
/// write(2) keeps the disk busy while the next slice is hashed and copied into the page cache, so write and
/// writeback overlap and the closing fsync has little left to do. Waiting on older slices bounds the dirty
/// memory, and dropping their pages keeps a checkpoint (written once, read only on restart) from evicting the
/// training job's page cache. sync_file_range is only a hint here: where the file system does not support
/// it, the fsync still makes the file durable.
class WritebackPipeline {
 public:
  explicit WritebackPipeline(int fd) : fd_(fd) {}
  /// After [off, off + len) was written.
  void written(uint64_t off, size_t len) {
    if (!enabled_ || len < (size_t{1} << 20)) return;
    if (::sync_file_range(fd_, static_cast<off64_t>(off), static_cast<off64_t>(len), SYNC_FILE_RANGE_WRITE) != 0) {
      enabled_ = false;  // ENOSYS / EINVAL / ESPIPE: this file system does not take the hint
      return;
    }
    inflight_.emplace_back(off, len);
    if (inflight_.size() > kWritebackDepth) drain_oldest();
  }
  /// After the fsync every page is clean: drop the rest of the file's pages from the cache as well.
  void after_fsync() {
    if (!inflight_.empty()) ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);
  }

 private:
  void drain_oldest() {
    auto [off, len] = inflight_.front();
    inflight_.erase(inflight_.begin());
    if (::sync_file_range(fd_, static_cast<off64_t>(off), static_cast<off64_t>(len),
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) == 0) {
      ::posix_fadvise(fd_, static_cast<off_t>(off), static_cast<off_t>(len), POSIX_FADV_DONTNEED);
    }
  }

  int fd_;
  bool enabled_ = true;
  std::vector<std::pair<uint64_t, uint64_t>> inflight_;  // slices whose writeback was started
};

/// write(2) until all `n` bytes are out. Throws IoError naming `path`.
void write_all(int fd, const char* p, size_t n, const std::string& path) {
  for (size_t done = 0; done < n;) {
    ssize_t w = ::write(fd, p + done, n - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw_errno("writing checkpoint file", path, errno);
    }
    if (w == 0) throw_errno("writing checkpoint file", path, ENOSPC);
    done += static_cast<size_t>(w);
  }
}

/// The bytes into the new file `f` (closed here), hashed as they go (`hash`), then fsync.
FileDigest write_durably(OwnedFd& f, const std::string& path, const std::vector<ConstBuffer>& buffers,
                         bool hash = true) {
  FileDigestBuilder digest;
  WritebackPipeline writeback(f.fd);
  uint64_t total = 0;
  for (const ConstBuffer& b : buffers) {
    const char* p = static_cast<const char*>(b.data);
    for (size_t left = b.size; left > 0;) {
      const size_t n = std::min(left, kWriteSlice);
      if (hash) digest.update(p, n);
      write_all(f.fd, p, n, path);
      writeback.written(total, n);
      p += n;
      left -= n;
      total += n;
    }
  }
  if (::fsync(f.fd) != 0) throw_errno("fsync of checkpoint file", path, errno);
  writeback.after_fsync();
  const int fd = std::exchange(f.fd, -1);
  if (::close(fd) != 0) throw_errno("closing checkpoint file", path, errno);
  if (!hash) {
    FileDigest sized;
    sized.size = total;
    return sized;
  }
  return digest.finish();
}

}  // namespace

FileDigest write_file_durably(const std::string& path, const std::vector<ConstBuffer>& buffers, unsigned mode) {
  OwnedFd f;
  f.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, static_cast<mode_t>(mode));
  if (f.fd < 0) throw_errno("creating checkpoint file", path, errno);
  return write_durably(f, path, buffers);
}

namespace {
/// The new file `name` of `dir` for writing (openat, O_EXCL|O_NOFOLLOW: never an existing entry or a link).
void create_in(const Dir& dir, const std::string& name, unsigned mode, OwnedFd& f) {
  f.fd = ::openat(dir.fd(), name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  static_cast<mode_t>(mode));
  if (f.fd < 0) throw_errno("creating checkpoint file", dir.path_of(name), errno);
}
}  // namespace

FileDigest write_file_durably(const Dir& dir, const std::string& name, const std::vector<ConstBuffer>& buffers,
                              unsigned mode) {
  OwnedFd f;
  create_in(dir, name, mode, f);
  return write_durably(f, dir.path_of(name), buffers);
}

uint64_t write_file_durably_unhashed(const Dir& dir, const std::string& name, const std::vector<ConstBuffer>& buffers,
                                     unsigned mode) {
  OwnedFd f;
  create_in(dir, name, mode, f);
  return write_durably(f, dir.path_of(name), buffers, /*hash=*/false).size;
}

void fsync_directory(const std::string& path) {
  OwnedFd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (f.fd < 0) throw_errno("opening directory", path, errno);
  if (::fsync(f.fd) != 0) throw_errno("fsync of directory", path, errno);
}

void make_directories(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) ETTKIT_THROW(IoError, "creating directory '", path, "' failed: ", ec.message());
}

void remove_tree_quietly(const std::string& path) {
  // Not fs::remove_all: see common/remove_tree.h (torch 2.11's libtorch.so exports a broken copy of it).
  if (int err = ettkit::detail::remove_tree(path); err != 0) {
    ETTKIT_LOG_WARN("checkpoint: could not remove '", path, "': ", std::generic_category().message(err));
  }
}

std::optional<uint64_t> file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return static_cast<uint64_t>(st.st_size);
}

void read_exact(int fd, void* dst, uint64_t size, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(dst);
  while (size > 0) {
    ssize_t n = ::pread(fd, p, std::min<uint64_t>(size, kWriteSlice), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("reading", path, errno);
    }
    if (n == 0) ETTKIT_THROW(CorruptData, "checkpoint file '", path, "' ends early at byte ", offset);
    p += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

void run_parallel(size_t n, int threads, const std::function<void(size_t)>& body) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr first;
  std::mutex mu;
  auto work = [&] {
    for (size_t i; !failed.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;) {
      try {
        body(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu);
        if (!first) first = std::current_exception();
        failed = true;
      }
    }
  };
  size_t extra = std::min<size_t>(n, static_cast<size_t>(std::max(threads, 1))) - (n > 0 ? 1 : 0);
  std::vector<std::thread> pool;
  pool.reserve(extra);
  for (size_t t = 0; t < extra; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (first) std::rethrow_exception(first);
}

namespace {
/// Ranges shorter than this are read together with their neighbours in the file (read_ranges).
constexpr uint64_t kSmallRange = uint64_t{64} << 10;
/// The largest gap between two small ranges that one read spans (its bytes are read and dropped).
constexpr uint64_t kMaxGap = uint64_t{64} << 10;
}  // namespace

void read_ranges(int fd, const std::vector<ReadRange>& ranges, int threads, const std::string& path) {
  // A column-wise overlap is one short run per row (a few hundred bytes, between the other columns' bytes):
  // one pread each made a resharding load of 128 MiB of column shards spend its time in 262,144 system
  // calls, slower than dcp.load. Short ranges are therefore grouped with their neighbours in the file (gaps
  // of up to kMaxGap, spans of up to kReadPiece), each group read by one pread into a bounce buffer and
  // copied out. Long ranges are read straight into their destination, in pieces of kReadPiece.
  std::vector<ReadRange> pieces;
  std::vector<const ReadRange*> small;
  for (const ReadRange& r : ranges) {
    if (r.size < kSmallRange) {
      if (r.size > 0) small.push_back(&r);
      continue;
    }
    for (uint64_t done = 0; done < r.size; done += kReadPiece) {
      pieces.push_back({static_cast<char*>(r.dst) + done, std::min(kReadPiece, r.size - done), r.offset + done});
    }
  }
  std::sort(small.begin(), small.end(), [](const ReadRange* a, const ReadRange* b) { return a->offset < b->offset; });
  struct Group {
    size_t first, last;  // small[first, last)
    uint64_t begin, end;  // the file bytes read
  };
  std::vector<Group> groups;
  for (size_t i = 0; i < small.size(); ++i) {
    const ReadRange& r = *small[i];
    if (!groups.empty()) {
      Group& g = groups.back();
      const uint64_t end = std::max(g.end, r.offset + r.size);
      if (r.offset <= g.end + kMaxGap && end - g.begin <= kReadPiece) {
        g.last = i + 1;
        g.end = end;
        continue;
      }
    }
    groups.push_back({i, i + 1, r.offset, r.offset + r.size});
  }
  run_parallel(pieces.size() + groups.size(), threads, [&](size_t i) {
    if (i < pieces.size()) {
      read_exact(fd, pieces[i].dst, pieces[i].size, pieces[i].offset, path);
      return;
    }
    const Group& g = groups[i - pieces.size()];
    if (g.last - g.first == 1) {
      read_exact(fd, small[g.first]->dst, small[g.first]->size, small[g.first]->offset, path);
      return;
    }
    auto buf = std::make_unique_for_overwrite<char[]>(g.end - g.begin);  // every byte is read over
    read_exact(fd, buf.get(), g.end - g.begin, g.begin, path);
    for (size_t k = g.first; k < g.last; ++k) {
      std::memcpy(small[k]->dst, buf.get() + (small[k]->offset - g.begin), small[k]->size);
    }
  });
}

namespace {
/// open_regular_or_throw without the throw: the descriptor, or -errno; -EINVAL for an entry that is not a
/// regular file.
int open_regular_at(int dirfd, const char* name) {
  int fd = ::openat(dirfd, name, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return -errno;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return -EINVAL;
  }
  return fd;
}
}  // namespace

int open_regular_or_throw(int dirfd, const std::string& name, const std::string& path, bool missing_ok) {
  int fd = open_regular_at(dirfd, name.c_str());
  if (fd >= 0 || (fd == -ENOENT && missing_ok)) return fd;
  ETTKIT_CHECK(fd != -EINVAL, CorruptData, "'", path, "' is not a regular file");
  const std::string why = refused_entry(dirfd, name, -fd);
  ETTKIT_CHECK(why.empty(), CorruptData, "'", path, "' ", why);
  throw_errno("opening", path, -fd);
}

std::string read_bounded(int fd, const std::string& path, uint64_t max_bytes) {
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("reading", path, errno);
    }
    if (n == 0) break;
    ETTKIT_CHECK(out.size() + static_cast<uint64_t>(n) <= max_bytes, CorruptData, "'", path, "' is larger than ",
                 max_bytes, " bytes, the most ettkit reads of a file of its kind");
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::string read_small_file(const std::string& path, uint64_t max_bytes) {
  OwnedFd f;
  f.fd = open_regular_or_throw(AT_FDCWD, path, path, /*missing_ok=*/false);
  return read_bounded(f.fd, path, max_bytes);
}

std::vector<std::string> entry_names(int dirfd) {
  std::vector<std::string> names;
  const int fd = ::fcntl(dirfd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return names;
  DIR* d = ::fdopendir(fd);  // owns fd from here
  if (d == nullptr) {
    ::close(fd);
    return names;
  }
  ::rewinddir(d);  // the duplicate shares the original's position
  while (const dirent* e = ::readdir(d)) {
    std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(std::move(n));
  }
  ::closedir(d);
  return names;
}

bool entry_gone(int dirfd, const std::string& name) {
  struct stat st {};
  return ::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT;
}

}  // namespace ettkit::checkpoint::detail
