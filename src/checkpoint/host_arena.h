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
  bool busy = false;  // guarded by Stager::Impl::mu

  /// Allocates `bytes` (at least 1): cudaHostAlloc when `pin`, else an anonymous mapping. InvalidArgument
  /// when `pin` without CUDA; IoError (or CudaError) when the memory is not there.
  void allocate(size_t bytes, bool pin);
  void free() noexcept;
};

}  // namespace ettkit::checkpoint::detail
