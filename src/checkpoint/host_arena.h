#pragma once
// The stager's host memory: one exact-size arena per buffer (pinned with CUDA, mmap otherwise).
#include <cstddef>
#include <cstdint>

namespace ettkit::checkpoint::detail {

/// One host allocation, exact size (rounded to pages), pinned or plain. Owned by Stager::Impl, which frees
/// it explicitly (free() is idempotent; the struct is a plain value so that a vector of them can be
/// reassigned under the stager's mutex).
struct Arena {
  uint8_t* ptr = nullptr;
  size_t size = 0;
  bool pinned = false;
  bool busy = false;       // guarded by Stager::Impl::mu
  bool populated = false;  // every page is backed (pinned, populate(), or a save's copies wrote it)

  /// Allocates `bytes` (at least 1): cudaHostAlloc when `pin`, else an anonymous mapping. InvalidArgument
  /// when `pin` without CUDA; IoError (or CudaError) when the memory is not there.
  void allocate(size_t bytes, bool pin);
  /// Backs every page now (the kernel allocates and zeroes them), so that the first copy into the arena
  /// takes no page fault: MADV_POPULATE_WRITE, or one write per page where the kernel lacks it (< 5.14).
  /// Pinned memory is resident already. IoError when the kernel cannot back the pages (out of memory).
  void populate();
  void free() noexcept;
};

}  // namespace ettkit::checkpoint::detail
