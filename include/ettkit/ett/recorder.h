#pragma once
// ettkit::ett::Recorder: measures the phases of one training process and appends them to its ledger.
//
// What it promises
//  - The hot path (ScopedPhase, step(), record_phase()) does not allocate, lock or do I/O: it reads the
//    steady clock and pushes a fixed-size event into a bounded lock-free queue (~tens of ns). When the
//    queue is full the event is dropped and counted (the count goes into the ledger); training never
//    blocks on the recorder.
//  - A background thread owned by the Recorder drains the queue into RUN_DIR/ett/rank-<r>.jsonl every
//    `flush_interval_s`, writes a heartbeat record every `heartbeat_s`, and fdatasyncs per FsyncPolicy.
//    Each batch of whole lines goes out in one write(2) on an O_APPEND descriptor, so a crash can at worst
//    tear the last line, which readers skip.
//  - Attempts are numbered by the ledger: attempt = number of attempts already in the rank's file.
//  - close() (or the destructor) writes the end record with how the attempt ended and joins the thread
//    within `shutdown_timeout_s`. A process that is killed writes no end record; the report infers
//    "killed" from that and dates the failure by the last record.
//  - The current recorder: a Recorder is the process's current recorder from construction until close()
//    (or destruction), unless a newer open Recorder is. Components (AsyncCheckpointer, StageGraph, the
//    Python layer) that are given no recorder record into current_recorder(), so one recorder serves the
//    whole job however it was created (C++, `with ett.Recorder(...)`, `ett.init(...)`). See
//    current_recorder() below.
// Thread-safety: every member function may be called from any thread, except close()/destruction, which
// must not race with other calls.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "ettkit/common/export.h"

namespace ettkit::ett {

/// When the ledger file is fdatasync'ed. SIGKILL never loses data that reached write(2); fsync only
/// matters for a machine or kernel crash.
enum class FsyncPolicy : uint8_t {
  kNever,      ///< leave it to the kernel
  kHeartbeat,  ///< on every heartbeat and at close (default: bounded loss, no per-step cost)
  kAlways,     ///< after every batch the writer appends
};

/// How an attempt ended, as written in its end record.
enum class EndStatus : uint8_t { kClean, kException, kSignal };

struct ETTKIT_API RecorderOptions {
  /// The run directory; the ledger goes to run_dir/ett/rank-<rank>.jsonl. Required.
  std::string run_dir;
  /// Global rank and world size; -1 reads RANK / WORLD_SIZE from the environment (0 / 1 when unset).
  int rank = -1;
  int world_size = -1;
  double heartbeat_s = 1.0;
  double flush_interval_s = 0.1;
  FsyncPolicy fsync = FsyncPolicy::kHeartbeat;
  /// Capacity of the event queue (rounded up to a power of two, at least 1024).
  uint32_t queue_capacity = 1u << 16;
  /// Upper bound on how long close() waits for the final flush.
  double shutdown_timeout_s = 5.0;
  /// Emit NVTX ranges for phases (only when ettkit was built with CUDA; ETTKIT_NVTX=1 also enables it).
  bool nvtx = false;
  /// Read launcher-provided phases from ETTKIT_LAUNCHER_PHASES (see record_launcher_phases_json).
  bool launcher_phases_from_env = true;
  /// Free-form key/values written into this attempt's record (config hash, job id, ...).
  std::map<std::string, std::string> metadata;
  /// Opt-in: create the ledger 0644 (its directory 0755), for reports run by other users. By default it is
  /// 0600 (0700): the ledger carries the job's notes, exceptions and metadata.
  bool ledger_readable_by_others = false;
};

class Recorder;

/// A phase reported by the launcher (UTC epoch microseconds).
struct LauncherPhase {
  std::string name;
  int64_t begin_us;
  int64_t end_us;
};

/// RAII phase timer: the interval [construction, destruction) is recorded under `name`. Movable, not
/// copyable. Obtained from Recorder::phase(); must not outlive the Recorder.
class ETTKIT_API ScopedPhase {
 public:
  ScopedPhase(ScopedPhase&& other) noexcept;
  ScopedPhase& operator=(ScopedPhase&&) = delete;
  ScopedPhase(const ScopedPhase&) = delete;
  ScopedPhase& operator=(const ScopedPhase&) = delete;
  ~ScopedPhase();
  /// Ends the phase now (idempotent); the destructor then does nothing.
  void end();

 private:
  friend class Recorder;
  ScopedPhase(Recorder* recorder, uint32_t id, int64_t step);
  Recorder* recorder_;
  uint32_t id_;
  int64_t step_;
  int64_t begin_ns_;
};

class ETTKIT_API Recorder {
 public:
  /// Opens (creating if needed) the rank's ledger, numbers this attempt, writes the attempt record and
  /// the launcher phases, and starts the writer thread. Throws InvalidArgument for bad options and
  /// IoError when the ledger cannot be opened (naming the path).
  explicit Recorder(RecorderOptions options);
  /// Equivalent to close(EndStatus::kClean) if close() was not called, or to close(kException) when the
  /// Recorder is destroyed while an exception unwinds the stack.
  ~Recorder();
  Recorder(const Recorder&) = delete;
  Recorder& operator=(const Recorder&) = delete;

