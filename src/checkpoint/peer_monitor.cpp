// PeerMonitor: heartbeats and liveness-aware waits on the c10d Store.
#include "checkpoint/peer_monitor.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

#include "checkpoint/store_exchange.h"  // bytes_of, string_of
#include "common/background_thread.h"
#include "common/describe.h"
#include "common/logging.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace ettkit::checkpoint::detail {

using ::ettkit::detail::first_line;

PeerMonitor::PeerMonitor(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int /*world*/,
                         double peer_timeout_s)
    : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), peer_timeout_s_(peer_timeout_s) {
  set(prefix_ + "alive/" + std::to_string(rank_), "0");
  heartbeat_ = std::thread([this] {
    ettkit::detail::mark_background_thread();
    beat();
  });
}

PeerMonitor::~PeerMonitor() { close(false); }

void PeerMonitor::close(bool clean) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stop_ && !heartbeat_.joinable()) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  if (clean) {
    try {
      store_->set(prefix_ + "closed/" + std::to_string(rank_), bytes_of("1"));
    } catch (const std::exception& e) {
      ETTKIT_LOG_DEBUG("checkpoint: could not publish that rank ", rank_, " closed: ", first_line(e));
    }
  }
}

void PeerMonitor::beat() {
  auto period = std::chrono::duration<double>(std::clamp(peer_timeout_s_ / 6.0, 0.05, 1.0));
  uint64_t n = 0;
  std::unique_lock<std::mutex> lk(mu_);
  while (!cv_.wait_for(lk, period, [&] { return stop_; })) {
    lk.unlock();
    try {
      store_->set(prefix_ + "alive/" + std::to_string(rank_), bytes_of(std::to_string(++n)));
    } catch (const std::exception& e) {
      // The Store is gone (its host died): nobody can read a heartbeat any more; waits notice it themselves.
      ETTKIT_LOG_DEBUG("checkpoint: heartbeat of rank ", rank_, " stopped: ", first_line(e));
      lk.lock();
      return;
    }
    lk.lock();
  }
}

void PeerMonitor::set(const std::string& key, const std::string& value) {
  try {
    store_->set(key, bytes_of(value));
  } catch (const std::exception& e) {
    ETTKIT_THROW(checkpoint::PeerLost, "the c10d Store that coordinates the checkpoint commit is unreachable (",
                 first_line(e), "): its host (rank 0 or the launcher) is gone");
  }
}

void PeerMonitor::judge(const std::vector<int>& watch, const std::string& what) {
  auto now = std::chrono::steady_clock::now();
  for (int r : watch) {
    std::string closed = prefix_ + "closed/" + std::to_string(r);
    std::string alive = prefix_ + "alive/" + std::to_string(r);
    std::string value;
    bool have = false;
    try {
      if (store_->check({closed})) {
        ETTKIT_THROW(checkpoint::PeerLost, what, ": rank ", r,
                     " closed its checkpointer without taking part (it saved fewer steps than this rank)");
      }
      if (store_->check({alive})) {
        value = string_of(store_->get(alive));
        have = true;
      }
    } catch (const checkpoint::PeerLost&) {
      throw;
    } catch (const std::exception& e) {
      ETTKIT_THROW(checkpoint::PeerLost, what, ": the c10d Store is unreachable (", first_line(e),
                   "): its host (rank 0 or the launcher) is gone");
    }
    if (!have) continue;  // not open yet: only timeout_s judges it
    std::lock_guard<std::mutex> lk(mu_);
    auto it = seen_.find(r);
    if (it == seen_.end() || it->second.value != value) {
      seen_[r] = Seen{value, now};
      continue;
    }
    double silent = std::chrono::duration<double>(now - it->second.since).count();
    if (silent > peer_timeout_s_) {
      ETTKIT_THROW(checkpoint::PeerLost, what, ": rank ", r, " is gone (no heartbeat for ", silent,
                   " s, peer_timeout_s=", peer_timeout_s_, ")");
    }
  }
}

void PeerMonitor::wait_keys(const std::vector<std::string>& keys, const std::vector<int>& watch, double timeout_s,
                            const std::string& what) {
  auto start = std::chrono::steady_clock::now();
  auto last_judged = start - std::chrono::hours(1);
  auto nap = std::chrono::microseconds(500);
  for (;;) {
    bool ready = false;
    try {
      ready = store_->check(keys);
    } catch (const std::exception& e) {
      ETTKIT_THROW(checkpoint::PeerLost, what, ": the c10d Store is unreachable (", first_line(e),
                   "): its host (rank 0 or the launcher) is gone");
    }
    if (ready) return;
    auto now = std::chrono::steady_clock::now();
    if (now - last_judged >= std::chrono::milliseconds(200)) {
      try {
        judge(watch, what);
      } catch (const checkpoint::PeerLost&) {
        // A rank may have published its key and then closed (or stopped beating) after the check above:
        // it took part. Only a rank whose key is still missing now is lost. (It set its key before it
        // closed, and the Store is linearizable, so a key set before an observed "closed" is visible.)
        bool arrived = false;
        try {
          arrived = store_->check(keys);
        } catch (const std::exception&) {
        }
        if (arrived) return;
        throw;
      }
      last_judged = now;
    }
    double waited = std::chrono::duration<double>(now - start).count();
    ETTKIT_CHECK(waited < timeout_s, Timeout, what, ": not complete within ", timeout_s, " s");
    std::this_thread::sleep_for(nap);
    nap = std::min<std::chrono::microseconds>(nap * 2, std::chrono::milliseconds(50));
  }
}

}  // namespace ettkit::checkpoint::detail
