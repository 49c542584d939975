#pragma once
// The files of one rank of a committed step, opened together and checked against the manifest before any
// tensor is read. Torch-free.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <sys/types.h>

#include "checkpoint/file_io.h"
#include "checkpoint/manifest.h"

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// The most a rank's extra bytes (`rank-<r>.extra`) may hold. They are read whole into memory on load, so a
/// hostile manifest naming a huge (or sparse) file must be refused before the read; save() refuses more.
inline constexpr uint64_t kMaxExtraBytes = uint64_t{256} << 20;

/// The files of one rank of step-<N>, opened together: once open, a step that retention renames and deletes
/// still reads whole.
struct OpenedStep {
  std::string path;  ///< CKPT_DIR/step-<N>
  std::string manifest_path;
  Manifest manifest;
  ReadFile data;   ///< rank-<r>.safetensors
  ReadFile extra;  ///< rank-<r>.extra
};
/// step-<N> of a checkpoint (or memory-tier) directory, opened once and its manifest read and decoded once:
/// the files of any of its ranks are then opened from the same directory handle with that one manifest (a
/// resharding load opens every old rank's, a same-world load its own). Owns the step directory's descriptor;
/// each OpenedStep it hands out owns its own files and a copy of the manifest. Never follows a link.
class StepDirectory {
 public:
  /// Opens step-<N> of `dir` and decodes its manifest. nullopt when the step directory (or its manifest) vanished
  /// (retired by retention); throws like open_step for a bad manifest or a directory that is not what it should be.
  static std::optional<StepDirectory> open(const std::string& dir, int64_t step);
  const Manifest& manifest() const { return manifest_; }
  const std::string& path() const { return path_; }
  const std::string& manifest_path() const { return manifest_path_; }
  /// `rank`'s data and extra files with this manifest. nullopt when the step was retired meanwhile; CorruptData
  /// when a file is missing from the directory still in place.
  std::optional<OpenedStep> open_rank(int rank) const;

 private:
  StepDirectory(Dir parent, Dir step, std::string name, std::string path);
  bool moved_away() const;  // the step directory is no longer at its path
  /// `file` of the step directory; an invalid ReadFile when the step was retired, CorruptData when it is missing.
  ReadFile open_file(const std::string& file) const;

  Dir parent_, step_;
  std::string name_, path_, manifest_path_;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  Manifest manifest_;
};
/// Opens step-<N> for `rank` (StepDirectory::open, then open_rank). nullopt when the step directory vanished before or while it was opened
/// (retired by the writer's retention: not a corruption). Throws CorruptData (or Unsupported) when the step
/// exists but its manifest is bad or a file is missing, or when the step directory or one of its files is a
/// symbolic link or not what it should be (never followed: the step falls back like any corrupt one),
/// IoError for other failures.
std::optional<OpenedStep> open_step(const std::string& dir, int64_t step, int rank);
/// The manifest's digest of `file` (one of `step`'s open files), once the manifest is seen to list it and the
/// file to have the listed size. Throws CorruptData naming the manifest or the file.
const FileDigest& listed_digest(const OpenedStep& step, const ReadFile& file);
/// `step`'s extra file read whole and checked: its size, and with `verify` its XXH3 (of the bytes returned,
/// so that what is used is what was checked). Throws CorruptData naming the file, IoError.
std::string read_checked_extra(const OpenedStep& step, bool verify);
/// What a load checks of one rank's files before it reads any tensor, and what RestorePrefetch checks ahead
/// of it (one function, so that the two cannot drift): the data file's size, and with `verify` every chunk
/// checksum on up to `threads` threads (the whole-file XXH3 for a manifest from before chunks); then the
/// extra file as read_checked_extra. `stop`, when given, is asked between groups of `threads` chunks: true
/// ends the check early, with nullopt. Returns the extra file's bytes. Throws CorruptData naming the file and
/// the bad byte range or checksum, IoError on a read error.
std::optional<std::string> check_step_files(const OpenedStep& step, bool verify, int threads,
                                            const std::function<bool()>& stop = {});
/// Tests only: called by load_latest before it opens each candidate (empty: none).
void set_before_open_step_hook(std::function<void(int64_t step)> hook);
void run_before_open_step_hook(int64_t step);

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
