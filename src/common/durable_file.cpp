#include "ettkit/common/durable_file.h"

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "ettkit/common/error.h"

namespace ettkit {

namespace {

[[noreturn]] void throw_errno(const char* what, const std::string& path, int err) {
  ETTKIT_THROW(IoError, what, " '", path, "' failed: ", std::strerror(err), " (errno ", err, ")");
}

// Closes on every path out, so that a throw in the middle leaks no descriptor.
struct FileDescriptor {
  int fd = -1;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

void write_all(int fd, std::string_view bytes, const std::string& path) {
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("writing", path, errno);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
}

void fsync_dir(const std::string& dir) {
  FileDescriptor d;
  d.fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (d.fd < 0) throw_errno("opening directory", dir, errno);
  if (::fsync(d.fd) != 0) throw_errno("fsync of directory", dir, errno);
}

}  // namespace

std::string xxh3_hex(const void* data, size_t size) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(XXH3_64bits(data, size)));
  return buf;
}

void replace_file_durably(const std::string& temp_path, const std::string& path, std::string_view bytes) {
  const std::filesystem::path target(path);
  const std::filesystem::path temp(temp_path);
  ETTKIT_EXPECTS(temp.parent_path() == target.parent_path(), "temporary file '", temp_path,
                 "' must be in the directory of '", path, "' (a rename across directories is not atomic)");
  try {
    {
      FileDescriptor f;
      f.fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      if (f.fd < 0) throw_errno("creating", temp_path, errno);
      write_all(f.fd, bytes, temp_path);
      if (::fsync(f.fd) != 0) throw_errno("fsync of", temp_path, errno);
    }
    if (::rename(temp_path.c_str(), path.c_str()) != 0) throw_errno("renaming over", path, errno);
  } catch (...) {
    ::unlink(temp_path.c_str());
    throw;
  }
  const std::string dir = target.parent_path().empty() ? "." : target.parent_path().string();
  fsync_dir(dir);
}

}  // namespace ettkit
