// The Recorder: validates its options, numbers the attempt, and runs the hot path (read a clock, move a
// mark, enqueue a 32-byte event). Everything that touches the ledger file (opening, the attempt record,
// the writer thread, flush and close) is the LedgerWriter's (ett/ledger_writer.h); the process_exit hook
// below decides which closed ledgers get this process's last instant.
#include "ettkit/ett/recorder.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

#include "ett/ledger_format.h"
#include "ett/ledger_writer.h"
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

using detail::Event;
using detail::EventKind;

int64_t env_or(const char* name, int64_t fallback) { return detail::env_int(name).value_or(fallback); }

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
  std::string path;  // absolute, to recognize the same ledger closed again
  int fd = -1;       // the ledger's own descriptor: the path may name a planted FIFO by the time of the exit
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
// A process that closes recorders on many run directories (a test suite) holds at most this many
// descriptors for the exit; the oldest entries go first.
constexpr size_t kMaxClosedLedgers = 64;

void close_entry(const ClosedLedger& entry) {
  if (entry.fd >= 0) ::close(entry.fd);
}

void remember_closed_ledger(const std::string& ledger_path, int fd, int attempt) {
  std::error_code ec;
  fs::path path = fs::absolute(ledger_path, ec);
  if (ec || fd < 0) {  // no process_exit record rather than one in the wrong file
    if (fd >= 0) ::close(fd);
    return;
  }
  ClosedLedgers& ledgers = closed_ledgers();
  std::lock_guard lock(ledgers.mutex);
  auto& entries = ledgers.entries;
  std::erase_if(entries, [&](const ClosedLedger& e) {
    if (e.path != path.string()) return false;
    close_entry(e);
    return true;
  });
  if (entries.size() >= kMaxClosedLedgers) {
    close_entry(entries.front());
    entries.erase(entries.begin());
  }
  entries.push_back({path.string(), fd, attempt, ::getpid()});
}

// A Recorder constructed after others closed: the process went on to record something else (a notebook's
// next run, an in-process restart), so its exit no longer ends the attempts it closed before.
void forget_closed_ledgers() {
  ClosedLedgers& ledgers = closed_ledgers();
  std::lock_guard lock(ledgers.mutex);
  for (const auto& entry : ledgers.entries) close_entry(entry);
  ledgers.entries.clear();
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
    detail::append_to_closed_ledger(entry.fd, detail::process_exit_line(entry.attempt, entry.pid, ts));
  }
}

// ---- the constructor's steps ---------------------------------------------------------------------------

void validate_timing(const RecorderOptions& options) {
  ETTKIT_EXPECTS(std::isfinite(options.heartbeat_s) && options.heartbeat_s > 0,
                 "RecorderOptions.heartbeat_s=", options.heartbeat_s, " must be a positive number of seconds");
  ETTKIT_EXPECTS(std::isfinite(options.flush_interval_s) && options.flush_interval_s > 0,
                 "RecorderOptions.flush_interval_s=", options.flush_interval_s,
                 " must be a positive number of seconds");
  ETTKIT_EXPECTS(std::isfinite(options.shutdown_timeout_s) && options.shutdown_timeout_s >= 0,
                 "RecorderOptions.shutdown_timeout_s=", options.shutdown_timeout_s, " must be >= 0");
}

// Read before anything is written: a bad variable fails construction and leaves the ledger alone.
std::vector<LauncherPhase> launcher_phases_from_env(const RecorderOptions& options) {
  const char* env = std::getenv("ETTKIT_LAUNCHER_PHASES");
  if (!options.launcher_phases_from_env || env == nullptr || *env == '\0') return {};
  return parse_launcher_phases(env, "ETTKIT_LAUNCHER_PHASES");
}

// What the attempt record says about this process; the LedgerWriter formats it.
detail::AttemptHeader attempt_header(const RecorderOptions& options, int attempt, int rank, int world,
                                     int64_t start_us, std::optional<int64_t> proc_start_us) {
  detail::AttemptHeader h;
  h.attempt = attempt;
  h.rank = rank;
  h.world = world;
  h.pid = static_cast<int64_t>(::getpid());
  h.host = detail::host_name();
  h.ts_us = start_us;
  h.proc_start_us = proc_start_us;
  h.restart_count = detail::env_int("TORCHELASTIC_RESTART_COUNT");
  if (const char* run_id = std::getenv("TORCHELASTIC_RUN_ID")) h.run_id = run_id;
  h.metadata = options.metadata;
  return h;
}

}  // namespace

