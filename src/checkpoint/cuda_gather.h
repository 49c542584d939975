#pragma once
// One kernel that copies many small device buffers into page-locked host memory (the stager's arena).
//
// Why: a cudaMemcpyAsync per tensor costs the host about 5 us and the copy engine about as much again per
// copy, whatever its size. The first GPU run (H200, docs/benchmarks.md "GPU") staged 256 MB in 20,001
// tensors at 3.7 GB/s against 54 GB/s for one copy of the same bytes, and save() blocked the host for 94 ms.
// A kernel that reads a table of (source, destination, bytes) and writes the arena through its mapped
// address moves all of them in one launch; the large tensors keep their copy-engine memcpy (no SMs used).
// Opt-in (StagerOptions::cuda_gather_max_bytes, default 0): on the H200 it staged 1.8x faster alone but
// blocked save() longer beside a training step, not yet explained.
//
// Compiled by nvcc in CUDA builds only; the header names no CUDA type so that C++ files may include it.
#include <cstdint>

namespace ettkit::checkpoint::detail {

/// The largest tensor StagerOptions::cuda_gather_max_bytes may send through the kernel (larger ones are one
/// cudaMemcpyAsync each: there the copy engine is at full speed and leaves the SMs to the training step).
inline constexpr int64_t kGatherMaxBytes = int64_t{1} << 20;
/// Each gathered tensor is cut into pieces of at most this many bytes, one thread block each.
inline constexpr int64_t kGatherPieceBytes = int64_t{64} << 10;

/// Queues the copies on `stream` (a cudaStream_t): `device_table` is 3 * `pieces` int64 in device memory,
/// (source device address, destination address the device can write, bytes) per piece, each at most
/// kGatherPieceBytes. Returns at once; the table must stay allocated until the kernel ran (stream order).
/// Throws CudaError when the launch fails.
void launch_gather(const int64_t* device_table, int64_t pieces, void* stream);

}  // namespace ettkit::checkpoint::detail
