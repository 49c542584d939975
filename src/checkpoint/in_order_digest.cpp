// XXH3 digests of bytes written out of order (in_order_digest.h).
#include "checkpoint/in_order_digest.h"

#include <algorithm>
#include <optional>

#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

/// One segment's stream over arena bytes [begin, end): `done` bytes from `begin` are hashed, `ready` bytes from
/// `begin` are reported (ready >= done: [done, ready) waits for a hashing thread); `pending` holds reported
/// ranges beyond `ready` (arena offsets, begin -> end). Bytes reported in order (a tensor's one piece, the
/// next piece of a chunk) only move `ready`: no map node per report. `hashing`: a thread is hashing outside
/// the lock, and takes what arrives meanwhile. `blocked`: header bytes come first, at the finish; nothing is
/// hashed before. The stream's state (an aligned allocation of xxhash's) is made at the segment's first hash,
/// not with the digest, and kept for the next pass (reuse()).
struct InOrderDigest::Segment {
  std::mutex mu;
  std::optional<Xxh3Stream> lazy_stream;
  Xxh3Stream& stream() {
    if (!lazy_stream) lazy_stream.emplace();
    return *lazy_stream;
  }
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t done = 0;
  uint64_t ready = 0;
  bool hashing = false;
  bool blocked = false;
  std::map<uint64_t, uint64_t> pending;
};

uint64_t disk_chunk_bytes(uint64_t file_bytes) {
  uint64_t chunk = kInOrderChunkBytes;
  while (chunk < kHashChunkBytes && chunk * 64 < file_bytes) chunk *= 2;
  return chunk;
}

InOrderDigest::InOrderDigest(const uint8_t* data, std::vector<std::pair<uint64_t, uint64_t>> ranges,
                             std::vector<bool> blocked)
    : data_(data), count_(ranges.size()) {
  segments_ = std::make_unique<Segment[]>(count_);
  begins_.reserve(count_);
  for (size_t i = 0; i < count_; ++i) {
    ETTKIT_EXPECTS(ranges[i].first <= ranges[i].second && (i == 0 || ranges[i - 1].second <= ranges[i].first),
                   "InOrderDigest: range ", i, " [", ranges[i].first, ", ", ranges[i].second,
                   ") is reversed or overlaps the one before");
    segments_[i].begin = ranges[i].first;
    segments_[i].end = ranges[i].second;
    segments_[i].blocked = blocked[i];
    begins_.push_back(ranges[i].first);
  }
}

InOrderDigest::~InOrderDigest() = default;

std::unique_ptr<InOrderDigest> InOrderDigest::for_file(const uint8_t* data, uint64_t head, uint64_t size,
                                                       uint64_t chunk_bytes) {
  ETTKIT_EXPECTS(chunk_bytes >= (uint64_t{1} << 20), "chunk_bytes=", chunk_bytes, " must be >= 1048576");
  const uint64_t file = head + size;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::vector<bool> blocked;
  for (uint64_t at = 0; at < file; at += chunk_bytes) {
    const uint64_t stop = std::min(file, at + chunk_bytes);
    // In arena offsets: the chunk's bytes after the header.
    ranges.emplace_back(std::max(at, head) - head, std::max(stop, head) - head);
    blocked.push_back(at < head);
  }
  std::unique_ptr<InOrderDigest> d(new InOrderDigest(data, std::move(ranges), std::move(blocked)));
  d->head_ = head;
  d->size_ = size;
  d->chunk_bytes_ = chunk_bytes;
  return d;
}

std::unique_ptr<InOrderDigest> InOrderDigest::for_tensors(const uint8_t* data,
                                                          const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  return std::unique_ptr<InOrderDigest>(new InOrderDigest(data, ranges, std::vector<bool>(ranges.size(), false)));
}

void InOrderDigest::reuse() {
  if (!fresh_) {
    for (size_t k = 0; k < count_; ++k) {
      std::lock_guard<std::mutex> lk(segments_[k].mu);
      recycle(segments_[k]);
    }
  }
  fresh_ = false;
  hashed_early_.store(0, std::memory_order_relaxed);
}

void InOrderDigest::recycle(Segment& s) {
  if (s.lazy_stream) s.lazy_stream->reset();
  s.done = 0;
  s.ready = 0;
  s.hashing = false;
  s.pending.clear();
}