// ------------------------------------------------------------------------------------------------------
// The Recorder's own state: identity, the step/phase marks of the hot path, and the ledger writer it owns.
class Recorder::Impl {
 public:
  RecorderOptions options;
  std::unique_ptr<detail::LedgerWriter> ledger;
  bool nvtx = false;  // set once by the constructor
  int rank = 0;
  int world_size = 1;
  int attempt = 0;
  std::string ledger_path;
  int64_t start_steady_ns = 0;
  std::optional<int64_t> proc_start_us;  // when the process started (exec), if /proc says
  // Step boundaries (steady ns): the first step of the attempt starts at the latest phase end.
  std::atomic<int64_t> last_step_mark{-1};
  std::atomic<int64_t> last_phase_end{0};
  std::atomic<bool> closed{false};

  // Moves the latest phase end forward to `end_ns` (never back), lock-free.
  void advance_phase_end(int64_t end_ns) {
    int64_t prev = last_phase_end.load(std::memory_order_relaxed);
    while (prev < end_ns && !last_phase_end.compare_exchange_weak(prev, end_ns, std::memory_order_relaxed)) {
    }
  }

  void resolve_identity(const RecorderOptions& opts) {
    rank = opts.rank >= 0 ? opts.rank : static_cast<int>(env_or("RANK", 0));
    world_size = opts.world_size > 0 ? opts.world_size : static_cast<int>(env_or("WORLD_SIZE", 1));
    ETTKIT_EXPECTS(rank >= 0 && rank < world_size, "rank ", rank, " is outside [0, world_size=", world_size,
                   ")");
  }

  // Opens the ledger, numbers this attempt and queues its record; the writer thread starts last.
  void open_ledger(RecorderOptions opts) {
    ledger = std::make_unique<detail::LedgerWriter>(detail::LedgerWriterOptions{
        ledger_path, opts.heartbeat_s, opts.flush_interval_s, opts.fsync, opts.queue_capacity,
        opts.ledger_readable_by_others});
    attempt = ledger->attempts_before();
    nvtx = (opts.nvtx || env_or("ETTKIT_NVTX", 0) != 0) && ETTKIT_WITH_CUDA;
    start_steady_ns = steady_ns();
    last_phase_end.store(start_steady_ns, std::memory_order_relaxed);
    proc_start_us = detail::process_start_epoch_us();
    ledger->append_attempt_header(
        attempt_header(opts, attempt, rank, world_size, start_epoch_us(), proc_start_us));
    options = std::move(opts);
    ledger->start();
  }

  int64_t start_epoch_us() const { return ledger->anchor().to_epoch_us(start_steady_ns); }
};

