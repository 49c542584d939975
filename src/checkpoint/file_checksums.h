#pragma once
// Checksums of files on disk: the whole-file XXH3, the chunk checksums checked on several threads, and which
// chunks the page cache no longer holds (a prefetched verification is then redone for those).

#include <cstddef>
#include <string>
#include <vector>

#include "checkpoint/checksums.h"
#include "checkpoint/file_io.h"

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// XXH3-64 of a whole file (hex). Throws IoError.
std::string file_xxh3(const std::string& path);
/// XXH3-64 of a whole open file (hex). Throws IoError.
std::string file_xxh3(const ReadFile& file);
/// Checks `file` against `digest`'s chunk checksums on up to `threads` threads, each reading its chunks
/// through a small buffer. Throws CorruptData naming the file and the first bad byte range, IoError on a
/// read error. Requires digest.chunks (ETTKIT_EXPECTS).
void verify_file_chunks(const ReadFile& file, const FileDigest& digest, int threads);
/// The same for the chunks numbered in `which` only (a resharding load checks what it reads).
void verify_file_chunks(const ReadFile& file, const FileDigest& digest, int threads, const std::vector<size_t>& which);
/// The chunks of `file` (numbered as in `digest.chunks`) with a page that is not in the page cache now
/// (cachestat where the kernel has it, else mincore; `use_cachestat` false: mincore only, for its test). A
/// load that verified the file earlier (RestorePrefetch) checks these again: their bytes will come from the
/// storage device once more, not from the pages it hashed. Every chunk when residency cannot be asked (no
/// mmap; mincore reports only this process's mappings for a file it may not write).
std::vector<size_t> nonresident_chunks(const ReadFile& file, const FileDigest& digest, bool use_cachestat = true);

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
