#pragma once
// The checksum every checkpoint file carries: XXH3-64 of the whole file and of each kHashChunkBytes piece of
// it (FileDigest), computed from bytes in memory. Torch-free and file-system-free: what is hashed from files
// on disk is file_checksums.h.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// Size of the pieces a file's chunk checksums cover (the last piece may be shorter).
inline constexpr uint64_t kHashChunkBytes = uint64_t{32} << 20;

/// What a durably written file is: its size and its XXH3-64 checksum (lowercase hex, 16 digits), and the
/// XXH3-64 of each `chunk_bytes` piece of it in order (empty in manifests written before chunks existed).
/// Why both: the whole-file hash is what every earlier reader checks; the chunk hashes let a loader
/// verify the pieces on several threads (one XXH3 stream cannot be split), and name the bad byte range.
struct FileDigest {
  uint64_t size = 0;
  std::string xxh3;
  uint64_t chunk_bytes = 0;
  std::vector<std::string> chunks;
};

/// Checks a digest's fields against each other, as decode_manifest does for each file: xxh3 and chunk
/// checksums of 16 lowercase hex digits, chunk_bytes >= 1 MiB with exactly the chunks that cover `size`
/// (or no chunks at all). CorruptData naming `where` and the bad field.
void check_file_digest(const FileDigest& d, const std::string& where);

/// `v` as 16 lowercase hex digits (how every checksum and every run id is written).
std::string hex64(uint64_t v);
/// Whether `s` is what hex64 writes: exactly 16 lowercase hex digits.
bool is_hex64(std::string_view s);
/// XXH3-64 of bytes in memory (hex).
std::string xxh3_of(const std::string& bytes);
std::string xxh3_of(const void* data, size_t size);
/// XXH3-64 of bytes in memory (the number): the widest vector unit the CPU has, where libxxhash can pick it.
uint64_t xxh3_64_of(const void* data, size_t size);

/// An XXH3-64 over bytes that arrive in pieces. Move-only.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(Xxh3Stream&&) noexcept;
  Xxh3Stream& operator=(Xxh3Stream&&) noexcept;
  void update(const void* data, size_t size);
  uint64_t digest() const;
  void reset();

 private:
  struct State;  // the xxhash state: xxhash.h stays out of this header (the tests include it)
  std::unique_ptr<State> state_;
};

/// The FileDigest of bytes that arrive in order (what a durable write hashes as it writes): the whole-file
/// checksum and one per kHashChunkBytes piece.
class FileDigestBuilder {
 public:
  FileDigestBuilder();
  void update(const void* data, size_t size);
  /// The digest of everything given so far. Call once, at the end.
  FileDigest finish();

 private:
  Xxh3Stream whole_;
  Xxh3Stream chunk_;  // the current kHashChunkBytes piece
  uint64_t chunk_left_ = kHashChunkBytes;
  FileDigest digest_;
};

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
