// The FileDigest of bytes written out of order (in_order_digest.h).
#include "checkpoint/in_order_digest.h"

#include <algorithm>
#include <string>

#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

/// One chunk's stream: `done` bytes from its start are hashed; `pending` holds reported ranges beyond them
/// (begin -> end, chunk-relative). `hashing`: a thread is hashing outside the lock, and takes what arrives.
struct InOrderDigest::Chunk {
  std::mutex mu;
  Xxh3Stream stream;
  uint64_t done = 0;
  bool hashing = false;
  std::map<uint64_t, uint64_t> pending;
};

InOrderDigest::InOrderDigest(const uint8_t* file, uint64_t size, uint64_t chunk_bytes)
    : file_(file), size_(size), chunk_bytes_(chunk_bytes) {
  ETTKIT_EXPECTS(chunk_bytes >= (uint64_t{1} << 20), "chunk_bytes=", chunk_bytes, " must be >= 1048576");
  count_ = static_cast<size_t>(size / chunk_bytes + (size % chunk_bytes != 0));
  chunks_ = std::make_unique<Chunk[]>(count_);
}

InOrderDigest::~InOrderDigest() = default;

void InOrderDigest::covered(uint64_t begin, uint64_t end, bool hash_now) {
  end = std::min(end, size_);
  while (begin < end) {
    const size_t k = static_cast<size_t>(begin / chunk_bytes_);
    const uint64_t base = k * chunk_bytes_;
    const uint64_t stop = std::min(end, base + chunk_bytes_);
    Chunk& c = chunks_[k];
    std::unique_lock<std::mutex> lk(c.mu);
    c.pending.emplace(begin - base, stop - base);
    if (hash_now) drain(k, c, lk);
    begin = stop;
  }
}

void InOrderDigest::drain(size_t k, Chunk& c, std::unique_lock<std::mutex>& lk) {
  // One hashing thread per chunk: the others leave their ranges in `pending` for it.
  if (c.hashing) return;
  for (;;) {
    uint64_t until = c.done;
    while (!c.pending.empty() && c.pending.begin()->first <= until) {
      until = std::max(until, c.pending.begin()->second);
      c.pending.erase(c.pending.begin());
    }
    if (until == c.done) return;
    c.hashing = true;
    const uint64_t from = c.done;
    lk.unlock();
    c.stream.update(file_ + k * chunk_bytes_ + from, static_cast<size_t>(until - from));
    hashed_early_.fetch_add(until - from, std::memory_order_relaxed);
    lk.lock();
    c.done = until;
    c.hashing = false;
  }
}

FileDigest InOrderDigest::finish() {
  FileDigest d;
  d.size = size_;
  d.chunk_bytes = chunk_bytes_;
  d.chunks.reserve(count_);
  for (size_t k = 0; k < count_; ++k) {
    Chunk& c = chunks_[k];
    std::lock_guard<std::mutex> lk(c.mu);
    ETTKIT_EXPECTS(!c.hashing, "InOrderDigest::finish() while chunk ", k, " is being hashed");
    const uint64_t len = std::min(chunk_bytes_, size_ - k * chunk_bytes_);
    // The rest of the chunk from the bytes as they are now: what waited, and what nobody reported.
    if (c.done < len) c.stream.update(file_ + k * chunk_bytes_ + c.done, static_cast<size_t>(len - c.done));
    c.done = len;
    c.pending.clear();
    d.chunks.push_back(hex64(c.stream.digest()));
  }
  set_file_xxh3(d, xxh3_of(nullptr, 0));
  return d;
}

}  // namespace ettkit::checkpoint::detail
