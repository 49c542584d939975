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

// The whole file, or "" when it does not exist or cannot be read.
std::string read_whole(const std::string& path) {
  std::string content;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return content;
  struct stat st {};
  if (::fstat(fd, &st) == 0 && st.st_size > 0) {
    content.resize(static_cast<size_t>(st.st_size));
    size_t got = 0;
    while (got < content.size()) {
      ssize_t n = ::read(fd, content.data() + got, content.size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    content.resize(got);
  }
  ::close(fd);
  return content;
}

struct ExistingLedger {
  int attempts = 0;
  int64_t last_ts_us = 0;
  bool ends_with_newline = true;
};

// The latest `ts` or `e` among up to the last 64 complete lines of `content`.
int64_t last_timestamp(const std::string& content) {
  int64_t last = 0;
  size_t end = content.size();
  for (int lines = 0; lines < 64 && end > 0; ++lines) {
    size_t begin = content.rfind('\n', end - 1);
    begin = (begin == std::string::npos) ? 0 : begin + 1;
    auto record = nlohmann::json::parse(content.begin() + static_cast<std::ptrdiff_t>(begin),
                                        content.begin() + static_cast<std::ptrdiff_t>(end), nullptr,
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

// Counts the attempts already recorded and finds the latest timestamp, reading only what is needed:
// a substring scan for attempt records (GB/s) and a JSON parse of the last lines for the timestamp.
ExistingLedger scan_existing(const std::string& path) {
  ExistingLedger info;
  const std::string content = read_whole(path);
  if (content.empty()) return info;
  info.ends_with_newline = content.back() == '\n';
  const std::string needle = "\"t\":\"attempt\"";
  for (size_t pos = content.find(needle); pos != std::string::npos; pos = content.find(needle, pos + 1)) {
    ++info.attempts;
  }
  info.last_ts_us = last_timestamp(content);
  return info;
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

void append_to_closed_ledger(const std::string& path, const std::string& line) noexcept {
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return;
  write_all(fd, line.data(), line.size());  // one write(2) of one whole line, as every record
  ::close(fd);
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

std::string LedgerWriter::prepare_path(const std::string& run_dir, int rank) {
  fs::path dir = fs::path(run_dir) / ledger::kDirName;
  std::error_code ec;
  fs::create_directories(dir, ec);
  ETTKIT_CHECK(!ec, IoError, "cannot create the ledger directory '", dir.string(), "': ", ec.message());
  return (dir / (std::string(ledger::kFilePrefix) + std::to_string(rank) + std::string(ledger::kFileSuffix)))
      .string();
}

LedgerWriter::LedgerWriter(LedgerWriterOptions options) {
  const ExistingLedger existing = scan_existing(options.path);
  attempts_before_ = existing.attempts;
  last_ts_us_ = existing.last_ts_us;
  const int fd = ::open(options.path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  ETTKIT_CHECK(fd >= 0, IoError, "cannot open the ledger '", options.path, "' for appending: ",
               std::strerror(errno));
  state_ = std::make_shared<State>(std::move(options), fd);
  queue_ = &state_->queue;
  dropped_ = &state_->dropped;
  if (!existing.ends_with_newline) {
    // A previous attempt was killed mid-line: terminate the torn line so our first record stands alone.
    write_all(fd, "\n", 1);
  }
}

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
