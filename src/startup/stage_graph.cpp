// StageGraph scheduler. One mutex (Impl::mu_) guards all run state; it is never held while a stage's
// callable runs, so a callable may block on anything (a Python stage blocks on the GIL). Workers and the
// calling thread wait on one condition variable (cv_) with predicates; every state change notifies it.
// The threads are a WorkerPool's (startup/worker_pool.h); each runs worker_loop_locked() below and shares
// ownership of the Impl with the StageGraph, so a detached worker (detach_on_destroy) can finish a stage
// that outlived the graph.
#include "ettkit/startup/stage_graph.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <limits>
#include <mutex>
#include <optional>
#include <unordered_map>

#include "common/describe.h"
#include "common/logging.h"
#include "startup/stage_dag.h"
#include "startup/worker_pool.h"
#include "ettkit/common/clock.h"
#include "ettkit/ett/phases.h"
#include "ettkit/ett/recorder.h"

namespace ettkit::startup {

namespace {
constexpr size_t kNone = std::numeric_limits<size_t>::max();

// Inside a catch (...): the caught exception, or a rethrow when it is a foreign one, which no exception_ptr
// can hold. The forced unwind of pthread_exit / pthread_cancel is foreign (CPython ends a thread that asks
// for the GIL during interpreter exit this way): it must go on to the thread's start, or glibc aborts the
// process ("FATAL: exception not rethrown"). Catching abi::__forced_unwind& by name would do, but binds a
// reference to a null object (UBSan reports it).
std::exception_ptr caught_or_rethrow() {
  std::exception_ptr caught = std::current_exception();
  if (!caught) throw;
  return caught;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "'" : ", '") + n + "'";
  return out;
}
}  // namespace

StageFailed::StageFailed(std::string stage, std::exception_ptr cause, const std::string& cause_text,
                         const char* file, int line)
    : Error("start-up stage '" + stage + "' failed: " + cause_text, file, line),
      stage_(std::move(stage)),
      cause_(std::move(cause)) {}

const char* to_string(StageStatus status) {
  switch (status) {
    case StageStatus::kNotRun:
      return "not_run";
    case StageStatus::kSucceeded:
      return "succeeded";
    case StageStatus::kFailed:
      return "failed";
    case StageStatus::kCancelled:
      return "cancelled";
    case StageStatus::kTimedOut:
      return "timed_out";
  }
  return "unknown";
}

// ---- StageContext --------------------------------------------------------------------------------------

struct StageContext::Token {
  std::atomic<bool> flag{false};
  std::mutex mu;                // guards nothing but the wait below (flag is atomic)
  std::condition_variable cv;
  void cancel() {
    {
      std::lock_guard<std::mutex> lk(mu);
      flag.store(true);
    }
    cv.notify_all();
  }
};

StageContext::StageContext(const std::string* stage, std::shared_ptr<Token> token)
    : stage_(stage), token_(std::move(token)) {}

bool StageContext::cancel_requested() const noexcept { return token_->flag.load(); }

bool StageContext::wait_cancelled(double timeout_s) const {
  std::unique_lock<std::mutex> lk(token_->mu);
  auto cancelled = [&] { return token_->flag.load(); };
  if (std::isfinite(timeout_s)) {
    token_->cv.wait_for(lk, std::chrono::duration<double>(std::max(0.0, timeout_s)), cancelled);
  } else {
    token_->cv.wait(lk, cancelled);
  }
  return token_->flag.load();
}

void StageContext::throw_if_cancelled() const {
  ETTKIT_CHECK(!cancel_requested(), Cancelled, "start-up stage '", stage(),
               "' was cancelled (its deadline or the graph's passed, or another stage failed)");
}

// ---- Impl ----------------------------------------------------------------------------------------------

class StageGraph::Impl : public std::enable_shared_from_this<StageGraph::Impl> {
 public:
  explicit Impl(StageGraphOptions options)
      : options_(options), pool_(mu_, cv_, [this](size_t stage) { abandon_locked(stage); }) {
    ETTKIT_EXPECTS(options_.max_workers >= 1 && options_.max_workers <= 64, "StageGraph max_workers=",
                   options_.max_workers, " is out of range; use 1..64");
    ETTKIT_EXPECTS(std::isfinite(options_.timeout_s) && options_.timeout_s >= 0, "StageGraph timeout_s=",
                   options_.timeout_s, " is invalid; use 0 (no deadline) or a positive number of seconds");
  }

