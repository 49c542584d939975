#include "checkpoint/storage.h"
#include "common/remove_tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <xxhash.h>
#if ETTKIT_XXH_DISPATCH
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <string_view>
#include <thread>

#include "common/logging.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/durable_file.h"
#include "ettkit/common/error.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace ettkit::checkpoint::detail {

namespace {
// Large writes go out in slices: the kernel caps one write(2) at ~2 GiB, a failing write's error stays
// close to the bytes it concerns, and each slice's writeback is started as soon as it is written.
constexpr size_t kWriteSlice = size_t{16} << 20;
// Writeback pipeline depth: the writer waits for the slice this many slices back, so at most
// kWritebackDepth * kWriteSlice bytes of this file are dirty at a time.
constexpr size_t kWritebackDepth = 4;

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// The same XXH3-64 either way; the dispatching entry points use the widest vector unit the CPU has.
#if ETTKIT_XXH_DISPATCH
inline XXH_errorcode xxh3_update(XXH3_state_t* s, const void* p, size_t n) {
  return XXH3_64bits_update_dispatch(s, p, n);
}
inline XXH64_hash_t xxh3_64(const void* p, size_t n) { return XXH3_64bits_dispatch(p, n); }
#else
inline XXH_errorcode xxh3_update(XXH3_state_t* s, const void* p, size_t n) { return XXH3_64bits_update(s, p, n); }
inline XXH64_hash_t xxh3_64(const void* p, size_t n) { return XXH3_64bits(p, n); }
#endif

struct Xxh3 {
  XXH3_state_t* s = XXH3_createState();
  Xxh3() { XXH3_64bits_reset(s); }
  ~Xxh3() { XXH3_freeState(s); }
  void update(const void* p, size_t n) { xxh3_update(s, p, n); }
  uint64_t digest() const { return XXH3_64bits_digest(s); }
};

[[noreturn]] void throw_errno(const char* what, const std::string& path, int err) {
  ETTKIT_THROW(IoError, what, " '", path, "' failed: ", std::strerror(err), " (errno ", err, ")");
}
}  // namespace

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string xxh3_of(const std::string& bytes) { return hex64(xxh3_64(bytes.data(), bytes.size())); }
std::string xxh3_of(const void* data, size_t size) { return hex64(xxh3_64(data, size)); }

ReadFile::~ReadFile() {
  if (fd_ >= 0) ::close(fd_);
}

ReadFile& ReadFile::operator=(ReadFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
  }
  return *this;
}

uint64_t ReadFile::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw_errno("stat of", path_, errno);
  return static_cast<uint64_t>(st.st_size);
}

std::string ReadFile::read_all(uint64_t max_bytes) const {
  std::string out;
  char buf[65536];
  for (uint64_t off = 0; off <= max_bytes;) {
    const uint64_t want = std::min<uint64_t>(sizeof buf, max_bytes + 1 - off);
    ssize_t n = ::pread(fd_, buf, static_cast<size_t>(want), static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("reading", path_, errno);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    off += static_cast<uint64_t>(n);
  }
  return out;
}

Dir::~Dir() {
  if (fd_ >= 0) ::close(fd_);
}

Dir& Dir::operator=(Dir&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    path_ = std::move(o.path_);
  }
  return *this;
}

Dir open_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw_errno("opening directory", path, errno);
  return Dir(fd, path);
}

namespace {
/// Why the entry `name` of `dirfd`, which an O_NOFOLLOW open refused with `err`, is not what was asked for
/// (O_DIRECTORY | O_NOFOLLOW answers ENOTDIR for a link, O_NOFOLLOW alone ELOOP); "" when it is none of
/// the refusals below (the caller reports `err` itself).
std::string refused_entry(int dirfd, const std::string& name, int err) {
  struct stat st {};
  if ((err == ENOTDIR || err == ELOOP || err == EMLINK) &&
      ::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    if (S_ISLNK(st.st_mode)) return "is a symbolic link (ettkit never follows one inside a checkpoint directory)";
    if (err == ENOTDIR) return "is not a directory";
  }
  return "";
}
}  // namespace

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
FileDigest write_durably(Fd& f, const std::string& path, const std::vector<ConstBuffer>& buffers);
}  // namespace

FileDigest write_file_durably(const std::string& path, const std::vector<ConstBuffer>& buffers, unsigned mode) {
  Fd f;
  f.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, static_cast<mode_t>(mode));
  if (f.fd < 0) throw_errno("creating checkpoint file", path, errno);
  return write_durably(f, path, buffers);
}

FileDigest write_file_durably(const Dir& dir, const std::string& name, const std::vector<ConstBuffer>& buffers,
                              unsigned mode) {
  const std::string path = dir.path_of(name);
  Fd f;
  f.fd = ::openat(dir.fd(), name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  static_cast<mode_t>(mode));
  if (f.fd < 0) throw_errno("creating checkpoint file", path, errno);
  return write_durably(f, path, buffers);
}

