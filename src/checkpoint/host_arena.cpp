// The stager's host arenas (host_arena.h).
#include "checkpoint/host_arena.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <string>

#include "ettkit/common/config.h"
#include "ettkit/common/error.h"

#if ETTKIT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "common/cuda_check.h"
#endif

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14 (older headers lack it; older kernels answer EINVAL)
#endif

namespace ettkit::checkpoint::detail {

namespace {
/// The crash tests' kill point (tests/python/test_checkpoint_spare_crash.py): with
/// ETTKIT_TEST_KILL_BACKING_FILE_ARENA=1 in the environment, the process kills itself (SIGKILL, nothing
/// flushed or removed) halfway through backing a memory-tier arena file: the moment a restart must cope with,
/// a sized, half-backed file that no step links, reached deterministically instead of by a timed kill.
bool kill_while_backing_file_arena() {
  static const bool on = [] {
    const char* v = std::getenv("ETTKIT_TEST_KILL_BACKING_FILE_ARENA");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}
}  // namespace

void Arena::allocate(size_t bytes, bool pin) {
  size = std::max<size_t>(bytes, 1);
  pinned = pin;
#if ETTKIT_WITH_CUDA
  if (pin) {
    void* p = nullptr;
    // cudaHostAlloc, not the CachingHostAllocator: exact size, no power-of-two rounding. Mapped: the gather
    // kernel writes small tensors into it directly (cuda_gather.h).
    ETTKIT_CUDA_CHECK(cudaHostAlloc(&p, size, cudaHostAllocPortable | cudaHostAllocMapped), "allocating a ", size,
                      "-byte pinned checkpoint arena (pin_memory=False stages into plain host memory)");
    ptr = static_cast<uint8_t*>(p);
    populated = true;  // page-locked: resident from the allocation on
    return;
  }
#else
  ETTKIT_EXPECTS(!pin, "pin_memory=1 needs ettkit built with CUDA");
#endif
  // mmap: page-aligned, returned to the OS on munmap (malloc might keep it and inflate RSS).
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ETTKIT_CHECK(p != MAP_FAILED, IoError, "mmap of a ", size, "-byte checkpoint arena failed: ", std::strerror(errno));
#ifdef MADV_HUGEPAGE
  ::madvise(p, size, MADV_HUGEPAGE);
#endif
  ptr = static_cast<uint8_t*>(p);
}

void Arena::allocate_file(const std::shared_ptr<ArenaFiles>& from, size_t bytes, size_t header_room, bool pin) {
  size = std::max<size_t>(bytes, 1);
  reserve = header_room;
  files = from;
  const size_t length = reserve + size;
  fd = files->create(length, file);
  void* p = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    free();
    ETTKIT_THROW(IoError, "mmap of the ", length, "-byte memory-tier arena '", file, "' failed: ", std::strerror(err));
  }
  map = static_cast<uint8_t*>(p);
  ptr = map + reserve;
#if ETTKIT_WITH_CUDA
  if (pin) {
    // Registered, not allocated: the pages are the memory tier's file. Mapped: the gather kernel writes small
    // tensors into it directly (cuda_gather.h). Registration backs every page.
    cudaError_t e = cudaHostRegister(map, length, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // registration failed: not a sticky error, clear it
      free();
      ETTKIT_THROW(IoError, "pinning the ", length, "-byte memory-tier arena '", file,
                   "' (cudaHostRegister) failed: ", cudaGetErrorString(e));
    }
    pinned = true;
    populated = true;
  }
#else
  ETTKIT_EXPECTS(!pin, "pin_memory=1 needs ettkit built with CUDA");
#endif
}

uint64_t Arena::links() const {
  struct stat st {};
  return fd >= 0 && ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_nlink) : 0;
}

void Arena::populate() {
  if (!ptr || populated) return;
  if (!pinned) {
    // In slices, each its own call: MADV_POPULATE_WRITE holds the process's mmap lock (read) while it
    // faults pages in, and a whole arena in one call held it for ~18 ms at a time, so every mmap, munmap or
    // brk of the training thread beside a prepare() in the background (a tensor, a malloc, a thread's
    // stack) waited that long (#65: mmap+munmap beside a 256 MiB tmpfs populate, median 18 ms in one call,
    // 0.24 ms in 256 KiB slices, at the same throughput).
    constexpr size_t kSlice = size_t{256} << 10;
    const bool kill_halfway = files && kill_while_backing_file_arena();
    for (size_t off = 0; off < size; off += kSlice) {
      if (kill_halfway && off >= size / 2) ::raise(SIGKILL);
      if (::madvise(ptr + off, std::min(kSlice, size - off), MADV_POPULATE_WRITE) == 0) continue;
      ETTKIT_CHECK(errno == EINVAL || errno == ENOSYS, IoError, "backing the pages of a ", size,
                   "-byte checkpoint arena failed: ", std::strerror(errno));
      const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
      volatile uint8_t* bytes = ptr;  // volatile: the writes are the point, the compiler may not drop them
      for (size_t at = off; at < size; at += page) bytes[at] = 0;
      break;
    }
  }
  populated = true;
}

void Arena::free() noexcept {
  if (fd >= 0 || map) {
#if ETTKIT_WITH_CUDA
    if (pinned && map) cudaHostUnregister(map);
#endif
    if (map) ::munmap(map, reserve + size);
    if (fd >= 0) ::close(fd);
    if (!file.empty() && files) files->remove(file);
    map = nullptr;
    ptr = nullptr;
    fd = -1;
    file.clear();
    return;
  }
  if (!ptr) return;
#if ETTKIT_WITH_CUDA
  if (pinned) {
    cudaFreeHost(ptr);
    ptr = nullptr;
    return;
  }
#endif
  ::munmap(ptr, size);
  ptr = nullptr;
}

int reclaim_candidate(const std::vector<Arena>& arenas) {
  int newest = -1;
  int oldest = -1;
  for (size_t i = 0; i < arenas.size(); ++i) {
    const Arena& a = arenas[i];
    if (a.busy || !a.published) continue;
    if (newest < 0 || a.published_seq > arenas[static_cast<size_t>(newest)].published_seq) newest = static_cast<int>(i);
    if (oldest < 0 || a.published_seq < arenas[static_cast<size_t>(oldest)].published_seq) oldest = static_cast<int>(i);
  }
  return oldest == newest ? -1 : oldest;
}

}  // namespace ettkit::checkpoint::detail
