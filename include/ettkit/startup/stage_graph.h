#pragma once
// ettkit::startup::StageGraph: runs a trainer's start-up as a DAG of named stages instead of a serial
// script, so that independent work (building the model, fetching the first batch, compiling, setting up
// process groups) overlaps and Time to Start approaches the critical path instead of the serial sum.
//
// What it promises
//  - Validation before anything runs: duplicate names, unknown dependencies, cycles, a forking stage
//    that depends on a threaded one and bad options are rejected with InvalidArgument (naming the stage)
//    when add() or run() is called, before the first stage starts.
//  - Scheduling rules, enforced by the scheduler rather than left to the caller:
//      * `forks`: the stage forks processes (e.g. creating a DataLoader iterator with worker processes).
//        Forking stages run first, on the calling thread, in dependency order, before the graph starts
//        any thread: fork() while other threads hold locks can deadlock the child.
//      * `runs_dynamo`: at most one such stage runs at a time (PT2 is not thread-safe; one compile lock).
//      * `collective_group`: stages that issue collectives on the same process group never run
//        concurrently and always run in the same order on every rank: the graph's deterministic
//        topological order (ties broken by the order of add()), so two ranks cannot issue the same
//        group's collectives in different orders and hang.
//  - A small pool (`max_workers` threads) runs every other ready stage concurrently.
//  - Failure: the first error is re-thrown from run() as StageFailed naming the stage (the stage's own
//    exception is its cause()); every stage that depends on a failed stage, directly or transitively, is
//    cancelled without running. Independent stages still run (or, with `fail_fast`, are cancelled if
//    they have not started).
//  - Deadlines: a stage that runs longer than its `timeout_s`, or a graph that runs longer than the
//    graph's `timeout_s`, is reported as timed out: its StageContext is cancelled, its dependents are
//    cancelled and run() throws Timeout naming the stage. A thread cannot be killed, so a stage that
//    ignores the cancellation keeps its worker thread; that thread is joined by join() or the destructor
//    (or, with `detach_on_destroy`, left to finish on its own: it keeps the graph's state alive).
//  - Interrupts: run(interrupted, poll_interval_s) calls `interrupted` on the calling thread while it
//    waits; when it returns true, every stage is cancelled (running ones are asked to stop) and run()
//    throws Cancelled promptly. A binding uses it to deliver Ctrl-C without the core knowing Python.
//  - Thread exit: a forced unwind (pthread_exit, pthread_cancel; CPython ends threads that way at
//    interpreter exit) passes through a stage untouched and ends its worker cleanly.
//  - Every stage that ran is recorded into the ETT recorder (the options' or the current one), as a
//    phase named by the stage's `phase` (default: the stage name), with its real begin and end.
//  - run() returns a StageReport: per-stage begin/end/status, the critical path, the serial sum and the
//    time saved by running stages concurrently.
// Ownership: the graph owns the stage callables and its worker threads; the recorder is borrowed and
// must outlive run(). Thread-safety: add()/run()/join() must be called from one thread at a time; the
// callables run on the calling thread (forking stages) or on worker threads.
// Never holds its mutex while a stage runs, so a stage may block on anything (the GIL included).

#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ettkit/common/error.h"
#include "ettkit/common/export.h"

namespace ettkit::ett {
class Recorder;
}  // namespace ettkit::ett

namespace ettkit::startup {

/// Thrown by StageGraph::run() when a stage failed; names the stage and carries the stage's own error.
class ETTKIT_API StageFailed : public Error {
 public:
  StageFailed(std::string stage, std::exception_ptr cause, const std::string& cause_text, const char* file,
              int line);
  /// The name of the stage that failed first.
  const std::string& stage() const noexcept { return stage_; }
  /// The exception the stage threw (rethrow it with std::rethrow_exception to inspect its type).
  std::exception_ptr cause() const noexcept { return cause_; }

