// The memory tier's arena files (memory_tier.h, create_arena / remove_arena / link_arena): the stager's
// arenas, its spares included, made by the writer thread inside the rank directory.
//
// Why each name is created O_CREAT | O_EXCL | O_NOFOLLOW relative to the rank directory's handle, and a
// taken name is passed over rather than opened: the file is sized, mapped shared and written with a save's
// bytes, so opening an existing entry would write through it - a symbolic link or a hard link to another
// file (its target overwritten), a FIFO (an open that blocks the writer thread for good), a file someone
// else keeps open (a reader of the staged bytes). O_EXCL refuses every existing entry, a dangling link
// included, without opening it; the rank directory is this user's, mode 0700 (verified at construction), and
// the names are random, so a taken name means a stale or foreign entry, never a file of this arena.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>

#include "checkpoint/memory_tier.h"
#include "checkpoint/memory_tier_entries.h"
#include "common/logging.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

namespace {

constexpr const char* kArenaPrefix = ".arena-";

/// What the entry found under a taken name is, for the warning: its kind, owner and mode (links not followed).
std::string describe_taken(const Dir& dir, const std::string& name) {
  struct stat st {};
  if (::fstatat(dir.fd(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) return "an entry gone since";
  const char* kind = S_ISLNK(st.st_mode)    ? "a symbolic link"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISDIR(st.st_mode)  ? "a directory"
                     : S_ISREG(st.st_mode)  ? "a regular file"
                                            : "a special file";
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return std::string(kind) + " (owner uid " + std::to_string(st.st_uid) + ", mode " + mode + ", " +
         std::to_string(st.st_nlink) + " link(s))";
}

std::mutex g_names_mu;
std::function<std::string()> g_names;  // set_arena_names_for_testing(); guarded by g_names_mu

std::string next_arena_name() {
  std::lock_guard<std::mutex> lk(g_names_mu);
  return kArenaPrefix + (g_names ? g_names() : random_id());
}

}  // namespace

void MemoryTier::set_arena_names_for_testing(std::function<std::string()> next) {
  std::lock_guard<std::mutex> lk(g_names_mu);
  g_names = std::move(next);
}

int MemoryTier::create_arena(uint64_t bytes, std::string& name) {
  int fd = -1;
  for (int attempt = 1; fd < 0; ++attempt) {
    name = next_arena_name();
    ETTKIT_EXPECTS(is_plain_file_name(name), "arena name '", name, "' is not a plain file name");
    fd = ::openat(rank_dir_.fd(), name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC,
                  static_cast<mode_t>(kFileMode));
    if (fd >= 0) break;
    const int err = errno;
    const std::string path = rank_dir_.path_of(name);
    ETTKIT_CHECK(err == EEXIST, IoError, "checkpoint memory tier: creating the arena '", path,
                 "' failed: ", std::strerror(err));
    const std::string found = describe_taken(rank_dir_, name);
    ETTKIT_CHECK(attempt < kArenaNameAttempts, IoError, "checkpoint memory tier: creating the arena '", path,
                 "' failed: the name is taken by ", found, ", as were the ", kArenaNameAttempts - 1, " random names "
                 "before it. An arena is a new regular file of this user, mode 0600, that no other entry shares: "
                 "nothing but this rank's memory tier may write '", dir_, "'. Remove the entries that are not "
                 "step-<N> directories (the next start removes every ", kArenaPrefix, "* name)");
    // Never opened, never removed: whatever it is stays as found (a restart's cleanup removes the name).
    ETTKIT_LOG_WARN("checkpoint memory tier: '", path, "' is taken by ", found, " that this tier did not create; "
                    "the arena takes another name");
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlinkat(rank_dir_.fd(), name.c_str(), 0);
    ETTKIT_THROW(IoError, "checkpoint memory tier: sizing the arena '", rank_dir_.path_of(name), "' to ", bytes,
                 " bytes failed: ", std::strerror(err));
  }
  return fd;
}

void MemoryTier::remove_arena(const std::string& name) noexcept {
  if (name.rfind(kArenaPrefix, 0) != 0 || !is_plain_file_name(name)) return;
  ::unlinkat(rank_dir_.fd(), name.c_str(), 0);
}

void MemoryTier::link_arena(const std::string& arena, const std::string& tmp, const std::string& file) {
  ETTKIT_EXPECTS(arena.rfind(kArenaPrefix, 0) == 0 && is_plain_file_name(arena) && is_plain_file_name(file),
                 "link_arena('", arena, "', '", file, "'): not an arena and a plain file name");
  const std::string tmp_name = entry_of(dir_, tmp);
  const int fd = tier_entries::open_directory_at(rank_dir_.fd(), tmp_name);
  ETTKIT_CHECK(fd >= 0, IoError, "checkpoint memory tier: opening '", tmp, "' failed: ", std::strerror(errno));
  const Dir tmp_dir(fd, tmp);
  // Flags 0: a link at the arena's name would be linked itself, never followed (and the loader refuses it).
  ETTKIT_CHECK(::linkat(rank_dir_.fd(), arena.c_str(), tmp_dir.fd(), file.c_str(), 0) == 0, IoError,
               "checkpoint memory tier: linking the arena '", rank_dir_.path_of(arena), "' as '",
               tmp_dir.path_of(file), "' failed: ", std::strerror(errno));
}

}  // namespace ettkit::checkpoint::detail