  /// Interns a phase name (validated) and returns its id. Cheap after the first call for a name.
  uint32_t phase_id(std::string_view name);

  /// Starts a scoped phase; `step` optionally ties it to a global step (e.g. a checkpoint's step).
  ScopedPhase phase(uint32_t id, int64_t step = -1) { return ScopedPhase(this, id, step); }
  ScopedPhase phase(std::string_view name, int64_t step = -1) { return phase(phase_id(name), step); }

  /// Records a phase whose interval was measured elsewhere, in UTC epoch microseconds.
  void record_phase(uint32_t id, int64_t begin_us, int64_t end_us, int64_t step = -1);
  /// Records a background-track interval (e.g. checkpoint persistence) that does not block training.
  void record_background(uint32_t id, int64_t begin_us, int64_t end_us, int64_t step = -1);

  /// Marks the completion of global step `n`. Its interval starts at the previous step mark of this
  /// attempt or, for the attempt's first step, at the end of the latest phase that ended (or at recorder
  /// start). Phases that happen inside a step (e.g. checkpoint_blocking) take precedence in the report.
  /// Throws InvalidArgument for n < 0.
  void step(int64_t n);
  /// Records step `n` with an explicit interval (steady-clock nanoseconds from steady_ns()).
  void step_interval(int64_t n, int64_t begin_steady_ns, int64_t end_steady_ns);

  /// Records a configuration value the report uses (e.g. "checkpoint_interval_s", "checkpoint_interval_steps").
  void set_config(std::string_view key, double value);

  /// Records a fact about this attempt as text (which compile path the start took, why a fallback happened):
  /// the report lists an attempt's notes under attempts[].notes, the last value of a key winning. `key` as a
  /// phase name; `value` at most kMaxNoteBytes bytes of UTF-8. Throws InvalidArgument otherwise.
  void set_note(std::string_view key, std::string_view value);
  static constexpr size_t kMaxNoteBytes = 1024;

  /// Parses launcher-provided phases: a JSON object {"<phase>": [begin_epoch_s, end_epoch_s], ...}.
  /// Phases that end before this ledger's previous records are skipped (a restart reuses the same
  /// environment). Throws InvalidArgument naming `source` and the bad field.
  void record_launcher_phases_json(std::string_view json, std::string_view source);
  /// The same, for phases already parsed.
  void record_launcher_phases(const std::vector<LauncherPhase>& phases);

  /// Blocks until every event recorded before the call is written (and synced per policy), or throws
  /// Timeout after `timeout_s`.
  void flush(double timeout_s = 10.0);

  /// Writes the end record and stops the writer (bounded by shutdown_timeout_s). Idempotent.
  void close(EndStatus status = EndStatus::kClean, std::string_view detail = {});

  int rank() const;
  int world_size() const;
  /// This process's attempt number (0 for the first attempt recorded in this ledger).
  int attempt() const;
  /// Path of the ledger file.
  const std::string& ledger_path() const;
  /// Events dropped because the queue was full.
  uint64_t dropped() const;
  bool closed() const;

  /// Test hook: blocks until the writer thread has completed `n` more loop iterations.
  void wait_for_writer_iterations_for_testing(int n);

  class Impl;

 private:
  friend class ScopedPhase;
  void make_current();
  void stop_being_current();
  void push_phase(uint32_t id, int64_t begin_ns, int64_t end_ns, int64_t step);
  std::unique_ptr<Impl> impl_;
};

/// The process's current recorder: the most recently constructed Recorder that is still open, or null.
///
/// Open recorders form a stack: construction pushes, close() (or destruction) removes that recorder
/// wherever it is, so a nested recorder is current until it closes and then the enclosing one is again,
/// and closing out of order never leaves a closed recorder current. The stack is process-wide on purpose:
/// it is how a recorder made by Python (`with ett.Recorder(...)`, `ett.init(...)`) reaches C++ components
/// and the other way round. Thread-safe. A forked child starts with an empty stack (the parent's recorders
/// record the parent's attempt).
///
/// The pointer is borrowed: whoever uses it must know that the recorder outlives that use (a component
/// takes it at its construction and must be destroyed before the recorder, as with an explicit recorder).
ETTKIT_API Recorder* current_recorder();

/// The recorder a component records into: `explicit_recorder` when not null; otherwise, with
/// `use_current`, current_recorder(), and when there is none a warning (once per process per `component`)
/// that the component's phases are not recorded; otherwise null (the caller asked for no recording).
ETTKIT_API Recorder* recorder_for(const char* component, Recorder* explicit_recorder, bool use_current);

}  // namespace ettkit::ett
