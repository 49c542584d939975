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

/// What a durably written file is: its size, its checksum `xxh3` (lowercase hex, 16 digits), and the XXH3-64
/// of each `chunk_bytes` piece of it in order (empty in manifests written before chunks existed). The chunk
/// hashes are what a loader verifies: on several threads (one XXH3 stream cannot be split), naming the bad
/// byte range, and only the chunks a resharding read touches. `xxh3` is the XXH3-64 of the whole file when
/// it has at most one chunk (then equal to that chunk's: every extra file and small step, which earlier
/// readers check whole), else derived from the chunk hashes (xxh3_of_chunks): each byte is hashed once as
/// it is written. Manifests written before 2026-11-27 hold the whole-file hash for every file; a reader
/// checks `xxh3` against the bytes only for a file without chunks, so both load.
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
/// A FileDigest's `xxh3` from its chunk hashes and size (FileDigest says which rule); sets digest.xxh3.
/// `empty_file_hash`: the hash of no bytes, for a file without chunks.
void set_file_xxh3(FileDigest& digest, const std::string& empty_file_hash);
/// The `xxh3` of a file of more than one chunk: XXH3-64 of its size and then each chunk's XXH3-64, 8 bytes
/// little-endian each (hex). `chunks` must be hex64 strings.
std::string xxh3_of_chunks(uint64_t size, const std::vector<std::string>& chunks);

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

/// The FileDigest of bytes that arrive in order (what a durable write hashes as it writes): one XXH3-64 per
/// kHashChunkBytes piece, each byte hashed once, and the file's `xxh3` from them (FileDigest).
class FileDigestBuilder {
 public:
  /// `chunk_bytes`: the pieces' size (at least 1 MiB, what a manifest accepts).
  explicit FileDigestBuilder(uint64_t chunk_bytes = kHashChunkBytes);
  void update(const void* data, size_t size);
  /// The digest of everything given so far. Call once, at the end.
  FileDigest finish();

 private:
  Xxh3Stream chunk_;  // the current piece
  uint64_t chunk_left_;
  FileDigest digest_;
};

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
