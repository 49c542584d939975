// The report's two timeline rules (src/ett/report_timeline.cpp: flatten() and the failure cause that
// collect_attempts() names) against tests/data/ownership_rules.json, the corpus that
// tests/python/test_ownership_rules.py holds the live view's copies (python/ettkit/ett/_ownership.py) to.
// Both sides give the corpus's verdicts, so a rule changed on one side only fails that side's test.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "ett/report_passes.h"

#ifndef ETTKIT_OWNERSHIP_CORPUS
#error "ETTKIT_OWNERSHIP_CORPUS (the corpus path) is defined by tests/cpp/CMakeLists.txt"
#endif

namespace ettkit::ett {
namespace {

using namespace report_detail;  // NOLINT: the units under test
using nlohmann::json;

const json& corpus() {
  static const json doc = [] {
    std::ifstream in(ETTKIT_OWNERSHIP_CORPUS);
    if (!in) throw std::runtime_error(std::string("cannot open the corpus ") + ETTKIT_OWNERSHIP_CORPUS);
    return json::parse(in);
  }();
  return doc;
}

Kind kind_of(const std::string& k) {
  if (k == "phase") return Kind::kPhase;
  if (k == "training") return Kind::kTraining;
  if (k == "wasted") return Kind::kWasted;
  throw std::invalid_argument("corpus item kind '" + k + "'; expected phase, training or wasted");
}

Layer layer_of(const std::string& l) {
  if (l == "filler") return Layer::kFiller;
  if (l == "step") return Layer::kStep;
  if (l == "phase") return Layer::kPhase;
  throw std::invalid_argument("corpus item layer '" + l + "'; expected filler, step or phase");
}

TEST(OwnershipRules, TheReportOwnsEachInstantAsTheCorpusSays) {
  const json& cases = corpus().at("flatten");
  ASSERT_GE(cases.size(), 9u);
  for (const json& c : cases) {
    SCOPED_TRACE(c.at("case").get<std::string>());
    std::vector<Labelled> items;
    for (const json& it : c.at("items")) {
      items.push_back({it.at("b").get<int64_t>(), it.at("e").get<int64_t>(), it.at("name").get<std::string>(),
                       kind_of(it.at("kind")), layer_of(it.at("layer"))});
    }
    json owners = json::array();
    for (const Segment& s : flatten(items, c.at("lo").get<int64_t>(), c.at("hi").get<int64_t>())) {
      owners.push_back({s.b, s.e, s.name});
    }
    EXPECT_EQ(owners, c.at("owners"));
  }
}

// One attempt (number 0) per corpus rank, as the ledger reader would have read it.
LedgerSet ledger_of(const json& c) {
  LedgerSet set;
  for (const json& r : c.at("ranks")) {
    detail::RankLedger rank;
    rank.rank = r.at("rank").get<int>();
    detail::AttemptLedger a;
    a.attempt = 0;
    a.rank = rank.rank;
    a.ts = r.at("ts").get<int64_t>();
    a.activity_end = r.at("activity_end").get<int64_t>();
    a.last_ts = r.at("last_ts").get<int64_t>();
    if (!r.at("end").is_null()) {
      a.has_end = true;
      a.end_ts = r.at("end").at("ts").get<int64_t>();
      a.status = r.at("end").at("status").get<std::string>();
      a.detail = r.at("end").at("detail").get<std::string>();
    }  // else killed: no end record, and running stays false (its process is gone)
    rank.attempts.push_back(std::move(a));
    set.ranks.push_back(std::move(rank));
  }
  return set;
}

TEST(OwnershipRules, TheReportNamesAFailureAsTheCorpusSays) {
  const json& cases = corpus().at("cause_of_failure");
  ASSERT_GE(cases.size(), 12u);
  for (const json& c : cases) {
    SCOPED_TRACE(c.at("case").get<std::string>());
    const LedgerSet set = ledger_of(c);
    Analysis an;
    an.set = &set;
    collect_attempts(an);
    ASSERT_EQ(an.jobs.count(0), 1u);
    const JobAttempt& job = an.jobs.at(0);
    ASSERT_TRUE(job.failed);
    const std::string category = job.status == "exception" ? "exception:" + job.exception_type : job.status;
    EXPECT_EQ(category, c.at("category").get<std::string>());
    EXPECT_EQ(job.detail, c.at("detail").get<std::string>());
    ASSERT_TRUE(job.failure_point.has_value());
    EXPECT_EQ(*job.failure_point, c.at("failure_point").get<int64_t>());
  }
}

}  // namespace
}  // namespace ettkit::ett
