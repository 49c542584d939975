// The report's passes one at a time (src/ett/report_passes.h), on ledgers built in memory, and the one
// serializer (to_json) on a hand-built typed Report. report_test.cpp checks the whole report from files.
#include "ett/report_passes.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace ettkit::ett {
namespace {

using namespace report_detail;  // NOLINT: the units under test
using nlohmann::json;

// A ledger in memory: one attempt per call, on the given rank.
struct LedgerBuilder {
  LedgerSet set;
  uint32_t name(const std::string& n) {
    for (uint32_t i = 0; i < set.names.size(); ++i) {
      if (set.names[i] == n) return i;
    }
    set.names.push_back(n);
    return static_cast<uint32_t>(set.names.size() - 1);
  }
  detail::AttemptLedger& attempt(int rank, int n, int64_t ts) {
    auto it = std::find_if(set.ranks.begin(), set.ranks.end(), [&](const auto& r) { return r.rank == rank; });
    if (it == set.ranks.end()) {
      set.ranks.push_back({});
      it = std::prev(set.ranks.end());
      it->rank = rank;
    }
    it->attempts.push_back({});
    auto& a = it->attempts.back();
    a.attempt = n;
    a.rank = rank;
    a.ts = ts;
    a.last_ts = ts;
    return a;
  }
  void phase(detail::AttemptLedger& a, const std::string& n, int64_t b, int64_t e) {
    a.phases.push_back({b, e, -1, name(n), false});
    a.activity_end = std::max(a.activity_end, e);
    a.last_ts = std::max(a.last_ts, e);
  }
  void step(detail::AttemptLedger& a, int64_t n, int64_t b, int64_t e) {
    a.steps.push_back({n, b, e});
    a.activity_end = std::max(a.activity_end, e);
    a.last_ts = std::max(a.last_ts, e);
  }
  void end(detail::AttemptLedger& a, int64_t ts, const std::string& status) {
    a.has_end = true;
    a.end_ts = ts;
    a.status = status;
  }
};

Analysis timeline_of(const LedgerSet& set, const ReportOptions& o = {}) {
  Analysis an;
  an.set = &set;
  collect_attempts(an);
  flatten_rank_timelines(an);
  assign_buckets(an);
  build_job_timeline(an, o);
  return an;
}

TEST(ReportPasses, FlattenGivesTheInnermostIntervalItsTimeAndFillsGaps) {
  auto segs = flatten({{0, 10, "training", Kind::kTraining, Layer::kStep},
                       {2, 4, "checkpoint_blocking", Kind::kPhase, Layer::kPhase},
                       {12, 14, "eval", Kind::kPhase, Layer::kPhase}},
                      0, 15);
  ASSERT_EQ(segs.size(), 6u);
  EXPECT_EQ(segs[0].name, "training");
  EXPECT_EQ(segs[0].e, 2);
  EXPECT_EQ(segs[1].name, "checkpoint_blocking");
  EXPECT_EQ(segs[2].name, "training");
  EXPECT_EQ(segs[3].name, "unattributed");
  EXPECT_EQ(segs[3].b, 10);
  EXPECT_EQ(segs[4].name, "eval");
  EXPECT_EQ(segs[5].name, "unattributed");
  EXPECT_EQ(segs[5].e, 15);
}

// The failure point is the first rank to stop; an exception raised while the other rank was still
// demonstrably alive (it recorded a step 8 s later) names the failure. Times in seconds here: the cause rule
// allows 5 ms of clock skew (cause_of_failure()).
TEST(ReportPasses, CollectAttemptsNamesTheFirstRankToStopAsTheFailure) {
  constexpr int64_t kS = 1'000'000;
  LedgerBuilder l;
  auto& r0 = l.attempt(0, 0, 0);
  l.step(r0, 1, 0, 10 * kS);
  l.step(r0, 2, 10 * kS, 20 * kS);  // killed later: no end record
  auto& r1 = l.attempt(1, 0, 0);
  l.step(r1, 1, 0, 10 * kS);
  l.end(r1, 12 * kS, "exception");
  r1.detail = "ValueError: boom";
  Analysis an;
  an.set = &l.set;
  collect_attempts(an);
  ASSERT_EQ(an.jobs.size(), 1u);
  const JobAttempt& job = an.jobs.at(0);
  EXPECT_TRUE(job.failed);
  EXPECT_EQ(*job.failure_point, 10 * kS);  // rank 1 stopped first, at its last activity
  EXPECT_EQ(job.status, "exception");
  EXPECT_EQ(job.exception_type, "ValueError");
}

// Issue #47 item 6, at the pass itself: the killed rank's last record comes 0.5 ms after the survivor's
// last activity and 0.4 ms before the survivor's exception. The old rule (first rank to stop names it)
// said exception:ValueError; the kill is the cause. The failure point is still the first rank to stop.
TEST(ReportPasses, CollectAttemptsNamesAKilledRankOverAPeersLaterException) {
  LedgerBuilder l;
  auto& r0 = l.attempt(0, 0, 0);
  l.step(r0, 1, 0, 10'000'500);  // killed: no end record
  auto& r1 = l.attempt(1, 0, 0);
  l.step(r1, 1, 0, 10'000'000);
  l.end(r1, 10'000'900, "exception");
  r1.detail = "RuntimeError: Connection closed by peer";
  Analysis an;
  an.set = &l.set;
  collect_attempts(an);
  const JobAttempt& job = an.jobs.at(0);
  EXPECT_EQ(*job.failure_point, 10'000'000);
  EXPECT_EQ(job.status, "killed");
  EXPECT_EQ(job.exception_type, "");
}

TEST(ReportPasses, TheJobTimelineTakesTheMostSevereRankAndCoversE2E) {
  LedgerBuilder l;
  auto& r0 = l.attempt(0, 0, 0);
  l.phase(r0, "compile", 0, 10);
  l.step(r0, 1, 10, 20);
  l.end(r0, 20, "clean");
  auto& r1 = l.attempt(1, 0, 0);
  l.phase(r1, "compile", 0, 14);
  l.step(r1, 1, 14, 20);
  l.end(r1, 20, "clean");
  const Analysis an = timeline_of(l.set);
  EXPECT_EQ(an.e2e_begin, 0);
  EXPECT_EQ(an.e2e_end, 20);
  ASSERT_EQ(an.job_timeline.size(), 2u);
  EXPECT_EQ(an.job_timeline[0].name, "compile");
  EXPECT_EQ(an.job_timeline[0].e, 14);
  EXPECT_EQ(an.job_timeline[0].bucket, Bucket::kIdle);
  EXPECT_EQ(an.job_timeline[1].bucket, Bucket::kEffective);
  Report r;
  sum_buckets(an, r);
  EXPECT_EQ(r.effective_us, 6);
  EXPECT_EQ(r.idle_us, 14);
  EXPECT_EQ(r.phases.at("compile").bucket, Bucket::kIdle);
}

TEST(ReportPasses, RecoveriesMeasureFromTheFailureToTheNextTraining) {
  LedgerBuilder l;
  auto& a0 = l.attempt(0, 0, 0);
  l.step(a0, 1, 0, 10);
  l.step(a0, 2, 10, 20);
  l.end(a0, 20, "signal");
  auto& a1 = l.attempt(0, 1, 25);
  l.phase(a1, "checkpoint_restore/memory", 25, 27);
  l.step(a1, 2, 27, 37);
  l.step(a1, 3, 37, 47);
  l.end(a1, 47, "clean");
  const Analysis an = timeline_of(l.set);
  Report r;
  sum_buckets(an, r);
  const RecoveryCosts costs = attempts_and_recoveries(an, r);
  ASSERT_EQ(r.recoveries.size(), 1u);
  const Recovery& rec = r.recoveries[0];
  EXPECT_TRUE(rec.recovered);
  EXPECT_EQ(*rec.resumed_attempt, 1);
  EXPECT_DOUBLE_EQ(rec.total_s, 7e-6);  // 20 -> 27 µs: detect_and_teardown then the restore
  EXPECT_DOUBLE_EQ(rec.retraining_s, 10e-6);
  EXPECT_EQ(rec.restored_from, CheckpointTier::kMemory);
  EXPECT_EQ(rec.category, "signal");
  EXPECT_EQ(costs.restores_from[static_cast<int>(CheckpointTier::kMemory)], 1);
  EXPECT_EQ(r.failures, 1);
  ASSERT_EQ(r.attempts.size(), 2u);
  EXPECT_DOUBLE_EQ(*r.attempts[1].time_to_start_s, 2e-6);
}

TEST(ReportPasses, ARecommendationIsRaisedToTheDurableFloorAndSaysSo) {
  auto rec = recommendation_for(2.0, 3600.0, "measured", 60.0, /*durable_median=*/500.0, 300.0, 36000.0, 1.0,
                                IntervalMethod::kYoung);
  ASSERT_TRUE(rec);
  EXPECT_DOUBLE_EQ(rec->optimum_s, std::sqrt(2 * 2.0 * 3600.0));  // 120 s < the 500 s floor
  EXPECT_DOUBLE_EQ(rec->interval_s, 500.0);
  EXPECT_EQ(*rec->interval_steps, 500);
  EXPECT_NE(rec->note.find("continuous checkpointing"), std::string::npos);
  EXPECT_DOUBLE_EQ(rec->waste_at_recommended_s, 36000.0 * waste_fraction(500.0, 2.0, 3600.0));
  EXPECT_FALSE(recommendation_for(std::nullopt, 3600.0, "measured", 0, 1, std::nullopt, 1, 1, IntervalMethod::kYoung));
  EXPECT_FALSE(recommendation_for(2.0, std::nullopt, "", 0, 1, std::nullopt, 1, 1, IntervalMethod::kYoung));
}

TEST(ReportPasses, ToJsonWritesNullsForWhatTheModelLacksAndKeepsTheDocumentedKeys) {
  Report r;
  r.run_dir = "/runs/x";
  r.world_size = 1;
  r.e2e_begin_us = 0;
  r.e2e_end_us = 4'000'000;
  r.effective_us = 3'000'000;
  r.idle_us = 1'000'000;
  r.phases["training"] = PhaseTotal{3.0, Bucket::kEffective};
  r.phases["eval"] = PhaseTotal{1.0, std::nullopt};
  AttemptSummary a;
  a.status = "clean";
  r.attempts.push_back(a);
  r.badput_s = {{"CUSTOM_BADPUT_EVENTS", 1.0}};
  const json j = json::parse(to_json(r));
  EXPECT_DOUBLE_EQ(j["ett_pct"], 75.0);
  EXPECT_EQ(j["phase_buckets"]["eval"], "mixed");
  EXPECT_TRUE(j["attempts"][0]["exception_type"].is_null());
  EXPECT_TRUE(j["attempts"][0]["time_to_start_s"].is_null());
  EXPECT_TRUE(j["recommendation"].is_null());
  EXPECT_TRUE(j["mtbf_source"].is_null());
  EXPECT_DOUBLE_EQ(j["badput_pct"]["CUSTOM_BADPUT_EVENTS"], 25.0);
  EXPECT_FALSE(j.contains("timeline"));
  EXPECT_EQ(j["checkpoints"]["tiers"].size(), 1u);  // no memory tier
  for (const char* key : {"format_version", "e2e_s", "idle_pct", "substages", "time_to_start_s", "recoveries",
                          "failures_by_category", "unsaved_training_s", "checkpoint_blocking_s", "steps",
                          "recommended_interval_s", "rank_skew", "ledger"}) {
    EXPECT_TRUE(j.contains(key)) << key;
  }
}

}  // namespace
}  // namespace ettkit::ett