// ------------------------------------------------------------------------------------------------------
Recorder::Recorder(RecorderOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& im = *impl_;
  ETTKIT_EXPECTS(!options.run_dir.empty(), "RecorderOptions.run_dir is empty; pass the run directory");
  validate_timing(options);
  im.resolve_identity(options);
  im.ledger_path = detail::LedgerWriter::prepare_path(options.run_dir, im.rank, options.ledger_readable_by_others);
  const std::vector<LauncherPhase> launcher_phases = launcher_phases_from_env(options);
  im.open_ledger(std::move(options));

  // Interpreter start, imports, argument parsing: everything between exec and the recorder.
  const int64_t start_us = im.start_epoch_us();
  if (im.proc_start_us && *im.proc_start_us < start_us) {
    record_phase(phase_id(phase::kProcessBootstrap), *im.proc_start_us, start_us);
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

uint32_t Recorder::phase_id(std::string_view name) { return impl_->ledger->names().intern(name); }

// ---- the hot path: read a clock, move a mark, enqueue 32 bytes -------------------------------------------

void Recorder::push_phase(uint32_t id, int64_t begin_ns, int64_t end_ns, int64_t step) {
  impl_->advance_phase_end(end_ns);
  impl_->ledger->enqueue(Event{begin_ns, end_ns, step, id, EventKind::kPhaseSteady});
}

void Recorder::record_phase(uint32_t id, int64_t begin_us, int64_t end_us, int64_t step) {
  ETTKIT_EXPECTS(end_us >= begin_us, "record_phase: end_us=", end_us, " is before begin_us=", begin_us);
  // Like a ScopedPhase, a recorded phase ends the idle gap before the first step (e.g. start-up stages
  // recorded by a StageGraph): map its end onto the steady clock and move the mark forward.
  int64_t now_ns = steady_ns();
  impl_->advance_phase_end(std::min(now_ns, now_ns - (epoch_us() - end_us) * 1000));
  impl_->ledger->enqueue(Event{begin_us, end_us, step, id, EventKind::kPhaseEpoch});
}

void Recorder::record_background(uint32_t id, int64_t begin_us, int64_t end_us, int64_t step) {
  ETTKIT_EXPECTS(end_us >= begin_us, "record_background: end_us=", end_us, " is before begin_us=", begin_us);
  impl_->ledger->enqueue(Event{begin_us, end_us, step, id, EventKind::kBackgroundEpoch});
}

void Recorder::step(int64_t n) {
  // A negative number is not a step (-1 is the ledger's "no step" in phase records): refused, not recorded.
  ETTKIT_EXPECTS(n >= 0, "step: global step numbers are >= 0; got ", n);
  Impl& im = *impl_;
  int64_t now = steady_ns();
  int64_t prev = im.last_step_mark.exchange(now, std::memory_order_relaxed);
  int64_t begin = prev >= 0 ? prev : im.last_phase_end.load(std::memory_order_relaxed);
  im.ledger->enqueue(Event{begin, now, n, 0, EventKind::kStepSteady});
}

void Recorder::step_interval(int64_t n, int64_t begin_steady_ns, int64_t end_steady_ns) {
  ETTKIT_EXPECTS(n >= 0, "step_interval: global step numbers are >= 0; got ", n);
  ETTKIT_EXPECTS(end_steady_ns >= begin_steady_ns, "step_interval: end is before begin for step ", n);
  impl_->last_step_mark.store(end_steady_ns, std::memory_order_relaxed);
  impl_->ledger->enqueue(Event{begin_steady_ns, end_steady_ns, n, 0, EventKind::kStepSteady});
}

// ---- records off the hot path ------------------------------------------------------------------------

void Recorder::set_config(std::string_view key, double value) {
  validate_phase_name(key);  // same character set: keys go into JSON unescaped elsewhere
  ETTKIT_EXPECTS(std::isfinite(value), "config '", key, "' must be finite, got ", value);
  nlohmann::json record = {{"v", ledger::kFormatVersion}, {"t", "config"}, {"key", key}, {"value", value}};
  impl_->ledger->append_line(detail::record_line(record));
}

void Recorder::set_note(std::string_view key, std::string_view value) {
  validate_phase_name(key);
  ETTKIT_EXPECTS(value.size() <= kMaxNoteBytes, "note '", key, "' is ", value.size(), " bytes; at most ",
                 kMaxNoteBytes, " are recorded (shorten it)");
  nlohmann::json record = {{"v", ledger::kFormatVersion}, {"t", "note"}, {"key", key}, {"value", value}};
  impl_->ledger->append_line(detail::record_line(record));
}

void Recorder::record_launcher_phases_json(std::string_view json, std::string_view source) {
  record_launcher_phases(parse_launcher_phases(json, source));
}

void Recorder::record_launcher_phases(const std::vector<LauncherPhase>& phases) {
  for (const auto& p : phases) {
    // A restart reuses its launcher's environment: phases already behind the ledger's last record belong
    // to an earlier attempt.
    if (p.end_us <= impl_->ledger->last_ts_us()) continue;
    impl_->ledger->enqueue(Event{p.begin_us, p.end_us, -1, phase_id(p.name), EventKind::kLauncherEpoch});
  }
}

void Recorder::flush(double timeout_s) { impl_->ledger->flush(timeout_s); }

void Recorder::close(EndStatus status, std::string_view detail) {
  Impl& im = *impl_;
  if (im.closed.exchange(true)) return;
  // First: from now on components created elsewhere get the enclosing recorder, not this closing one.
  stop_being_current();
  const char* status_name = status == EndStatus::kClean ? "clean"
                            : status == EndStatus::kException ? "exception"
                                                              : "signal";
  nlohmann::json record = {{"v", ledger::kFormatVersion},
                           {"t", "end"},
                           {"ts", epoch_us()},
                           {"status", status_name},
                           {"detail", std::string(detail)}};
  if (im.ledger->close(detail::record_line(record), im.options.shutdown_timeout_s)) {
    // After the end record: the exit hook appends this process's last instant behind it.
    remember_closed_ledger(im.ledger_path, im.ledger->duplicate_descriptor(), im.attempt);
  }
}

int Recorder::rank() const { return impl_->rank; }
int Recorder::world_size() const { return impl_->world_size; }
int Recorder::attempt() const { return impl_->attempt; }
const std::string& Recorder::ledger_path() const { return impl_->ledger_path; }
uint64_t Recorder::dropped() const { return impl_->ledger->dropped(); }
bool Recorder::closed() const { return impl_->closed.load(); }

void Recorder::wait_for_writer_iterations_for_testing(int n) { impl_->ledger->wait_for_iterations_for_testing(n); }

// ------------------------------------------------------------------------------------------------------
ScopedPhase::ScopedPhase(Recorder* recorder, uint32_t id, int64_t step)
    : recorder_(recorder), id_(id), step_(step), begin_ns_(steady_ns()) {
#if defined(ETTKIT_HAVE_NVTX)
  if (recorder_->impl_->nvtx) nvtxRangePushA(recorder_->impl_->ledger->names().name_of(id_));
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
  if (recorder_->impl_->nvtx) nvtxRangePop();
#endif
  recorder_->push_phase(id_, begin_ns_, end_ns, step_);
  recorder_ = nullptr;
}

}  // namespace ettkit::ett
