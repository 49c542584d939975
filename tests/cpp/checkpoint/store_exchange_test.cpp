// StoreExchange (src/checkpoint/store_exchange.h) over an in-process Store: the all-gather returns every
// rank's value in rank order, rank 0's value reaches the others, the worst verdict wins with its rank named;
// and what any client of the Store could plant instead of a rank's value (not JSON, the wrong type, a missing
// field, a verdict outside the enum) is refused with CorruptData naming the key, the rank and what was
// expected. A rank that closed without taking part ends the wait at once with PeerLost. Every order is set up
// before the wait (no thread races the waiter), so each test takes one path every run.
#include "checkpoint/store_exchange.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <memory>
#include <string>
#include <vector>

#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {
namespace {

using json = nlohmann::json;

constexpr const char* kRun = "ck/";
constexpr const char* kGather = "ck/x/";

/// `world` ranks' monitors and exchanges over one in-process Store.
struct Job {
  explicit Job(int world) : store(c10::make_intrusive<c10d::HashStore>()) {
    for (int r = 0; r < world; ++r) {
      monitors.push_back(std::make_unique<PeerMonitor>(store, kRun, r, world, 5.0));
      exchanges.push_back(std::make_unique<StoreExchange>(*store, monitors.back().get(), 60.0));
    }
  }
  ~Job() {
    for (auto& m : monitors) m->close(true);
  }
  StoreExchange& rank(int r) { return *exchanges[static_cast<size_t>(r)]; }
  /// What a stranger on the Store does: writes `text` under `key` as it is.
  void plant(const std::string& key, const std::string& text) { store->set(key, bytes_of(text)); }
  c10::intrusive_ptr<c10d::HashStore> store;
  std::vector<std::unique_ptr<PeerMonitor>> monitors;
  std::vector<std::unique_ptr<StoreExchange>> exchanges;
};

/// The message of the E that fn throws, or a text no assertion below matches.
template <class E, class F>
std::string refusal(F fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.message();
  }
  return "(nothing of that kind thrown)";
}

void check_count(const json& v, const std::string& source) {
  ETTKIT_CHECK(v.is_object() && v.contains("n") && v["n"].is_number_integer(), CorruptData, source,
               " has no integer 'n'");
}

int severity(int v) { return v; }

}  // namespace

TEST(StoreExchange, AllGatherReturnsEveryRanksValueInRankOrder) {
  Job job(3);
  // Ranks 2 and 1 publish first (the first half of their all_gather); rank 0's then finds every value.
  job.rank(2).publish(std::string(kGather) + "2", json{{"n", 20}});
  job.rank(1).publish(std::string(kGather) + "1", json{{"n", 10}});
  auto got = job.rank(0).all_gather(kGather, 0, 3, json{{"n", 0}}, "test", "{\"n\": integer}", check_count);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0]["n"], 0);
  EXPECT_EQ(got[1]["n"], 10);
  EXPECT_EQ(got[2]["n"], 20);
  // Rank 1's own all_gather sets its key again and reads the same values.
  auto again = job.rank(1).all_gather(kGather, 1, 3, json{{"n", 10}}, "test", "{\"n\": integer}", check_count);
  EXPECT_EQ(again, got);
}

TEST(StoreExchange, Rank0sValueReachesEveryRank) {
  Job job(2);
  EXPECT_EQ(job.rank(0).from_rank0("ck/id", 0, "00000000000000ab", "the run id"), "00000000000000ab");
  EXPECT_EQ(job.rank(1).from_rank0("ck/id", 1, "ignored", "the run id"), "00000000000000ab");
  // Before a run id exists there is no monitor: the wait is the Store's, bounded by the timeout.
  StoreExchange bare(*job.store, nullptr, 5.0);
  EXPECT_EQ(bare.from_rank0("ck/id", 1, "", "the run id"), "00000000000000ab");
}

