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
#include "ettkit/checkpoint/step_format.h"  // SafetensorsEntry, SafetensorsIndex and the header's parse

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

using ettkit::checkpoint::kWholeTensorDigestPrefix;  // its home: ettkit/checkpoint/shard_names.h

// The index of a file's tensors and its parse from bytes are public (ettkit/checkpoint/step_format.h), so that
// Python's readers apply the same rules through ettkit._C.checkpoint.
using ettkit::checkpoint::SafetensorsEntry;
using ettkit::checkpoint::SafetensorsIndex;
/// The 8-byte little-endian length + JSON header padded with spaces to a multiple of 8.
std::string encode_safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                      const std::map<std::string, std::string>& metadata);
/// `header` (encode_safetensors_header's) padded with spaces to exactly `total` bytes, its length field
/// rewritten: what a file whose data section starts at `total` carries (the format allows trailing
/// whitespace). InvalidArgument when it does not fit or `total` is not a multiple of 8.
std::string pad_safetensors_header(std::string header, size_t total);
/// Reads, parses and validates the header of the safetensors file `path` whose size is `file_size`
/// (parse_safetensors_header's rules). Throws CorruptData naming the file.
SafetensorsIndex read_safetensors_index(const std::string& path, uint64_t file_size);
SafetensorsIndex read_safetensors_index(const ReadFile& file);
/// Bytes per element of a safetensors dtype string, or 0 when unknown (the one dtype table's answer:
/// defined in safetensors_dtypes.cpp).
int safetensors_dtype_size(const std::string& dtype);

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
