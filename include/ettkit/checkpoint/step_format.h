#pragma once
// The rules of a step's files that every reader applies, in one place: the C++ loader, and Python's readers
// (the DCP StorageReader in python/ettkit/checkpoint/_dcp_reader.py and export's step_reader.py) through
// ettkit._C.checkpoint (python/csrc/bind_step_files.cpp). A safetensors header is parsed from bytes, so that a
// reader that verifies a file's checksum chunks before parsing them hands over exactly the verified bytes.

#include <cstddef>
#include <cstdint>
#include <map>
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

}  // namespace ettkit::checkpoint
