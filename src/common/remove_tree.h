#pragma once
// Tree removal that cannot be redirected, without std::filesystem.
//
// Why not fs::remove_all: torch 2.11.0's libtorch.so exports a static copy of libstdc++'s <filesystem>
// (pytorch/pytorch#133437) whose remove_all calls weak symbols that resolve to null; a binary that lists
// libtorch before libstdc++ (every binary linked against ettkit::core, and ettkit._C under Python) binds to
// that copy and crashes on the first remove_all.
//
// Why not a path-based walk (nftw + remove, what this header did before): a directory that another process
// can write into (a shared checkpoint directory, /dev/shm) can have one of the walked directories swapped for
// a symbolic link between the walk's stat and its remove, and the walk then deletes whatever the link names.
// Here every directory is opened with O_NOFOLLOW | O_DIRECTORY and its entries are removed with unlinkat
// relative to that handle: a symbolic link is removed as a link, never followed, at any depth and at any
// moment. Header-only: the C++ tests use it too.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace ettkit::detail {

/// Removes the entry `name` of the directory open as `dirfd` (AT_FDCWD: the working directory), and,
/// when it is a directory (not a symbolic link to one), everything under it, depth first. Never follows a
/// symbolic link. Returns 0, or the errno of the first failure (ENOENT is no failure). `depth` bounds the
/// recursion: a tree deeper than 256 levels fails with ELOOP rather than exhausting the stack.
inline int remove_tree_at(int dirfd, const char* name, int depth = 0) noexcept {
  if (::unlinkat(dirfd, name, 0) == 0 || errno == ENOENT) return 0;
  if (errno != EISDIR && errno != EPERM) return errno;  // Linux answers EISDIR; POSIX allows EPERM
  if (depth >= 256) return ELOOP;
  const int fd = ::openat(dirfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    // Swapped for a non-directory between the unlink and the open (ENOTDIR, ELOOP): unlink that instead.
    if (errno == ENOTDIR || errno == ELOOP) return ::unlinkat(dirfd, name, 0) == 0 || errno == ENOENT ? 0 : errno;
    return errno == ENOENT ? 0 : errno;
  }
  DIR* d = ::fdopendir(fd);  // owns fd from here
  if (d == nullptr) {
    const int err = errno;
    ::close(fd);
    return err;
  }
  int first = 0;
  for (;;) {
    errno = 0;
    const dirent* e = ::readdir(d);
    if (e == nullptr) {
      if (errno != 0 && first == 0) first = errno;
      break;
    }
    const std::string n = e->d_name;
    if (n == "." || n == "..") continue;
    if (const int err = remove_tree_at(::dirfd(d), n.c_str(), depth + 1); err != 0 && first == 0) first = err;
  }
  ::closedir(d);
  if (first != 0) return first;
  return ::unlinkat(dirfd, name, AT_REMOVEDIR) == 0 || errno == ENOENT ? 0 : errno;
}

/// Removes `path` and everything under it (see remove_tree_at). The components of `path` above its last
/// one are resolved as usual: they are the caller's own directories; everything below is never followed.
inline int remove_tree(const std::string& path) noexcept {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  if (p.empty()) return EINVAL;
  const auto slash = p.rfind('/');
  if (slash == std::string::npos) return remove_tree_at(AT_FDCWD, p.c_str());
  const std::string parent = slash == 0 ? std::string("/") : p.substr(0, slash);
  const std::string leaf = p.substr(slash + 1);
  if (leaf.empty() || leaf == "." || leaf == "..") return EINVAL;
  const int pfd = ::open(parent.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (pfd < 0) return errno == ENOENT ? 0 : errno;
  const int err = remove_tree_at(pfd, leaf.c_str());
  ::close(pfd);
  return err;
}

}  // namespace ettkit::detail
