#include "ett/ledger_reader.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "common/logging.h"
#include "ett/flat_record.h"
#include "ett/ledger_format.h"
#include "ettkit/common/error.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace ettkit::ett::detail {

namespace {

// A record the reader skips; message() says why (it ends up in ledger.warnings). One of ettkit's errors
// (CorruptData), like everything the library throws, although the reader catches every one of them.
class CorruptRecord : public CorruptData {
 public:
  explicit CorruptRecord(std::string why, const char* file = __builtin_FILE(), int line = __builtin_LINE())
      : CorruptData(std::move(why), file, line) {}
};

// UTC epoch microseconds a ledger time may take: 1970-01-01 up to 9999-12-31T23:59:59 (a whole second, so
// that the time still prints as a date after the conversion to double seconds). A time outside this range
// is a corrupt record. The bound also keeps every difference of two ledger times (durations, E2E) far
// from int64 overflow.
constexpr int64_t kMaxEpochUs = 253'402'300'799'000'000;

// The full parser's document, seen through the same accessors as FlatRecord, so that one function reads a
// record whichever parser produced it.
class JsonRecord {
 public:
  explicit JsonRecord(const json& j) : j_(j) {}
  std::optional<int64_t> integer(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end() || !it->is_number_integer()) return std::nullopt;
    return it->get<int64_t>();
  }
  std::optional<std::string_view> string(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end() || !it->is_string()) return std::nullopt;
    return std::string_view(it->get_ref<const std::string&>());
  }
  std::optional<double> number(const char* key) const {
    auto it = j_.find(key);
    if (it == j_.end() || !it->is_number()) return std::nullopt;
    return it->get<double>();
  }

 private:
  const json& j_;
};

template <class Record>
int64_t req_int(const Record& r, const char* key) {
  auto v = r.integer(key);
  if (!v) throw CorruptRecord(std::string("'") + key + "' is missing or not an integer");
  return *v;
}

bool is_epoch_us(int64_t t) { return t >= 0 && t <= kMaxEpochUs; }

template <class Record>
int64_t req_time(const Record& r, const char* key) {
  int64_t t = req_int(r, key);
  if (!is_epoch_us(t)) {
    throw CorruptRecord(std::string("'") + key + "' = " + std::to_string(t) +
                        " is out of range for UTC epoch microseconds (1970 to 9999)");
  }
  return t;
}

class NameTable {
 public:
  explicit NameTable(std::vector<std::string>& names) : names_(names) {}
  uint32_t intern(const std::string& name) {
    auto [it, inserted] = index_.try_emplace(name, static_cast<uint32_t>(names_.size()));
    if (inserted) names_.push_back(name);
    return it->second;
  }

 private:
  std::vector<std::string>& names_;
  std::unordered_map<std::string, uint32_t> index_;
};

// Outcome of reading one record into the ledger.
enum class RecordOutcome { kRead, kSkipped, kOrphan };

