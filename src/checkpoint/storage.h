#pragma once
// Torch-free file-system side of the checkpointer: durable writes with XXH3 checksums, the safetensors
// header codec, the manifest codec and the directory layout (step-<N>, .tmp-step-*, latest).
//
// Layout of CKPT_DIR:
//   step-<N>/manifest.json            written last by rank 0; its presence after the rename = committed
//   step-<N>/rank-<r>.safetensors     one per rank, readable by safetensors.torch.load_file
//   step-<N>/rank-<r>.extra           the rank's non-tensor state (opaque bytes)
//   .tmp-step-<N>-<run>/              a save in progress (removed at the next start of another run)
//   .trash-*                          a retired step being deleted (rename first, then delete)
//   latest                            "step-<N>\n", replaced atomically (tmp + rename + dir fsync); a hint:
//                                     loaders never read it, and it may lag when its write failed
//   .lock                             the writer's advisory lock (flock) and who holds it (one JSON line)
//
// Commit order: every manifest carries commit_seq, one more than the highest in the directory when it was
// written (manifests from before commit_seq: 0, then ordered by created_unix_us). "Newest" always means
// the latest commit, never the largest step number: a job restarted from step 1 into a directory holding
// step 300 makes step 1 the newest. Retention and load_latest both follow this order.

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

// Exported (though not installed) so tests/cpp/checkpoint can exercise the decoders directly.
#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// A byte range to write (not owned).
struct ConstBuffer {
  const void* data;
  size_t size;
};

/// Size of the pieces a file's chunk checksums cover (the last piece may be shorter).
inline constexpr uint64_t kHashChunkBytes = uint64_t{32} << 20;

/// What a durably written file is: its size and its XXH3-64 checksum (lowercase hex, 16 digits), and the
/// XXH3-64 of each `chunk_bytes` piece of it in order (empty in manifests written before chunks existed).
/// Why both: the whole-file hash is what every earlier reader checks; the chunk hashes let a loader
/// verify the pieces on several threads (one XXH3 stream cannot be split), and name the bad byte range.
struct FileDigest {
  uint64_t size = 0;
  std::string xxh3;
  uint64_t chunk_bytes = 0;
  std::vector<std::string> chunks;
};

/// A directory held open, so that what is created, opened, renamed or removed in it goes by name relative to
/// this handle: once it is open, renaming its path or swapping a directory of that path for a symbolic link
/// redirects nothing. Move-only; closes its descriptor.
class Dir {
 public:
  Dir() = default;
  Dir(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~Dir();
  Dir(Dir&& o) noexcept : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)) {}
  Dir& operator=(Dir&& o) noexcept;
  Dir(const Dir&) = delete;
  Dir& operator=(const Dir&) = delete;
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  /// `name` inside this directory, as messages name it.
  std::string path_of(const std::string& name) const { return path_ + "/" + name; }

 private:
  int fd_ = -1;
  std::string path_;
};
/// Opens the directory `path`. Links in `path` are followed: it is the caller's own directory (the
/// checkpoint directory the user named, a memory-tier root). Throws IoError.
Dir open_directory(const std::string& path);
/// Opens the entry `name` of `parent` as a directory without ever following a symbolic link. nullopt when
/// it does not exist; CorruptData when it is a symbolic link or not a directory; IoError otherwise.
std::optional<Dir> open_subdirectory(const Dir& parent, const std::string& name);
/// mkdirat(parent, name, mode) (less the umask), then open_subdirectory. An existing directory is used
/// (the ranks of one save on one host create the same temporary directory); an existing symbolic link or
/// file under that name is refused with CorruptData. IoError for other failures.
Dir make_subdirectory(const Dir& parent, const std::string& name, unsigned mode);

/// Writes `buffers` back to back into a new file `path` (O_CREAT|O_EXCL|O_NOFOLLOW: never through a link),
/// hashing the bytes as they go, then fsyncs it. Throws IoError naming the file and the errno text (ENOSPC,
/// EFBIG, EEXIST for any existing entry, a link included); a failed write leaves a partial file that the
/// caller's temp directory owns. `mode`: the new file's mode before the umask (the memory tier's files are
/// 0600: MemoryTier::kFileMode).
FileDigest write_file_durably(const std::string& path, const std::vector<ConstBuffer>& buffers, unsigned mode = 0644);
/// The same for the new file `name` of `dir` (openat with O_NOFOLLOW: immune to a swap of `dir`'s path).
FileDigest write_file_durably(const Dir& dir, const std::string& name, const std::vector<ConstBuffer>& buffers,
                              unsigned mode = 0644);