  // Called by ~StageGraph, while it still owns the Impl. By default a thread cannot be abandoned while it
  // runs one of our callables (a C++ stage may capture the caller's locals): wait for stages that
  // outlived their deadline, however long they take. With detach_on_destroy the callables own what they
  // touch, so a worker still inside a stage is detached; it holds the Impl until it leaves.
  void shutdown() {
    if (!options_.detach_on_destroy) {
      pool_.join(std::nullopt);
      return;
    }
    pool_.join_idle();
    pool_.detach_busy();
  }

  struct Stage {
    std::string name;
    StageFn fn;
    StageOptions options;
    std::string phase;
  };

  void add(const std::string& name, StageFn fn, StageOptions options) {
    ETTKIT_EXPECTS(!ran_, "stage '", name, "' added after run(); a StageGraph runs once");
    ETTKIT_EXPECTS(!name.empty(), "a start-up stage needs a non-empty name");
    ETTKIT_EXPECTS(by_name_.find(name) == by_name_.end(), "stage '", name,
                   "' is already defined; stage names must be unique");
    ETTKIT_EXPECTS(static_cast<bool>(fn), "stage '", name, "' has no callable");
    ETTKIT_EXPECTS(std::isfinite(options.timeout_s) && options.timeout_s >= 0, "stage '", name, "' timeout_s=",
                   options.timeout_s, " is invalid; use 0 (no deadline) or a positive number of seconds");
    ETTKIT_EXPECTS(!(options.forks && options.timeout_s > 0), "stage '", name,
                   "' forks processes, so it runs on the calling thread before any thread exists to watch "
                   "a deadline; drop its timeout_s (the graph's timeout_s still applies)");
    std::string phase = options.phase.empty() ? name : options.phase;
    try {
      ett::validate_phase_name(phase);
    } catch (const InvalidArgument& e) {
      ETTKIT_THROW(InvalidArgument, "stage '", name, "' cannot be recorded: ", e.message(),
                   options.phase.empty() ? " (set StageOptions::phase to a valid phase name)" : "");
    }
    for (const auto& dep : options.after) {
      ETTKIT_EXPECTS(dep != name, "stage '", name, "' depends on itself");
    }
    by_name_.emplace(name, stages_.size());
    stages_.push_back(Stage{name, std::move(fn), std::move(options), std::move(phase)});
  }

  // Explicit dependency edges (pred -> succ) as indices; throws for unknown names.
  std::vector<std::vector<size_t>> explicit_preds() const {
    std::vector<std::vector<size_t>> preds(stages_.size());
    for (size_t i = 0; i < stages_.size(); ++i) {
      for (const auto& dep : stages_[i].options.after) {
        auto it = by_name_.find(dep);
        if (it == by_name_.end()) {
          std::vector<std::string> names;
          for (const auto& s : stages_) names.push_back(s.name);
          ETTKIT_THROW(InvalidArgument, "stage '", stages_[i].name, "' depends on '", dep,
                       "', which is not a stage of this graph; stages are: ", join_names(names));
        }
        if (std::find(preds[i].begin(), preds[i].end(), it->second) == preds[i].end()) {
          preds[i].push_back(it->second);
        }
      }
    }
    return preds;
  }

  // "a <- b <- ... <- a" (x <- y: x needs y) for a cycle of the explicit dependencies.
  std::string describe_cycle(const std::vector<std::vector<size_t>>& preds) const {
    const std::vector<size_t> cycle = detail::find_cycle(preds);
    std::string out;
    for (size_t i : cycle) out += stages_[i].name + " <- ";
    return cycle.empty() ? out : out + stages_[cycle.front()].name;
  }