namespace {
/// The bytes into the new file `f` (closed here), hashed as they go, then fsync.
FileDigest write_durably(Fd& f, const std::string& path, const std::vector<ConstBuffer>& buffers) {
  Xxh3 h;
  Xxh3 chunk;  // the current kHashChunkBytes piece
  uint64_t chunk_left = kHashChunkBytes;
  FileDigest digest;
  digest.chunk_bytes = kHashChunkBytes;
  auto hash = [&](const char* p, size_t n) {
    h.update(p, n);
    while (n > 0) {
      size_t k = static_cast<size_t>(std::min<uint64_t>(n, chunk_left));
      chunk.update(p, k);
      p += k;
      n -= k;
      chunk_left -= k;
      if (chunk_left == 0) {
        digest.chunks.push_back(hex64(chunk.digest()));
        XXH3_64bits_reset(chunk.s);
        chunk_left = kHashChunkBytes;
      }
    }
  };
  uint64_t total = 0;
  // Why not plain write + one fsync: the kernel would start writeback only when dirty limits are hit,
  // and the final fsync would then wait for most of the file at once. Starting each slice's writeback
  // right after its write(2) keeps the disk busy while the next slice is hashed and copied into the
  // page cache, so write and writeback overlap and the closing fsync has little left to do. Waiting on
  // older slices bounds the dirty memory, and dropping their pages keeps a checkpoint (written once,
  // read only on restart) from evicting the training job's page cache. sync_file_range is only a hint
  // here: where the file system does not support it, the fsync below still makes the file durable.
  bool writeback = true;
  std::vector<std::pair<uint64_t, uint64_t>> inflight;  // slices whose writeback was started
  auto drain_oldest = [&] {
    auto [off, len] = inflight.front();
    inflight.erase(inflight.begin());
    if (writeback &&
        ::sync_file_range(f.fd, static_cast<off64_t>(off), static_cast<off64_t>(len),
                          SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) == 0) {
      ::posix_fadvise(f.fd, static_cast<off_t>(off), static_cast<off_t>(len), POSIX_FADV_DONTNEED);
    }
  };
  for (const ConstBuffer& b : buffers) {
    const char* p = static_cast<const char*>(b.data);
    size_t left = b.size;
    while (left > 0) {
      size_t n = std::min(left, kWriteSlice);
      hash(p, n);
      size_t done = 0;
      while (done < n) {
        ssize_t w = ::write(f.fd, p + done, n - done);
        if (w < 0) {
          if (errno == EINTR) continue;
          throw_errno("writing checkpoint file", path, errno);
        }
        if (w == 0) throw_errno("writing checkpoint file", path, ENOSPC);
        done += static_cast<size_t>(w);
      }
      if (writeback && n >= (size_t{1} << 20)) {
        if (::sync_file_range(f.fd, static_cast<off64_t>(total), static_cast<off64_t>(n), SYNC_FILE_RANGE_WRITE) == 0) {
          inflight.emplace_back(total, n);
          if (inflight.size() > kWritebackDepth) drain_oldest();
        } else {
          writeback = false;  // ENOSYS / EINVAL / ESPIPE: this file system does not take the hint
        }
      }
      p += n;
      left -= n;
      total += n;
    }
  }
  if (::fsync(f.fd) != 0) throw_errno("fsync of checkpoint file", path, errno);
  // After the fsync every page is clean: drop the rest of the file's pages from the cache as well.
  if (!inflight.empty()) ::posix_fadvise(f.fd, 0, 0, POSIX_FADV_DONTNEED);
  int fd = f.fd;
  f.fd = -1;
  if (::close(fd) != 0) throw_errno("closing checkpoint file", path, errno);
  if (chunk_left != kHashChunkBytes) digest.chunks.push_back(hex64(chunk.digest()));
  digest.size = total;
  digest.xxh3 = hex64(h.digest());
  return digest;
}
}  // namespace

std::string file_xxh3(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) throw_errno("opening", path, errno);
  return file_xxh3(ReadFile(fd, path));
}

std::string file_xxh3(const ReadFile& f) {
  Xxh3 h;
  std::unique_ptr<char[]> buf(new char[size_t{8} << 20]);
  for (uint64_t off = 0;;) {
    ssize_t n = ::pread(f.fd(), buf.get(), size_t{8} << 20, static_cast<off_t>(off));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("reading", f.path(), errno);
    }
    if (n == 0) break;
    h.update(buf.get(), static_cast<size_t>(n));
    off += static_cast<uint64_t>(n);
  }
  return hex64(h.digest());
}

void fsync_directory(const std::string& path) {
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (f.fd < 0) throw_errno("opening directory", path, errno);
  if (::fsync(f.fd) != 0) throw_errno("fsync of directory", path, errno);
}

