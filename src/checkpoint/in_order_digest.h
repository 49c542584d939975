#pragma once
// InOrderDigest: the FileDigest of a file whose bytes are written out of order by several threads (the
// stager's copies into a memory-tier arena), hashed by the writing threads right after they write, while
// the bytes are still in the CPU's cache. Why: a memory-tier save's only other pass over its bytes was the
// writer's hash after staging, 0.56-0.97x a memcpy of them; fused with the copy it costs about 0.2x
// (checkpoint_hash_bench, docs/benchmarks.md). One XXH3 stream cannot be split, so each chunk is hashed in
// order: a piece that arrives before the ones in front of it waits, and is hashed by the thread that fills
// the gap (or by finish()). Torch-free.
//
// Ownership: borrows the file's bytes (a mapping the caller keeps alive and does not change after reporting
// them); thread-safe for covered(); finish() once, after every covered() has returned.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "checkpoint/checksums.h"

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// The chunk size of a file hashed by InOrderDigest: small enough that the copy engine's jobs, cut at chunk
/// boundaries, stay balanced across its threads for a state of a few tens of MiB; big enough that a GiB
/// makes 256 checksums in the manifest (about 5 KB).
inline constexpr uint64_t kInOrderChunkBytes = uint64_t{4} << 20;

class InOrderDigest {
 public:
  /// The digest of `size` bytes at `file`, in chunks of `chunk_bytes` (>= 1 MiB).
  InOrderDigest(const uint8_t* file, uint64_t size, uint64_t chunk_bytes = kInOrderChunkBytes);
  ~InOrderDigest();
  InOrderDigest(const InOrderDigest&) = delete;
  InOrderDigest& operator=(const InOrderDigest&) = delete;

  /// [begin, end) of the file holds its final bytes from now on. With `hash_now`, this thread hashes every
  /// byte that thereby joins its chunk's hashed prefix, unless another thread is hashing that chunk (which
  /// then takes them too); without, the range only waits for a later call or finish() (a caller on the
  /// training thread, which must not pay for the hash). Ranges must not overlap; out of the file: ignored
  /// beyond its end.
  void covered(uint64_t begin, uint64_t end, bool hash_now = true);
  /// The same for `n` bytes at `p`, an address inside the file.
  void covered(const uint8_t* p, size_t n, bool hash_now = true) {
    covered(static_cast<uint64_t>(p - file_), static_cast<uint64_t>(p - file_) + n, hash_now);
  }
  /// The file's digest: whatever no covered() hashed (the ranges nobody reported, such as a header written
  /// afterwards, and the pieces that waited) is hashed now, in order, from the bytes as they are. Call once,
  /// when every byte is final and no covered() runs.
  FileDigest finish();

  uint64_t chunk_bytes() const { return chunk_bytes_; }
  /// The file offset of `p`, an address inside the file.
  uint64_t offset_of(const uint8_t* p) const { return static_cast<uint64_t>(p - file_); }
  /// Bytes hashed by covered() so far (the rest is finish()'s): what the fusion saved, for tests.
  uint64_t hashed_early() const { return hashed_early_.load(std::memory_order_relaxed); }

 private:
  struct Chunk;
  void drain(size_t k, Chunk& c, std::unique_lock<std::mutex>& lk);

  const uint8_t* file_;
  uint64_t size_;
  uint64_t chunk_bytes_;
  std::unique_ptr<Chunk[]> chunks_;
  size_t count_;
  std::atomic<uint64_t> hashed_early_{0};
};

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
