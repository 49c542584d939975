#pragma once
// ettkit::startup::detail::WorkerPool: the threads a StageGraph runs its stages on, and the bookkeeping that
// lets the graph join, wait for or let go of each of them.
//
// What it promises
//  - spawn_locked() starts one thread that runs the scheduler's loop. However the thread leaves that loop
//    (by returning, or by a forced unwind out of a stage: pthread_exit, pthread_cancel), the pool marks the
//    worker exited, hands the stage it was still inside to `on_abandon` (so the graph never waits for a
//    thread that is gone) and wakes every waiter.
//  - Each thread is joined or detached exactly once: join() and join_idle() join the threads that exited,
//    detach_busy() lets go of the ones still inside a stage. A thread is never abandoned while joinable.
// Who owns what
//  - The scheduler owns the mutex and the condition variable; the pool only waits on them. A Worker's
//    `current` and `exited`, and the list of workers, are guarded by that mutex; `thread` and `joined` belong
//    to the thread that joins (the StageGraph's owner).
//  - A worker's loop carries what keeps the scheduler, and with it this pool, alive (the StageGraph's Impl):
//    so a detached worker can finish a stage that outlived its graph.

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace ettkit::startup::detail {

class WorkerPool {
 public:
  static constexpr size_t kIdle = std::numeric_limits<size_t>::max();

  struct Worker {
    int index = 0;
    size_t current = kIdle;  // the stage this worker is inside, or kIdle (guarded by the mutex)
    bool exited = false;     // guarded by the mutex
    bool joined = false;     // touched only by the thread that joins
    std::thread thread;
  };

  /// A worker's loop: entered and left with `lk` (the scheduler's mutex) held; it sets `self.current`
  /// around each stage it runs.
  using Loop = std::function<void(Worker& self, std::unique_lock<std::mutex>& lk)>;
  /// Called with the mutex held for the stage a worker's thread was inside when it left its loop.
  using OnAbandon = std::function<void(size_t stage)>;

  WorkerPool(std::mutex& mu, std::condition_variable& cv, OnAbandon on_abandon);
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Starts a worker running `loop`. Requires the mutex.
  void spawn_locked(Loop loop);
  /// Workers started so far. Requires the mutex.
  size_t size_locked() const { return workers_.size(); }

  /// Joins the workers that exited, waiting up to `timeout_s` (forever when nullopt) for all of them to
  /// exit. True when every worker is joined. Workers leave once the graph is finished; only a thread still
  /// inside a stage stays.
  bool join(std::optional<double> timeout_s);
  /// Waits for every worker that is not inside a stage to exit, and joins it.
  void join_idle();
  /// Detaches every worker not joined yet (call after join_idle(): those are inside a stage).
  void detach_busy();

 private:
  class ExitMark;
  void run(Worker& self, const Loop& loop);
  // Moves the exited, unjoined workers into `to_join`; sets *all to false if some have not exited.
  void collect_exited_locked(std::vector<Worker*>& to_join, bool* all);
  static void join_all(const std::vector<Worker*>& to_join);

  std::mutex& mu_;
  std::condition_variable& cv_;
  const OnAbandon on_abandon_;
  std::vector<std::unique_ptr<Worker>> workers_;  // unique_ptr: a Worker's address outlives the vector's growth
};

}  // namespace ettkit::startup::detail
