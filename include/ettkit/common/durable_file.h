#pragma once
// Small files written so that a crash leaves the old version or the new one, whole, and the checksum
// every ettkit file format uses. The checkpointer's `latest` pointer and the start-up compile caches
// (python/ettkit/startup/cache.py, through ettkit._C) share these, so that there is one atomic-write
// protocol and one checksum in the project.

#include <cstddef>
#include <string>
#include <string_view>

#include "ettkit/common/export.h"

namespace ettkit {

/// XXH3-64 of `size` bytes at `data`, as 16 lowercase hex digits.
ETTKIT_API std::string xxh3_hex(const void* data, size_t size);

/// Replaces `path` with `bytes`: writes them to `temp_path` (created exclusively; it must be in the same
/// directory as `path`, so that the rename is atomic), fsyncs it, renames it over `path` and fsyncs the
/// directory, so that the rename itself is durable. A reader sees the old file or the new one, never a
/// torn one, and of concurrent writers one complete file wins. On failure the temporary file is removed
/// and IoError names the file, the step that failed and the errno text; `path` is untouched.
ETTKIT_API void replace_file_durably(const std::string& temp_path, const std::string& path, std::string_view bytes);

}  // namespace ettkit