  void validate() const {
    auto preds = explicit_preds();
    auto order = detail::topological_order(preds);
    if (order.size() != stages_.size()) {
      ETTKIT_THROW(InvalidArgument, "start-up stages form a cycle (a <- b: a needs b): ", describe_cycle(preds),
                   "; remove one of these dependencies");
    }
    for (size_t i = 0; i < stages_.size(); ++i) {
      if (!stages_[i].options.forks) continue;
      for (size_t p : preds[i]) {
        ETTKIT_EXPECTS(stages_[p].options.forks, "stage '", stages_[i].name,
                       "' forks processes, so it runs before any worker thread starts; it cannot depend on '",
                       stages_[p].name, "', which runs on a worker thread (mark that stage forks=true too, or "
                       "use a forkserver/spawn multiprocessing context and drop forks)");
      }
    }
  }

  std::vector<std::string> topological_order() const {
    auto order = detail::topological_order(explicit_preds());
    std::vector<std::string> names;
    for (size_t i : order) names.push_back(stages_[i].name);
    return names;
  }

  StageReport run(const InterruptCheck& interrupted, double poll_interval_s);
  StageReport report() const {
    std::lock_guard<std::mutex> lk(mu_);
    return report_;
  }
  bool join(double timeout_s) {
    ETTKIT_EXPECTS(!std::isnan(timeout_s), "StageGraph::join timeout_s is NaN; use seconds or infinity");
    return pool_.join(std::isfinite(timeout_s) ? std::optional<double>(std::max(0.0, timeout_s)) : std::nullopt);
  }
  size_t size() const { return stages_.size(); }

