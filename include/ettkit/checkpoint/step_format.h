#pragma once
// The rules of a step's files that every reader applies, in one place: the C++ loader, and Python's readers
// (the DCP StorageReader in python/ettkit/checkpoint/_dcp_reader.py and export's step_reader.py) through
// ettkit._C.checkpoint (python/csrc/bind_step_files.cpp). A safetensors header is parsed from bytes, so that a
// reader that verifies a file's checksum chunks before parsing them hands over exactly the verified bytes.

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ettkit/common/export.h"

namespace ettkit::checkpoint {

/// The most ranks a manifest may claim. A reader walks and opens one file per rank: a manifest claiming 2^31
/// ranks would have it loop (and allocate) per rank before finding the first file missing. 2^24 is far beyond
/// any job's world size.
inline constexpr int64_t kMaxWorldSize = int64_t{1} << 24;
/// The most items one error message lists (mismatched keys, moved shards, ...); the rest are counted
/// ("... (N more)" in C++, "... and N more" in Python), so that a wrong model of 10^4 tensors gives a message
/// a person reads.
inline constexpr size_t kMaxListedInMessage = 12;

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // relative to the data section
  uint64_t end = 0;
};
struct SafetensorsIndex {
  uint64_t data_offset = 0;  // where the data section starts in the file
  uint64_t data_size = 0;
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;  // the header's __metadata__ (strings to strings)
};

/// The header's JSON length `n` from the first 8 bytes of the safetensors file `path` of `file_size` bytes,
/// checked: the file holds at least 8 + n bytes and n is within the format's cap. CorruptData naming the file.
ETTKIT_API uint64_t safetensors_header_length(const std::string& path, std::string_view first8, uint64_t file_size);
/// Parses and validates the header JSON `text` (the n bytes after the length) of the safetensors file `path` of
/// `file_size` bytes: the layout of the format, dtypes ettkit writes, element counts that match dtype and
/// shape, byte ranges inside the data section and not overlapping. CorruptData naming the file and the entry.
ETTKIT_API SafetensorsIndex parse_safetensors_header(const std::string& path, std::string_view text,
                                                     uint64_t file_size);
/// A manifest's "world_size" given as its JSON text (`value_json`: "4", "0", "1.5", "\"x\""), checked as
/// decode_manifest checks it: an integer in [1, kMaxWorldSize]. CorruptData naming `source` otherwise.
ETTKIT_API int checked_world_size(const std::string& value_json, const std::string& source);

/// One data file's entry of a manifest's "files": its size and XXH3-64, and its chunk checksums (none in
/// manifests older than them).
struct ManifestFileEntry {
  uint64_t size = 0;
  std::string xxh3;
  uint64_t chunk_bytes = 0;         ///< 0 without chunk checksums
  std::vector<std::string> chunks;  ///< XXH3-64 (hex) of each chunk_bytes chunk, covering the size exactly
};
/// A manifest's file entry given as its JSON text, decoded and checked as decode_manifest checks each entry
/// (the one decoder of both). `field` is how a message names the entry: the C++ loader says
/// "files.rank-0.safetensors", Python's readers "files['rank-0.safetensors']" (a name with dots stays
/// readable). CorruptData "manifest '<source>': field '<field>.chunks' is ...; expected ..." otherwise.
ETTKIT_API ManifestFileEntry decode_manifest_file_entry(const std::string& entry_json, const std::string& source,
                                                        const std::string& field);

/// One box of a sharded tensor that a rank holds: where it starts in the whole tensor, its size, and its
/// placement where the side records one (torch's text of a DTensor's placements, a ShardedTensor's
/// "rank:r/device"; nullopt: none, as for a safetensors file, which records no placement).
struct ShardBox {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  std::optional<std::string> placement;
};
/// One rank's tensors as the moved verdict sees them, of a saved step or of the state being loaded.
struct ShardLayout {
  /// Per sharded tensor's key, the boxes this rank holds. An empty list: a key this rank holds no shard of
  /// (Python's skeletons list those; a file cannot).
  std::map<std::string, std::vector<ShardBox>> sharded;
  /// The names of the tensors held whole (only those that a side held sharded matter).
  std::set<std::string> whole;
};
/// Whether this rank's shards moved between the step it saved (`saved`) and the state it loads (`wanted`):
/// the first difference's name, "" when there is none. A difference is a tensor wanted whole that the step
/// holds only in pieces (returned: its name); a sharded key only one side lists (its first box's
/// "key@offsets", or the key when it lists none), except, with `partial`, a key only the step has (a partial
/// load leaves it unread); a box one side holds and the other does not hold at the same offsets, or holds at
/// another size or placement ("key@offsets"). Boxes are matched by offsets, so their order does not matter:
/// a box's offsets and size are its elements. Each difference means the step was saved under another layout
/// (another sharding plan, mesh shape, placements or world size), which the loader reads by resharding; the
/// C++ loader (read_plan.cpp) and Python's skeleton check (_restore.py, through
/// ettkit._C.checkpoint.first_moved_shard) both ask this.
ETTKIT_API std::string first_moved_shard(const ShardLayout& saved, const ShardLayout& wanted, bool partial);

}  // namespace ettkit::checkpoint
