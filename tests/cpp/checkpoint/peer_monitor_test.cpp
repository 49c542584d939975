// PeerMonitor's verdicts, against a c10d Store whose answers a test scripts: which interleavings of a peer's
// "my key is set" and "I closed" make a waiting rank report PeerLost. The orders are forced, not raced, so
// each test takes one path every run.
#include <gtest/gtest.h>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "checkpoint/peer_monitor.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace ettkit::checkpoint::detail {
namespace {

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

/// A HashStore that runs `hook` once, right after the first check() of `watched` has answered "missing":
/// what a peer does between the waiter's look at the keys and its look at the peer's liveness.
class ScriptedStore : public c10d::HashStore {
 public:
  std::string watched;
  std::function<void(ScriptedStore&)> hook;
  std::atomic<bool> unreachable{false};

  bool check(const std::vector<std::string>& keys) override {
    if (unreachable) throw std::runtime_error("Connection reset by peer");
    bool ready = c10d::HashStore::check(keys);
    bool is_watched = keys.size() == 1 && keys[0] == watched;
    if (is_watched && !ready && hook) {
      auto h = std::move(hook);
      hook = nullptr;
      h(*this);
    }
    return ready;
  }
};

constexpr const char* kPrefix = "ck/";
constexpr const char* kVote = "ck/vote/1";

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(PeerMonitor, APeerThatSetItsKeyAndThenClosedTookPart) {
  // The order that once failed a 3-rank load_latest: the waiter sees the vote missing, the peer votes and
  // closes, the waiter sees "closed". The vote is there, so the peer is not lost.
  auto store = c10::make_intrusive<ScriptedStore>();
  store->watched = kVote;
  store->hook = [](ScriptedStore& s) {
    s.set(kVote, bytes("ok"));
    s.set(std::string(kPrefix) + "closed/1", bytes("1"));
  };
  PeerMonitor monitor(store, kPrefix, 0, 2, 5.0);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(monitor.wait_keys({kVote}, {1}, 30.0, "step 7: the vote of rank 1"));
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_EQ(store->hook, nullptr) << "the scripted interleaving did not happen";
  monitor.close(true);
}

TEST(PeerMonitor, APeerThatClosedWithoutItsKeyIsLostAtOnce) {
  auto store = c10::make_intrusive<ScriptedStore>();
  store->watched = kVote;
  store->hook = [](ScriptedStore& s) { s.set(std::string(kPrefix) + "closed/1", bytes("1")); };
  PeerMonitor monitor(store, kPrefix, 0, 2, 5.0);
  auto t0 = std::chrono::steady_clock::now();
  try {
    monitor.wait_keys({kVote}, {1}, 30.0, "step 7: the vote of rank 1");
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("step 7: the vote of rank 1"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1 closed"), std::string::npos) << what;
  }
  EXPECT_LT(seconds_since(t0), 5.0);  // not the 30 s timeout
}

TEST(PeerMonitor, APeerWhoseHeartbeatStopsIsLostAfterPeerTimeout) {
  auto store = c10::make_intrusive<ScriptedStore>();
  store->set(std::string(kPrefix) + "alive/1", bytes("3"));  // seen once, then never again
  PeerMonitor monitor(store, kPrefix, 0, 2, 0.5);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_THROW(monitor.wait_keys({kVote}, {1}, 60.0, "step 7"), PeerLost);
  double took = seconds_since(t0);
  EXPECT_GE(took, 0.5);   // silent for peer_timeout_s first
  EXPECT_LT(took, 30.0);  // and not the 60 s timeout
}

TEST(PeerMonitor, ARankThatNeverOpenedIsJudgedByTheTimeoutOnly) {
  auto store = c10::make_intrusive<ScriptedStore>();
  PeerMonitor monitor(store, kPrefix, 0, 2, 0.1);
  EXPECT_THROW(monitor.wait_keys({kVote}, {1}, 0.6, "step 7"), Timeout);
}

TEST(PeerMonitor, AnUnreachableStoreIsAPeerLostNamingTheHost) {
  auto store = c10::make_intrusive<ScriptedStore>();
  PeerMonitor monitor(store, kPrefix, 0, 2, 5.0);
  store->unreachable = true;
  try {
    monitor.wait_keys({kVote}, {1}, 30.0, "step 7");
    FAIL() << "expected PeerLost";
  } catch (const PeerLost& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("unreachable"), std::string::npos) << what;
    EXPECT_NE(what.find("Connection reset by peer"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace ettkit::checkpoint::detail
