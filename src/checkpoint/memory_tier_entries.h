// The memory tier's directory entries, read, probed and removed through the handles of its verified
// directories (memory_tier.h, "created, never adopted"): the listing, bounded reads and quiet removals that the
// tier and its stale-tier cleanup share. Private to memory_tier*.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/file_io.h"

namespace ettkit::checkpoint::detail::tier_entries {

/// openat of the directory `name` of `parent`, never through a link; -1 and errno on failure.
int open_directory_at(int parent, const std::string& name);

struct Entry {
  std::string name;
  bool directory = false;  // a directory, not a link to one
};

/// The entries of `dir` (without "." and ".."), read through a descriptor of their own (a dup would share
/// readdir's position with `dir`). Throws IoError.
std::vector<Entry> entries_of(const Dir& dir);

/// The regular file `name` of `dir` read whole when it has at most `limit` bytes (nullopt otherwise, or when
/// it is missing or a link).
std::optional<std::string> read_bounded_file_at(const Dir& dir, const std::string& name, uint64_t limit);

/// Removes the tree `name` of `dir`, warning (never throwing) when it cannot.
void remove_quietly_at(const Dir& dir, const std::string& name) noexcept;

/// Whether some process holds the flock of the rank directory `rank` of the tier `job` (no lock file:
/// nobody).
bool lock_held(const Dir& job, const std::string& rank);

/// The rank directories ("rank-<r>") of the tier `job`.
std::vector<std::string> rank_dirs(const Dir& job);

}  // namespace ettkit::checkpoint::detail::tier_entries
