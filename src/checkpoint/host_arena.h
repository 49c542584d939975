#pragma once
// The stager's host memory: one exact-size arena per buffer (pinned with CUDA, mmap otherwise), or, with a
// memory tier, files of that tier mapped shared, so that a memory-tier save commits its arena as the step's
// data file instead of copying it (docs/checkpoint.md, "The memory tier").
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ettkit::checkpoint::detail {

/// Where file-backed arenas live: the memory tier's rank directory, created 0600 by this user only
/// (MemoryTier::create_arena). The callbacks borrow the tier; AsyncCheckpointer::close() takes the files
/// away from the stager (Stager::set_arena_files(nullptr)) before it closes the tier.
struct ArenaFiles {
  /// Creates a new, empty arena file of `bytes` bytes and returns its open descriptor (owned by the caller)
  /// and its name in `name`. Throws IoError.
  std::function<int(uint64_t bytes, std::string& name)> create;
  /// Removes the arena file's name (a memory step that links it keeps its bytes). Never throws.
  std::function<void(const std::string& name)> remove;
  /// Retires the memory step `step` of this rank (its data file is a link to an arena the stager needs
  /// back). Never throws.
  std::function<void(int64_t step)> reclaim;
};

/// One host allocation, exact size (rounded to pages), pinned or plain; anonymous memory, or a mapped file
/// of ArenaFiles. Owned by Stager::Impl, which frees it explicitly (free() is idempotent; the struct is a
/// plain value so that a vector of them can be reassigned under the stager's mutex).
struct Arena {
  uint8_t* ptr = nullptr;  // the staged bytes (a file arena: its data section, after `reserve` bytes)
  size_t size = 0;
  bool pinned = false;
  bool busy = false;       // guarded by Stager::Impl::mu
  bool populated = false;  // every page is backed (pinned, populate(), or a save's copies wrote it)

  // A file arena: the file is `reserve` bytes of safetensors header room, then the `size` staged bytes.
  std::shared_ptr<ArenaFiles> files;
  int fd = -1;
  std::string file;        // its name in the memory tier's rank directory
  uint8_t* map = nullptr;  // the mapping of the whole file
  size_t reserve = 0;
  // A memory step links the file (guarded by Stager::Impl::mu): which step, and in which order the steps
  // were published (the newest published arena is never reclaimed for a new save).
  bool published = false;
  int64_t published_step = -1;
  uint64_t published_seq = 0;

  /// Allocates `bytes` (at least 1): cudaHostAlloc when `pin`, else an anonymous mapping. InvalidArgument
  /// when `pin` without CUDA; IoError (or CudaError) when the memory is not there.
  void allocate(size_t bytes, bool pin);
  /// Allocates a file arena of `reserve` + `bytes` from `files`, mapped shared; pinned with cudaHostRegister
  /// when `pin`. IoError (or CudaError) when the file or the mapping cannot be made.
  void allocate_file(const std::shared_ptr<ArenaFiles>& files, size_t bytes, size_t reserve, bool pin);
  /// Backs every page now (the kernel allocates and zeroes them), so that the first copy into the arena
  /// takes no page fault: MADV_POPULATE_WRITE, or one write per page where the kernel lacks it (< 5.14).
  /// Pinned memory is resident already. IoError when the kernel cannot back the pages (out of memory).
  void populate();
  /// Whether a memory step links this arena's file now (its link count is above one). False for anonymous
  /// memory and when the count cannot be read.
  bool linked() const { return links() > 1; }
  /// The file's link count (its arena name, the step that links it, any other link); 0 for anonymous memory
  /// and when the count cannot be read.
  uint64_t links() const;
  void free() noexcept;
};

/// The arena a save reclaims when none of `arenas` is free (Stager: free_or_reclaimed): the oldest published
/// one that is not busy, unless it is also the newest (the step a restart restores stays); -1 when none.
int reclaim_candidate(const std::vector<Arena>& arenas);

}  // namespace ettkit::checkpoint::detail