  bool wait_held(const std::string& name, double timeout_s) {
    auto it = by_name_.find(name);
    ETTKIT_EXPECTS(it != by_name_.end(), "wait_held_for_testing: no stage named '", name, "'");
    size_t idx = it->second;
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s),
                        [&] { return !held_seen_.empty() && held_seen_[idx]; });
  }

 private:
  enum class State : uint8_t { kPending, kRunning, kDone };
  using Worker = detail::WorkerPool::Worker;

  using Clock = std::chrono::steady_clock;
  double rel_s(Clock::time_point t) const { return std::chrono::duration<double>(t - t0_).count(); }
  int64_t epoch_of(Clock::time_point t) const {
    return anchor_.to_epoch_us(std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
  }

  // ---- all *_locked functions require mu_ ----

  bool all_done_locked() const {
    return std::all_of(state_.begin(), state_.end(), [](State s) { return s == State::kDone; });
  }

  // The first dispatchable stage in topological order, or kNone. Marks stages that are ready but held
  // back by a rule (for the test hook and the debug log).
  size_t pick_locked() {
    size_t found = kNone;
    bool newly_held = false;
    for (size_t i : order_) {
      if (state_[i] != State::kPending || stages_[i].options.forks) continue;
      bool explicit_ok = std::all_of(explicit_[i].begin(), explicit_[i].end(),
                                     [&](size_t p) { return records_[p].status == StageStatus::kSucceeded; });
      if (!explicit_ok) continue;
      bool order_ok = implicit_[i] == kNone || records_[implicit_[i]].status == StageStatus::kSucceeded;
      bool dynamo_ok = !stages_[i].options.runs_dynamo || dynamo_running_ == kNone;
      if (order_ok && dynamo_ok) {
        if (found == kNone) found = i;
      } else if (!held_seen_[i]) {
        held_seen_[i] = true;
        newly_held = true;
        ETTKIT_LOG_DEBUG("start-up stage '", stages_[i].name, "' is ready but waits for ",
                         order_ok ? "the running dynamo stage '" + stages_[dynamo_running_].name + "'"
                                  : "'" + stages_[implicit_[i]].name + "' (same collective group, runs first)");
      }
    }
    if (newly_held) cv_.notify_all();
    return found;
  }

  void begin_locked(size_t i, int worker, Clock::time_point now) {
    state_[i] = State::kRunning;
    auto& r = records_[i];
    r.started = true;
    r.worker = worker;
    r.begin_s = rel_s(now);
    r.begin_epoch_us = epoch_of(now);
    if (stages_[i].options.runs_dynamo) dynamo_running_ = i;
    if (stages_[i].options.timeout_s > 0) {
      deadline_[i] = now + std::chrono::duration_cast<Clock::duration>(
                               std::chrono::duration<double>(stages_[i].options.timeout_s));
    }
  }

  // Runs stage i's body without the lock; its exception becomes the stage's error (a forced unwind is
  // rethrown by caught_or_rethrow).
  std::exception_ptr invoke(size_t i, StageContext& ctx) {
    try {
      stages_[i].fn(ctx);
    } catch (...) {
      return caught_or_rethrow();
    }
    return nullptr;
  }

  void record_phase_locked(size_t i) {
    if (options_.recorder == nullptr || !records_[i].started) return;
    try {
      options_.recorder->record_phase(phase_ids_[i], records_[i].begin_epoch_us, records_[i].end_epoch_us);
    } catch (const std::exception& e) {
      // Measuring must never fail the start-up it measures.
      ETTKIT_LOG_WARN("could not record start-up stage '", stages_[i].name, "': ", e.what());
    }
  }

  void set_first_error_locked(size_t i, std::exception_ptr err, bool timeout) {
    if (first_error_) return;
    first_error_ = std::move(err);
    first_error_stage_ = i;
    first_error_is_timeout_ = timeout;
  }

  // Marks a pending stage terminal without running it.
  void cancel_locked(size_t i, const std::string& why) {
    if (state_[i] != State::kPending) return;
    state_[i] = State::kDone;
    records_[i].status = StageStatus::kCancelled;
    records_[i].error = why;
  }

  // Cancels every pending stage reachable from `i` (dependents, and later stages of its collective group).
  void cancel_dependents_locked(size_t i) {
    std::vector<size_t> todo{i};
    while (!todo.empty()) {
      size_t v = todo.back();
      todo.pop_back();
      for (size_t s : succs_[v]) {
        if (state_[s] != State::kPending) continue;
        cancel_locked(s, "depends on '" + stages_[v].name + "', which " + to_string(records_[v].status));
        todo.push_back(s);
      }
    }
  }

  void fail_fast_locked(size_t culprit) {
    for (size_t j = 0; j < stages_.size(); ++j) {
      if (state_[j] == State::kPending) {
        cancel_locked(j, "fail_fast: stage '" + stages_[culprit].name + "' " + to_string(records_[culprit].status));
      } else if (state_[j] == State::kRunning) {
        tokens_[j]->cancel();
      }
    }
  }

  void finish_locked(size_t i, std::exception_ptr err, Clock::time_point now) {
    if (dynamo_running_ == i) dynamo_running_ = kNone;
    if (state_[i] == State::kDone) return;  // timed out earlier; the late result is dropped
    state_[i] = State::kDone;
    auto& r = records_[i];
    r.end_s = rel_s(now);
    r.end_epoch_us = epoch_of(now);
    if (err) {
      r.status = StageStatus::kFailed;
      r.error = ettkit::detail::describe(err);
      set_first_error_locked(i, err, false);
      cancel_dependents_locked(i);
      if (options_.fail_fast) fail_fast_locked(i);
    } else {
      r.status = StageStatus::kSucceeded;
    }
    record_phase_locked(i);
    if (all_done_locked()) finished_ = true;
  }

  void time_out_locked(size_t i, Clock::time_point now, const std::string& why) {
    auto& r = records_[i];
    state_[i] = State::kDone;
    r.status = StageStatus::kTimedOut;
    r.end_s = rel_s(now);
    r.end_epoch_us = epoch_of(now);
    r.error = why;
    tokens_[i]->cancel();
    record_phase_locked(i);
    cancel_dependents_locked(i);
    if (stages_[i].options.runs_dynamo) {
      // The timed-out stage may still be compiling; another dynamo stage must not start beside it, and
      // waiting for it could take forever: cancel them now, deterministically.
      for (size_t j = 0; j < stages_.size(); ++j) {
        if (stages_[j].options.runs_dynamo) {
          cancel_locked(j, "dynamo stage '" + stages_[i].name + "' timed out and may still be running");
        }
      }
    }
    if (options_.fail_fast) fail_fast_locked(i);
    // Keep the pool's capacity: the timed-out stage still occupies its thread.
    bool pending = std::any_of(state_.begin(), state_.end(), [](State s) { return s == State::kPending; });
    if (pending) spawn_worker_locked();
  }

  // Applies stage and graph deadlines; returns the earliest future deadline (or nullopt).
  std::optional<Clock::time_point> apply_deadlines_locked(Clock::time_point now) {
    std::optional<Clock::time_point> next;
    for (size_t i = 0; i < stages_.size(); ++i) {
      if (state_[i] != State::kRunning || !deadline_[i]) continue;
      if (now >= *deadline_[i]) {
        std::string why = "exceeded its deadline of " + format_s(stages_[i].options.timeout_s) + " s";
        time_out_locked(i, now, why);
        set_first_error_locked(i,
                               std::make_exception_ptr(Timeout("start-up stage '" + stages_[i].name + "' " + why +
                                                                   " (StageOptions::timeout_s)",
                                                               __FILE__, __LINE__)),
                               true);
      } else if (!next || *deadline_[i] < *next) {
        next = deadline_[i];
      }
    }
    if (graph_deadline_) {
      if (now >= *graph_deadline_) {
        std::vector<std::string> running;
        size_t culprit = kNone;
        for (size_t i = 0; i < stages_.size(); ++i) {
          if (state_[i] == State::kRunning) {
            running.push_back(stages_[i].name);
            if (culprit == kNone) culprit = i;
          }
        }
        std::string why = "the graph exceeded its deadline of " + format_s(options_.timeout_s) + " s";
        // Pending stages first, so timing out the running ones finds nothing left to start a worker for.
        for (size_t i = 0; i < stages_.size(); ++i) cancel_locked(i, why + " before it could start");
        for (size_t i = 0; i < stages_.size(); ++i) {
          if (state_[i] == State::kRunning) time_out_locked(i, now, why);
        }
        std::string msg = "start-up graph exceeded its deadline of " + format_s(options_.timeout_s) + " s (" +
                          (running.empty() ? std::string("no stage was running")
                                           : "still running: " + join_names(running)) +
                          ")";
        set_first_error_locked(culprit, std::make_exception_ptr(Timeout(msg, __FILE__, __LINE__)), true);
        finished_ = true;
      } else if (!next || *graph_deadline_ < *next) {
        next = graph_deadline_;
      }
    }
    if (all_done_locked()) finished_ = true;
    return next;
  }

  // run()'s interrupt check said stop: nothing more starts, running stages are asked to cancel and are
  // reported cancelled now (their late results are dropped, like a timed-out stage's).
  void interrupt_locked(Clock::time_point now) {
    const std::string why = "the start-up graph was interrupted";
    for (size_t i = 0; i < stages_.size(); ++i) cancel_locked(i, why + " before it could start");
    for (size_t i = 0; i < stages_.size(); ++i) {
      if (state_[i] != State::kRunning) continue;
      interrupted_running_.push_back(stages_[i].name);
      auto& r = records_[i];
      state_[i] = State::kDone;
      r.status = StageStatus::kCancelled;
      r.end_s = rel_s(now);
      r.end_epoch_us = epoch_of(now);
      r.error = why + " while it ran";
      tokens_[i]->cancel();
      record_phase_locked(i);
    }
    interrupted_ = true;
    finished_ = true;
  }

  // Calls the caller's interrupt check without the lock (it may take the GIL, which a stage holding our
  // lock could be waiting for). True when the run was interrupted.
  bool poll_interrupt(std::unique_lock<std::mutex>& lk, const InterruptCheck& interrupted) {
    lk.unlock();
    bool stop = false;
    try {
      stop = interrupted();
    } catch (...) {
      interrupt_error_ = caught_or_rethrow();  // a forced unwind goes on; `lk` is unlocked, nothing to restore
      stop = true;
    }
    lk.lock();
    // Even when the graph finished meanwhile: the caller asked to stop (a binding may hold a pending
    // KeyboardInterrupt), so run() must not return as if nothing happened.
    if (stop) interrupt_locked(Clock::now());
    return stop;
  }

  // A worker's thread ended inside stage i (a forced unwind: pthread_exit, pthread_cancel) while the
  // graph still waited for it: the stage fails, so run() does not wait forever.
  void abandon_locked(size_t i) {
    if (state_[i] != State::kRunning) return;  // timed out or interrupted: already reported
    finish_locked(i,
                  std::make_exception_ptr(Cancelled("start-up stage '" + stages_[i].name +
                                                        "' ended its thread (pthread_exit or pthread_cancel) "
                                                        "before it returned",
                                                    __FILE__, __LINE__)),
                  Clock::now());
  }

  static std::string format_s(double s) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", s);
    return buf;
  }

  void spawn_worker_locked() {
    pool_.spawn_locked([self = shared_from_this()](Worker& me, std::unique_lock<std::mutex>& lk) {
      self->worker_loop_locked(me, lk);
    });
  }

  // A worker's life: take the first dispatchable stage, run it without the lock, record how it ended;
  // until the graph is finished. The pool marks the worker exited however it leaves.
  void worker_loop_locked(Worker& self, std::unique_lock<std::mutex>& lk) {
    while (true) {
      size_t i = kNone;
      cv_.wait(lk, [&] {
        if (finished_) return true;
        i = pick_locked();
        return i != kNone;
      });
      if (i == kNone) break;
      begin_locked(i, self.index, Clock::now());
      self.current = i;
      cv_.notify_all();  // the caller may need a new wake-up time (this stage's deadline)
      StageContext ctx(&stages_[i].name, tokens_[i]);
      lk.unlock();
      std::exception_ptr err = invoke(i, ctx);
      auto end = Clock::now();
      lk.lock();
      self.current = detail::WorkerPool::kIdle;
      finish_locked(i, std::move(err), end);
      cv_.notify_all();
    }
  }

  // run()'s steps (defined below the class).
  struct Outcome {
    bool interrupted;
    std::exception_ptr interrupt_error;
    std::vector<std::string> interrupted_running;
    std::exception_ptr error;
    size_t error_stage;
    bool error_is_timeout;
  };
  void plan_run();
  void reset_run_state_locked();
  void run_forking_stages(std::unique_lock<std::mutex>& lk, const InterruptCheck& interrupted);
  void start_workers(std::unique_lock<std::mutex>& lk, const InterruptCheck& interrupted);
  void wait_until_finished(std::unique_lock<std::mutex>& lk, const InterruptCheck& interrupted,
                           double poll_interval_s);
  StageReport build_report_locked();
  void throw_outcome(const Outcome& outcome) const;

  StageGraphOptions options_;
  std::vector<Stage> stages_;
  std::unordered_map<std::string, size_t> by_name_;
  bool ran_ = false;

  // Fixed once run() starts (read by workers without the lock).
  std::vector<size_t> order_;
  std::vector<std::vector<size_t>> explicit_;
  std::vector<size_t> implicit_;  // previous stage of the same collective group, or kNone
  std::vector<std::vector<size_t>> succs_;
  std::vector<uint32_t> phase_ids_;
  std::vector<std::shared_ptr<StageContext::Token>> tokens_;
  Clock::time_point t0_;
  ClockAnchor anchor_;
  std::optional<Clock::time_point> graph_deadline_;

  // Run state, guarded by mu_.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<State> state_;
  std::vector<StageRecord> records_;
  std::vector<std::optional<Clock::time_point>> deadline_;
  std::vector<bool> held_seen_;
  size_t dynamo_running_ = kNone;  // index of the dynamo stage whose thread is inside it
  bool finished_ = false;
  bool interrupted_ = false;                  // run()'s interrupt check said stop
  std::vector<std::string> interrupted_running_;  // stages that were running when it did
  std::exception_ptr interrupt_error_;        // what the interrupt check threw, if it threw
  std::exception_ptr first_error_;
  size_t first_error_stage_ = kNone;
  bool first_error_is_timeout_ = false;
  detail::WorkerPool pool_;  // after mu_ and cv_, which it waits on
  StageReport report_;
};