void make_directories(const std::string& path) {
  std::error_code ec;
  fs::create_directories(path, ec);
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

namespace {
/// Runs body(i) for i in [0, n) on up to `threads` threads (the calling thread is one of them); rethrows
/// the first exception after every thread has stopped. The others stop taking work once one has failed.
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

// Why a few MiB: large enough that pread's per-call cost vanishes, small enough that a 1 GiB tensor is
// spread over every thread and a chunk's bytes are still in cache when they are hashed.
constexpr uint64_t kReadPiece = uint64_t{4} << 20;
}  // namespace

void read_ranges(int fd, const std::vector<ReadRange>& ranges, int threads, const std::string& path) {
  std::vector<ReadRange> pieces;
  for (const ReadRange& r : ranges) {
    for (uint64_t done = 0; done < r.size; done += kReadPiece) {
      pieces.push_back({static_cast<char*>(r.dst) + done, std::min(kReadPiece, r.size - done), r.offset + done});
    }
  }
  run_parallel(pieces.size(), threads, [&](size_t i) {
    read_exact(fd, pieces[i].dst, pieces[i].size, pieces[i].offset, path);
  });
}

void verify_file_chunks(const ReadFile& file, const FileDigest& digest, int threads) {
  std::vector<size_t> all(digest.chunks.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  verify_file_chunks(file, digest, threads, all);
}

void verify_file_chunks(const ReadFile& file, const FileDigest& digest, int threads, const std::vector<size_t>& which) {
  ETTKIT_EXPECTS(digest.chunk_bytes > 0 && !digest.chunks.empty(), "verify_file_chunks needs chunk checksums");
  for (size_t i : which) {
    ETTKIT_EXPECTS(i < digest.chunks.size(), "chunk ", i, " of '", file.path(), "': the manifest has ",
                   digest.chunks.size());
  }
  // MAP_POPULATE maps a chunk's cached pages in one call instead of one fault per few pages: verification
  // of 1 GiB in ext4's page cache went from 2.3x to 1.6-1.8x a memcpy of the same bytes. tmpfs (the memory
  // tier) is the exception, measured the other way (2.3x without, 2.8-3.2x with): its pages are populated
  // one by one in either case, and the up-front pass only adds one more walk over them.
  struct statfs sfs {};
  constexpr long kTmpfsMagic = 0x01021994;
  bool tmpfs = ::fstatfs(file.fd(), &sfs) == 0 && static_cast<long>(sfs.f_type) == kTmpfsMagic;
  const int populate = tmpfs ? 0 : MAP_POPULATE;
  run_parallel(which.size(), threads, [&](size_t k) {
    const size_t i = which[k];
    uint64_t begin = i * digest.chunk_bytes;
    uint64_t end = std::min(digest.size, begin + digest.chunk_bytes);
    std::string got;
    // Hashed where the page cache holds it (a mapping: no copy into a buffer, 3-4x faster than pread on
    // the CI machine); chunk offsets are multiples of chunk_bytes, so page-aligned. The file is a committed
    // step's, never written again; its size was checked against the manifest before this.
    void* map = end > begin ? ::mmap(nullptr, end - begin, PROT_READ, MAP_SHARED | populate, file.fd(),
                                     static_cast<off_t>(begin))
                            : MAP_FAILED;
    if (map != MAP_FAILED) {
      ::madvise(map, end - begin, MADV_SEQUENTIAL);
      got = hex64(xxh3_64(map, end - begin));
      ::munmap(map, end - begin);
    } else {
      // A file system without mmap: through a buffer.
      std::unique_ptr<char[]> buf(new char[kReadPiece]);
      Xxh3 h;
      for (uint64_t off = begin; off < end; off += kReadPiece) {
        uint64_t n = std::min(kReadPiece, end - off);
        read_exact(file.fd(), buf.get(), n, off, file.path());
        h.update(buf.get(), static_cast<size_t>(n));
      }
      got = hex64(h.digest());
    }
    ETTKIT_CHECK(got == digest.chunks[i], CorruptData, "'", file.path(), "' bytes [", begin, ", ", end,
                 ") have XXH3 ", got, "; the manifest says ", digest.chunks[i]);
  });
}

namespace {

// cachestat(2) (Linux 6.5): the page-cache state of a file range in one call. Not in Debian 12's headers;
// 451 on every architecture (the generic syscall table).
#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif
struct CachestatRange {
  uint64_t off;
  uint64_t len;
};
struct Cachestat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

/// Whether every page of [begin, end) of `fd` is in the page cache; nullopt when the kernel cannot say
/// through cachestat (older than 6.5, or seccomp refuses it).
std::optional<bool> resident_by_cachestat(int fd, uint64_t begin, uint64_t end, uint64_t page) {
  CachestatRange range{begin, end - begin};
  Cachestat cs{};
  if (::syscall(__NR_cachestat, fd, &range, &cs, 0) != 0) return std::nullopt;
  return cs.nr_cache >= (end - begin + page - 1) / page;
}

/// The same through mincore(2) on a mapping without MAP_POPULATE (it faults nothing in): one page-cache
/// lookup per page, about 20 ms per GiB here against well under 1 ms for cachestat.
bool resident_by_mincore(int fd, uint64_t begin, uint64_t end, uint64_t page, std::vector<unsigned char>& vec) {
  void* map = ::mmap(nullptr, end - begin, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(begin));
  if (map == MAP_FAILED) return false;
  vec.assign(static_cast<size_t>((end - begin + page - 1) / page), 0);
  bool resident = ::mincore(map, end - begin, vec.data()) == 0 &&
                  std::all_of(vec.begin(), vec.end(), [](unsigned char v) { return (v & 1) != 0; });
  ::munmap(map, end - begin);
  return resident;
}

}  // namespace

std::vector<size_t> nonresident_chunks(const ReadFile& file, const FileDigest& digest, bool use_cachestat) {
  std::vector<size_t> out;
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec;
  for (size_t i = 0; i < digest.chunks.size(); ++i) {
    uint64_t begin = i * digest.chunk_bytes;
    uint64_t end = std::min(digest.size, begin + digest.chunk_bytes);
    if (end <= begin) continue;
    std::optional<bool> resident;
    if (use_cachestat) {
      resident = resident_by_cachestat(file.fd(), begin, end, page);
      use_cachestat = resident.has_value();
    }
    if (!resident) resident = resident_by_mincore(file.fd(), begin, end, page, vec);
    if (!*resident) out.push_back(i);
  }
  return out;
}

namespace {
/// Opens the entry `name` of `dirfd` (AT_FDCWD: a path) for reading: never through a symbolic link at the
/// last component, and only a regular file (O_NONBLOCK: a FIFO planted under a step file's name cannot
/// block the open). Returns the descriptor, or -errno; -EINVAL for an entry that is not a regular file.
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

/// open_regular_at or the error: CorruptData for a link or a non-regular file (`path` names it), IoError
/// for other failures. ENOENT is returned as -ENOENT when `missing_ok`.
int open_regular_or_throw(int dirfd, const std::string& name, const std::string& path, bool missing_ok) {
  int fd = open_regular_at(dirfd, name.c_str());
  if (fd >= 0 || (fd == -ENOENT && missing_ok)) return fd;
  ETTKIT_CHECK(fd != -EINVAL, CorruptData, "'", path, "' is not a regular file");
  const std::string why = refused_entry(dirfd, name, -fd);
  ETTKIT_CHECK(why.empty(), CorruptData, "'", path, "' ", why);
  throw_errno("opening", path, -fd);
}

/// The whole of the open file `fd`, at most `max_bytes` of it (CorruptData naming `path` beyond).
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
}  // namespace

std::string read_small_file(const std::string& path, uint64_t max_bytes) {
  Fd f;
  f.fd = open_regular_or_throw(AT_FDCWD, path, path, /*missing_ok=*/false);
  return read_bounded(f.fd, path, max_bytes);
}

// ---- safetensors -------------------------------------------------------------------------------------

int safetensors_dtype_size(const std::string& d) {
  static const std::map<std::string, int> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I16", 2}, {"U16", 2},
      {"F16", 2},  {"BF16", 2}, {"I32", 4}, {"U32", 4},     {"F32", 4},     {"I64", 8}, {"U64", 8},
      {"F64", 8},  {"C64", 8}};
  auto it = sizes.find(d);
  return it == sizes.end() ? 0 : it->second;
}

std::string encode_safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                      const std::map<std::string, std::string>& metadata) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  for (const auto& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = h.dump();
  // The data section should start 8-byte aligned (the format's recommendation; readers mmap it).
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  return out;
}

