// The gather kernel (cuda_gather.h).
#include "checkpoint/cuda_gather.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "common/cuda_check.h"

namespace ettkit::checkpoint::detail {

namespace {

constexpr int kThreads = 256;

/// The bytes [0, n) of `src` to `dst` by the block's threads in words of W bytes (both aligned to W), the
/// tail byte by byte. Consecutive threads write consecutive words: a warp's stores to the arena coalesce
/// into full lines on the link.
template <class Word>
__device__ void copy_words(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t n) {
  const int64_t words = n / static_cast<int64_t>(sizeof(Word));
  const auto* s = reinterpret_cast<const Word*>(src);
  auto* d = reinterpret_cast<Word*>(dst);
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
  for (int64_t i = words * static_cast<int64_t>(sizeof(Word)) + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void gather_kernel(const int64_t* __restrict__ table, int64_t pieces) {
  for (int64_t p = blockIdx.x; p < pieces; p += gridDim.x) {
    const auto* src = reinterpret_cast<const uint8_t*>(table[3 * p]);
    auto* dst = reinterpret_cast<uint8_t*>(table[3 * p + 1]);
    const int64_t n = table[3 * p + 2];
    // The arena packs tensors back to back, so a destination is often aligned to its dtype only.
    const uintptr_t both = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
    if ((both & 15) == 0) {
      copy_words<uint4>(src, dst, n);
    } else if ((both & 7) == 0) {
      copy_words<uint2>(src, dst, n);
    } else if ((both & 3) == 0) {
      copy_words<uint32_t>(src, dst, n);
    } else if ((both & 1) == 0) {
      copy_words<uint16_t>(src, dst, n);
    } else {
      copy_words<uint8_t>(src, dst, n);
    }
  }
}

}  // namespace

void launch_gather(const int64_t* device_table, int64_t pieces, void* stream) {
  if (pieces <= 0) return;
  // One block per piece up to a grid far beyond what the GPU holds at once; the loop covers the rest.
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(pieces, int64_t{1} << 20));
  gather_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(device_table, pieces);
  ETTKIT_CUDA_CHECK(cudaGetLastError(), "launching the checkpoint gather kernel for ", pieces, " pieces");
}

}  // namespace ettkit::checkpoint::detail