// ---- run(): the named steps ----------------------------------------------------------------------------

// The run's fixed plan (read by workers without the lock): order, implicit collective-group edges,
// successors, phase ids and cancellation tokens.
void StageGraph::Impl::plan_run() {
  const size_t n = stages_.size();
  explicit_ = explicit_preds();
  order_ = detail::topological_order(explicit_);
  implicit_.assign(n, kNone);
  std::unordered_map<std::string, size_t> last_of_group;
  for (size_t i : order_) {
    const auto& g = stages_[i].options.collective_group;
    if (g.empty()) continue;
    auto it = last_of_group.find(g);
    if (it != last_of_group.end()) implicit_[i] = it->second;
    last_of_group[g] = i;
  }
  succs_.assign(n, {});
  for (size_t i = 0; i < n; ++i) {
    for (size_t p : explicit_[i]) succs_[p].push_back(i);
    if (implicit_[i] != kNone) succs_[implicit_[i]].push_back(i);
  }
  phase_ids_.assign(n, 0);
  if (options_.recorder != nullptr) {
    for (size_t i = 0; i < n; ++i) phase_ids_[i] = options_.recorder->phase_id(stages_[i].phase);
  }
  tokens_.clear();
  for (size_t i = 0; i < n; ++i) tokens_.push_back(std::make_shared<StageContext::Token>());
}

