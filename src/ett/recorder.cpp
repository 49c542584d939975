#include "ettkit/ett/recorder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/logging.h"
#include "ett/event_queue.h"
#include "ett/ledger_format.h"
#include "ett/process_info.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/config.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/phases.h"

#if defined(ETTKIT_HAVE_NVTX)
#include <nvtx3/nvToolsExt.h>
#endif

namespace fs = std::filesystem;

namespace ettkit::ett {

namespace {

constexpr uint32_t kMaxPhases = 4096;

enum class EventKind : uint8_t {
  kPhaseSteady,       // a, b: steady ns
  kPhaseEpoch,        // a, b: epoch us
  kLauncherEpoch,     // a, b: epoch us; a phase the launcher reported (before this process existed)
  kBackgroundEpoch,   // a, b: epoch us
  kStepSteady,        // a, b: steady ns; value: step index
};

// 32 bytes: two events per cache line.
struct Event {
  int64_t a;
  int64_t b;
  int64_t value;  // step index (or -1)
  uint32_t id;
  EventKind kind;
};

int64_t env_or(const char* name, int64_t fallback) { return detail::env_int(name).value_or(fallback); }

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

// Counts the attempts already recorded and finds the latest timestamp, reading only what is needed:
// a substring scan for attempt records (GB/s) and a JSON parse of the last lines for the timestamp.
ExistingLedger scan_existing(const std::string& path) {
  ExistingLedger info;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return info;
  std::string content;
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
  if (content.empty()) return info;
  info.ends_with_newline = content.back() == '\n';
  const std::string needle = "\"t\":\"attempt\"";
  for (size_t pos = content.find(needle); pos != std::string::npos; pos = content.find(needle, pos + 1)) {
    ++info.attempts;
  }
  // Last timestamps: parse up to the last 64 complete lines.
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
          info.last_ts_us = std::max(info.last_ts_us, it->get<int64_t>());
        }
      }
    }
    if (begin == 0) break;
    end = begin - 1;
  }
  return info;
}

// Parses {"<phase>": [begin_epoch_s, end_epoch_s], ...}; throws InvalidArgument naming `source`.
std::vector<LauncherPhase> parse_launcher_phases(std::string_view json, std::string_view source) {
  auto doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  ETTKIT_EXPECTS(doc.is_object(), source,
                 " is not a JSON object; expected {\"scheduling\": [begin_epoch_s, end_epoch_s], ...}");
  std::vector<LauncherPhase> out;
  for (const auto& [name, value] : doc.items()) {
    ETTKIT_EXPECTS(value.is_array() && value.size() == 2 && value[0].is_number() && value[1].is_number(),
                   source, "[\"", name, "\"] must be [begin_epoch_s, end_epoch_s] (two numbers), got ",
                   value.dump());
    double b = value[0].get<double>();
    double e = value[1].get<double>();
    ETTKIT_EXPECTS(std::isfinite(b) && std::isfinite(e) && b > 0 && e >= b, source, "[\"", name,
                   "\"] = [", b, ", ", e, "] must satisfy 0 < begin <= end (epoch seconds)");
    validate_phase_name(name);
    out.push_back({name, static_cast<int64_t>(std::llround(b * 1e6)), static_cast<int64_t>(std::llround(e * 1e6))});
  }
  return out;
}

// ---- the process_exit record ---------------------------------------------------------------------------
// A clean attempt does not end when its recorder closes: the interpreter, the process group and the
// libraries still tear down (seconds; minutes for NCCL on large jobs). The process's last instant is
// appended to the ledger of every attempt this process closed since it last constructed a Recorder, by a
// hook that runs as late as a process
// that exits normally allows: an ELF destructor of this library, which the dynamic loader runs after
// Python's finalization, every atexit handler and every C++ static destructor. It needs neither Python nor
// the Recorder (closed and destroyed by then): only what close() registered below. A process that is
// killed or leaves by _exit() (os._exit, a forked multiprocessing worker) writes none; the report then
// ends the attempt at its end record, as before.

struct ClosedLedger {
  std::string path;  // absolute: the process may change directory before it exits
  int attempt = 0;
  pid_t pid = 0;     // the process that closed it: a forked child that exits must not write for its parent
};