void InOrderDigest::covered(const uint8_t* p, size_t n, bool hash_now) {
  uint64_t begin = offset_of(p);
  const uint64_t end = begin + n;
  // The first segment that may hold `begin`: the last one starting at or before it.
  size_t k = static_cast<size_t>(std::upper_bound(begins_.begin(), begins_.end(), begin) - begins_.begin());
  k = k == 0 ? 0 : k - 1;
  for (; k < count_ && begin < end; ++k) {
    Segment& s = segments_[k];
    if (s.end <= begin) continue;  // a gap, or an empty segment
    if (s.begin >= end) break;
    const uint64_t from = std::max(begin, s.begin);
    const uint64_t stop = std::min(end, s.end);
    if (from < stop) {
      std::unique_lock<std::mutex> lk(s.mu);
      if (from == s.begin + s.ready) {
        // In order: the reported prefix grows, and takes the pending ranges it now reaches.
        uint64_t until = stop;
        while (!s.pending.empty() && s.pending.begin()->first <= until) {
          until = std::max(until, s.pending.begin()->second);
          s.pending.erase(s.pending.begin());
        }
        s.ready = until - s.begin;
      } else {
        s.pending.emplace(from, stop);
      }
      if (hash_now) drain(s, lk);
    }
    begin = stop;
  }
}

void InOrderDigest::drain(Segment& s, std::unique_lock<std::mutex>& lk) {
  // One hashing thread per segment: the others extend `ready` (or leave their ranges in `pending`) for it.
  if (s.hashing || s.blocked) return;
  while (s.done < s.ready) {
    const uint64_t from = s.begin + s.done;
    const uint64_t until = s.begin + s.ready;
    s.hashing = true;
    lk.unlock();
    s.stream().update(data_ + from, static_cast<size_t>(until - from));
    hashed_early_.fetch_add(until - from, std::memory_order_relaxed);
    lk.lock();
    s.done = until - s.begin;
    s.hashing = false;
  }
}

void InOrderDigest::finish_segment(Segment& s) {
  std::lock_guard<std::mutex> lk(s.mu);
  ETTKIT_EXPECTS(!s.hashing, "InOrderDigest finished while a segment is being hashed");
  // The rest of the segment from the bytes as they are now: what waited, and what nobody reported.
  const uint64_t from = s.begin + s.done;
  if (from < s.end) s.stream().update(data_ + from, static_cast<size_t>(s.end - from));
  s.done = s.end - s.begin;
  s.ready = s.done;
  s.pending.clear();
}

FileDigest InOrderDigest::finish_file(const uint8_t* head, size_t head_bytes) {
  ETTKIT_EXPECTS(chunk_bytes_ > 0, "finish_file() of a digest made by for_tensors()");
  ETTKIT_EXPECTS(head_bytes == head_, "finish_file(): ", head_bytes, " header bytes given, ", head_, " planned");
  FileDigest d;
  d.size = head_ + size_;
  d.chunk_bytes = chunk_bytes_;
  d.chunks.reserve(count_);
  for (size_t k = 0; k < count_; ++k) {
    Segment& s = segments_[k];
    if (s.blocked) {
      // Nothing of it was hashed: the header's part of the chunk first, then its arena bytes.
      const uint64_t at = k * chunk_bytes_;
      s.stream().update(head + at, static_cast<size_t>(std::min(head_, at + chunk_bytes_) - at));
    }
    finish_segment(s);
    d.chunks.push_back(hex64(s.stream().digest()));
    recycle(s);
  }
  fresh_ = true;
  set_file_xxh3(d, xxh3_of(nullptr, 0));
  return d;
}

std::vector<std::string> InOrderDigest::finish_tensors() {
  ETTKIT_EXPECTS(chunk_bytes_ == 0, "finish_tensors() of a digest made by for_file()");
  std::vector<std::string> out;
  out.reserve(count_);
  for (size_t k = 0; k < count_; ++k) {
    Segment& s = segments_[k];
    finish_segment(s);
    out.push_back(hex64(s.stream().digest()));
    recycle(s);  // as new for the arena's next save (reuse())
  }
  fresh_ = true;
  return out;
}

}  // namespace ettkit::checkpoint::detail
