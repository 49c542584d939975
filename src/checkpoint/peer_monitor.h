#pragma once
// Liveness of the ranks that share one checkpoint commit, through the c10d Store (no collectives).
//
// Why: a rank that waits for its peers' votes would otherwise wait commit_timeout_s (600 s by default)
// for a peer that is already dead, once per queued save, and close() would wait for all of them: the
// checkpointer would be what keeps a dead job alive. Each rank publishes a heartbeat key from the moment
// its checkpointer opens until it closes; a waiting rank that sees a peer's heartbeat stop, or its
// "closed" marker, gives up at once with PeerLost.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ettkit::checkpoint::detail {

/// Owns the heartbeat thread of one rank. Thread-safe.
class PeerMonitor {
 public:
  /// Starts publishing `<prefix>alive/<rank>` every peer_timeout_s / 6 (at most every second).
  PeerMonitor(c10::intrusive_ptr<c10d::Store> store, std::string prefix, int rank, int world,
              double peer_timeout_s);
  ~PeerMonitor();
  PeerMonitor(const PeerMonitor&) = delete;
  PeerMonitor& operator=(const PeerMonitor&) = delete;

  /// Stops the heartbeat; `clean`: also publishes `<prefix>closed/<rank>`, so that peers still waiting
  /// for this rank fail at once instead of after peer_timeout_s. Idempotent.
  void close(bool clean);

  /// Waits until every key exists. Throws PeerLost when a rank in `watch` closed, stopped its heartbeat
  /// for peer_timeout_s, or the Store is unreachable; Timeout after timeout_s. A rank whose heartbeat was
  /// never seen (its checkpointer is not open yet) is judged by timeout_s only. `what` names the wait in
  /// the messages ("checkpoint step 7: the votes of ranks 1-3"). A rank that set its key and then closed took
  /// part: the keys are checked again before a lost peer is reported.
  void wait_keys(const std::vector<std::string>& keys, const std::vector<int>& watch, double timeout_s,
                 const std::string& what);

  /// store->set that reports an unreachable Store as PeerLost.
  void set(const std::string& key, const std::string& value);

 private:
  struct Seen {
    std::string value;
    std::chrono::steady_clock::time_point since;
  };
  void beat();
  /// Throws PeerLost if a watched rank is gone (mu_ not held).
  void judge(const std::vector<int>& watch, const std::string& what);

  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
  int rank_;
  double peer_timeout_s_;
  std::mutex mu_;  // guards stop_, seen_
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<int, Seen> seen_;
  std::thread heartbeat_;
};

}  // namespace ettkit::checkpoint::detail