// Reads one record (either parser's) into `ledger`. Throws CorruptRecord (or std::exception for a field of
// the wrong type) when the record is unusable; the caller counts it.
template <class Record>
RecordOutcome read_record(const Record& rec, std::string_view type, int rank, const fs::path& path,
                          uint64_t line_no, RankLedger& ledger, LedgerSet& set, NameTable& names) {
  if (type == "attempt") {
    AttemptLedger a;
    a.attempt = static_cast<int>(req_int(rec, "attempt"));
    a.rank = static_cast<int>(rec.integer("rank").value_or(rank));
    a.world = static_cast<int>(rec.integer("world").value_or(1));
    a.ts = req_time(rec, "ts");
    a.proc_start = rec.integer("proc_start");
    if (a.proc_start && !is_epoch_us(*a.proc_start)) {
      // Only dates process_bootstrap / worker_spawn: the attempt itself is still usable.
      set.warnings.push_back(path.string() + ":" + std::to_string(line_no) + ": proc_start " +
                             std::to_string(*a.proc_start) + " is out of range; ignored");
      a.proc_start.reset();
    }
    a.restart_count = rec.integer("restart_count");
    a.pid = rec.integer("pid").value_or(-1);
    if (auto host = rec.string("host")) a.host = std::string(*host);
    a.last_ts = a.ts;
    set.world_size = std::max(set.world_size, a.world);
    ledger.attempts.push_back(std::move(a));
    return RecordOutcome::kRead;
  }
  if (ledger.attempts.empty()) return RecordOutcome::kOrphan;
  AttemptLedger& a = ledger.attempts.back();
  if (type == "step") {
    StepRecord s{req_int(rec, "n"), req_time(rec, "b"), req_time(rec, "e")};
    if (s.e < s.b) throw CorruptRecord("ends before it begins");
    a.steps.push_back(s);
    a.activity_end = std::max(a.activity_end, s.e);
    a.last_ts = std::max(a.last_ts, s.e);
  } else if (type == "phase" || type == "bg") {
    auto name = rec.string("name");
    if (!name) throw CorruptRecord("'name' is missing or not a string");
    PhaseRecord p;
    p.b = req_time(rec, "b");
    p.e = req_time(rec, "e");
    if (p.e < p.b) throw CorruptRecord("ends before it begins");
    p.step = rec.integer("step").value_or(-1);
    p.name = names.intern(std::string(*name));
    p.launcher = rec.string("src") == std::optional<std::string_view>("launcher");
    if (type == "phase") {
      a.phases.push_back(p);
      a.activity_end = std::max(a.activity_end, p.e);
    } else {
      a.background.push_back(p);
    }
    a.last_ts = std::max(a.last_ts, p.e);
  } else if (type == "hb") {
    a.last_ts = std::max(a.last_ts, req_time(rec, "ts"));
  } else if (type == "config") {
    auto key = rec.string("key");
    auto value = rec.number("value");
    if (!key || !value) throw CorruptRecord("'key' or 'value' is missing or of the wrong type");
    a.config[std::string(*key)] = *value;
  } else if (type == "note") {
    auto key = rec.string("key");
    auto value = rec.string("value");
    if (!key || !value) throw CorruptRecord("'key' or 'value' is missing or not a string");
    a.notes[std::string(*key)] = std::string(*value);
  } else if (type == "dropped") {
    a.dropped = static_cast<uint64_t>(req_int(rec, "n"));
  } else if (type == "end") {
    a.has_end = true;
    a.end_ts = req_time(rec, "ts");
    a.last_ts = std::max(a.last_ts, a.end_ts);
    a.status = std::string(rec.string("status").value_or("clean"));
    a.detail = std::string(rec.string("detail").value_or(""));
  } else if (type == "process_exit") {
    // Written by the exit hook of the process that closed attempt `attempt` (recorder.cpp). It belongs to
    // that attempt only: a record naming another attempt or process (a line appended out of place) is
    // skipped rather than stretching an attempt it does not describe.
    const int64_t ts = req_time(rec, "ts");
    const int64_t attempt = req_int(rec, "attempt");
    const int64_t pid = rec.integer("pid").value_or(-1);
    if (attempt != a.attempt || (a.pid >= 0 && pid >= 0 && pid != a.pid)) return RecordOutcome::kSkipped;
    a.process_exit_ts = std::max(a.process_exit_ts.value_or(ts), ts);
  } else {
    // An unknown record type of a known version: written by a newer minor ettkit; skip quietly.
    return RecordOutcome::kSkipped;
  }
  return RecordOutcome::kRead;
}

// A file descriptor owned by its scope.
class FileHandle {
 public:
  explicit FileHandle(int fd = -1) : fd_(fd) {}
  FileHandle(FileHandle&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileHandle& operator=(FileHandle&& other) noexcept {
    std::swap(fd_, other.fd_);
    return *this;
  }
  FileHandle(const FileHandle&) = delete;
  FileHandle& operator=(const FileHandle&) = delete;
  ~FileHandle() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }

 private:
  int fd_;
};

std::string errno_text(int err) { return std::strerror(err); }