/// XXH3-64 of a whole file (hex). Throws IoError.
std::string file_xxh3(const std::string& path);
/// fsync of a directory (so a rename or create inside it is durable). Throws IoError.
void fsync_directory(const std::string& path);
void fsync_directory(const Dir& dir);
/// mkdir -p. Throws IoError.
void make_directories(const std::string& path);
/// rm -rf that never throws (logs a warning instead).
void remove_tree_quietly(const std::string& path);
/// Size of a regular file, or nullopt when it does not exist.
std::optional<uint64_t> file_size(const std::string& path);
/// Reads `size` bytes at `offset` into `dst`; throws CorruptData when the file is shorter, IoError otherwise.
void read_exact(int fd, void* dst, uint64_t size, uint64_t offset, const std::string& path);
/// A byte range of a file to read into memory (`dst` not owned).
struct ReadRange {
  void* dst;
  uint64_t size;
  uint64_t offset;
};
/// Reads every range on up to `threads` threads (ranges are split into pieces of a few MiB, so that one
/// large tensor is read by all of them). Throws like read_exact (the first error of any thread).
void read_ranges(int fd, const std::vector<ReadRange>& ranges, int threads, const std::string& path);
/// What read_small_file reads at most: a manifest of thousands of ranks' chunk checksums is a few MiB.
inline constexpr uint64_t kMaxSmallFileBytes = uint64_t{256} << 20;
/// The most a rank's extra bytes (`rank-<r>.extra`) may hold. They are read whole into memory on load, so a
/// hostile manifest naming a huge (or sparse) file must be refused before the read; save() refuses more.
inline constexpr uint64_t kMaxExtraBytes = uint64_t{256} << 20;
/// Reads a whole (small) file, never through a symbolic link at its last component (CorruptData for a
/// link, a non-regular file or one larger than `max_bytes`). Throws IoError otherwise.
std::string read_small_file(const std::string& path, uint64_t max_bytes = kMaxSmallFileBytes);
std::string hex64(uint64_t v);
/// XXH3-64 of bytes in memory (hex).
std::string xxh3_of(const std::string& bytes);
std::string xxh3_of(const void* data, size_t size);

/// A file opened read-only; closed by its owner. Reading through it is immune to a rename or unlink of
/// the path afterwards (the open inode outlives its directory entry).
class ReadFile {
 public:
  ReadFile() = default;
  ReadFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~ReadFile();
  ReadFile(ReadFile&& o) noexcept : fd_(std::exchange(o.fd_, -1)), path_(std::move(o.path_)) {}
  ReadFile& operator=(ReadFile&& o) noexcept;
  ReadFile(const ReadFile&) = delete;
  ReadFile& operator=(const ReadFile&) = delete;
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  /// Size from fstat. Throws IoError.
  uint64_t size() const;
  /// The whole file, or at most `max_bytes` + 1 of it (a caller that gets more than it allowed knows the
  /// file is too large without holding it: a hostile file may be huge or sparse). Throws IoError.
  std::string read_all(uint64_t max_bytes = kMaxSmallFileBytes) const;

 private:
  int fd_ = -1;
  std::string path_;
};

// ---- safetensors -------------------------------------------------------------------------------------
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // relative to the data section
  uint64_t end = 0;
};
/// The 8-byte little-endian length + JSON header padded with spaces to a multiple of 8.
std::string encode_safetensors_header(const std::vector<SafetensorsEntry>& entries,
                                      const std::map<std::string, std::string>& metadata);
