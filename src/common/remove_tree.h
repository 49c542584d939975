#pragma once
// std::filesystem::remove_all, without std::filesystem. torch 2.11.0's libtorch.so exports a static copy of
// libstdc++'s <filesystem> (pytorch/pytorch#133437) whose remove_all calls weak symbols that resolve to null;
// a binary that lists libtorch before libstdc++ (every binary linked against ettkit::core, and ettkit._C under
// Python) binds to that copy and crashes on the first remove_all. nftw + remove walks the tree the same way
// (depth first, symbolic links removed, not followed). Header-only: the C++ tests use it too.
#include <ftw.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <string>

namespace ettkit::detail {

/// Removes `path` and everything under it. Returns 0, or the errno of the first failure (ENOENT is no failure).
inline int remove_tree(const std::string& path) noexcept {
  auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) -> int {
    return std::remove(p) == 0 || errno == ENOENT ? 0 : -1;
  };
  errno = 0;
  if (nftw(path.c_str(), remove_one, 32, FTW_DEPTH | FTW_PHYS) == 0 || errno == ENOENT) return 0;
  return errno != 0 ? errno : EIO;
}

}  // namespace ettkit::detail