// Splits a file into lines, reading it in fixed chunks. Promises: a line is handed out whole only when it
// is at most `max_line` bytes; a longer one (an 8 MB line of '[', a 512 MB sparse file of NULs) is reported
// once as oversized and skipped up to its newline, so what is held at any time is one chunk and at most
// `max_line` bytes of carried line, whatever the file holds.
class BoundedLineReader {
 public:
  struct Line {
    std::string_view text;  // valid until the next call of next()
    bool terminated = true;  // ended by a newline (false: the file's last bytes)
    bool oversized = false;  // longer than max_line: text is empty and the line was skipped
  };

  BoundedLineReader(int fd, std::string path, size_t max_line)
      : fd_(fd), path_(std::move(path)), max_line_(max_line), buffer_(kChunkBytes) {}

  /// The next line, or false at the end of the file. Throws IoError when the file cannot be read.
  bool next(Line& out) {
    carry_.clear();
    for (;;) {
      if (pos_ == end_ && !fill()) return at_end(out);
      const char* begin = buffer_.data() + pos_;
      const size_t avail = end_ - pos_;
      const auto* newline = static_cast<const char*>(std::memchr(begin, '\n', avail));
      const size_t len = newline ? static_cast<size_t>(newline - begin) : avail;
      const size_t consumed = len + (newline ? 1 : 0);
      if (skipping_) {
        pos_ += consumed;
        if (newline) {
          skipping_ = false;
          out = Line{{}, true, true};
          return true;
        }
        continue;
      }
      if (carry_.size() + len > max_line_) {
        skipping_ = true;  // the rest of this line is dropped as it is read
        carry_.clear();
        continue;
      }
      pos_ += consumed;
      if (newline && carry_.empty()) {
        out = Line{std::string_view(begin, len), true, false};  // whole in the chunk: no copy
        return true;
      }
      carry_.append(begin, len);
      if (newline) {
        out = Line{carry_, true, false};
        return true;
      }
    }
  }

 private:
  static constexpr size_t kChunkBytes = size_t{64} << 10;

  bool fill() {
    for (;;) {
      const ssize_t n = ::read(fd_, buffer_.data(), buffer_.size());
      if (n < 0 && errno == EINTR) continue;
      ETTKIT_CHECK(n >= 0, IoError, "cannot read ledger file '", path_, "': ", errno_text(errno));
      pos_ = 0;
      end_ = static_cast<size_t>(n);
      return n > 0;
    }
  }

  bool at_end(Line& out) {
    if (skipping_) {
      skipping_ = false;
      out = Line{{}, false, true};
      return true;
    }
    if (carry_.empty()) return false;
    out = Line{carry_, false, false};
    return true;
  }

  int fd_;
  std::string path_;
  size_t max_line_;
  std::vector<char> buffer_;
  size_t pos_ = 0;
  size_t end_ = 0;
  std::string carry_;
  bool skipping_ = false;
};

// Whether `line` nests arrays and objects at most `max_depth` deep. Brackets inside strings do not count;
// for text that is no JSON the answer does not matter, since the full parser refuses it anyway. Run before
// the full parser, which would build one node per level: 8 MB of '[' cost it about 1.2 GB.
bool nesting_within(std::string_view line, int max_depth) {
  int depth = 0;
  bool in_string = false;
  bool escaped = false;
  for (char c : line) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

// Opens the ledger file `name` of the ledger folder `dirfd` for reading, only as a regular file of that
// folder: a symbolic link is never followed (it could name any file the reader may read) and a FIFO or a
// device is never opened (a FIFO would block the report). Returns an invalid handle, with the reason in
// `why`, for an entry that is skipped; throws IoError when a regular file cannot be opened.
FileHandle open_ledger_file(int dirfd, const std::string& name, const std::string& path, std::string& why) {
  struct stat st {};
  if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    ETTKIT_CHECK(errno == ENOENT, IoError, "cannot read ledger file '", path, "': ", errno_text(errno));
    why = "was removed while the report listed the ledger folder";
    return FileHandle();
  }
  if (S_ISLNK(st.st_mode)) {
    why = "is a symbolic link; the report reads only regular files in the ledger folder, never through a link";
    return FileHandle();
  }
  if (!S_ISREG(st.st_mode)) {
    why = "is not a regular file (a directory, FIFO, socket or device)";
    return FileHandle();
  }
  // O_NOFOLLOW and the second check close the gap between the stat and the open (a swap for a link or FIFO).
  FileHandle fd(::openat(dirfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ELOOP || errno == ENOENT) {
      why = "was replaced while the report read the ledger folder";
      return FileHandle();
    }
    ETTKIT_THROW(IoError, "cannot read ledger file '", path, "': ", errno_text(errno));
  }
  ETTKIT_CHECK(::fstat(fd.get(), &st) == 0, IoError, "cannot read ledger file '", path, "': ", errno_text(errno));
  if (!S_ISREG(st.st_mode)) {
    why = "was replaced by something that is not a regular file while the report read the ledger folder";
    return FileHandle();
  }
  return fd;
}