SafetensorsIndex read_safetensors_index(const std::string& path, uint64_t size) {
  ETTKIT_CHECK(size >= 8, CorruptData, "safetensors file '", path, "' has ", size, " bytes; at least 8 needed");
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) throw_errno("opening", path, errno);
  ReadFile f(fd, path);
  ETTKIT_CHECK(f.size() == size, CorruptData, "safetensors file '", path, "' has ", f.size(), " bytes, not ", size);
  return read_safetensors_index(f);
}

namespace {

// Bounds of a safetensors header besides its byte size (safetensors' own cap).
constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;
// {"name": {"shape": [2, 3]}}: the format nests three containers deep, never more.
constexpr int kSafetensorsLayoutDepth = 3;

// One entry as the header states it, before its fields are checked against each other.
struct RawSafetensorsEntry {
  std::string name;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::vector<uint64_t> offsets;
  bool has_dtype = false, has_shape = false, has_offsets = false;
};

// Decodes a safetensors header with nlohmann's SAX interface straight into entries, checking the layout
// as each token arrives. A JSON tree costs ~40 bytes a value (a 20 MB header of nested arrays took
// 760 MB); this keeps only the entries, about the size of their text, and refuses the first token that
// does not belong to the format: a container nested deeper than the layout, a non-object entry, a
// non-string dtype or __metadata__ value, a non-integer dimension. Fields the format does not define are
// skipped (as safetensors does) when they hold scalars or an array of scalars.
class SafetensorsHeaderDecoder final : public nlohmann::json_sax<json> {
 public:
  std::vector<RawSafetensorsEntry>& entries() { return entries_; }
  std::map<std::string, std::string>& metadata() { return metadata_; }
  /// Why the header was refused.
  const std::string& error() const noexcept { return error_; }

  bool null() override { return other("null"); }
  bool boolean(bool) override { return other("a boolean"); }
  bool number_integer(number_integer_t) override { return other("a negative number"); }
  bool number_float(number_float_t, const string_t&) override { return other("a fractional number"); }
  bool binary(binary_t&) override { return other("binary data"); }

  bool number_unsigned(number_unsigned_t v) override {
    if (depth_ == 3 && field_ == Field::kShape) {
      entries_.back().shape.push_back(v);
      return true;
    }
    if (depth_ == 3 && field_ == Field::kOffsets && entries_.back().offsets.size() < 2) {
      entries_.back().offsets.push_back(v);
      return true;
    }
    return other("a number");
  }

  bool string(string_t& v) override {
    if (depth_ == 2 && in_metadata_) {
      metadata_[std::move(metadata_key_)] = std::move(v);
      return true;
    }
    if (depth_ == 2 && field_ == Field::kDtype) {
      entries_.back().dtype = std::move(v);
      return true;
    }
    return other("a string");
  }

  bool start_object(std::size_t) override {
    if (depth_ < 2) {  // the header, or an entry or __metadata__ in it
      ++depth_;
      return true;
    }
    return other("an object", true);
  }
  bool end_object() override {
    if (depth_ == 2 && !in_metadata_) {
      const auto& e = entries_.back();
      if (!e.has_dtype || !e.has_shape || !e.has_offsets || e.offsets.size() != 2) return fail_entry();
    }
    --depth_;
    return true;
  }

  bool start_array(std::size_t) override {
    if (depth_ == 2 && !in_metadata_ && field_ != Field::kDtype) {  // shape, data_offsets or an unknown field
      ++depth_;
      return true;
    }
    return other("an array", true);
  }
  bool end_array() override {
    --depth_;
    return true;
  }

  bool key(string_t& k) override {
    if (depth_ == 1) {
      in_metadata_ = k == "__metadata__";
      if (!in_metadata_) {
        entries_.emplace_back();
        entries_.back().name = std::move(k);
      }
      return true;
    }
    if (in_metadata_) {
      metadata_key_ = std::move(k);
      return true;
    }
    auto& e = entries_.back();
    bool* seen = nullptr;
    if (k == "dtype") {
      field_ = Field::kDtype;
      seen = &e.has_dtype;
    } else if (k == "shape") {
      field_ = Field::kShape;
      seen = &e.has_shape;
    } else if (k == "data_offsets") {
      field_ = Field::kOffsets;
      seen = &e.has_offsets;
    } else {
      field_ = Field::kOther;
      field_name_ = std::move(k);
      return true;
    }
    if (*seen) return fail("entry '", e.name, "' has two '", k, "' fields");
    *seen = true;
    return true;
  }

  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    // nlohmann's text quotes the last token, which can be as long as the header: keep the start.
    return fail("invalid JSON: ", std::string_view(e.what()).substr(0, 240));
  }

 private:
  enum class Field : uint8_t { kDtype, kShape, kOffsets, kOther };

  template <typename... Parts>
  bool fail(Parts&&... parts) {
    if (error_.empty()) error_ = ettkit::detail::concat(std::forward<Parts>(parts)...);
    return false;
  }
  bool fail_entry() {
    return fail("entry '", entries_.back().name,
                "' lacks a string dtype, an array shape or two unsigned data_offsets");
  }