void StageGraph::Impl::reset_run_state_locked() {
  const size_t n = stages_.size();
  ran_ = true;
  state_.assign(n, State::kPending);
  deadline_.assign(n, std::nullopt);
  held_seen_.assign(n, false);
  records_.clear();
  for (const auto& s : stages_) {
    StageRecord r;
    r.name = s.name;
    r.phase = s.phase;
    r.after = s.options.after;
    r.runs_dynamo = s.options.runs_dynamo;
    r.forks = s.options.forks;
    r.collective_group = s.options.collective_group;
    records_.push_back(std::move(r));
  }
  t0_ = Clock::now();
  anchor_ = ClockAnchor();
  if (options_.timeout_s > 0) {
    graph_deadline_ =
        t0_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.timeout_s));
  }
}

// Step 1: the forking stages, on this thread, before any worker exists.
void StageGraph::Impl::run_forking_stages(std::unique_lock<std::mutex>& lk, const InterruptCheck& interrupted) {
  for (size_t i : order_) {
    if (!stages_[i].options.forks || state_[i] != State::kPending) continue;
    if (apply_deadlines_locked(Clock::now()), finished_) break;
    if (interrupted && poll_interrupt(lk, interrupted)) break;
    bool deps_ok = std::all_of(explicit_[i].begin(), explicit_[i].end(),
                               [&](size_t p) { return records_[p].status == StageStatus::kSucceeded; });
    if (!deps_ok) continue;  // cancelled via cancel_dependents_locked already
    begin_locked(i, -1, Clock::now());
    StageContext ctx(&stages_[i].name, tokens_[i]);
    lk.unlock();
    std::exception_ptr err = invoke(i, ctx);
    auto end = Clock::now();
    lk.lock();
    finish_locked(i, std::move(err), end);
  }
}