// Reads one ledger file into `set`. Returns false, with the reason in `why`, when the entry is skipped.
bool read_file(int dirfd, const std::string& name, const fs::path& path, int rank, LedgerSet& set,
               NameTable& names, bool fast_scan, std::string& why) {
  FileHandle fd = open_ledger_file(dirfd, name, path.string(), why);
  if (!fd.valid()) return false;
  BoundedLineReader lines(fd.get(), path.string(), ledger::kMaxLineBytes);
  RankLedger ledger;
  ledger.rank = rank;
  ledger.path = path.string();
  uint64_t line_no = 0;
  uint64_t corrupt_here = 0;
  FlatRecord flat;
  BoundedLineReader::Line current;
  while (lines.next(current)) {
    ++line_no;
    const std::string_view line = current.text;
    if (line.empty() && !current.oversized) continue;
    auto bad = [&](const std::string& why_bad = "") {
      if (!current.terminated && !current.oversized) {
        ++set.torn_lines;
      } else {
        ++set.corrupt_lines;
        if (++corrupt_here <= 3) {
          set.warnings.push_back(path.string() + ":" + std::to_string(line_no) + ": corrupt record skipped" +
                                 (why_bad.empty() ? "" : " (" + why_bad + ")"));
        }
      }
    };
    if (current.oversized) {
      bad("longer than " + std::to_string(ledger::kMaxLineBytes) + " bytes; a ledger record is far shorter");
      continue;
    }
    // Both parsers feed the same checks: the fast one reads the Recorder's own lines, the full one the rest.
    auto read = [&](const auto& rec) {
      auto version = rec.integer("v");
      auto type = rec.string("t");
      if (!version || !type) {
        bad();
        return;
      }
      ETTKIT_CHECK(*version <= ledger::kFormatVersion, Unsupported, "ledger '", path.string(), "' line ",
                   line_no, " has format version ", *version, "; this ettkit reads up to version ",
                   ledger::kFormatVersion, " — upgrade ettkit to read it");
      try {
        switch (read_record(rec, *type, rank, path, line_no, ledger, set, names)) {
          case RecordOutcome::kRead:
            ++set.records;
            break;
          case RecordOutcome::kOrphan:
            ++set.orphan_records;
            break;
          case RecordOutcome::kSkipped:
            break;
        }
      } catch (const CorruptRecord& e) {
        bad(e.message());
      } catch (const std::exception&) {
        bad();  // a field of the wrong JSON type
      }
    };
    if (fast_scan && flat.scan(line)) {
      read(flat);
      continue;
    }
    if (!nesting_within(line, ledger::kMaxNestingDepth)) {
      bad("nested deeper than " + std::to_string(ledger::kMaxNestingDepth) + " levels");
      continue;
    }
    json doc = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!doc.is_object()) {
      bad();
      continue;
    }
    read(JsonRecord(doc));
  }
  if (corrupt_here > 3) {
    set.warnings.push_back(path.string() + ": " + std::to_string(corrupt_here) + " corrupt records skipped in all");
  }
  // Processes phases in time order later; sort once here.
  for (auto& a : ledger.attempts) {
    std::sort(a.steps.begin(), a.steps.end(), [](const StepRecord& x, const StepRecord& y) { return x.b < y.b; });
    if (a.dropped > 0) {
      set.warnings.push_back(path.string() + ": attempt " + std::to_string(a.attempt) + " dropped " +
                             std::to_string(a.dropped) + " events (recorder queue full)");
    }
  }
  set.ranks.push_back(std::move(ledger));
  return true;
}

