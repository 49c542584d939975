// The stager's host arenas (host_arena.h).
#include "checkpoint/host_arena.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

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

bool Arena::linked() const {
  struct stat st {};
  return fd >= 0 && ::fstat(fd, &st) == 0 && st.st_nlink > 1;
}

void Arena::populate() {
  if (!ptr || populated) return;
  if (!pinned) {
    if (::madvise(ptr, size, MADV_POPULATE_WRITE) != 0) {
      ETTKIT_CHECK(errno == EINVAL || errno == ENOSYS, IoError, "backing the pages of a ", size,
                   "-byte checkpoint arena failed: ", std::strerror(errno));
      const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
      volatile uint8_t* bytes = ptr;  // volatile: the writes are the point, the compiler may not drop them
      for (size_t off = 0; off < size; off += page) bytes[off] = 0;
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

}  // namespace ettkit::checkpoint::detail