// Step 2: everything else on the pool, unless the caller is already interrupting (e.g. Ctrl-C in a forking
// stage, which runs on the thread that receives signals).
void StageGraph::Impl::start_workers(std::unique_lock<std::mutex>& lk, const InterruptCheck& interrupted) {
  if (!finished_ && interrupted) poll_interrupt(lk, interrupted);
  if (!finished_) apply_deadlines_locked(Clock::now());
  if (!finished_) {
    size_t threaded = 0;
    for (State s : state_) threaded += (s == State::kPending) ? 1 : 0;
    size_t want = std::min<size_t>(threaded, static_cast<size_t>(options_.max_workers));
    for (size_t w = 0; w < want; ++w) spawn_worker_locked();
    if (want == 0) finished_ = all_done_locked();
  }
  if (all_done_locked()) finished_ = true;
}

// Step 3: wake for the earliest deadline and, with an interrupt check, at least every poll interval.
void StageGraph::Impl::wait_until_finished(std::unique_lock<std::mutex>& lk, const InterruptCheck& interrupted,
                                           double poll_interval_s) {
  const auto poll_every = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(poll_interval_s));
  auto next_poll = Clock::now() + poll_every;
  while (!finished_) {
    auto now = Clock::now();
    auto next = apply_deadlines_locked(now);
    if (finished_) break;
    if (interrupted) {
      if (now >= next_poll) {
        if (poll_interrupt(lk, interrupted)) break;
        next_poll = Clock::now() + poll_every;
        continue;  // the lock was released: look at the state again
      }
      if (!next || next_poll < *next) next = next_poll;
    }
    if (next) {
      cv_.wait_until(lk, *next);
    } else {
      cv_.wait(lk);
    }
  }
  cv_.notify_all();
}

