// Checksums of files on disk (file_checksums.h).
#include "checkpoint/file_checksums.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <optional>

#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

std::string file_xxh3(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) throw_errno("opening", path, errno);
  return file_xxh3(ReadFile(fd, path));
}

std::string file_xxh3(const ReadFile& f) {
  Xxh3Stream h;
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

void verify_file_chunks(const ReadFile& file, const FileDigest& digest, int threads) {
  std::vector<size_t> all(digest.chunks.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  verify_file_chunks(file, digest, threads, all);
}

namespace {

/// XXH3 (hex) of [begin, end) of `file`, hashed where the page cache holds it (a mapping: no copy into a
/// buffer, 3-4x faster than pread on the CI machine); chunk offsets are multiples of chunk_bytes, so
/// page-aligned. The file is a committed step's, never written again; its size was checked against the
/// manifest before this. `populate`: MAP_POPULATE or 0.
std::string chunk_xxh3(const ReadFile& file, uint64_t begin, uint64_t end, int populate) {
  void* map = end > begin ? ::mmap(nullptr, end - begin, PROT_READ, MAP_SHARED | populate, file.fd(),
                                   static_cast<off_t>(begin))
                          : MAP_FAILED;
  if (map != MAP_FAILED) {
    ::madvise(map, end - begin, MADV_SEQUENTIAL);
    std::string got = hex64(xxh3_64_of(map, end - begin));
    ::munmap(map, end - begin);
    return got;
  }
  // A file system without mmap: through a buffer.
  std::unique_ptr<char[]> buf(new char[kReadPiece]);
  Xxh3Stream h;
  for (uint64_t off = begin; off < end; off += kReadPiece) {
    uint64_t n = std::min(kReadPiece, end - off);
    read_exact(file.fd(), buf.get(), n, off, file.path());
    h.update(buf.get(), static_cast<size_t>(n));
  }
  return hex64(h.digest());
}

}  // namespace

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
    const std::string got = chunk_xxh3(file, begin, end, populate);
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

}  // namespace ettkit::checkpoint::detail
