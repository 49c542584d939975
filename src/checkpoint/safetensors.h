#pragma once
// The safetensors file format as ettkit writes and reads it: the header codec (8-byte length, JSON, padding)
// and the validated index of a file's tensors. Torch-free; the dtype strings are those of
// ettkit/checkpoint/safetensors_dtypes.h.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"
#include "ettkit/checkpoint/shard_names.h"  // kWholeTensorDigestPrefix: the digests a header carries

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

using ettkit::checkpoint::kWholeTensorDigestPrefix;  // its home: ettkit/checkpoint/shard_names.h

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
/// `header` (encode_safetensors_header's) padded with spaces to exactly `total` bytes, its length field
/// rewritten: what a file whose data section starts at `total` carries (the format allows trailing
/// whitespace). InvalidArgument when it does not fit or `total` is not a multiple of 8.
std::string pad_safetensors_header(std::string header, size_t total);
struct SafetensorsIndex {
  uint64_t data_offset = 0;  // where the data section starts in the file
  uint64_t data_size = 0;
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;  // the header's __metadata__ (strings to strings)
};
/// Parses and validates the header of the safetensors file `path` whose size is `file_size`: offsets in
/// range, non-overlapping, element counts match dtype and shape. Throws CorruptData naming the file.
SafetensorsIndex read_safetensors_index(const std::string& path, uint64_t file_size);
SafetensorsIndex read_safetensors_index(const ReadFile& file);
/// Bytes per element of a safetensors dtype string, or 0 when unknown (the one dtype table's answer:
/// defined in safetensors_dtypes.cpp).
int safetensors_dtype_size(const std::string& dtype);

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
