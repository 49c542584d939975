// XXH3 checksums of bytes in memory and the FileDigest of a file's bytes (checksums.h).
#include "checkpoint/checksums.h"

#include <xxhash.h>
#if ETTKIT_XXH_DISPATCH
#include <xxh_x86dispatch.h>
#endif

#include <algorithm>
#include <cstdio>
#include <string>

#include "checkpoint/identifiers.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

namespace {
// The same XXH3-64 either way; the dispatching entry points use the widest vector unit the CPU has.
#if ETTKIT_XXH_DISPATCH
inline XXH_errorcode xxh3_update(XXH3_state_t* s, const void* p, size_t n) {
  return XXH3_64bits_update_dispatch(s, p, n);
}
inline XXH64_hash_t xxh3_64(const void* p, size_t n) { return XXH3_64bits_dispatch(p, n); }
#else
inline XXH_errorcode xxh3_update(XXH3_state_t* s, const void* p, size_t n) { return XXH3_64bits_update(s, p, n); }
inline XXH64_hash_t xxh3_64(const void* p, size_t n) { return XXH3_64bits(p, n); }
#endif
}  // namespace

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool is_hex64(std::string_view s) {
  auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); };
  return s.size() == 16 && std::all_of(s.begin(), s.end(), hex);
}

uint64_t xxh3_64_of(const void* data, size_t size) { return xxh3_64(data, size); }
std::string xxh3_of(const std::string& bytes) { return hex64(xxh3_64(bytes.data(), bytes.size())); }
std::string xxh3_of(const void* data, size_t size) { return hex64(xxh3_64(data, size)); }

struct Xxh3Stream::State {
  XXH3_state_t* s = XXH3_createState();
  ~State() { XXH3_freeState(s); }
};

Xxh3Stream::Xxh3Stream() : state_(std::make_unique<State>()) { XXH3_64bits_reset(state_->s); }
Xxh3Stream::~Xxh3Stream() = default;
Xxh3Stream::Xxh3Stream(Xxh3Stream&&) noexcept = default;
Xxh3Stream& Xxh3Stream::operator=(Xxh3Stream&&) noexcept = default;
void Xxh3Stream::update(const void* data, size_t size) { xxh3_update(state_->s, data, size); }
uint64_t Xxh3Stream::digest() const { return XXH3_64bits_digest(state_->s); }
void Xxh3Stream::reset() { XXH3_64bits_reset(state_->s); }

FileDigestBuilder::FileDigestBuilder(uint64_t chunk_bytes) : chunk_left_(chunk_bytes) {
  ETTKIT_EXPECTS(chunk_bytes >= (uint64_t{1} << 20), "chunk_bytes=", chunk_bytes, " must be >= 1048576");
  digest_.chunk_bytes = chunk_bytes;
}

void FileDigestBuilder::update(const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  digest_.size += size;
  while (size > 0) {
    const size_t k = static_cast<size_t>(std::min<uint64_t>(size, chunk_left_));
    chunk_.update(p, k);
    p += k;
    size -= k;
    chunk_left_ -= k;
    if (chunk_left_ == 0) {
      digest_.chunks.push_back(hex64(chunk_.digest()));
      chunk_.reset();
      chunk_left_ = digest_.chunk_bytes;
    }
  }
}

FileDigest FileDigestBuilder::finish() {
  if (chunk_left_ != digest_.chunk_bytes) digest_.chunks.push_back(hex64(chunk_.digest()));
  set_file_xxh3(digest_, hex64(chunk_.digest()));
  return std::move(digest_);
}

void set_file_xxh3(FileDigest& digest, const std::string& empty_file_hash) {
  if (digest.chunks.size() <= 1) {
    // One chunk: its hash is the whole file's (an empty file: the hash of nothing).
    digest.xxh3 = digest.chunks.empty() ? empty_file_hash : digest.chunks.front();
  } else {
    digest.xxh3 = xxh3_of_chunks(digest.size, digest.chunks);
  }
}

std::string xxh3_of_chunks(uint64_t size, const std::vector<std::string>& chunks) {
  std::string bytes;
  bytes.reserve(8 * (chunks.size() + 1));
  auto put = [&bytes](uint64_t v) {
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  put(size);
  for (const std::string& c : chunks) put(std::stoull(c, nullptr, 16));
  return xxh3_of(bytes);
}

void check_file_digest(const FileDigest& d, const std::string& where) {
  ETTKIT_CHECK(is_hex64(d.xxh3), CorruptData, where, ": xxh3 ", shown_untrusted(d.xxh3),
               " is not 16 lowercase hex digits");
  if (d.chunks.empty() && d.chunk_bytes == 0) return;
  ETTKIT_CHECK(d.chunk_bytes >= (uint64_t{1} << 20), CorruptData, where, ": chunk_bytes=", d.chunk_bytes,
               " must be >= 1048576");
  const uint64_t want = d.size / d.chunk_bytes + (d.size % d.chunk_bytes != 0);
  ETTKIT_CHECK(d.chunks.size() == want, CorruptData, where, ": ", d.chunks.size(), " chunk checksums for ", d.size,
               " bytes in chunks of ", d.chunk_bytes, "; ", want, " expected");
  for (const std::string& c : d.chunks) {
    ETTKIT_CHECK(is_hex64(c), CorruptData, where, ": chunk checksum ", shown_untrusted(c),
                 " is not 16 lowercase hex digits");
  }
}

}  // namespace ettkit::checkpoint::detail