StageReport StageGraph::Impl::build_report_locked() {
  report_ = StageReport{};
  report_.stages = records_;
  report_.workers = static_cast<int>(pool_.size_locked());
  std::vector<std::pair<size_t, size_t>> edges;
  for (size_t i = 0; i < stages_.size(); ++i) {
    for (size_t p : explicit_[i]) edges.emplace_back(p, i);
    if (implicit_[i] != kNone) edges.emplace_back(implicit_[i], i);
  }
  summarize(report_, edges);
  return report_;
}

// Step 4, after the idle workers are joined: an interrupt, then a stage's error, becomes run()'s exception.
void StageGraph::Impl::throw_outcome(const Outcome& outcome) const {
  if (outcome.interrupted) {
    // An interrupt wins over a stage error: the caller asked to stop, and that is what it gets.
    if (outcome.interrupt_error) std::rethrow_exception(outcome.interrupt_error);
    ETTKIT_THROW(Cancelled, "start-up graph was interrupted (",
                 outcome.interrupted_running.empty()
                     ? std::string("no stage was running")
                     : "still running: " + join_names(outcome.interrupted_running) +
                           "; asked to cancel, their threads are left to join()",
                 ")");
  }
  if (outcome.error) {
    if (outcome.error_is_timeout) std::rethrow_exception(outcome.error);
    throw StageFailed(stages_[outcome.error_stage].name, outcome.error, ettkit::detail::describe(outcome.error),
                      __FILE__, __LINE__);
  }
}

StageReport StageGraph::Impl::run(const InterruptCheck& interrupted, double poll_interval_s) {
  ETTKIT_EXPECTS(!ran_, "StageGraph::run() was already called; a StageGraph runs once (build a new one)");
  ETTKIT_EXPECTS(std::isfinite(poll_interval_s) && poll_interval_s > 0, "StageGraph::run poll_interval_s=",
                 poll_interval_s, " is invalid; use a positive number of seconds");
  validate();
  plan_run();

  std::unique_lock<std::mutex> lk(mu_);
  reset_run_state_locked();
  run_forking_stages(lk, interrupted);
  start_workers(lk, interrupted);
  wait_until_finished(lk, interrupted, poll_interval_s);
  StageReport out = build_report_locked();
  const Outcome outcome{interrupted_, interrupt_error_,   interrupted_running_,
                        first_error_, first_error_stage_, first_error_is_timeout_};
  lk.unlock();

  // Idle workers exit promptly now; threads still inside a timed-out or interrupted stage are left to
  // join() or the destructor.
  pool_.join_idle();
  throw_outcome(outcome);
  return out;
}

// ---- StageGraph ----------------------------------------------------------------------------------------

StageGraph::StageGraph(StageGraphOptions options) {
  options.recorder = ett::recorder_for("StageGraph", options.recorder, options.use_current_recorder);
  impl_ = std::make_shared<Impl>(options);
}
StageGraph::~StageGraph() { impl_->shutdown(); }
void StageGraph::add(const std::string& name, StageFn fn, StageOptions options) {
  impl_->add(name, std::move(fn), std::move(options));
}
void StageGraph::validate() const { impl_->validate(); }
std::vector<std::string> StageGraph::topological_order() const { return impl_->topological_order(); }
StageReport StageGraph::run() { return impl_->run({}, 0.05); }
StageReport StageGraph::run(const InterruptCheck& interrupted, double poll_interval_s) {
  return impl_->run(interrupted, poll_interval_s);
}
StageReport StageGraph::report() const { return impl_->report(); }
bool StageGraph::join(double timeout_s) { return impl_->join(timeout_s); }
size_t StageGraph::size() const { return impl_->size(); }
bool StageGraph::wait_held_for_testing(const std::string& name, double timeout_s) {
  return impl_->wait_held(name, timeout_s);
}

}  // namespace ettkit::startup