// Leaked on purpose: a static container would be destroyed before the ELF destructor that reads it runs.
struct ClosedLedgers {
  std::mutex mutex;
  std::vector<ClosedLedger> entries;  // one per ledger path (its latest attempt), oldest first
};
ClosedLedgers& closed_ledgers() {
  static auto* ledgers = new ClosedLedgers();
  return *ledgers;
}
// A process that closes recorders on many run directories (a test suite) pays at most this many open(2)s at
// exit; the oldest entries go first.
constexpr size_t kMaxClosedLedgers = 64;

void remember_closed_ledger(const std::string& ledger_path, int attempt) {
  std::error_code ec;
  fs::path path = fs::absolute(ledger_path, ec);
  if (ec) return;  // no process_exit record rather than one in the wrong file
  ClosedLedgers& ledgers = closed_ledgers();
  std::lock_guard lock(ledgers.mutex);
  auto& entries = ledgers.entries;
  std::erase_if(entries, [&](const ClosedLedger& e) { return e.path == path.string(); });
  if (entries.size() >= kMaxClosedLedgers) entries.erase(entries.begin());
  entries.push_back({path.string(), attempt, ::getpid()});
}

// A Recorder constructed after others closed: the process went on to record something else (a notebook's
// next run, an in-process restart), so its exit no longer ends the attempts it closed before.
void forget_closed_ledgers() {
  ClosedLedgers& ledgers = closed_ledgers();
  std::lock_guard lock(ledgers.mutex);
  ledgers.entries.clear();
}

// The line `{"v":1,"t":"process_exit","ts":...,"attempt":...,"pid":...}` for an entry.
std::string process_exit_line(const ClosedLedger& entry, int64_t ts) {
  std::string line;
  open_record(line, "process_exit");
  append_int(line, "ts", ts);
  append_int(line, "attempt", entry.attempt);
  append_int(line, "pid", entry.pid);
  line += "}\n";
  return line;
}

