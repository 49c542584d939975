#pragma once
// InOrderDigest: XXH3 digests of bytes that several threads write out of order (the stager's copies into an
// arena), hashed by the writing threads right after they write, while the bytes are still in the CPU's
// cache. Why: a save's passes over its bytes after staging (the chunk checksums of its data file, and on the
// disk tier each whole tensor's digest) cost 0.56-0.97x a memcpy of them each; fused with the copy, about
// 0.2x (checkpoint_hash_bench, docs/benchmarks.md). One XXH3 stream cannot be split, so each segment is
// hashed in order: a piece that arrives before the ones in front of it waits, and is hashed by the thread
// that fills the gap (or by finish). Two shapes of segments:
// - for_file(): the chunks of a file that is `head` bytes of header and then the arena's bytes, the header
//   coming only at the end (finish_file): the FileDigest the file's manifest entry carries;
// - for_tensors(): one segment per given byte range of the arena (a whole tensor's), for header_of().
// Torch-free.
//
// Ownership: borrows the arena (the caller keeps it alive and unchanged after reporting its bytes);
// covered() is thread-safe; a finish once, after every covered() has returned. A digest is made once per plan
// and arena and serves save after save (reuse()): a finish leaves every segment as new, so that the next
// save's caller thread does nothing per segment (made per save, 20,001 segments with a mutex and a map each
// were about 0.7 ms of that thread's save at 20,001 tensors in perf, issue #65).
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checksums.h"

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// The chunk size of a file hashed by InOrderDigest: small enough that the copy engine's jobs, cut at chunk
/// boundaries, stay balanced across its threads for a state of a few tens of MiB; big enough that a GiB
/// makes 256 checksums in the manifest (about 5 KB).
inline constexpr uint64_t kInOrderChunkBytes = uint64_t{4} << 20;

/// The chunk size of a disk-tier data file hashed by its copies: a 64th of the file rounded up to a power of
/// two, between 4 MiB and kHashChunkBytes (32 MiB). Why: the first chunk holds the header, which is known
/// only after the copies (it records each tensor's digest), so that chunk is hashed afterwards from memory
/// that has left the cache; with 32 MiB chunks that was all of a 32 MiB state. A 64th bounds it, and rank 0's
/// manifest, which lists every rank's chunks, grows by at most 64 checksums a file (files of 2 GiB and more
/// keep 32 MiB chunks, as before).
uint64_t disk_chunk_bytes(uint64_t file_bytes);

class InOrderDigest {
 public:
  /// The chunks of a file of `head` header bytes followed by the `size` bytes at `data`, in chunks of
  /// `chunk_bytes` (>= 1 MiB) counted from the file's start. A chunk that holds header bytes is hashed by
  /// finish_file(), which is given them.
  static std::unique_ptr<InOrderDigest> for_file(const uint8_t* data, uint64_t head, uint64_t size,
                                                 uint64_t chunk_bytes = kInOrderChunkBytes);
  /// One digest per range [begin, end) of `data` (ascending, not overlapping; gaps are not hashed).
  static std::unique_ptr<InOrderDigest> for_tensors(const uint8_t* data,
                                                    const std::vector<std::pair<uint64_t, uint64_t>>& ranges);
  ~InOrderDigest();
  InOrderDigest(const InOrderDigest&) = delete;
  /// Makes the digest as new for another pass over the same bytes (the arena's next save). Costs nothing
  /// after a finish, which leaves each segment as new (and keeps its XXH3 state for the next pass); a digest
  /// that was not finished (a failed save) has every segment reset now. Not while anyone reports or finishes.
  void reuse();
  /// The bytes the digest reads (the arena it was made for).
  const uint8_t* data() const { return data_; }
  InOrderDigest& operator=(const InOrderDigest&) = delete;

  /// The `n` bytes at `p` (inside the arena) hold their final bytes from now on. With `hash_now`, this
  /// thread hashes every byte that thereby joins its segment's hashed prefix, unless another thread is
  /// hashing that segment (which then takes them too); without, the bytes only wait for a later call or the
  /// finish (a caller on the training thread, which must not pay for the hash). Reports must not overlap;
  /// bytes outside every segment are ignored.
  void covered(const uint8_t* p, size_t n, bool hash_now = true);
  /// for_file(): the file's digest, given its `head` header bytes. What no covered() hashed (the chunks
  /// that hold header bytes, the pieces that waited, the bytes nobody reported) is hashed now, in order,
  /// from the bytes as they are. Call once, when every byte is final and no covered() runs.
  FileDigest finish_file(const uint8_t* head, size_t head_bytes);
  /// for_tensors(): each range's XXH3-64 (hex), in the order given, finished the same way.
  std::vector<std::string> finish_tensors();

  /// for_file()'s chunk size and header length: chunk k starts at file offset k * chunk_bytes, which is
  /// arena offset k * chunk_bytes - head_bytes (where the copy engine cuts its jobs).
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  uint64_t head_bytes() const { return head_; }
  /// The arena offset of `p`.
  uint64_t offset_of(const uint8_t* p) const { return static_cast<uint64_t>(p - data_); }
  /// Bytes hashed by covered() so far (the rest is the finish's): what the fusion saved, for tests.
  uint64_t hashed_early() const { return hashed_early_.load(std::memory_order_relaxed); }

 private:
  struct Segment;
  InOrderDigest(const uint8_t* data, std::vector<std::pair<uint64_t, uint64_t>> ranges, std::vector<bool> blocked);
  void drain(Segment& s, std::unique_lock<std::mutex>& lk);
  /// Finishes segment `s` from the arena (after any header bytes the caller hashed into it).
  void finish_segment(Segment& s);
  /// Segment `s` as new, keeping its stream's state: after its digest was taken, or by reuse().
  static void recycle(Segment& s);

  const uint8_t* data_;
  uint64_t head_ = 0;
  uint64_t size_ = 0;
  uint64_t chunk_bytes_ = 0;  // for_file() only
  std::vector<uint64_t> begins_;  // each segment's first arena offset, ascending
  std::unique_ptr<Segment[]> segments_;
  size_t count_ = 0;
  std::atomic<uint64_t> hashed_early_{0};
  // Every segment as new (made, or finished since its last use): reuse() has nothing to reset. Written by a
  // finish and read by reuse(), which the stager orders through the arena's hand-off (its mutex).
  bool fresh_ = true;
};

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