  // A value (or a container opening) that this position does not take, or one skipped there (what an
  // unknown field holds).
  bool other(const char* what, bool container = false) {
    if (depth_ == 0) return fail("the header is ", what, ", not a JSON object");
    if (in_metadata_) return fail("'__metadata__' must map strings to strings (the format's rule)");
    const std::string& name = entries_.back().name;
    if (depth_ == 1) return fail("entry '", name, "' is ", what, ", not an object");
    if (container && depth_ == kSafetensorsLayoutDepth) {
      return fail("entry '", name, "' nests ", what, " deeper than the format's ", kSafetensorsLayoutDepth,
                  " levels");
    }
    if (field_ == Field::kOther) {
      if (!container) return true;
      return fail("entry '", name, "' has ", what, " in field '", field_name_, "', which the format does not define");
    }
    if (field_ == Field::kShape) return fail("entry '", name, "' has a bad shape (", what, ")");
    return fail_entry();
  }

  std::vector<RawSafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
  std::string metadata_key_;
  int depth_ = 0;  // containers open at the current token
  bool in_metadata_ = false;
  Field field_ = Field::kOther;
  std::string field_name_;  // the current unknown field, for messages
  std::string error_;
};

}  // namespace

SafetensorsIndex read_safetensors_index(const ReadFile& file) {
  const std::string& path = file.path();
  const uint64_t size = file.size();
  ETTKIT_CHECK(size >= 8, CorruptData, "safetensors file '", path, "' has ", size, " bytes; at least 8 needed");
  unsigned char len_bytes[8];
  read_exact(file.fd(), len_bytes, 8, 0, path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  ETTKIT_CHECK(n <= size - 8 && n <= kMaxSafetensorsHeaderBytes, CorruptData, "safetensors file '", path,
               "' declares a header of ", n, " bytes but the file has ", size, " bytes (the format's limit is ",
               kMaxSafetensorsHeaderBytes, ")");
  std::string text(n, '\0');
  read_exact(file.fd(), text.data(), n, 8, path);
  // Decoded token by token against the format's layout (SafetensorsHeaderDecoder): no JSON tree, and no
  // typed nlohmann getter that could throw its own exception or silently convert a value.
  SafetensorsHeaderDecoder decoder;
  if (!json::sax_parse(text, &decoder)) {
    ETTKIT_THROW(CorruptData, "safetensors file '", path, "' has a malformed header: ",
                 decoder.error().empty() ? std::string("the header is not a JSON object") : decoder.error());
  }
  SafetensorsIndex idx;
  idx.data_offset = 8 + n;
  idx.data_size = size - idx.data_offset;
  idx.metadata = std::move(decoder.metadata());
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto& raw : decoder.entries()) {
    SafetensorsEntry e;
    e.name = std::move(raw.name);
    e.dtype = std::move(raw.dtype);
    int es = safetensors_dtype_size(e.dtype);
    ETTKIT_CHECK(es > 0, CorruptData, "safetensors file '", path, "': entry '", e.name, "' has unknown dtype '",
                 e.dtype, "'");
    uint64_t bytes = static_cast<uint64_t>(es);
    e.shape.reserve(raw.shape.size());
    for (uint64_t d : raw.shape) {
      // A dimension must fit int64 (torch sizes) and the byte count must not overflow: a product that wraps
      // would let a huge shape pass the size check below.
      bool dim_ok = d <= static_cast<uint64_t>(INT64_MAX) && !__builtin_mul_overflow(bytes, d, &bytes);
      ETTKIT_CHECK(dim_ok, CorruptData, "safetensors file '", path, "': entry '", e.name, "' has a bad shape (",
                   "dimension ", d, " overflows)");
      e.shape.push_back(static_cast<int64_t>(d));
    }
    e.begin = raw.offsets[0];
    e.end = raw.offsets[1];
    ETTKIT_CHECK(e.begin <= e.end && e.end <= idx.data_size && e.end - e.begin == bytes, CorruptData,
                 "safetensors file '", path, "': entry '", e.name, "' has data_offsets [", e.begin, ", ", e.end,
                 "] inconsistent with its shape or the data size ", idx.data_size);
    ranges.emplace_back(e.begin, e.end);
    std::string name = e.name;
    ETTKIT_CHECK(idx.tensors.emplace(name, std::move(e)).second, CorruptData, "safetensors file '", path,
                 "' has entry '", name, "' twice");
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    ETTKIT_CHECK(ranges[i].first >= ranges[i - 1].second, CorruptData, "safetensors file '", path,
                 "' has overlapping tensors");
  }
  return idx;
}

// ---- manifest ----------------------------------------------------------------------------------------

std::string encode_manifest(const Manifest& m) {
  json j;
  j["format"] = "ettkit-checkpoint";
  j["version"] = 1;
  j["step"] = m.step;
  j["world_size"] = m.world_size;
  j["created_unix_us"] = m.created_unix_us;
  j["commit_seq"] = m.commit_seq;
  j["torch_version"] = m.torch_version;
  json files = json::object();
  for (const auto& [name, d] : m.files) {
    json f = {{"size", d.size}, {"xxh3", d.xxh3}};
    if (!d.chunks.empty()) {
      f["chunk_bytes"] = d.chunk_bytes;
      f["chunks"] = d.chunks;
    }
    files[name] = std::move(f);
  }
  j["files"] = files;
  j["metadata"] = m.metadata;
  return j.dump(2) + "\n";
}

namespace {
/// Typed, range-checked reads of manifest fields: a wrong type or an out-of-range value is CorruptData
/// naming the file and the field, never a JSON-library exception or a silent conversion (a float step, a
/// version that wraps to 1 in an int).
struct ManifestReader {
  const json& j;
  const std::string& source;