struct SafetensorsIndex {
  uint64_t data_offset = 0;  // where the data section starts in the file
  uint64_t data_size = 0;
  std::map<std::string, SafetensorsEntry> tensors;
  std::map<std::string, std::string> metadata;  // the header's __metadata__ (strings to strings)
};
/// The __metadata__ key under which a disk save records the XXH3-64 (hex) of a tensor it saved whole (no
/// `@offsets` in its name): "ettkit.xxh3.<name>". Why: a step resharded onto another number of ranks gives
/// every new rank one old rank's copy of such a tensor, which is right only when every old rank held the
/// same bytes (a DDP replica); these digests prove it, or show the tensor was per-rank state, from the
/// headers alone.
inline constexpr const char* kWholeTensorDigestPrefix = "ettkit.xxh3.";
/// Parses and validates the header of the safetensors file `path` whose size is `file_size`: offsets in
/// range, non-overlapping, element counts match dtype and shape. Throws CorruptData naming the file.
SafetensorsIndex read_safetensors_index(const std::string& path, uint64_t file_size);
SafetensorsIndex read_safetensors_index(const ReadFile& file);
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
/// Bytes per element of a safetensors dtype string, or 0 when unknown.
int safetensors_dtype_size(const std::string& dtype);

// ---- manifest ----------------------------------------------------------------------------------------
struct Manifest {
  int64_t step = -1;
  int world_size = 0;
  int64_t created_unix_us = 0;
  /// Position in the directory's commit history (see the commit order above); 0 in older manifests.
  uint64_t commit_seq = 0;
  std::map<std::string, FileDigest> files;  // file name (inside the step dir) -> digest
  std::map<std::string, std::string> metadata;
  std::string torch_version;
};
std::string encode_manifest(const Manifest& m);
/// Checks every field's type and range. Throws CorruptData naming `source` and the bad field (Unsupported
/// for a version newer than 1); never anything else.
Manifest decode_manifest(const std::string& text, const std::string& source);

// ---- directory layout --------------------------------------------------------------------------------
/// The largest step: step-<N> names have at most 18 digits.
constexpr int64_t kMaxStep = 999'999'999'999'999'999;

// ---- identifiers that cross the Store or a file --------------------------------------------------------
// Every value read from the Store, a manifest or a directory listing that can become part of a path or a
// Store key is checked by one of these before it is used; the name builders below refuse what they do not
// pass, so that no caller can build a path from an unchecked value.

/// Whether `s` is a run id as random_id() makes them: exactly 16 lowercase hex digits.
bool is_run_id(std::string_view s);
/// `id` when it is a run id; else CorruptData naming `source` (the Store key, the manifest) and what is valid.
const std::string& checked_run_id(const std::string& id, const std::string& source);
/// Whether `step` can name a step directory: 0 <= step <= kMaxStep.
constexpr bool is_step(int64_t step) { return step >= 0 && step <= kMaxStep; }
/// Whether `name` can be a file of a step directory: 1 to 255 bytes, no '/', no NUL, not "." or "..".
bool is_plain_file_name(std::string_view name);
/// A manifest's "ettkit.run_id" metadata (what memory-tier steps carry), checked. CorruptData naming
/// `source` when it is missing or not a run id.
std::string manifest_run_id(const Manifest& m, const std::string& source);
/// Checks a digest's fields against each other, as decode_manifest does for each file: xxh3 and chunk
/// checksums of 16 lowercase hex digits, chunk_bytes >= 1 MiB with exactly the chunks that cover `size`
/// (or no chunks at all). CorruptData naming `where` and the bad field.
void check_file_digest(const FileDigest& d, const std::string& where);
/// A JSON array of step numbers (a Store message: rank 0's candidates for load_latest), each checked with
/// is_step. CorruptData naming `source` for anything else.
std::vector<int64_t> decode_step_list(const std::string& text, const std::string& source);

/// "step-<N>". InvalidArgument unless is_step(step).
std::string step_dir_name(int64_t step);
/// ".tmp-step-<N>-<run id>". InvalidArgument unless is_step(step) and is_run_id(run_id).
std::string temp_dir_name(int64_t step, const std::string& run_id);

