// The files of one rank of a committed step (step_files.h).
#include "checkpoint/step_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <mutex>
#include <numeric>
#include <vector>

#include "checkpoint/directory_layout.h"
#include "checkpoint/file_checksums.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

namespace {
std::mutex g_hook_mu;
std::function<void(int64_t)> g_before_open_step;
}  // namespace

void set_before_open_step_hook(std::function<void(int64_t step)> hook) {
  std::lock_guard<std::mutex> lk(g_hook_mu);
  g_before_open_step = std::move(hook);
}

void run_before_open_step_hook(int64_t step) {
  std::function<void(int64_t)> hook;
  {
    std::lock_guard<std::mutex> lk(g_hook_mu);
    hook = g_before_open_step;
  }
  if (hook) hook(step);
}

StepDirectory::StepDirectory(Dir parent, Dir step, std::string name, std::string path)
    : parent_(std::move(parent)), step_(std::move(step)), name_(std::move(name)), path_(std::move(path)) {
  struct stat opened {};
  if (::fstat(step_.fd(), &opened) != 0) throw_errno("stat of", path_, errno);
  dev_ = opened.st_dev;
  ino_ = opened.st_ino;
}

// A file missing from a directory that is no longer at its path (renamed to .trash-*, deleted) was retired
// under us; missing from the directory still in place, the step is damaged.
bool StepDirectory::moved_away() const {
  struct stat now {};
  return ::fstatat(parent_.fd(), name_.c_str(), &now, AT_SYMLINK_NOFOLLOW) != 0 || now.st_ino != ino_ ||
         now.st_dev != dev_;
}

ReadFile StepDirectory::open_file(const std::string& file) const {
  std::string path = path_ + "/" + file;
  int fd = open_regular_or_throw(step_.fd(), file, path, /*missing_ok=*/true);
  if (fd >= 0) return ReadFile(fd, path);
  if (moved_away()) return ReadFile();
  ETTKIT_THROW(CorruptData, "'", path, "' is missing");
}

std::optional<StepDirectory> StepDirectory::open(const std::string& dir, int64_t step) {
  const std::string name = step_dir_name(step);
  const int top = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (top < 0) {
    if (errno == ENOENT) return std::nullopt;
    throw_errno("opening directory", dir, errno);
  }
  Dir parent(top, dir);
  // Never through a link: the step directory and its files are what this directory holds, or refused as
  // corrupt (load_latest then falls back to the next step).
  std::optional<Dir> d = open_subdirectory(parent, name);
  if (!d) return std::nullopt;
  StepDirectory out(std::move(parent), std::move(*d), name, dir + "/" + name);
  ReadFile manifest = out.open_file("manifest.json");
  if (manifest.fd() < 0) return std::nullopt;
  out.manifest_path_ = manifest.path();
  out.manifest_ = decode_manifest(read_bounded(manifest.fd(), out.manifest_path_, kMaxSmallFileBytes),
                                  out.manifest_path_);
  ETTKIT_CHECK(out.manifest_.step == step, CorruptData, "manifest '", out.manifest_path_, "' says step ",
               out.manifest_.step);
  return out;
}

std::optional<OpenedStep> StepDirectory::open_rank(int rank) const {
  OpenedStep out;
  out.path = path_;
  out.manifest_path = manifest_path_;
  std::string base = "rank-" + std::to_string(rank);
  out.data = open_file(base + ".safetensors");
  if (out.data.fd() < 0) return std::nullopt;
  out.extra = open_file(base + ".extra");
  if (out.extra.fd() < 0) return std::nullopt;
  out.manifest = manifest_;
  return out;
}

std::optional<OpenedStep> open_step(const std::string& dir, int64_t step, int rank) {
  std::optional<StepDirectory> d = StepDirectory::open(dir, step);
  if (!d) return std::nullopt;
  return d->open_rank(rank);
}

const FileDigest& listed_digest(const OpenedStep& step, const ReadFile& file) {
  std::string name = file.path().substr(step.path.size() + 1);
  auto it = step.manifest.files.find(name);
  ETTKIT_CHECK(it != step.manifest.files.end(), CorruptData, "manifest '", step.manifest_path, "' lists no '", name,
               "'");
  uint64_t size = file.size();
  ETTKIT_CHECK(size == it->second.size, CorruptData, "'", file.path(), "' has ", size, " bytes; the manifest says ",
               it->second.size);
  return it->second;
}

std::string read_checked_extra(const OpenedStep& step, bool verify) {
  const FileDigest& d = listed_digest(step, step.extra);
  ETTKIT_CHECK(d.size <= kMaxExtraBytes, CorruptData, "'", step.extra.path(), "' is listed with ", d.size,
               " bytes; extra bytes are at most ", kMaxExtraBytes, " (256 MiB)");
  std::string bytes = step.extra.read_all(d.size);
  ETTKIT_CHECK(bytes.size() == d.size, CorruptData, "'", step.extra.path(), "' changed size while being read");
  if (verify && d.chunks.size() > 1) {
    // Larger than a chunk: its `xxh3` is derived from the chunks' (checksums.h), which are checked here.
    for (size_t i = 0; i < d.chunks.size(); ++i) {
      const uint64_t begin = i * d.chunk_bytes, n = std::min<uint64_t>(d.chunk_bytes, d.size - begin);
      std::string h = xxh3_of(bytes.data() + begin, static_cast<size_t>(n));
      ETTKIT_CHECK(h == d.chunks[i], CorruptData, "'", step.extra.path(), "' bytes [", begin, ", ", begin + n,
                   ") have XXH3 ", h, "; the manifest says ", d.chunks[i]);
    }
  } else if (verify) {
    std::string h = xxh3_of(bytes);
    ETTKIT_CHECK(h == d.xxh3, CorruptData, "'", step.extra.path(), "' has XXH3 ", h, "; the manifest says ", d.xxh3);
  }
  return bytes;
}

std::optional<std::string> check_step_files(const OpenedStep& step, bool verify, int threads,
                                            const std::function<bool()>& stop) {
  const FileDigest& d = listed_digest(step, step.data);
  if (verify && !d.chunks.empty()) {
    if (!stop) {
      // Chunk by chunk on several threads; it names the bad byte range itself. Every chunk matching is the
      // whole file matching: the writer hashed both from the same bytes.
      verify_file_chunks(step.data, d, threads);
    } else {
      // A group of chunks per round, so that a stop waits for at most one group.
      const size_t group = static_cast<size_t>(std::max(1, threads));
      for (size_t first = 0; first < d.chunks.size(); first += group) {
        if (stop()) return std::nullopt;
        std::vector<size_t> which(std::min(group, d.chunks.size() - first));
        std::iota(which.begin(), which.end(), first);
        verify_file_chunks(step.data, d, threads, which);
      }
    }
  } else if (verify) {
    std::string h = file_xxh3(step.data);  // a manifest from before chunk checksums
    ETTKIT_CHECK(h == d.xxh3, CorruptData, "'", step.data.path(), "' has XXH3 ", h, "; the manifest says ", d.xxh3);
  }
  if (stop && stop()) return std::nullopt;
  return read_checked_extra(step, verify);
}
}  // namespace ettkit::checkpoint::detail