 private:
  std::string stage_;
  std::exception_ptr cause_;
};

/// What the scheduler needs to know about a stage besides its callable.
struct ETTKIT_API StageOptions {
  /// Stages that must succeed before this one starts.
  std::vector<std::string> after;
  /// The stage triggers Dynamo (torch.compile tracing or compiled code that may recompile): at most one
  /// such stage runs at a time.
  bool runs_dynamo = false;
  /// Non-empty: the stage issues collectives on this process group; such stages never overlap and run
  /// in the same order on every rank.
  std::string collective_group;
  /// The stage forks processes: it runs on the calling thread before any worker thread starts, and may
  /// only depend on other forking stages.
  bool forks = false;
  /// Deadline of the stage in seconds from its start; 0 = none. Forking stages cannot have one (no
  /// thread exists yet to watch them).
  double timeout_s = 0.0;
  /// ETT phase to record the stage under (e.g. "compile", "get_first_batch_data"); empty = the stage's
  /// name. Must be a valid phase name (letters, digits, _ . - /).
  std::string phase;
};

/// Handed to each stage: its name and a cooperative cancellation flag.
class ETTKIT_API StageContext {
 public:
  const std::string& stage() const noexcept { return *stage_; }
  /// True once the stage's deadline or the graph's deadline passed, or the graph aborted after a failure
  /// with fail_fast. Long-running stages should poll it (or wait_cancelled()) and return early.
  bool cancel_requested() const noexcept;
  /// Blocks until cancellation is requested or `timeout_s` passes; returns cancel_requested().
  bool wait_cancelled(double timeout_s) const;
  /// Throws Cancelled (naming the stage) if cancellation was requested.
  void throw_if_cancelled() const;

  struct Token;  // shared cancellation state (internal)
  StageContext(const std::string* stage, std::shared_ptr<Token> token);

 private:
  const std::string* stage_;
  std::shared_ptr<Token> token_;
};

using StageFn = std::function<void(StageContext&)>;

enum class StageStatus : uint8_t {
  kNotRun,     ///< the graph never reached it (run() not called, or aborted before it became ready)
  kSucceeded,  ///< returned normally
  kFailed,     ///< threw
  kCancelled,  ///< a dependency failed, timed out or was cancelled, fail_fast aborted the graph, or run() was
               ///< interrupted (a running stage is then cancelled too)
  kTimedOut,   ///< passed its own or the graph's deadline while running
};
ETTKIT_API const char* to_string(StageStatus status);

/// One stage in a StageReport. Times are seconds relative to the start of run() (steady clock) and UTC
/// epoch microseconds; both are 0 for stages that never started.
struct ETTKIT_API StageRecord {
  std::string name;
  std::string phase;
  std::vector<std::string> after;  ///< explicit dependencies
  bool runs_dynamo = false;
  bool forks = false;
  std::string collective_group;
  StageStatus status = StageStatus::kNotRun;
  bool started = false;
  double begin_s = 0.0;
  double end_s = 0.0;  ///< for a timed-out stage: when the deadline fired
  int64_t begin_epoch_us = 0;
  int64_t end_epoch_us = 0;
  int worker = -1;  ///< worker thread index, or -1 for the calling thread (forking stages)
  std::string error;  ///< the failure or timeout text, or why the stage was cancelled
  double duration_s() const { return started ? end_s - begin_s : 0.0; }
};

/// What a run achieved. `serial_sum_s` is what running every stage one after another would have taken,
/// `makespan_s` what the graph took (first begin to last end), `saved_s` the difference, and the
/// critical path the chain of dependencies (explicit, plus the implicit order of each collective group)
/// with the largest total duration: no schedule can beat it.
struct ETTKIT_API StageReport {
  std::vector<StageRecord> stages;  ///< in the order the stages were added
  std::vector<std::string> critical_path;
  double critical_path_s = 0.0;
  double serial_sum_s = 0.0;
  double makespan_s = 0.0;
  double saved_s = 0.0;
  int workers = 0;
  const StageRecord* find(const std::string& name) const;
  /// A plain-text table: one line per stage, then the totals.
  std::string to_table() const;
};

/// Fills critical_path/critical_path_s/serial_sum_s/makespan_s/saved_s of `report` from its stages.
/// `edges` are (before, after) index pairs: the explicit dependencies and any implicit ordering.
ETTKIT_API void summarize(StageReport& report, const std::vector<std::pair<size_t, size_t>>& edges);

struct ETTKIT_API StageGraphOptions {
  /// Worker threads for non-forking stages (1..64).
  int max_workers = 4;
  /// Deadline of the whole run in seconds from the start of run(); 0 = none.
  double timeout_s = 0.0;
  /// After the first failure, cancel every stage that has not started (not only its dependents).
  bool fail_fast = false;
  /// Borrowed; each stage that ran is recorded as a phase. Null: see use_current_recorder.
  ett::Recorder* recorder = nullptr;
  /// When `recorder` is null: true records into ett::current_recorder() as of the graph's construction
  /// (which must then outlive run(); a warning, once per process, when none is open); false records nothing.
  bool use_current_recorder = true;
  /// What the destructor does with a worker still inside a stage (one that outlived its deadline or an
  /// interrupt): false waits for it to return, however long that takes; true detaches it, and the thread
  /// keeps the scheduler's state and the stage's callable alive until it returns (it records nothing
  /// more). Set it only when every stage owns what it touches (the Python binding does): a C++ stage that
  /// captures locals by reference must be waited for.
  bool detach_on_destroy = false;
};

/// Polled by StageGraph::run() on the calling thread, without the scheduler's lock, while it waits:
/// returns true to interrupt the run. Should not throw; if it does, run() interrupts the graph and
/// rethrows that exception instead of Cancelled.
using InterruptCheck = std::function<bool()>;

class ETTKIT_API StageGraph {
 public:
  explicit StageGraph(StageGraphOptions options = {});
  /// Joins every worker thread, waiting for stages that outlived a deadline to return.
  ~StageGraph();
  StageGraph(const StageGraph&) = delete;
  StageGraph& operator=(const StageGraph&) = delete;