__attribute__((destructor)) void write_process_exit_records() {
  ClosedLedgers& ledgers = closed_ledgers();
  // try_lock: a thread that held the lock when exit() began must not hang the process's exit.
  if (!ledgers.mutex.try_lock()) return;
  std::lock_guard lock(ledgers.mutex, std::adopt_lock);
  const pid_t self = ::getpid();
  const int64_t ts = epoch_us();
  for (const auto& entry : ledgers.entries) {
    if (entry.pid != self) continue;
    // Never created, never through a link: a ledger removed or replaced since close() gets nothing.
    const int fd = ::open(entry.path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) continue;
    const std::string line = process_exit_line(entry, ts);
    write_all(fd, line.data(), line.size());  // one write(2) of one whole line, as every record
    ::close(fd);
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------------
// Writer state shared between the Recorder and its writer thread. Held by shared_ptr so that a writer
// stuck in write(2) on a dead file system past the shutdown deadline can be detached safely.
struct WriterState {
  explicit WriterState(uint32_t capacity) : queue(capacity) {}

  detail::BoundedMpscQueue<Event> queue;
  std::atomic<uint64_t> dropped{0};
  std::atomic<bool> nvtx{false};

  // Interned phase names: `names` owns the strings (deque: stable addresses), `name_ptrs` publishes them
  // lock-free to the hot path and the writer. `names_mutex` guards `names` and `name_index`.
  std::mutex names_mutex;
  std::deque<std::string> names;
  std::unordered_map<std::string, uint32_t> name_index;
  std::array<std::atomic<const char*>, kMaxPhases> name_ptrs{};
  std::atomic<uint32_t> name_count{0};

  // `mutex` guards everything below it.
  std::mutex mutex;
  std::condition_variable wake;      // writer waits on it
  std::condition_variable progress;  // flush()/close()/test hooks wait on it
  std::vector<std::string> side_lines;  // preformatted non-hot records (attempt, config, end)
  uint64_t flush_requests = 0;
  uint64_t flushes_done = 0;
  uint64_t iterations = 0;
  bool stop = false;
  bool finished = false;

  // Owned by the writer thread only after start.
  int fd = -1;
  std::string path;
  ClockAnchor anchor;
  double heartbeat_s = 1.0;
  double flush_interval_s = 0.1;
  FsyncPolicy fsync = FsyncPolicy::kHeartbeat;
  uint64_t reported_dropped = 0;
  bool write_error_logged = false;

  ~WriterState() {
    if (fd >= 0) ::close(fd);
  }

  const char* name_of(uint32_t id) const {
    const char* name = id < kMaxPhases ? name_ptrs[id].load(std::memory_order_acquire) : nullptr;
    return name ? name : "unknown";
  }

  void format(const Event& ev, std::string& out) {
    switch (ev.kind) {
      case EventKind::kPhaseSteady:
      case EventKind::kPhaseEpoch:
      case EventKind::kLauncherEpoch: {
        bool steady = ev.kind == EventKind::kPhaseSteady;
        open_record(out, "phase");
        append_name(out, name_of(ev.id));
        append_int(out, "b", steady ? anchor.to_epoch_us(ev.a) : ev.a);
        append_int(out, "e", steady ? anchor.to_epoch_us(ev.b) : ev.b);
        if (ev.value >= 0) append_int(out, "step", ev.value);
        if (ev.kind == EventKind::kLauncherEpoch) out += ",\"src\":\"launcher\"";
        break;
      }
      case EventKind::kBackgroundEpoch:
        open_record(out, "bg");
        append_name(out, name_of(ev.id));
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

  void write_batch(const std::string& batch, bool sync) {
    if (!batch.empty()) {
      if (int err = write_all(fd, batch.data(), batch.size()); err != 0) {
        // Never throw on the writer thread and never stop training for the ledger: log once, go on.
        if (!write_error_logged) {
          ETTKIT_LOG_ERROR("ETT ledger write to '", path, "' failed: ", std::strerror(err),
                           "; records are being lost");
          write_error_logged = true;
        }
        return;
      }
    }
    if (sync) ::fdatasync(fd);
  }

  void run() {
    auto next_heartbeat = SteadyClock::now();
    std::string batch;
    batch.reserve(1 << 16);
    std::vector<std::string> side;
    for (;;) {
      uint64_t flush_target;
      bool stopping;
      {
        std::unique_lock lock(mutex);
        auto deadline = std::min(next_heartbeat, SteadyClock::now() + std::chrono::duration_cast<
                                                                          SteadyClock::duration>(
                                                                          std::chrono::duration<double>(
                                                                              flush_interval_s)));
        wake.wait_until(lock, deadline, [&] { return stop || flush_requests > flushes_done; });
        flush_target = flush_requests;
        stopping = stop;
        side.swap(side_lines);
      }
      batch.clear();
      // Side lines first: the attempt record precedes the events of its attempt in the file.
      for (auto& line : side) batch += line;
      side.clear();
      Event ev;
      while (queue.try_pop(ev)) format(ev, batch);
      uint64_t dropped_now = dropped.load(std::memory_order_relaxed);
      if (dropped_now != reported_dropped) {
        open_record(batch, "dropped");
        append_int(batch, "n", static_cast<int64_t>(dropped_now));
        append_int(batch, "ts", epoch_us());
        batch += "}\n";
        reported_dropped = dropped_now;
      }
      bool sync = fsync == FsyncPolicy::kAlways && !batch.empty();
      auto now = SteadyClock::now();
      if (now >= next_heartbeat && !stopping) {
        open_record(batch, "hb");
        append_int(batch, "ts", epoch_us());
        batch += "}\n";
        sync = sync || fsync != FsyncPolicy::kNever;
        next_heartbeat =
            now + std::chrono::duration_cast<SteadyClock::duration>(std::chrono::duration<double>(heartbeat_s));
      }
      if (stopping) sync = fsync != FsyncPolicy::kNever;
      write_batch(batch, sync);
      {
        std::lock_guard lock(mutex);
        flushes_done = flush_target;
        ++iterations;
        if (stopping) finished = true;
      }
      progress.notify_all();
      if (stopping) return;
    }
  }
};

class Recorder::Impl {
 public:
  RecorderOptions options;
  std::shared_ptr<WriterState> state;
  std::thread writer;
  int rank = 0;
  int world_size = 1;
  int attempt = 0;
  std::string ledger_path;
  int64_t start_steady_ns = 0;
  int64_t last_ledger_ts_us = 0;
  // Step boundaries (steady ns): the first step of the attempt starts at the latest phase end.
  std::atomic<int64_t> last_step_mark{-1};
  std::atomic<int64_t> last_phase_end{0};
  std::atomic<bool> closed{false};

  // Only reached with a joinable writer if the constructor throws after starting it: stop the thread
  // (destroying a joinable std::thread terminates the process).
  ~Impl() {
    if (writer.joinable()) {
      {
        std::lock_guard lock(state->mutex);
        state->stop = true;
      }
      state->wake.notify_one();
      writer.join();
    }
  }
};

// ------------------------------------------------------------------------------------------------------
Recorder::Recorder(RecorderOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  ETTKIT_EXPECTS(!options.run_dir.empty(), "RecorderOptions.run_dir is empty; pass the run directory");
  ETTKIT_EXPECTS(std::isfinite(options.heartbeat_s) && options.heartbeat_s > 0,
                 "RecorderOptions.heartbeat_s=", options.heartbeat_s, " must be a positive number of seconds");
  ETTKIT_EXPECTS(std::isfinite(options.flush_interval_s) && options.flush_interval_s > 0,
                 "RecorderOptions.flush_interval_s=", options.flush_interval_s,
                 " must be a positive number of seconds");
  ETTKIT_EXPECTS(std::isfinite(options.shutdown_timeout_s) && options.shutdown_timeout_s >= 0,
                 "RecorderOptions.shutdown_timeout_s=", options.shutdown_timeout_s, " must be >= 0");
  im.rank = options.rank >= 0 ? options.rank : static_cast<int>(env_or("RANK", 0));
  im.world_size = options.world_size > 0 ? options.world_size : static_cast<int>(env_or("WORLD_SIZE", 1));
  ETTKIT_EXPECTS(im.rank >= 0 && im.rank < im.world_size, "rank ", im.rank, " is outside [0, world_size=",
                 im.world_size, ")");

  fs::path dir = fs::path(options.run_dir) / ledger::kDirName;
  std::error_code ec;
  fs::create_directories(dir, ec);
  ETTKIT_CHECK(!ec, IoError, "cannot create the ledger directory '", dir.string(), "': ", ec.message());
  im.ledger_path =
      (dir / (std::string(ledger::kFilePrefix) + std::to_string(im.rank) + std::string(ledger::kFileSuffix)))
          .string();

  // Validated before anything is written: a bad variable fails construction and leaves the ledger alone.
  std::vector<LauncherPhase> launcher_phases;
  if (const char* env = std::getenv("ETTKIT_LAUNCHER_PHASES");
      options.launcher_phases_from_env && env != nullptr && *env != '\0') {
    launcher_phases = parse_launcher_phases(env, "ETTKIT_LAUNCHER_PHASES");
  }

  ExistingLedger existing = scan_existing(im.ledger_path);
  im.attempt = existing.attempts;
  im.last_ledger_ts_us = existing.last_ts_us;

  auto state = std::make_shared<WriterState>(std::max<uint32_t>(options.queue_capacity, 1024));
  state->path = im.ledger_path;
  state->heartbeat_s = options.heartbeat_s;
  state->flush_interval_s = options.flush_interval_s;
  state->fsync = options.fsync;
  state->fd = ::open(im.ledger_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  ETTKIT_CHECK(state->fd >= 0, IoError, "cannot open the ledger '", im.ledger_path, "' for appending: ",
               std::strerror(errno));
  if (!existing.ends_with_newline) {
    // A previous attempt was killed mid-line: terminate the torn line so our first record stands alone.
    write_all(state->fd, "\n", 1);
  }
  bool nvtx_env = env_or("ETTKIT_NVTX", 0) != 0;
  state->nvtx.store((options.nvtx || nvtx_env) && ETTKIT_WITH_CUDA, std::memory_order_relaxed);
  im.state = state;
  im.start_steady_ns = steady_ns();
  im.last_phase_end.store(im.start_steady_ns, std::memory_order_relaxed);
  int64_t start_us = state->anchor.to_epoch_us(im.start_steady_ns);

  // The attempt record (non-hot path: nlohmann for escaping of user metadata).
  nlohmann::json record = {{"v", ledger::kFormatVersion},
                           {"t", "attempt"},
                           {"attempt", im.attempt},
                           {"rank", im.rank},
                           {"world", im.world_size},
                           {"pid", static_cast<int64_t>(::getpid())},
                           {"host", detail::host_name()},
                           {"ts", start_us},
                           {"ettkit", ETTKIT_VERSION_STRING}};
  auto proc_start = detail::process_start_epoch_us();
  record["proc_start"] = proc_start ? nlohmann::json(*proc_start) : nlohmann::json(nullptr);
  auto restart = detail::env_int("TORCHELASTIC_RESTART_COUNT");
  record["restart_count"] = restart ? nlohmann::json(*restart) : nlohmann::json(nullptr);
  const char* run_id = std::getenv("TORCHELASTIC_RUN_ID");
  record["run_id"] = run_id ? nlohmann::json(run_id) : nlohmann::json(nullptr);
  nlohmann::json meta = nlohmann::json::object();
  for (const auto& [k, v] : options.metadata) meta[k] = v;
  record["meta"] = meta;
  state->side_lines.push_back(record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
  im.options = std::move(options);

  im.writer = std::thread([state] { state->run(); });

  // Interpreter start, imports, argument parsing: everything between exec and the recorder.
  if (proc_start && *proc_start < start_us) {
    record_phase(phase_id(phase::kProcessBootstrap), *proc_start, start_us);
  }
  record_launcher_phases(launcher_phases);
  forget_closed_ledgers();
  // Last: a constructor that throws must not leave a pointer to a dead Recorder in the stack.
  make_current();
}

Recorder::~Recorder() {
  try {
    // Destroyed while an exception unwinds the stack: the attempt did not end cleanly.
    if (std::uncaught_exceptions() > 0) {
      close(EndStatus::kException, "C++ exception (destroyed during stack unwinding)");
    } else {
      close(EndStatus::kClean);
    }
  } catch (...) {
    // Destructors never throw; close() already logged the problem.
  }
}

uint32_t Recorder::phase_id(std::string_view name) {
  WriterState& st = *impl_->state;
  std::lock_guard lock(st.names_mutex);
  if (auto it = st.name_index.find(std::string(name)); it != st.name_index.end()) return it->second;
  validate_phase_name(name);
  uint32_t id = st.name_count.load(std::memory_order_relaxed);
  ETTKIT_EXPECTS(id < kMaxPhases, "too many distinct phase names (", kMaxPhases,
                 "); phase names must not encode per-step values — put those in the step index");
  st.names.emplace_back(name);
  st.name_index.emplace(st.names.back(), id);
  st.name_ptrs[id].store(st.names.back().c_str(), std::memory_order_release);
  st.name_count.store(id + 1, std::memory_order_release);
  return id;
}

void Recorder::push_phase(uint32_t id, int64_t begin_ns, int64_t end_ns, int64_t step) {
  Impl& im = *impl_;
  int64_t prev = im.last_phase_end.load(std::memory_order_relaxed);
  while (prev < end_ns &&
         !im.last_phase_end.compare_exchange_weak(prev, end_ns, std::memory_order_relaxed)) {
  }
  if (!im.state->queue.try_push(Event{begin_ns, end_ns, step, id, EventKind::kPhaseSteady})) {
    im.state->dropped.fetch_add(1, std::memory_order_relaxed);
  }
}

void Recorder::record_phase(uint32_t id, int64_t begin_us, int64_t end_us, int64_t step) {
  ETTKIT_EXPECTS(end_us >= begin_us, "record_phase: end_us=", end_us, " is before begin_us=", begin_us);
  // Like a ScopedPhase, a recorded phase ends the idle gap before the first step (e.g. start-up stages
  // recorded by a StageGraph): map its end onto the steady clock and move the mark forward.
  Impl& im = *impl_;
  int64_t now_ns = steady_ns();
  int64_t end_ns = std::min(now_ns, now_ns - (epoch_us() - end_us) * 1000);
  int64_t prev = im.last_phase_end.load(std::memory_order_relaxed);
  while (prev < end_ns && !im.last_phase_end.compare_exchange_weak(prev, end_ns, std::memory_order_relaxed)) {
  }
  if (!impl_->state->queue.try_push(Event{begin_us, end_us, step, id, EventKind::kPhaseEpoch})) {
    impl_->state->dropped.fetch_add(1, std::memory_order_relaxed);
  }
}

void Recorder::record_background(uint32_t id, int64_t begin_us, int64_t end_us, int64_t step) {
  ETTKIT_EXPECTS(end_us >= begin_us, "record_background: end_us=", end_us, " is before begin_us=", begin_us);
  if (!impl_->state->queue.try_push(Event{begin_us, end_us, step, id, EventKind::kBackgroundEpoch})) {
    impl_->state->dropped.fetch_add(1, std::memory_order_relaxed);
  }
}

void Recorder::step(int64_t n) {
  // A negative number is not a step (-1 is the ledger's "no step" in phase records): refused, not recorded.
  ETTKIT_EXPECTS(n >= 0, "step: global step numbers are >= 0; got ", n);
  Impl& im = *impl_;
  int64_t now = steady_ns();
  int64_t prev = im.last_step_mark.exchange(now, std::memory_order_relaxed);
  int64_t begin = prev >= 0 ? prev : im.last_phase_end.load(std::memory_order_relaxed);
  if (!im.state->queue.try_push(Event{begin, now, n, 0, EventKind::kStepSteady})) {
    im.state->dropped.fetch_add(1, std::memory_order_relaxed);
  }
}

void Recorder::step_interval(int64_t n, int64_t begin_steady_ns, int64_t end_steady_ns) {
  ETTKIT_EXPECTS(n >= 0, "step_interval: global step numbers are >= 0; got ", n);
  ETTKIT_EXPECTS(end_steady_ns >= begin_steady_ns, "step_interval: end is before begin for step ", n);
  impl_->last_step_mark.store(end_steady_ns, std::memory_order_relaxed);
  if (!impl_->state->queue.try_push(Event{begin_steady_ns, end_steady_ns, n, 0, EventKind::kStepSteady})) {
    impl_->state->dropped.fetch_add(1, std::memory_order_relaxed);
  }
}

void Recorder::set_config(std::string_view key, double value) {
  validate_phase_name(key);  // same character set: keys go into JSON unescaped elsewhere
  ETTKIT_EXPECTS(std::isfinite(value), "config '", key, "' must be finite, got ", value);
  nlohmann::json record = {{"v", ledger::kFormatVersion}, {"t", "config"}, {"key", key}, {"value", value}};
  std::lock_guard lock(impl_->state->mutex);
  impl_->state->side_lines.push_back(record.dump() + "\n");
}

void Recorder::set_note(std::string_view key, std::string_view value) {
  validate_phase_name(key);
  ETTKIT_EXPECTS(value.size() <= kMaxNoteBytes, "note '", key, "' is ", value.size(), " bytes; at most ",
                 kMaxNoteBytes, " are recorded (shorten it)");
  nlohmann::json record = {{"v", ledger::kFormatVersion}, {"t", "note"}, {"key", key}, {"value", value}};
  // Invalid UTF-8 is replaced rather than refused: a note often carries an exception's text.
  std::string line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard lock(impl_->state->mutex);
  impl_->state->side_lines.push_back(std::move(line));
}

void Recorder::record_launcher_phases_json(std::string_view json, std::string_view source) {
  record_launcher_phases(parse_launcher_phases(json, source));
}

void Recorder::record_launcher_phases(const std::vector<LauncherPhase>& phases) {
  for (const auto& p : phases) {
    // A restart reuses its launcher's environment: phases already behind the ledger's last record belong
    // to an earlier attempt.
    if (p.end_us <= impl_->last_ledger_ts_us) continue;
    if (!impl_->state->queue.try_push(Event{p.begin_us, p.end_us, -1, phase_id(p.name), EventKind::kLauncherEpoch})) {
      impl_->state->dropped.fetch_add(1, std::memory_order_relaxed);
    }
  }
}

void Recorder::flush(double timeout_s) {
  WriterState& st = *impl_->state;
  std::unique_lock lock(st.mutex);
  ETTKIT_CHECK(!st.finished, InvalidArgument, "flush() on a closed Recorder (ledger '", impl_->ledger_path, "')");
  uint64_t target = ++st.flush_requests;
  uint64_t queue_target = st.queue.enqueued();
  st.wake.notify_one();
  bool done = st.progress.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] {
    return st.finished || (st.flushes_done >= target && st.queue.dequeued() >= queue_target);
  });
  ETTKIT_CHECK(done, Timeout, "ETT ledger flush to '", impl_->ledger_path, "' did not finish within ",
               timeout_s, " s");
}

void Recorder::close(EndStatus status, std::string_view detail) {
  Impl& im = *impl_;
  if (im.closed.exchange(true)) return;
  // First: from now on components created elsewhere get the enclosing recorder, not this closing one.
  stop_being_current();
  auto state = im.state;
  const char* status_name = status == EndStatus::kClean ? "clean"
                            : status == EndStatus::kException ? "exception"
                                                              : "signal";
  nlohmann::json record = {{"v", ledger::kFormatVersion},
                           {"t", "end"},
                           {"ts", epoch_us()},
                           {"status", status_name},
                           {"detail", std::string(detail)}};
  bool finished;
  {
    std::unique_lock lock(state->mutex);
    state->side_lines.push_back(record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
    state->stop = true;
    state->wake.notify_one();
    finished = state->progress.wait_for(lock, std::chrono::duration<double>(im.options.shutdown_timeout_s),
                                        [&] { return state->finished; });
  }
  if (finished) {
    im.writer.join();
    // After the end record: the exit hook appends this process's last instant behind it.
    remember_closed_ledger(im.ledger_path, im.attempt);
  } else {
    // The writer is stuck (e.g. a hung network file system). Shutdown must stay bounded: let it go; it
    // owns a reference to its state, so detaching is safe.
    ETTKIT_LOG_ERROR("ETT ledger '", im.ledger_path, "' did not flush within ", im.options.shutdown_timeout_s,
                     " s at close; the last records may be lost");
    im.writer.detach();
  }
}

int Recorder::rank() const { return impl_->rank; }
int Recorder::world_size() const { return impl_->world_size; }
int Recorder::attempt() const { return impl_->attempt; }
const std::string& Recorder::ledger_path() const { return impl_->ledger_path; }
uint64_t Recorder::dropped() const { return impl_->state->dropped.load(std::memory_order_relaxed); }
bool Recorder::closed() const { return impl_->closed.load(); }

void Recorder::wait_for_writer_iterations_for_testing(int n) {
  WriterState& st = *impl_->state;
  std::unique_lock lock(st.mutex);
  uint64_t target = st.iterations + static_cast<uint64_t>(n);
  st.wake.notify_one();
  st.progress.wait(lock, [&] { return st.finished || st.iterations >= target; });
}

// ------------------------------------------------------------------------------------------------------
ScopedPhase::ScopedPhase(Recorder* recorder, uint32_t id, int64_t step)
    : recorder_(recorder), id_(id), step_(step), begin_ns_(steady_ns()) {
#if defined(ETTKIT_HAVE_NVTX)
  if (recorder_->impl_->state->nvtx.load(std::memory_order_relaxed)) {
    nvtxRangePushA(recorder_->impl_->state->name_of(id_));
  }
#endif
}

ScopedPhase::ScopedPhase(ScopedPhase&& other) noexcept
    : recorder_(std::exchange(other.recorder_, nullptr)),
      id_(other.id_),
      step_(other.step_),
      begin_ns_(other.begin_ns_) {}

ScopedPhase::~ScopedPhase() { end(); }

void ScopedPhase::end() {
  if (recorder_ == nullptr) return;
  int64_t end_ns = steady_ns();
#if defined(ETTKIT_HAVE_NVTX)
  if (recorder_->impl_->state->nvtx.load(std::memory_order_relaxed)) nvtxRangePop();
#endif
  recorder_->push_phase(id_, begin_ns_, end_ns, step_);
  recorder_ = nullptr;
}

}  // namespace ettkit::ett