/// An entry of CKPT_DIR whose name starts with "step-".
struct StepEntry {
  std::string name;
  int64_t step = -1;       ///< N when the name is exactly step_dir_name(N) with N <= kMaxStep; else -1
  bool directory = false;  ///< a directory (a symbolic link is never followed: listed with its problem)
  bool committed = false;  ///< a directory whose manifest decodes and names step N
  uint64_t commit_seq = 0;
  int64_t created_unix_us = 0;
  std::string problem;  ///< why it is not committed
};
/// Whether `a` was committed after `b`: by commit_seq, then created_unix_us, then step.
bool committed_after(const StepEntry& a, const StepEntry& b);
struct StepListing {
  std::vector<StepEntry> committed;  ///< newest commit first
  std::vector<StepEntry> others;     ///< everything else named step-*, by name (never ettkit's to delete)
};
/// Classifies every step-* entry of `dir`, reading each step directory's manifest (not its data files).
/// An entry that vanishes while being read is left out.
StepListing list_steps(const std::string& dir);
/// Committed steps, newest commit first.
std::vector<int64_t> list_step_dirs(const std::string& dir);
/// What load_latest tries, in order: step-<N> directories that are not committed (each is reported as not
/// loadable), then the committed steps, newest commit first.
std::vector<int64_t> load_candidates(const std::string& dir);

/// The files of one rank of step-<N>, opened together: once open, a step that retention renames and deletes
/// still reads whole.
struct OpenedStep {
  std::string path;  ///< CKPT_DIR/step-<N>
  std::string manifest_path;
  Manifest manifest;
  ReadFile data;   ///< rank-<r>.safetensors
  ReadFile extra;  ///< rank-<r>.extra
};
/// Opens step-<N> for `rank`. nullopt when the step directory vanished before or while it was opened
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

/// Removes what a dead writer left in `dir`: the temporary directories of runs other than `run_id`
/// (.tmp-step-<N>-<run id>; `run_id` need not be a run id: "" keeps none), retired steps being deleted
/// (.trash-<name>-<id>) and `latest` temporaries (latest.tmp-<id>). Only names of exactly these forms are
/// touched, each through remove_tree_at relative to the opened directory: a symbolic link is removed as a
/// link, never followed. Returns how many were removed.
int remove_stale_temporaries(const std::string& dir, const std::string& run_id);
/// Points `latest` at step-<N>: write latest.tmp, fsync, rename, fsync dir. Throws IoError (and removes its
/// temporary file).
void update_latest(const std::string& dir, int64_t step);
/// The commit point: retires an existing step-<N> (a re-save) by rename, renames `tmp` (an entry of `dir`)
/// to step-<N>, fsyncs `dir`; every rename relative to the opened `dir`. Throws IoError.
void commit_step_directory(const std::string& dir, const std::string& tmp, int64_t step);

/// The directory's commit history as its one writer sees it (rank 0 of the job holding the lock; only the
/// writer thread calls it): the next commit's sequence number, and what happens after a commit.
class CommitHistory {
 public:
  /// 1 + the highest commit_seq in `dir` (read from the manifests at the first call, counted in memory
  /// afterwards: the directory lock makes this writer the only one).
  uint64_t next_seq(const std::string& dir);
  /// After step `step` was committed: points `latest` at it, then keeps the `keep_last` newest committed
  /// steps (by commit order; <= 0 keeps all) and retires the other committed ones (rename to .trash-*, then
  /// delete). Never touches the step just committed or an entry that is not a committed step (those get a
  /// warning, once per name). Never throws: failures are logged, the step stays committed. Returns the
  /// names retired.
  std::vector<std::string> after_commit(const std::string& dir, int64_t step, int keep_last);

 private:
  bool scanned_ = false;
  uint64_t last_seq_ = 0;
  std::vector<std::string> warned_;
};

/// An advisory lock (flock) on CKPT_DIR/.lock that the directory's writer holds for its life; the file
/// names the holder (one JSON line: job, host, pid, since). The kernel releases it when the holder's
/// process dies, so a dead job's lock is taken over by the next one without any staleness rule.
class DirectoryLock {
 public:
  DirectoryLock() = default;
  ~DirectoryLock() { release(); }
  DirectoryLock(DirectoryLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  DirectoryLock& operator=(DirectoryLock&& o) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  /// Takes the lock of `dir` and records this process in it. Returns nullopt on success (also on a file
  /// system without flock support: a warning, and nothing is held), else the holder's description. `mode`:
  /// the lock file's mode when this call creates it (before the umask).
  std::optional<std::string> try_acquire(const std::string& dir, unsigned mode = 0644);
  /// Empties the record and releases the lock. Idempotent.
  void release();
  bool held() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

/// A random 16-hex-digit id.
std::string random_id();

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