  /// Adds a stage. Throws InvalidArgument for an empty or duplicate name, a bad phase name, a negative
  /// timeout or a forking stage with a timeout. Dependencies may name stages added later.
  void add(const std::string& name, StageFn fn, StageOptions options = {});

  /// Throws InvalidArgument if a dependency is unknown, the stages form a cycle (the message shows it)
  /// or a forking stage depends on a non-forking one. run() calls it first.
  void validate() const;

  /// The order run() follows when it has a choice: a topological order, ties broken by order of add().
  std::vector<std::string> topological_order() const;

  /// Runs the graph once. Returns the report on success; throws StageFailed or Timeout (the report is
  /// then available from report()). Throws InvalidArgument if called twice or if validate() fails.
  StageReport run();

  /// run() that calls `interrupted` before each forking stage and at least every `poll_interval_s`
  /// while it waits. When it returns true, pending stages are cancelled, running ones are cancelled
  /// (their contexts report cancel_requested(); their threads are left to join() or the destructor, and
  /// a late result is dropped) and run() throws Cancelled naming what was still running.
  StageReport run(const InterruptCheck& interrupted, double poll_interval_s = 0.05);

  /// The report of the last run() (also after it threw); empty before.
  StageReport report() const;

  /// Waits up to `timeout_s` for workers still inside timed-out stages; true when all threads are joined.
  bool join(double timeout_s);

  size_t size() const;

  /// Test hook: blocks until the scheduler has seen stage `name` ready (its dependencies done) but held
  /// back by a scheduling rule (a running dynamo stage, or an earlier stage of its collective group).
  /// Returns false after `timeout_s`.
  bool wait_held_for_testing(const std::string& name, double timeout_s);

  class Impl;

 private:
  // Shared with the worker threads, so that a detached worker (detach_on_destroy) can finish its stage
  // after the graph is gone.
  std::shared_ptr<Impl> impl_;
};

}  // namespace ettkit::startup
