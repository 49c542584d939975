// The interval policy (include/ettkit/checkpoint/schedule.h): what an interval string means, which tier is
// due at which step and time, "auto" before and after its first measurement (Daly's interval, never below
// the time to commit), and the failure history read from an ETT ledger. Deterministic: every time is given.
#include "ettkit/checkpoint/schedule.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "ett/test_dir.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/interval.h"
#include "ettkit/ett/recorder.h"
#include "ettkit/ett/report.h"

namespace ck = ettkit::checkpoint;
using ck::Every;
using ck::Tier;
using ettkit::InvalidArgument;

namespace {

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST(Schedule, IntervalsParseStepsDurationsAutoAndNever) {
  EXPECT_EQ(Every::parse("500").kind, Every::Kind::kSteps);
  EXPECT_EQ(Every::parse("500").value, 500);
  EXPECT_EQ(Every::parse(" 90s ").value, 90);
  EXPECT_EQ(Every::parse("1.5min").value, 90);
  EXPECT_EQ(Every::parse("10 m").value, 600);
  EXPECT_EQ(Every::parse("2h").value, 7200);
  EXPECT_EQ(Every::parse(".5sec").value, 0.5);
  EXPECT_EQ(Every::parse("auto").kind, Every::Kind::kAuto);
  EXPECT_EQ(Every::parse("").kind, Every::Kind::kNever);
  EXPECT_EQ(Every::parse("never").kind, Every::Kind::kNever);
  EXPECT_STREQ(Every::parse("2h").kind_name(), "seconds");
  for (const char* bad : {"0", "0s", "-3", "soon", "10 parsecs", "1.2.3s", "s", "5d", "1e3s", ".s", "3.s",
                          "99999999999999999999"}) {
    std::string m = message_of([&] { Every::parse(bad, "every_memory"); });
    EXPECT_NE(m.find("every_memory="), std::string::npos) << bad << ": " << m;
  }
  EXPECT_NE(message_of([] { Every::steps(-1, "every_memory"); }).find("every_memory=-1 must be a positive number"),
            std::string::npos);
  EXPECT_NE(message_of([] { Every::seconds(std::nan(""), "every"); }).find("every=nan"), std::string::npos);
}

TEST(Schedule, StepIntervalsPerTierAndTheDiskWinsASharedStep) {
  ck::CheckpointSchedule s(Every::steps(6), Every::steps(2), {}, 0.0);
  std::vector<std::pair<int, Tier>> due;
  for (int step = 0; step <= 12; ++step) {
    if (auto t = s.due(step, 0.0, {}, {})) {
      due.emplace_back(step, *t);
      s.saved(step, *t, 0.0);
      EXPECT_FALSE(s.due(step, 0.0, {}, {})) << "saved twice at " << step;
    }
  }
  std::vector<std::pair<int, Tier>> want{{2, Tier::kMemory}, {4, Tier::kMemory}, {6, Tier::kDisk},
                                         {8, Tier::kMemory}, {10, Tier::kMemory}, {12, Tier::kDisk}};
  EXPECT_EQ(due, want);
  // A restored step is not saved again at once, by either tier.
  s.restored(18);
  EXPECT_FALSE(s.due(18, 0.0, {}, {}));
  EXPECT_EQ(s.due(20, 0.0, {}, {}), Tier::kMemory);
}

TEST(Schedule, DurationsCountFromTheTiersOwnLastSave) {
  ck::CheckpointSchedule s(Every::seconds(100), Every::seconds(10), {}, 1000.0);
  EXPECT_FALSE(s.due(1, 1009.0, {}, {}));
  EXPECT_EQ(s.due(2, 1010.0, {}, {}), Tier::kMemory);
  s.saved(2, Tier::kMemory, 1010.0);
  EXPECT_FALSE(s.due(3, 1019.0, {}, {}));
  EXPECT_EQ(s.due(4, 1100.0, {}, {}), Tier::kDisk);  // both due: the disk wins
  s.saved(4, Tier::kDisk, 1100.0);
  EXPECT_EQ(s.due(5, 1100.5, {}, {}), Tier::kMemory);  // a disk save does not reset the memory interval
}

TEST(Schedule, AutoSavesOnceToMeasureThenFollowsDalyNeverBelowTheTimeToCommit) {
  ck::FailureHistory h{3600.0, 20.0};
  ck::CheckpointSchedule s(Every::automatic(), {}, h, 0.0);
  ck::TierCosts none;
  EXPECT_EQ(s.due(1, 0.0, none, none), Tier::kDisk);  // nothing saved: the first save measures
  s.saved(1, Tier::kDisk, 0.0);
  EXPECT_EQ(s.auto_interval_s(none), ck::kAutoUnmeasuredIntervalS);  // not committed yet
  EXPECT_FALSE(s.due(2, ck::kAutoUnmeasuredIntervalS - 0.5, none, none));
  EXPECT_EQ(s.due(3, ck::kAutoUnmeasuredIntervalS, none, none), Tier::kDisk);
  ck::TierCosts measured{1, 2.0, 30.0};
  double daly = ettkit::ett::recommend_interval(2.0, 3600.0, 20.0, ettkit::ett::IntervalMethod::kDaly);
  ASSERT_GT(daly, 30.0);
  EXPECT_DOUBLE_EQ(s.auto_interval_s(measured), daly);
  EXPECT_FALSE(s.due(4, daly - 0.5, measured, none));
  EXPECT_EQ(s.due(5, daly, measured, none), Tier::kDisk);
  // A save cheaper than it takes to commit: the interval is the commit time, and a zero blocking is 0.1 ms.
  ck::TierCosts cheap{3, 0.0, 45.0};
  EXPECT_DOUBLE_EQ(s.auto_interval_s(cheap),
                   std::max(45.0, ettkit::ett::recommend_interval(1e-4, 3600.0, 20.0, ettkit::ett::IntervalMethod::kDaly)));
  EXPECT_THROW(ck::CheckpointSchedule(Every{}, Every{}, ck::FailureHistory{0.0, 0.0}), InvalidArgument);
  EXPECT_THROW(ck::CheckpointSchedule(Every{}, Every{}, ck::FailureHistory{10.0, -1.0}), InvalidArgument);
}

TEST(Schedule, FailureHistoryComesFromTheLedgerOrThePrior) {
  ettkit::testing::TempDir d;
  // No ledger yet (a job's first start): the prior, no restart cost.
  auto none = ck::FailureHistory::from_run(d.str() + "/not-yet", 7200.0);
  EXPECT_EQ(none.mtbf_s, 7200.0);
  EXPECT_EQ(none.restart_s, 0.0);
  EXPECT_THROW(ck::FailureHistory::from_run(d.str(), 0.0), InvalidArgument);
  // A ledger with two failures: attempt 0 killed after step 3 (recovered 15 s later), attempt 1 raising
  // after step 4 (recovered 5 s later); 50 s of training in all: MTBF 25 s, mean Time to Recover 10 s.
  std::filesystem::create_directories(d.path() / "ett");
  std::ofstream f(d.path() / "ett" / "rank-0.jsonl");
  const long long t0 = 1'700'000'000'000'000;
  auto us = [&](double s) { return std::to_string(t0 + static_cast<long long>(s * 1e6)); };
  auto step = [&](int n, double b, double e) {
    return R"({"v":1,"t":"step","n":)" + std::to_string(n) + R"(,"b":)" + us(b) + R"(,"e":)" + us(e) + "}\n";
  };
  auto attempt = [&](int n, double ts) {
    return R"({"v":1,"t":"attempt","attempt":)" + std::to_string(n) + R"(,"rank":0,"world":1,"ts":)" + us(ts) + "}\n";
  };
  f << attempt(0, 0) << step(1, 0, 10) << step(2, 10, 20) << step(3, 20, 30)
    << R"({"v":1,"t":"hb","ts":)" << us(34) << "}\n"
    << attempt(1, 40) << R"({"v":1,"t":"phase","name":"checkpoint_restore","b":)" << us(40) << R"(,"e":)" << us(45)
    << "}\n"
    << step(3, 45, 55) << step(4, 55, 65) << R"({"v":1,"t":"end","ts":)" << us(66)
    << R"(,"status":"exception","detail":"ValueError: bad batch"})" << "\n"
    << attempt(2, 70) << step(5, 70, 80) << R"({"v":1,"t":"end","ts":)" << us(80) << R"(,"status":"clean","detail":""})"
    << "\n";
  f.close();
  auto h = ck::FailureHistory::from_run(d.str(), 7200.0);
  EXPECT_DOUBLE_EQ(h.mtbf_s, 25.0);
  EXPECT_DOUBLE_EQ(h.restart_s, 10.0);
  // What "auto" then recommends is held against that history.
  ck::CheckpointSchedule s(Every::automatic(), {}, h, 0.0);
  EXPECT_DOUBLE_EQ(s.auto_interval_s({1, 1.0, 0.0}),
                   ettkit::ett::recommend_interval(1.0, 25.0, 10.0, ettkit::ett::IntervalMethod::kDaly));
}

// The overloads that take the checkpointer read each tier's own measured costs (TierCosts::of) at the
// caller's time: the Python layer's due() and auto_interval_s() hand no costs over, C++ reads them.
TEST(Schedule, DueReadsEachTiersCostsFromTheCheckpointer) {
  ettkit::testing::TempDir d;
  ck::CheckpointerOptions o;
  o.directory = d.str() + "/ck";
  o.use_current_recorder = false;
  ck::AsyncCheckpointer c(o);
  ASSERT_TRUE(c.save(1, {{"w", at::ones({4})}}).wait());
  ck::CheckpointSchedule s(Every::automatic(), Every::automatic(), ck::FailureHistory{3600.0, 0.0}, 0.0);
  s.saved(1, Tier::kDisk, 0.0);
  s.saved(1, Tier::kMemory, 0.0);
  const double disk = s.auto_interval_s(c, Tier::kDisk);
  EXPECT_DOUBLE_EQ(disk, s.auto_interval_s(ck::TierCosts::of(c, Tier::kDisk)));
  ASSERT_LT(disk, ck::kAutoUnmeasuredIntervalS);  // one disk save committed: measured
  EXPECT_EQ(s.auto_interval_s(c, Tier::kMemory), ck::kAutoUnmeasuredIntervalS);  // no memory save committed
  EXPECT_FALSE(s.due(2, disk * 0.5, c));
  EXPECT_EQ(s.due(3, disk, c), Tier::kDisk);
  c.close();
}

// A C++-only trainer (no Python anywhere) gets the configured interval into its ETT report from the schedule
// it saves by: the ledger adaptor writes the config records that the Python AsyncCheckpointer writes through
// the same call. "auto" and "never" write none (the report infers "auto"'s interval from the saves).
TEST(Schedule, ACppTrainerRecordsItsFixedIntervalsForTheReport) {
  ettkit::testing::TempDir d;
  std::string ledger;
  {
    ettkit::ett::RecorderOptions ro;
    ro.run_dir = d.str();
    ro.rank = 0;
    ro.world_size = 1;
    ro.launcher_phases_from_env = false;
    ettkit::ett::Recorder rec(ro);
    ledger = rec.ledger_path();
    ck::CheckpointerOptions o;
    o.directory = d.str() + "/ck";
    o.recorder = &rec;
    ck::AsyncCheckpointer c(o);
    ck::CheckpointSchedule when(Every::steps(2), Every::parse("90s"), {}, 0.0);  // the memory tier: never due at 0
    when.record_intervals(rec);
    ck::CheckpointSchedule(Every::automatic(), Every{}).record_intervals(rec);  // records nothing
    for (int64_t step = 1; step <= 4; ++step) {
      if (auto tier = when.due(step, 0.0, c); tier == Tier::kDisk) {
        ASSERT_TRUE(c.save(step, {{"w", at::full({4}, static_cast<double>(step))}}).wait());
        when.saved(step, *tier, 0.0);
      }
      rec.step(step);
    }
    c.close();
    rec.close();
  }
  std::vector<std::pair<std::string, double>> config;
  for (const std::string& line : ettkit::testing::read_lines(ledger)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j["t"] == "config") config.emplace_back(j["key"], j["value"]);
  }
  EXPECT_EQ(config, (std::vector<std::pair<std::string, double>>{{"checkpoint_interval_steps", 2.0},
                                                                 {"checkpoint_memory_interval_s", 90.0}}));
  auto report = nlohmann::json::parse(ettkit::ett::build_report_json(d.str()));
  EXPECT_EQ(report["checkpoints"]["interval_source"], "configured_steps") << report["checkpoints"].dump();
}