  [[noreturn]] void bad(const std::string& field, const json& v, const char* want) const {
    std::string shown = v.dump();
    if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
    ETTKIT_THROW(CorruptData, "manifest '", source, "': field '", field, "' is ", shown, "; expected ", want);
  }
  /// `field` inside `obj`; `path` is how the message names it (e.g. files.rank-0.extra.size).
  const json* find(const json& obj, const std::string& field, bool required, const std::string& path = "") const {
    auto it = obj.find(field);
    if (it != obj.end()) return &*it;
    ETTKIT_CHECK(!required, CorruptData, "manifest '", source, "' lacks the field '", path.empty() ? field : path, "'");
    return nullptr;
  }
  int64_t integer(const json& v, const std::string& field, int64_t lo, int64_t hi) const {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (hi >= 0 && u <= static_cast<uint64_t>(hi) && static_cast<int64_t>(u) >= lo) return static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      int64_t x = v.get<int64_t>();
      if (x >= lo && x <= hi) return x;
    } else {
      bad(field, v, "an integer");
    }
    bad(field, v, ettkit::detail::concat("an integer in [", lo, ", ", hi, "]").c_str());
  }
  uint64_t unsigned_integer(const json& v, const std::string& field) const {
    if (!v.is_number_unsigned()) bad(field, v, "a non-negative integer");
    return v.get<uint64_t>();
  }
  std::string string(const json& v, const std::string& field) const {
    if (!v.is_string()) bad(field, v, "a string");
    return v.get<std::string>();
  }
};

bool is_xxh3_hex(const std::string& s) {
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
  return s.size() == 16 && std::all_of(s.begin(), s.end(), hex);
}
}  // namespace

Manifest decode_manifest(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  ETTKIT_CHECK(j.is_object(), CorruptData, "manifest '", source, "' is not a JSON object");
  ManifestReader r{j, source};
  const json& format = *r.find(j, "format", true);
  if (!format.is_string() || format.get<std::string>() != "ettkit-checkpoint") {
    r.bad("format", format, "\"ettkit-checkpoint\"");
  }
  const json& version = *r.find(j, "version", true);
  if (!version.is_number_integer()) r.bad("version", version, "an integer");
  bool newer = version.is_number_unsigned() ? version.get<uint64_t>() > 1 : version.get<int64_t>() > 1;
  ETTKIT_CHECK(!newer, Unsupported, "manifest '", source, "' has version ", version.dump(),
               "; this ettkit reads version 1");
  if (version.get<int64_t>() != 1) r.bad("version", version, "1");
  Manifest m;
  m.step = r.integer(*r.find(j, "step", true), "step", 0, kMaxStep);
  m.world_size = static_cast<int>(r.integer(*r.find(j, "world_size", true), "world_size", 1, INT_MAX));
  if (const json* v = r.find(j, "created_unix_us", false)) {
    m.created_unix_us = r.integer(*v, "created_unix_us", 0, INT64_MAX);
  }
  if (const json* v = r.find(j, "commit_seq", false)) m.commit_seq = r.unsigned_integer(*v, "commit_seq");
  if (const json* v = r.find(j, "torch_version", false)) m.torch_version = r.string(*v, "torch_version");
  const json& files = *r.find(j, "files", true);
  if (!files.is_object()) r.bad("files", files, "an object mapping file names to {size, xxh3}");
  for (auto it = files.begin(); it != files.end(); ++it) {
    // A file name is opened inside the step directory: a path in it would reach outside.
    if (!is_plain_file_name(it.key())) r.bad("files", json(it.key()), "file names without '/' (not '.' or '..')");
    std::string field = "files." + it.key();
    const json& f = it.value();
    if (!f.is_object()) r.bad(field, f, "an object {size, xxh3}");
    FileDigest d;
    d.size = r.unsigned_integer(*r.find(f, "size", true, field + ".size"), field + ".size");
    d.xxh3 = r.string(*r.find(f, "xxh3", true, field + ".xxh3"), field + ".xxh3");
    if (!is_xxh3_hex(d.xxh3)) r.bad(field + ".xxh3", f["xxh3"], "16 lowercase hex digits");
    // Chunk checksums (optional: older manifests have none). Their count must cover the size exactly, so
    // a hostile chunk_bytes cannot make a loader skip bytes or loop over chunks that do not exist.
    if (const json* cb = r.find(f, "chunk_bytes", false)) {
      d.chunk_bytes = r.unsigned_integer(*cb, field + ".chunk_bytes");
      if (d.chunk_bytes < (uint64_t{1} << 20)) r.bad(field + ".chunk_bytes", *cb, "an integer >= 1048576");
      const json& chunks = *r.find(f, "chunks", true, field + ".chunks");
      uint64_t want = d.size / d.chunk_bytes + (d.size % d.chunk_bytes != 0);
      if (!chunks.is_array() || chunks.size() != want) {
        r.bad(field + ".chunks", chunks,
              ettkit::detail::concat("an array of ", want, " checksums (size / chunk_bytes, rounded up)").c_str());
      }
      for (const json& c : chunks) {
        if (!c.is_string() || !is_xxh3_hex(c.get<std::string>())) {
          r.bad(field + ".chunks", c, "16 lowercase hex digits per chunk");
        }
        d.chunks.push_back(c.get<std::string>());
      }
    } else if (f.contains("chunks")) {
      r.bad(field + ".chunk_bytes", json(nullptr), "an integer >= 1048576 beside 'chunks'");
    }
    m.files[it.key()] = std::move(d);
  }
  if (const json* meta = r.find(j, "metadata", false)) {
    if (!meta->is_object()) r.bad("metadata", *meta, "an object of strings");
    for (auto it = meta->begin(); it != meta->end(); ++it) {
      m.metadata[it.key()] = r.string(it.value(), "metadata." + it.key());
    }
  }
  return m;
}

// ---- identifiers --------------------------------------------------------------------------------------

namespace {
bool is_lower_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }

/// At most 80 bytes of an untrusted value, quoted, control bytes and quotes escaped: a message quotes what
/// was refused without carrying a megabyte of it, or a newline that forges a log line.
std::string shown(std::string_view v) {
  std::string out = "'";
  for (size_t i = 0; i < v.size() && i < 80; ++i) {
    const auto c = static_cast<unsigned char>(v[i]);
    if (c < 0x20 || c == 0x7f || c == '\\' || c == '\'') {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\x%02x", c);
      out += esc;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (v.size() > 80) out += "...";
  return out + "' (" + std::to_string(v.size()) + " bytes)";
}
}  // namespace

bool is_run_id(std::string_view s) { return s.size() == 16 && std::all_of(s.begin(), s.end(), is_lower_hex); }

const std::string& checked_run_id(const std::string& id, const std::string& source) {
  ETTKIT_CHECK(is_run_id(id), CorruptData, source, " holds the run id ", shown(id),
               "; a run id is 16 lowercase hex digits (what the checkpointer's random_id() makes)");
  return id;
}

bool is_plain_file_name(std::string_view name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find_first_of(std::string_view("/\0", 2)) == std::string_view::npos;
}

std::string manifest_run_id(const Manifest& m, const std::string& source) {
  auto it = m.metadata.find("ettkit.run_id");
  ETTKIT_CHECK(it != m.metadata.end(), CorruptData, source, " has no ettkit.run_id in its metadata");
  return checked_run_id(it->second, source + "'s metadata 'ettkit.run_id'");
}

void check_file_digest(const FileDigest& d, const std::string& where) {
  auto hex16 = [](const std::string& h) { return h.size() == 16 && std::all_of(h.begin(), h.end(), is_lower_hex); };
  ETTKIT_CHECK(hex16(d.xxh3), CorruptData, where, ": xxh3 ", shown(d.xxh3), " is not 16 lowercase hex digits");
  if (d.chunks.empty() && d.chunk_bytes == 0) return;
  ETTKIT_CHECK(d.chunk_bytes >= (uint64_t{1} << 20), CorruptData, where, ": chunk_bytes=", d.chunk_bytes,
               " must be >= 1048576");
  const uint64_t want = d.size / d.chunk_bytes + (d.size % d.chunk_bytes != 0);
  ETTKIT_CHECK(d.chunks.size() == want, CorruptData, where, ": ", d.chunks.size(), " chunk checksums for ", d.size,
               " bytes in chunks of ", d.chunk_bytes, "; ", want, " expected");
  for (const std::string& c : d.chunks) {
    ETTKIT_CHECK(hex16(c), CorruptData, where, ": chunk checksum ", shown(c), " is not 16 lowercase hex digits");
  }
}

std::vector<int64_t> decode_step_list(const std::string& text, const std::string& source) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  ETTKIT_CHECK(j.is_array(), CorruptData, source, " is ", shown(text), ", not a JSON array of step numbers");
  std::vector<int64_t> steps;
  steps.reserve(j.size());
  for (const json& v : j) {
    const bool ok = v.is_number_unsigned() && v.get<uint64_t>() <= static_cast<uint64_t>(kMaxStep);
    ETTKIT_CHECK(ok, CorruptData, source, " holds ", shown(v.dump()), "; a step is an integer in [0, ", kMaxStep, "]");
    steps.push_back(v.get<int64_t>());
  }
  return steps;
}

// ---- layout ------------------------------------------------------------------------------------------

std::string step_dir_name(int64_t step) {
  ETTKIT_EXPECTS(is_step(step), "step ", step, " cannot name a step directory: it must be in [0, ", kMaxStep, "]");
  return "step-" + std::to_string(step);
}