TEST(StoreExchange, TheWorstVerdictWinsWithItsRankNamed) {
  Job job(3);
  job.rank(1).publish("ck/v/1", json{{"v", 2}, {"why", "step 4 is torn"}});
  job.rank(2).publish("ck/v/2", json{{"v", 2}, {"why", "step 4 is missing"}});
  RankVerdict worst = job.rank(0).worst_verdict("ck/v/", 0, 3, {1, "mine is bad"}, 3, severity, "test");
  EXPECT_EQ(worst.verdict, 2);
  EXPECT_EQ(worst.why, "rank 1: step 4 is torn");  // a tie: the lowest rank's
  // A rank's own verdict, when it is the worst, keeps its reason as it is.
  Job alone(1);
  RankVerdict mine = alone.rank(0).worst_verdict("ck/v/", 0, 1, {3, "vanished"}, 3, severity, "test");
  EXPECT_EQ(mine.verdict, 3);
  EXPECT_EQ(mine.why, "vanished");
}

TEST(StoreExchange, AValueThatIsNotJsonIsRefusedNamingTheKeyAndTheShape) {
  Job job(2);
  job.plant("ck/x/1", "not json");
  EXPECT_EQ(refusal<CorruptData>([&] {
              job.rank(0).all_gather(kGather, 0, 2, json{{"n", 0}}, "load", "{\"n\": integer}", check_count);
            }),
            "load: rank 1's value under the Store key 'ck/x/1' is not JSON (8 bytes); expected {\"n\": integer}");
  EXPECT_EQ(refusal<CorruptData>([] { StoreExchange::decode("\xff\xfe{", "k", "a list"); }),
            "k is not JSON (3 bytes); expected a list");
}

TEST(StoreExchange, AValueOfTheWrongTypeOrWithAFieldMissingIsRefused) {
  Job job(2);
  job.plant("ck/x/1", "[1, 2]");
  EXPECT_EQ(refusal<CorruptData>([&] {
              job.rank(0).all_gather(kGather, 0, 2, json{{"n", 0}}, "load", "{\"n\": integer}", check_count);
            }),
            "load: rank 1's value under the Store key 'ck/x/1' has no integer 'n'");
  // Verdicts: the reason missing, a verdict outside the enum, a verdict that is text.
  const std::string expected = "vote: rank 1's value under the Store key 'ck/v/1' does not hold a verdict "
                               "{\"v\": 0-3, \"why\": text}";
  for (const char* planted : {R"({"v": 1})", R"({"v": 4, "why": "x"})", R"({"v": -1, "why": "x"})",
                              R"({"v": "1", "why": "x"})", R"("ok")"}) {
    Job j(2);
    j.plant("ck/v/1", planted);
    EXPECT_EQ(refusal<CorruptData>([&] { j.rank(0).worst_verdict("ck/v/", 0, 2, {0, ""}, 3, severity, "vote"); }),
              expected)
        << planted;
  }
}

TEST(StoreExchange, ARankThatClosedWithoutItsValueEndsTheWaitAtOnce) {
  Job job(3);
  job.rank(1).publish(std::string(kGather) + "1", json{{"n", 10}});
  job.monitors[2]->close(/*clean=*/true);  // rank 2 is gone without taking part; the timeout is 60 s
  const std::string m = refusal<PeerLost>([&] {
    job.rank(0).all_gather(kGather, 0, 3, json{{"n", 0}}, "load_latest: the memory steps", "{\"n\": integer}");
  });
  EXPECT_EQ(m, "load_latest: the memory steps: rank 2 closed its checkpointer without taking part (it saved fewer "
               "steps than this rank)");
  // Rank 0's value never came: a rank other than 0 is told so, naming the wait, once rank 0 closed.
  Job lost(2);
  lost.monitors[0]->close(true);
  EXPECT_NE(refusal<PeerLost>([&] { lost.rank(1).from_rank0("ck/id", 1, "", "the run id"); }).find("the run id: rank 0 closed"),
            std::string::npos);
}

}  // namespace ettkit::checkpoint::detail
