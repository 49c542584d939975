#include "startup/worker_pool.h"

#include <algorithm>
#include <chrono>
#include <utility>

namespace ettkit::startup::detail {

// Marks a worker gone however its thread leaves run(): at the end of the loop, or by a forced unwind out
// of a stage (then `lk` is unlocked and the stage is still current).
class WorkerPool::ExitMark {
 public:
  ExitMark(WorkerPool& pool, Worker& self, std::unique_lock<std::mutex>& lk) : pool_(pool), self_(self), lk_(lk) {}
  ExitMark(const ExitMark&) = delete;
  ExitMark& operator=(const ExitMark&) = delete;
  ~ExitMark() {
    if (!lk_.owns_lock()) lk_.lock();
    if (self_.current != kIdle) {
      pool_.on_abandon_(self_.current);
      self_.current = kIdle;
    }
    self_.exited = true;
    pool_.cv_.notify_all();
  }

 private:
  WorkerPool& pool_;
  Worker& self_;
  std::unique_lock<std::mutex>& lk_;
};

WorkerPool::WorkerPool(std::mutex& mu, std::condition_variable& cv, OnAbandon on_abandon)
    : mu_(mu), cv_(cv), on_abandon_(std::move(on_abandon)) {}

void WorkerPool::spawn_locked(Loop loop) {
  workers_.push_back(std::make_unique<Worker>());
  Worker* w = workers_.back().get();
  w->index = static_cast<int>(workers_.size() - 1);
  // The thread reads *w only under the mutex, which the caller holds until this assignment is done.
  w->thread = std::thread([this, w, loop = std::move(loop)] { run(*w, loop); });
}

void WorkerPool::run(Worker& self, const Loop& loop) {
  std::unique_lock<std::mutex> lk(mu_);
  ExitMark exit_mark(*this, self, lk);
  loop(self, lk);
}

bool WorkerPool::join(std::optional<double> timeout_s) {
  std::vector<Worker*> to_join;
  bool all = true;
  {
    std::unique_lock<std::mutex> lk(mu_);
    auto exited = [&] {
      return std::all_of(workers_.begin(), workers_.end(), [](const auto& w) { return w->exited || w->joined; });
    };
    if (timeout_s) {
      cv_.wait_for(lk, std::chrono::duration<double>(*timeout_s), exited);
    } else {
      cv_.wait(lk, exited);
    }
    collect_exited_locked(to_join, &all);
  }
  join_all(to_join);
  return all;
}

void WorkerPool::join_idle() {
  std::vector<Worker*> to_join;
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] {
      return std::all_of(workers_.begin(), workers_.end(),
                         [](const auto& w) { return w->exited || w->joined || w->current != kIdle; });
    });
    collect_exited_locked(to_join, nullptr);
  }
  join_all(to_join);
}

void WorkerPool::detach_busy() {
  for (auto& w : workers_) {
    if (!w->joined) {
      w->thread.detach();
      w->joined = true;
    }
  }
}

void WorkerPool::collect_exited_locked(std::vector<Worker*>& to_join, bool* all) {
  for (auto& w : workers_) {
    if (w->joined) continue;
    if (w->exited) {
      to_join.push_back(w.get());
    } else if (all != nullptr) {
      *all = false;
    }
  }
}

void WorkerPool::join_all(const std::vector<Worker*>& to_join) {
  for (Worker* w : to_join) {
    w->thread.join();
    w->joined = true;
  }
}

}  // namespace ettkit::startup::detail