bool is_ledger_file_name(const std::string& name) {
  return name.size() > ledger::kFilePrefix.size() + ledger::kFileSuffix.size() &&
         name.rfind(ledger::kFilePrefix, 0) == 0 &&
         name.compare(name.size() - ledger::kFileSuffix.size(), ledger::kFileSuffix.size(), ledger::kFileSuffix) == 0;
}

// The rank of "rank-<r>.jsonl" exactly as the Recorder writes it (std::to_string of a non-negative int), or
// nullopt. A stray copy ("rank-99999999999", "rank-007") must neither crash the report nor read as a
// second file of an existing rank.
std::optional<int> rank_of_ledger_file(const std::string& name) {
  std::string_view digits(name);
  digits.remove_prefix(ledger::kFilePrefix.size());
  digits.remove_suffix(ledger::kFileSuffix.size());
  int rank = 0;
  auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), rank);
  if (err != std::errc() || end != digits.data() + digits.size() || rank < 0) return std::nullopt;
  if (std::to_string(rank) != digits) return std::nullopt;  // leading zeros or a sign
  return rank;
}

// Opens the run directory the caller named (following a link there: the caller chose the path). A missing
// directory is the caller's mistake (InvalidArgument); anything else the OS refuses is an IoError.
FileHandle open_run_dir(const std::string& run_dir) {
  FileHandle fd(::open(run_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.valid()) return fd;
  ETTKIT_EXPECTS(errno != ENOENT && errno != ENOTDIR, "run directory '", run_dir,
                 "' does not exist or is not a directory; pass the directory given to ettkit.ett.Recorder");
  ETTKIT_THROW(IoError, "cannot open run directory '", run_dir, "': ", errno_text(errno));
}

// Opens RUN_DIR/ett as a directory of the run directory itself: a symbolic link there is refused, so that a
// run directory cannot make the report read ledger files elsewhere.
FileHandle open_ledger_folder(int run_fd, const std::string& run_dir, const fs::path& dir) {
  const std::string name(ledger::kDirName);
  FileHandle fd(::openat(run_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (fd.valid()) return fd;
  const int err = errno;
  struct stat st {};
  const bool is_link = ::fstatat(run_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode);
  ETTKIT_CHECK(!is_link, IoError, "ledger folder '", dir.string(),
               "' is a symbolic link; the report reads RUN_DIR/ett/ only as a directory of the run directory, "
               "never through a link: pass the run directory the link points into instead");
  ETTKIT_EXPECTS(err != ENOENT && err != ENOTDIR, "run directory '", run_dir, "' has no '", ledger::kDirName,
                 "/' ledger folder; it is written by ettkit.ett.Recorder(run_dir)");
  ETTKIT_THROW(IoError, "cannot open ledger folder '", dir.string(), "': ", errno_text(err));
}

// Entries of the ledger folder that were not read, each named in ledger.warnings (and logged) up to a
// bound: a folder of a million stray files must not grow the warnings, the log or an error message with it.
class SkippedEntries {
 public:
  explicit SkippedEntries(LedgerSet& set) : set_(set) {}
  void add(const std::string& path, const std::string& why) {
    if (++count_ > kListed) return;
    set_.warnings.push_back(path + ": skipped; " + why);
    ETTKIT_LOG_WARN(set_.warnings.back());
    summary_ += (summary_.empty() ? " Skipped: " : ", ") + path + " (" + why + ")";
  }
  // " Skipped: <path> (<why>), ..." for the listed entries, and how many more: for the error that nothing
  // could be read.
  std::string summary() const {
    return count_ > kListed ? summary_ + " and " + std::to_string(count_ - kListed) + " more" : summary_;
  }
  void finish() {
    if (count_ > kListed) {
      set_.warnings.push_back(std::to_string(count_ - kListed) + " more entries of the ledger folder skipped");
    }
  }

 private:
  static constexpr uint64_t kListed = 10;
  LedgerSet& set_;
  uint64_t count_ = 0;
  std::string summary_;
};

// The names in the ledger folder that are ledger files, with their ranks, sorted by rank. Names only: what
// each entry is gets checked when it is opened (open_ledger_file), so an entry of any other name (a link
// loop, a FIFO) is never looked at.
std::vector<std::pair<int, std::string>> list_ledger_files(int dir_fd, const fs::path& dir,
                                                           SkippedEntries& skipped) {
  DIR* listing = ::fdopendir(::fcntl(dir_fd, F_DUPFD_CLOEXEC, 0));  // owns the copy; dir_fd stays for openat
  ETTKIT_CHECK(listing != nullptr, IoError, "cannot list ledger folder '", dir.string(), "': ", errno_text(errno));
  std::vector<std::pair<int, std::string>> files;
  for (;;) {
    errno = 0;
    const dirent* entry = ::readdir(listing);
    if (entry == nullptr) break;
    const std::string name = entry->d_name;
    if (!is_ledger_file_name(name)) continue;
    std::optional<int> rank = rank_of_ledger_file(name);
    if (!rank) {
      skipped.add((dir / name).string(), "a ledger file is named rank-<r>.jsonl with r a rank in plain decimal "
                                         "(0 to 2147483647, no leading zeros)");
      continue;
    }
    files.emplace_back(*rank, name);
  }
  const int err = errno;
  ::closedir(listing);
  ETTKIT_CHECK(err == 0, IoError, "cannot list ledger folder '", dir.string(), "': ", errno_text(err));
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

LedgerSet read_ledger_dir(const std::string& run_dir) {
  const FileHandle run_fd = open_run_dir(run_dir);
  const fs::path dir = fs::path(run_dir) / ledger::kDirName;
  const FileHandle dir_fd = open_ledger_folder(run_fd.get(), run_dir, dir);
  LedgerSet set;
  SkippedEntries skipped(set);
  const std::vector<std::pair<int, std::string>> files = list_ledger_files(dir_fd.get(), dir, skipped);
  NameTable names(set.names);
  // ETTKIT_LEDGER_FULL_PARSER=1 reads every line with the full JSON parser: the fast scanner's reference,
  // for measuring what it saves and for checking that a report does not depend on it.
  const char* full = std::getenv("ETTKIT_LEDGER_FULL_PARSER");
  const bool fast_scan = full == nullptr || std::string_view(full) != "1";
  for (const auto& [rank, name] : files) {
    const fs::path path = dir / name;
    std::string why;
    if (read_file(dir_fd.get(), name, path, rank, set, names, fast_scan, why)) {
      ++set.files;
      continue;
    }
    skipped.add(path.string(), "it " + why);
  }
  skipped.finish();
  ETTKIT_EXPECTS(set.files > 0, "run directory '", run_dir, "' has no ledger files (", dir.string(),
                 "/rank-<r>.jsonl); was the Recorder created with this run_dir?", skipped.summary());
  bool any_attempt = false;
  for (const auto& r : set.ranks) any_attempt = any_attempt || !r.attempts.empty();
  ETTKIT_EXPECTS(any_attempt, "ledger files under '", dir.string(),
                 "' hold no attempt record (empty or corrupt); nothing to report");
  if (set.corrupt_lines > 0) {
    ETTKIT_LOG_WARN("ETT ledger under '", dir.string(), "': ", set.corrupt_lines, " corrupt lines skipped");
  }
  return set;
}

}  // namespace ettkit::ett::detail
