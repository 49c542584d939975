#include "ett/ledger_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <vector>

#include "checkpoint/file_io.h"
#include "common/logging.h"
#include "ett/event_queue.h"
#include "ett/ledger_format.h"
#include "ettkit/common/config.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/phases.h"

namespace fs = std::filesystem;

namespace ettkit::ett::detail {

namespace {

// Appends `{"v":1,"t":"<type>"` to `out`.
void open_record(std::string& out, std::string_view type) {
  out += "{\"v\":";
  out += std::to_string(ledger::kFormatVersion);
  out += ",\"t\":\"";
  out += type;
  out += '"';
}

void append_int(std::string& out, std::string_view key, int64_t value) {
  char buf[24];
  auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), value);
  out += ",\"";
  out += key;
  out += "\":";
  out.append(buf, ptr);
}

void append_name(std::string& out, const char* name) {
  // Names are validated to [A-Za-z0-9_./-]: no JSON escaping needed.
  out += ",\"name\":\"";
  out += name;
  out += '"';
}

// Writes all of `data` (retrying on EINTR and short writes). Returns errno or 0.
int write_all(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t n = ::write(fd, data, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    data += n;
    size -= static_cast<size_t>(n);
  }
  return 0;
}

struct ExistingLedger {
  int attempts = 0;
  int64_t last_ts_us = 0;
  bool ends_with_newline = true;
};

// How much of the ledger is held at once while it is scanned: the file may be huge or sparse (its size is
// whatever its writer made it), so it is streamed, never read whole.
constexpr size_t kScanPiece = size_t{1} << 20;
// The tail whose lines give the latest timestamp: 64 records of a few hundred bytes fit many times over.
constexpr size_t kTailBytes = size_t{1} << 20;