std::string temp_dir_name(int64_t step, const std::string& run_id) {
  ETTKIT_EXPECTS(is_step(step), "step ", step, " cannot name a temporary directory: it must be in [0, ", kMaxStep, "]");
  ETTKIT_EXPECTS(is_run_id(run_id), "run id ", shown(run_id), " cannot name a temporary directory: a run id is 16 "
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
/// The names in the directory open as `dirfd` (its own descriptor is left open; "." and ".." left out).
/// Empty when it cannot be read: a listing is a snapshot that its callers take again later anyway.
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

/// Whether the entry `name` of `dirfd` is gone (retired by the writer while it was being read).
bool entry_gone(int dirfd, const std::string& name) {
  struct stat st {};
  return ::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT;
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
    StepEntry e;
    e.name = n;
    e.step = canonical_step(n);
    // lstat: an entry is judged as what it is, never as what a link names (a link is never followed, so it
    // is never a step: a co-tenant's link to another directory must not make that directory look committed).
    struct stat st {};
    if (::fstatat(parent.fd(), n.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // vanished since the listing
    e.directory = S_ISDIR(st.st_mode);
    if (S_ISLNK(st.st_mode)) {
      e.problem = "a symbolic link (never followed: a step is a directory of the checkpoint directory itself)";
    } else if (!e.directory) {
      e.problem = "not a directory";
    }
    if (e.step < 0 && e.problem.empty()) {
      e.problem = "not a step directory name this checkpointer writes (step-<N>, N without leading zeros, N < 10^18)";
    }
    if (e.problem.empty()) {
      const std::string mpath = dir + "/" + n + "/manifest.json";
      try {
        std::optional<Dir> step_dir = open_subdirectory(parent, n);
        if (!step_dir) continue;  // retired while being listed
        Fd m;
        m.fd = open_regular_or_throw(step_dir->fd(), "manifest.json", mpath, /*missing_ok=*/true);
        if (m.fd < 0) {
          if (entry_gone(parent.fd(), n)) continue;  // retired while being listed
          e.problem = "it has no manifest.json (never committed)";
        } else {
          Manifest man = decode_manifest(read_bounded(m.fd, mpath, kMaxSmallFileBytes), mpath);
          ETTKIT_CHECK(man.step == e.step, CorruptData, "manifest '", mpath, "' says step ", man.step);
          e.committed = true;
          e.commit_seq = man.commit_seq;
          e.created_unix_us = man.created_unix_us;
        }
      } catch (const Error& x) {
        if (entry_gone(parent.fd(), n)) continue;
        e.problem = x.message();
      }
    }
    (e.committed ? out.committed : out.others).push_back(std::move(e));
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
std::mutex g_hook_mu;
std::function<void(int64_t)> g_before_open_step;
}  // namespace

void set_before_open_step_hook(std::function<void(int64_t step)> hook) {
  std::lock_guard<std::mutex> lk(g_hook_mu);
  g_before_open_step = std::move(hook);
}

void run_before_open_step_hook(int64_t step) {
  std::function<void(int64_t)> hook;
  {
    std::lock_guard<std::mutex> lk(g_hook_mu);
    hook = g_before_open_step;
  }
  if (hook) hook(step);
}

std::optional<OpenedStep> open_step(const std::string& dir, int64_t step, int rank) {
  OpenedStep out;
  const std::string name = step_dir_name(step);
  out.path = dir + "/" + name;
  const int top = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (top < 0) {
    if (errno == ENOENT) return std::nullopt;
    throw_errno("opening directory", dir, errno);
  }
  const Dir parent(top, dir);
  // Never through a link: the step directory and its files are what this directory holds, or refused as
  // corrupt (load_latest then falls back to the next step).
  std::optional<Dir> d = open_subdirectory(parent, name);
  if (!d) return std::nullopt;
  const int dfd = d->fd();
  struct stat opened {};
  if (::fstat(dfd, &opened) != 0) throw_errno("stat of", out.path, errno);
  // A file missing from a directory that is no longer at its path (renamed to .trash-*, deleted) was
  // retired under us; missing from the directory still in place, the step is damaged.
  auto moved_away = [&] {
    struct stat now {};
    return ::fstatat(parent.fd(), name.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0 || now.st_ino != opened.st_ino ||
           now.st_dev != opened.st_dev;
  };
  bool vanished = false;
  auto open_in = [&](const std::string& file) -> ReadFile {
    std::string path = out.path + "/" + file;
    int fd = open_regular_or_throw(dfd, file, path, /*missing_ok=*/true);
    if (fd >= 0) return ReadFile(fd, path);
    if (moved_away()) {
      vanished = true;
      return ReadFile();
    }
    ETTKIT_THROW(CorruptData, "'", path, "' is missing");
  };
  ReadFile manifest = open_in("manifest.json");
  if (vanished) return std::nullopt;
  out.manifest_path = manifest.path();
  out.manifest = decode_manifest(read_bounded(manifest.fd(), out.manifest_path, kMaxSmallFileBytes), out.manifest_path);
  ETTKIT_CHECK(out.manifest.step == step, CorruptData, "manifest '", out.manifest_path, "' says step ",
               out.manifest.step);
  std::string base = "rank-" + std::to_string(rank);
  out.data = open_in(base + ".safetensors");
  if (vanished) return std::nullopt;
  out.extra = open_in(base + ".extra");
  if (vanished) return std::nullopt;
  return out;
}

const FileDigest& listed_digest(const OpenedStep& step, const ReadFile& file) {
  std::string name = file.path().substr(step.path.size() + 1);
  auto it = step.manifest.files.find(name);
  ETTKIT_CHECK(it != step.manifest.files.end(), CorruptData, "manifest '", step.manifest_path, "' lists no '", name,
               "'");
  uint64_t size = file.size();
  ETTKIT_CHECK(size == it->second.size, CorruptData, "'", file.path(), "' has ", size, " bytes; the manifest says ",
               it->second.size);
  return it->second;
}

std::string read_checked_extra(const OpenedStep& step, bool verify) {
  const FileDigest& d = listed_digest(step, step.extra);
  ETTKIT_CHECK(d.size <= kMaxExtraBytes, CorruptData, "'", step.extra.path(), "' is listed with ", d.size,
               " bytes; extra bytes are at most ", kMaxExtraBytes, " (256 MiB)");
  std::string bytes = step.extra.read_all(d.size);
  ETTKIT_CHECK(bytes.size() == d.size, CorruptData, "'", step.extra.path(), "' changed size while being read");
  if (verify) {
    std::string h = xxh3_of(bytes);
    ETTKIT_CHECK(h == d.xxh3, CorruptData, "'", step.extra.path(), "' has XXH3 ", h, "; the manifest says ", d.xxh3);
  }
  return bytes;
}

std::optional<std::string> check_step_files(const OpenedStep& step, bool verify, int threads,
                                            const std::function<bool()>& stop) {
  const FileDigest& d = listed_digest(step, step.data);
  if (verify && !d.chunks.empty()) {
    if (!stop) {
      // Chunk by chunk on several threads; it names the bad byte range itself. Every chunk matching is the
      // whole file matching: the writer hashed both from the same bytes.
      verify_file_chunks(step.data, d, threads);
    } else {
      // A group of chunks per round, so that a stop waits for at most one group.
      const size_t group = static_cast<size_t>(std::max(1, threads));
      for (size_t first = 0; first < d.chunks.size(); first += group) {
        if (stop()) return std::nullopt;
        std::vector<size_t> which(std::min(group, d.chunks.size() - first));
        std::iota(which.begin(), which.end(), first);
        verify_file_chunks(step.data, d, threads, which);
      }
    }
  } else if (verify) {
    std::string h = file_xxh3(step.data);  // a manifest from before chunk checksums
    ETTKIT_CHECK(h == d.xxh3, CorruptData, "'", step.data.path(), "' has XXH3 ", h, "; the manifest says ", d.xxh3);
  }
  if (stop && stop()) return std::nullopt;
  return read_checked_extra(step, verify);
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
  std::vector<std::string> retired;
  if (keep_last <= 0) return retired;
  StepListing l = list_steps(dir);
  for (const StepEntry& e : l.others) {
    if (std::find(warned_.begin(), warned_.end(), e.name) != warned_.end()) continue;
    warned_.push_back(e.name);
    ETTKIT_LOG_WARN("checkpoint retention: leaving '", e.name, "' in '", dir, "' alone (not counted, never deleted): ",
                    e.problem);
  }
  int kept = 0;
  for (const StepEntry& e : l.committed) {
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

// ---- directory lock ----------------------------------------------------------------------------------

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

std::string random_id() {
  static thread_local std::mt19937_64 gen{std::random_device{}() ^ (static_cast<uint64_t>(::getpid()) << 32)};
  return hex64(gen());
}

}  // namespace ettkit::checkpoint::detail
