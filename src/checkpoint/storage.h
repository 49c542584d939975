#pragma once
// Torch-free file-system side of the checkpointer: durable writes with XXH3 checksums, the safetensors
// header codec, the manifest codec and the directory layout (step-<N>, .tmp-step-*, latest).
//
// Layout of CKPT_DIR:
//   step-<N>/manifest.json            written last by rank 0; its presence after the rename = committed
//   step-<N>/rank-<r>.safetensors     one per rank, readable by safetensors.torch.load_file
//   step-<N>/rank-<r>.extra           the rank's non-tensor state (opaque bytes)
//   .tmp-step-<N>-<run>/              a save in progress (removed at the next start of another run)
//   .trash-*                          a retired step being deleted (rename first, then delete)
//   latest                            "step-<N>\n", replaced atomically (tmp + rename + dir fsync)

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// Exported (though not installed) so tests/cpp/checkpoint can exercise the decoders directly.
#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// A byte range to write (not owned).
struct ConstBuffer {
  const void* data;
  size_t size;
};

/// What a durably written file is: its size and its XXH3-64 checksum (lowercase hex, 16 digits).
struct FileDigest {
  uint64_t size = 0;
  std::string xxh3;
};

/// Writes `buffers` back to back into a new file `path` (O_CREAT|O_EXCL), hashing the bytes as they go,
/// then fsyncs it. Throws IoError naming the file and the errno text (ENOSPC, EFBIG, ...); a failed
/// write leaves a partial file that the caller's temp directory owns.
FileDigest write_file_durably(const std::string& path, const std::vector<ConstBuffer>& buffers);
/// XXH3-64 of a whole file (hex). Throws IoError.
std::string file_xxh3(const std::string& path);
/// fsync of a directory (so a rename or create inside it is durable). Throws IoError.
void fsync_directory(const std::string& path);
/// mkdir -p. Throws IoError.
void make_directories(const std::string& path);
/// rm -rf that never throws (logs a warning instead).
void remove_tree_quietly(const std::string& path);
/// Size of a regular file, or nullopt when it does not exist.
std::optional<uint64_t> file_size(const std::string& path);
/// Reads `size` bytes at `offset` into `dst`; throws CorruptData when the file is shorter, IoError otherwise.
void read_exact(int fd, void* dst, uint64_t size, uint64_t offset, const std::string& path);
/// Reads a whole (small) file. Throws IoError.
std::string read_small_file(const std::string& path);
std::string hex64(uint64_t v);

// ---- safetensors -------------------------------------------------------------------------------------
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // relative to the data section
  uint64_t end = 0;
};
/// The 8-byte little-endian length + JSON header padded with spaces to a multiple of 8.
std::string encode_safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                      const std::map<std::string, std::string>& metadata);
struct SafetensorsIndex {
  uint64_t data_offset = 0;  // where the data section starts in the file
  uint64_t data_size = 0;
  std::map<std::string, SafetensorsEntry> tensors;
};
/// Parses and validates the header of the safetensors file `path` whose size is `file_size`: offsets in
/// range, non-overlapping, element counts match dtype and shape. Throws CorruptData naming the file.
SafetensorsIndex read_safetensors_index(const std::string& path, uint64_t file_size);
/// Bytes per element of a safetensors dtype string, or 0 when unknown.
int safetensors_dtype_size(const std::string& dtype);

// ---- manifest ----------------------------------------------------------------------------------------
struct Manifest {
  int64_t step = -1;
  int world_size = 0;
  int64_t created_unix_us = 0;
  std::map<std::string, FileDigest> files;  // file name (inside the step dir) -> digest
  std::map<std::string, std::string> metadata;
  std::string torch_version;
};
std::string encode_manifest(const Manifest& m);
/// Throws CorruptData naming `source` and the bad field.
Manifest decode_manifest(const std::string& text, const std::string& source);

// ---- directory layout --------------------------------------------------------------------------------
std::string step_dir_name(int64_t step);
std::string temp_dir_name(int64_t step, const std::string& run_id);
/// Steps that have a step-<N> directory, newest first (committed or not: the loader validates).
std::vector<int64_t> list_step_dirs(const std::string& dir);
/// Removes .tmp-step-* directories not belonging to `run_id` and all .trash-* entries.
int remove_stale_temporaries(const std::string& dir, const std::string& run_id);
/// Points `latest` at step-<N>: write latest.tmp, fsync, rename, fsync dir.
void update_latest(const std::string& dir, int64_t step);
/// Keeps the newest `keep_last` step directories (keep_last <= 0 keeps all); renames the others to
/// .trash-* (atomic) and deletes them.
void apply_retention(const std::string& dir, int keep_last);
/// A random 16-hex-digit id.
std::string random_id();

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