// Up to `size` bytes at `offset` of `fd` (fewer at the end of the file or on an error).
std::string read_at(int fd, uint64_t offset, size_t size) {
  std::string out(size, '\0');
  size_t got = 0;
  while (got < size) {
    ssize_t n = ::pread(fd, out.data() + got, size - got, static_cast<off_t>(offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  out.resize(got);
  return out;
}

// The latest `ts` or `e` among up to the last 64 complete lines of `tail` (whose first line may be cut).
int64_t last_timestamp(const std::string& tail, bool starts_at_a_line) {
  int64_t last = 0;
  size_t end = tail.size();
  for (int lines = 0; lines < 64 && end > 0; ++lines) {
    size_t begin = tail.rfind('\n', end - 1);
    const bool first = begin == std::string::npos;
    begin = first ? 0 : begin + 1;
    if (first && !starts_at_a_line) break;  // a line cut by the tail's start is not a record
    auto record = nlohmann::json::parse(tail.begin() + static_cast<std::ptrdiff_t>(begin),
                                        tail.begin() + static_cast<std::ptrdiff_t>(end), nullptr,
                                        /*allow_exceptions=*/false);
    if (record.is_object()) {
      for (const char* key : {"ts", "e"}) {
        if (auto it = record.find(key); it != record.end() && it->is_number_integer()) {
          last = std::max(last, it->get<int64_t>());
        }
      }
    }
    if (begin == 0) break;
    end = begin - 1;
  }
  return last;
}

// Counts the attempts already recorded in the open ledger `fd` of `size` bytes and finds the latest
// timestamp, holding at most a piece and the tail: a substring scan for attempt records (GB/s), streamed,
// and a JSON parse of the last lines for the timestamp.
ExistingLedger scan_existing(int fd, uint64_t size) {
  ExistingLedger info;
  if (size == 0) return info;
  const std::string needle = "\"t\":\"attempt\"";
  std::string carry;  // the last needle.size() - 1 bytes of the previous piece: a record cut between pieces
  for (uint64_t offset = 0; offset < size;) {
    std::string piece = read_at(fd, offset, kScanPiece);
    if (piece.empty()) break;
    offset += piece.size();
    piece.insert(0, carry);
    for (size_t pos = piece.find(needle); pos != std::string::npos; pos = piece.find(needle, pos + 1)) {
      ++info.attempts;
    }
    carry = piece.substr(piece.size() - std::min(piece.size(), needle.size() - 1));
  }
  const uint64_t tail_offset = size > kTailBytes ? size - kTailBytes : 0;
  const std::string tail = read_at(fd, tail_offset, kTailBytes);
  if (tail.empty()) return info;
  info.ends_with_newline = tail.back() == '\n';
  info.last_ts_us = last_timestamp(tail, tail_offset == 0);
  return info;
}

namespace fio = ::ettkit::checkpoint::detail;

unsigned directory_mode(bool readable_by_others) { return readable_by_others ? 0755 : 0700; }
unsigned file_mode(bool readable_by_others) { return readable_by_others ? 0644 : 0600; }

// The ledger directory `ledger_dir` (RUN_DIR/ett), created when missing. Its parent is the run directory the
// user named: created like `mkdir -p` and followed like any path they give; the ledger directory itself is opened without ever
// following a link and used only when this uid owns it: another user who made it first (a shared run
// directory) chose what is in it, so it is refused rather than adopted. Throws IoError naming it.
fio::Dir open_ledger_directory(const fs::path& ledger_dir, bool readable_by_others) {
  const std::string path = ledger_dir.string();
  try {
    const fs::path parent = ledger_dir.has_parent_path() ? ledger_dir.parent_path() : fs::path(".");
    fio::make_directories(parent.string());
    fio::Dir run = fio::open_directory(parent.string());
    fio::Dir dir = fio::make_subdirectory(run, ledger_dir.filename().string(), directory_mode(readable_by_others));
    struct stat st {};
    if (::fstat(dir.fd(), &st) != 0) fio::throw_errno("stat of", path, errno);
    ETTKIT_CHECK(st.st_uid == ::geteuid(), IoError, "owned by uid ", st.st_uid, ", not by this user (uid ",
                 ::geteuid(), "): ettkit writes a ledger only into a directory this user owns; remove it or ",
                 "choose another run directory");
    return dir;
  } catch (const Error& e) {  // a link, a file, a refusal: one error kind for the Recorder's callers
    ETTKIT_THROW(IoError, "cannot use the ledger directory '", path, "': ", e.message());
  }
}

// What makes the entry the ledger's open found unfit to append to, or "" when it is fit: a regular file
// of this uid with one name (a hard link would make another of the user's files the ledger).
std::string unfit_ledger(const struct stat& st) {
  if (!S_ISREG(st.st_mode)) {
    return S_ISFIFO(st.st_mode) ? "is a FIFO, not a regular file" : "is not a regular file";
  }
  if (st.st_uid != ::geteuid()) {
    return "is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
           std::to_string(::geteuid()) + ")";
  }
  if (st.st_nlink != 1) {
    return "has " + std::to_string(st.st_nlink) + " hard links (another name of the same file could be any " +
           "file of this user's)";
  }
  return "";
}

// Opens (creating it `mode`) the ledger `name` of `dir` for appending and reading: never through a link,
// never blocking on a FIFO (O_NONBLOCK), and checked on the descriptor, so what was checked is what is
// written. A ledger writable by others is its owner's to tighten: its group and world write bits are
// dropped. Throws IoError naming the path and what would be valid.
int open_ledger_file(const fio::Dir& dir, const std::string& name, unsigned mode) {
  const std::string path = dir.path_of(name);
  const int fd = ::openat(dir.fd(), name.c_str(),
                          O_RDWR | O_APPEND | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, mode);
  if (fd < 0) {
    const int err = errno;
    struct stat st {};
    const bool link = ::fstatat(dir.fd(), name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode);
    ETTKIT_CHECK(!link, IoError, "the ledger '", path, "' is a symbolic link: ettkit never appends through one ",
                 "(it could name any file of this user's); remove it");
    ETTKIT_THROW(IoError, "cannot open the ledger '", path, "' for appending: ", std::strerror(err));
  }
  fio::OwnedFd guard;
  guard.fd = fd;
  struct stat st {};
  if (::fstat(fd, &st) != 0) fio::throw_errno("stat of the ledger", path, errno);
  const std::string why = unfit_ledger(st);
  ETTKIT_CHECK(why.empty(), IoError, "the ledger '", path, "' ", why, "; ettkit appends only to a regular file ",
               "this user owns, with one link: remove it");
  if ((st.st_mode & 022) != 0 && ::fchmod(fd, st.st_mode & 0755) == 0) {
    ETTKIT_LOG_WARN("the ETT ledger '", path, "' was writable by other users; its group and world write ",
                    "permission was removed");
  }
  guard.fd = -1;
  return fd;
}

template <typename T>
nlohmann::json or_null(const std::optional<T>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

}  // namespace

// ---- PhaseNames ----------------------------------------------------------------------------------------

uint32_t PhaseNames::intern(std::string_view name) {
  std::lock_guard lock(mutex_);
  if (auto it = index_.find(std::string(name)); it != index_.end()) return it->second;
  validate_phase_name(name);
  uint32_t id = count_.load(std::memory_order_relaxed);
  ETTKIT_EXPECTS(id < kMaxPhases, "too many distinct phase names (", kMaxPhases,
                 "); phase names must not encode per-step values — put those in the step index");
  names_.emplace_back(name);
  index_.emplace(names_.back(), id);
  published_[id].store(names_.back().c_str(), std::memory_order_release);
  count_.store(id + 1, std::memory_order_release);
  return id;
}

const char* PhaseNames::name_of(uint32_t id) const noexcept {
  const char* name = id < kMaxPhases ? published_[id].load(std::memory_order_acquire) : nullptr;
  return name ? name : "unknown";
}

// ---- records -------------------------------------------------------------------------------------------

std::string record_line(const nlohmann::json& record) {
  return record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

std::string process_exit_line(int attempt, int64_t pid, int64_t ts_us) {
  std::string line;
  open_record(line, "process_exit");
  append_int(line, "ts", ts_us);
  append_int(line, "attempt", attempt);
  append_int(line, "pid", pid);
  line += "}\n";
  return line;
}

void append_to_closed_ledger(int fd, const std::string& line) noexcept {
  write_all(fd, line.data(), line.size());  // one write(2) of one whole line, as every record
}

// ---- the writer's state --------------------------------------------------------------------------------

// Shared by the LedgerWriter and its thread (see the header: a detached thread keeps it alive).
struct LedgerWriter::State {
  State(LedgerWriterOptions opts, int descriptor)
      : options(std::move(opts)), queue(std::max<uint32_t>(options.queue_capacity, 1024)), fd(descriptor) {}
  ~State() {
    if (fd >= 0) ::close(fd);
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  const LedgerWriterOptions options;
  BoundedMpscQueue<Event> queue;
  std::atomic<uint64_t> dropped{0};
  PhaseNames names;
  const ClockAnchor anchor;

  // `mutex` guards everything below it.
  std::mutex mutex;
  std::condition_variable wake;      // the thread waits on it
  std::condition_variable progress;  // flush()/close()/the test hook wait on it
  std::vector<std::string> side_lines;  // preformatted non-hot records (attempt, config, note, end)
  uint64_t flush_requests = 0;
  uint64_t flushes_done = 0;
  uint64_t iterations = 0;
  bool stop = false;
  bool finished = false;

  // The thread's own, once started.
  const int fd;
  uint64_t reported_dropped = 0;
  bool write_error_logged = false;

  void run();

 private:
  struct Round {
    uint64_t flush_target = 0;
    bool stopping = false;
  };
  Round wait_for_round(SteadyClock::time_point next_heartbeat, std::vector<std::string>& side);
  void format(const Event& ev, std::string& out) const;
  void append_dropped(std::string& batch);
  void write_batch(const std::string& batch, bool sync);
  void end_round(const Round& round);
};

namespace {
SteadyClock::duration seconds(double s) {
  return std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(s));
}
}  // namespace

LedgerWriter::State::Round LedgerWriter::State::wait_for_round(SteadyClock::time_point next_heartbeat,
                                                                std::vector<std::string>& side) {
  std::unique_lock lock(mutex);
  auto deadline = std::min(next_heartbeat, SteadyClock::now() + seconds(options.flush_interval_s));
  wake.wait_until(lock, deadline, [&] { return stop || flush_requests > flushes_done; });
  side.swap(side_lines);
  return Round{flush_requests, stop};
}

void LedgerWriter::State::format(const Event& ev, std::string& out) const {
  switch (ev.kind) {
    case EventKind::kPhaseSteady:
    case EventKind::kPhaseEpoch:
    case EventKind::kLauncherEpoch: {
      bool steady = ev.kind == EventKind::kPhaseSteady;
      open_record(out, "phase");
      append_name(out, names.name_of(ev.id));
      append_int(out, "b", steady ? anchor.to_epoch_us(ev.a) : ev.a);
      append_int(out, "e", steady ? anchor.to_epoch_us(ev.b) : ev.b);
      if (ev.value >= 0) append_int(out, "step", ev.value);
      if (ev.kind == EventKind::kLauncherEpoch) out += ",\"src\":\"launcher\"";
      break;
    }
    case EventKind::kBackgroundEpoch:
      open_record(out, "bg");
      append_name(out, names.name_of(ev.id));
      append_int(out, "b", ev.a);
      append_int(out, "e", ev.b);
      if (ev.value >= 0) append_int(out, "step", ev.value);
      break;
    case EventKind::kStepSteady:
      open_record(out, "step");
      append_int(out, "n", ev.value);
      append_int(out, "b", anchor.to_epoch_us(ev.a));
      append_int(out, "e", anchor.to_epoch_us(ev.b));
      break;
  }
  out += "}\n";
}

void LedgerWriter::State::append_dropped(std::string& batch) {
  uint64_t dropped_now = dropped.load(std::memory_order_relaxed);
  if (dropped_now == reported_dropped) return;
  open_record(batch, "dropped");
  append_int(batch, "n", static_cast<int64_t>(dropped_now));
  append_int(batch, "ts", epoch_us());
  batch += "}\n";
  reported_dropped = dropped_now;
}

void LedgerWriter::State::write_batch(const std::string& batch, bool sync) {
  if (!batch.empty()) {
    if (int err = write_all(fd, batch.data(), batch.size()); err != 0) {
      // Never throw on the writer thread and never stop training for the ledger: log once, go on.
      if (!write_error_logged) {
        ETTKIT_LOG_ERROR("ETT ledger write to '", options.path, "' failed: ", std::strerror(err),
                         "; records are being lost");
        write_error_logged = true;
      }
      return;
    }
  }
  if (sync) ::fdatasync(fd);
}

void LedgerWriter::State::end_round(const Round& round) {
  {
    std::lock_guard lock(mutex);
    flushes_done = round.flush_target;
    ++iterations;
    if (round.stopping) finished = true;
  }
  progress.notify_all();
}

void LedgerWriter::State::run() {
  auto next_heartbeat = SteadyClock::now();
  std::string batch;
  batch.reserve(1 << 16);
  std::vector<std::string> side;
  for (;;) {
    const Round round = wait_for_round(next_heartbeat, side);
    batch.clear();
    // Side lines first: the attempt record precedes the events of its attempt in the file.
    for (auto& line : side) batch += line;
    side.clear();
    Event ev;
    while (queue.try_pop(ev)) format(ev, batch);
    append_dropped(batch);
    bool sync = options.fsync == FsyncPolicy::kAlways && !batch.empty();
    auto now = SteadyClock::now();
    if (now >= next_heartbeat && !round.stopping) {
      open_record(batch, "hb");
      append_int(batch, "ts", epoch_us());
      batch += "}\n";
      sync = sync || options.fsync != FsyncPolicy::kNever;
      next_heartbeat = now + seconds(options.heartbeat_s);
    }
    if (round.stopping) sync = options.fsync != FsyncPolicy::kNever;
    write_batch(batch, sync);
    end_round(round);
    if (round.stopping) return;
  }
}

// ---- LedgerWriter --------------------------------------------------------------------------------------

std::string LedgerWriter::prepare_path(const std::string& run_dir, int rank, bool readable_by_others) {
  const fs::path dir = fs::path(run_dir) / ledger::kDirName;
  open_ledger_directory(dir, readable_by_others);  // created, or checked: this uid's, not a link
  return (dir / (std::string(ledger::kFilePrefix) + std::to_string(rank) + std::string(ledger::kFileSuffix)))
      .string();
}

LedgerWriter::LedgerWriter(LedgerWriterOptions options) {
  const fs::path path(options.path);
  // The directory again, by handle: the file is opened relative to it, so a path swapped since
  // prepare_path() redirects nothing.
  const fio::Dir dir = open_ledger_directory(path.parent_path(), options.readable_by_others);
  const int fd = open_ledger_file(dir, path.filename().string(), file_mode(options.readable_by_others));
  struct stat st {};
  const uint64_t size = ::fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
  const ExistingLedger existing = scan_existing(fd, size);
  attempts_before_ = existing.attempts;
  last_ts_us_ = existing.last_ts_us;
  state_ = std::make_shared<State>(std::move(options), fd);
  queue_ = &state_->queue;
  dropped_ = &state_->dropped;
  if (!existing.ends_with_newline) {
    // A previous attempt was killed mid-line: terminate the torn line so our first record stands alone.
    write_all(fd, "\n", 1);
  }
}

int LedgerWriter::duplicate_descriptor() const noexcept { return ::fcntl(state_->fd, F_DUPFD_CLOEXEC, 0); }

LedgerWriter::~LedgerWriter() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(state_->mutex);
    state_->stop = true;
  }
  state_->wake.notify_one();
  thread_.join();
}

const std::string& LedgerWriter::path() const { return state_->options.path; }
const ClockAnchor& LedgerWriter::anchor() const { return state_->anchor; }
PhaseNames& LedgerWriter::names() { return state_->names; }

uint64_t LedgerWriter::dropped() const noexcept { return state_->dropped.load(std::memory_order_relaxed); }

void LedgerWriter::append_attempt_header(const AttemptHeader& h) {
  nlohmann::json meta = nlohmann::json::object();
  for (const auto& [k, v] : h.metadata) meta[k] = v;
  const nlohmann::json record = {{"v", ledger::kFormatVersion},
                                 {"t", "attempt"},
                                 {"attempt", h.attempt},
                                 {"rank", h.rank},
                                 {"world", h.world},
                                 {"pid", h.pid},
                                 {"host", h.host},
                                 {"ts", h.ts_us},
                                 {"ettkit", ETTKIT_VERSION_STRING},
                                 {"proc_start", or_null(h.proc_start_us)},
                                 {"restart_count", or_null(h.restart_count)},
                                 {"run_id", or_null(h.run_id)},
                                 {"meta", meta}};
  append_line(record_line(record));
}

void LedgerWriter::append_line(std::string line) {
  std::lock_guard lock(state_->mutex);
  state_->side_lines.push_back(std::move(line));
}

void LedgerWriter::start() {
  ETTKIT_EXPECTS(!thread_.joinable(), "LedgerWriter::start() called twice for '", path(), "'");
  thread_ = std::thread([state = state_] { state->run(); });
}

void LedgerWriter::flush(double timeout_s) {
  State& st = *state_;
  std::unique_lock lock(st.mutex);
  ETTKIT_CHECK(!st.finished, InvalidArgument, "flush() on a closed Recorder (ledger '", path(), "')");
  uint64_t target = ++st.flush_requests;
  uint64_t queue_target = st.queue.enqueued();
  st.wake.notify_one();
  bool done = st.progress.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] {
    return st.finished || (st.flushes_done >= target && st.queue.dequeued() >= queue_target);
  });
  ETTKIT_CHECK(done, Timeout, "ETT ledger flush to '", path(), "' did not finish within ", timeout_s, " s");
}

bool LedgerWriter::close(std::string end_line, double timeout_s) {
  State& st = *state_;
  bool finished;
  {
    std::unique_lock lock(st.mutex);
    st.side_lines.push_back(std::move(end_line));
    st.stop = true;
    st.wake.notify_one();
    finished = st.progress.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return st.finished; });
  }
  if (finished) {
    thread_.join();
    return true;
  }
  // The thread is stuck (e.g. a hung network file system). Shutdown must stay bounded: let it go; it owns
  // a reference to the state, so detaching is safe.
  ETTKIT_LOG_ERROR("ETT ledger '", path(), "' did not flush within ", timeout_s,
                   " s at close; the last records may be lost");
  thread_.detach();
  return false;
}

void LedgerWriter::wait_for_iterations_for_testing(int n) {
  State& st = *state_;
  std::unique_lock lock(st.mutex);
  uint64_t target = st.iterations + static_cast<uint64_t>(n);
  st.wake.notify_one();
  st.progress.wait(lock, [&] { return st.finished || st.iterations >= target; });
}

}  // namespace ettkit::ett::detail
