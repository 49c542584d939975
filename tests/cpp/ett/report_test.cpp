#include "ettkit/ett/report.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include <cmath>

#include <nlohmann/json.hpp>

#include "ett/test_dir.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/recorder.h"

namespace ettkit::ett {
namespace {

using nlohmann::json;
using testing::TempDir;

constexpr int64_t kT0 = 1'700'000'000'000'000;
int64_t s(double seconds) { return kT0 + static_cast<int64_t>(seconds * 1e6); }

class LedgerFile {
 public:
  LedgerFile(const TempDir& dir, int rank) {
    std::filesystem::create_directories(dir.path() / "ett");
    out_.open(dir.path() / "ett" / ("rank-" + std::to_string(rank) + ".jsonl"));
    rank_ = rank;
  }
  LedgerFile& attempt(int n, double ts) {
    return line({{"t", "attempt"}, {"attempt", n}, {"rank", rank_}, {"world", 2}, {"ts", s(ts)}});
  }
  LedgerFile& attempt(int n, double ts, double proc_start) {
    return line({{"t", "attempt"}, {"attempt", n}, {"rank", rank_}, {"world", 2}, {"ts", s(ts)},
                 {"proc_start", s(proc_start)}});
  }
  LedgerFile& phase(const std::string& name, double b, double e) {
    return line({{"t", "phase"}, {"name", name}, {"b", s(b)}, {"e", s(e)}});
  }
  LedgerFile& phase(const std::string& name, double b, double e, int step) {
    return line({{"t", "phase"}, {"name", name}, {"b", s(b)}, {"e", s(e)}, {"step", step}});
  }
  LedgerFile& background(const std::string& name, double b, double e, int step) {
    return line({{"t", "bg"}, {"name", name}, {"b", s(b)}, {"e", s(e)}, {"step", step}});
  }
  LedgerFile& config(const std::string& key, double value) {
    return line({{"t", "config"}, {"key", key}, {"value", value}});
  }
  LedgerFile& step(int n, double b, double e) { return line({{"t", "step"}, {"n", n}, {"b", s(b)}, {"e", s(e)}}); }
  LedgerFile& hb(double ts) { return line({{"t", "hb"}, {"ts", s(ts)}}); }
  LedgerFile& end(double ts, const std::string& status = "clean", const std::string& detail = "") {
    return line({{"t", "end"}, {"ts", s(ts)}, {"status", status}, {"detail", detail}});
  }
  LedgerFile& raw(const std::string& text) {
    out_ << text;
    out_.flush();
    return *this;
  }

 private:
  LedgerFile& line(json j) {
    j["v"] = 1;
    out_ << j.dump() << "\n";
    out_.flush();
    return *this;
  }
  std::ofstream out_;
  int rank_;
};

json report(const TempDir& dir, ReportOptions o = {}) { return json::parse(build_report_json(dir.str(), o)); }

double bucket_sum(const json& r) {
  return r["ett_pct"].get<double>() + r["idle_pct"].get<double>() + r["failure_pct"].get<double>() +
         r["unattributed_pct"].get<double>();
}

TEST(Report, JobViewTakesTheSlowestRankAndBucketsSumTo100) {
  TempDir dir;
  // Rank 0 compiles 10 s, rank 1 compiles 12 s: the job trains only once both do (t = 12).
  LedgerFile r0(dir, 0), r1(dir, 1);
  r0.attempt(0, 0).phase("compile", 0, 10).step(1, 10, 20).step(2, 20, 30).end(30);
  r1.attempt(0, 0).phase("compile", 0, 12).step(1, 12, 20).step(2, 20, 30).end(30);
  auto r = report(dir);
  EXPECT_DOUBLE_EQ(r["e2e_s"], 30.0);
  EXPECT_DOUBLE_EQ(r["phases"]["compile"], 12.0);
  EXPECT_DOUBLE_EQ(r["phases"]["training"], 18.0);
  EXPECT_DOUBLE_EQ(r["time_to_start_s"][0], 12.0);
  EXPECT_NEAR(bucket_sum(r), 100.0, 1e-9);
  EXPECT_DOUBLE_EQ(r["rank_skew"]["phases"]["compile"]["skew_s"], 2.0);
  EXPECT_EQ(r["failures"], 0);
  EXPECT_EQ(r["mtbf_source"], "lower_bound_no_failures");
}

TEST(Report, NestedPhaseWinsOverTheStepAroundIt) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).step(1, 0, 10).phase("checkpoint_blocking", 8, 10).step(2, 10, 20).end(20);
  auto r = report(dir);
  EXPECT_DOUBLE_EQ(r["phases"]["checkpoint_blocking"], 2.0);
  EXPECT_DOUBLE_EQ(r["phases"]["training"], 18.0);
  EXPECT_EQ(r["checkpoints"]["count"], 1);
}

TEST(Report, KilledAttemptLostWorkAndExceptionCategories) {
  TempDir dir;
  LedgerFile f(dir, 0);
  // Attempt 0: steps 1..3, last record at 30, heartbeat at 34 (alive but its work after 30 is lost).
  f.attempt(0, 0).step(1, 0, 10).step(2, 10, 20).step(3, 20, 30).hb(34);
  // Attempt 1 starts at 40, re-trains step 3, then raises.
  f.attempt(1, 40).phase("checkpoint_restore", 40, 45).step(3, 45, 55).step(4, 55, 65).end(66, "exception",
                                                                                         "ValueError: bad batch");
  // Attempt 2 resumes and finishes.
  f.attempt(2, 70).step(5, 70, 80).end(80);
  auto r = report(dir);
  EXPECT_EQ(r["failures"], 2);
  EXPECT_EQ(r["failures_by_category"]["killed"], 1);
  EXPECT_EQ(r["failures_by_category"]["exception:ValueError"], 1);
  EXPECT_DOUBLE_EQ(r["phases"]["lost_in_flight"], 4.0 + 1.0);  // 30..34 and 65..66
  EXPECT_DOUBLE_EQ(r["phases"]["wasted_training"], 10.0);
  EXPECT_DOUBLE_EQ(r["unsaved_training_s"]["measured"], 10.0);
  ASSERT_EQ(r["time_to_recover_s"].size(), 2u);
  EXPECT_DOUBLE_EQ(r["time_to_recover_s"][0], 15.0);  // 30 -> first training at 45
  EXPECT_DOUBLE_EQ(r["recoveries"][0]["breakdown"]["detect_and_teardown"], 6.0);
  EXPECT_DOUBLE_EQ(r["recoveries"][0]["retraining_s"], 10.0);
  EXPECT_DOUBLE_EQ(r["time_to_recover_s"][1], 5.0);  // 65 -> 70
  EXPECT_EQ(r["attempts"][1]["exception_type"], "ValueError");
  EXPECT_NEAR(bucket_sum(r), 100.0, 1e-9);
  EXPECT_DOUBLE_EQ(r["effective_s"], 50.0);  // steps 1-5 once each, 10 s
}

TEST(Report, CorruptAndTornLinesAreSkippedAndCounted) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).step(1, 0, 10).raw("this is not json\n").raw("{\"v\":1,\"t\":\"step\"}\n").step(2, 10, 20);
  f.raw("{\"v\":1,\"t\":\"step\",\"n\":3,\"b\":17");  // torn: no newline
  auto r = report(dir);
  EXPECT_EQ(r["ledger"]["corrupt_lines"], 2);
  EXPECT_EQ(r["ledger"]["torn_lines"], 1);
  EXPECT_EQ(r["steps"]["recorded"], 2);
}

TEST(Report, BadRunDirectoriesGiveClearErrors) {
  TempDir dir;
  try {
    build_report_json((dir.path() / "missing").string());
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
  EXPECT_THROW(build_report_json(dir.str()), InvalidArgument);  // no ett/ folder
  std::filesystem::create_directories(dir.path() / "ett");
  try {
    build_report_json(dir.str());
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no ledger files"), std::string::npos) << e.what();
  }
}

TEST(Report, NewerFormatVersionIsUnsupported) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).raw("{\"v\":2,\"t\":\"step\",\"n\":1,\"b\":1,\"e\":2}\n");
  try {
    build_report_json(dir.str());
    FAIL();
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("format version 2"), std::string::npos) << e.what();
  }
}

bool has_warning(const json& r, const std::string& needle) {
  for (const auto& w : r["ledger"]["warnings"]) {
    if (w.get<std::string>().find(needle) != std::string::npos) return true;
  }
  return false;
}

TEST(Report, LedgerFilesWhoseNameIsNoRankAreSkippedWithAWarning) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).phase("compile", 0, 5).step(1, 5, 10).end(10);
  // A stray copy whose "rank" overflows int (std::stoi threw std::out_of_range here) and a zero-padded
  // name the Recorder never writes (it would have been read as a second rank-7 file).
  for (const char* name : {"rank-99999999999.jsonl", "rank-007.jsonl"}) {
    std::ofstream(dir.path() / "ett" / name)
        << R"({"v":1,"t":"attempt","attempt":0,"rank":0,"world":1,"ts":1700000000000000})" << "\n";
  }
  auto r = report(dir);
  EXPECT_EQ(r["ledger"]["files"], 1);
  EXPECT_EQ(r["ranks"], json::array({0}));
  EXPECT_TRUE(has_warning(r, "rank-99999999999.jsonl")) << r["ledger"]["warnings"];
  EXPECT_TRUE(has_warning(r, "rank-007.jsonl")) << r["ledger"]["warnings"];
  EXPECT_DOUBLE_EQ(r["e2e_s"], 10.0);
}

TEST(Report, TimestampsOutsideTheEpochRangeAreCorruptRecordsNotOverflow) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).phase("compile", 0, 5).step(1, 5, 10);
  // E2E = INT64_MAX - INT64_MIN overflowed to a negative number.
  f.raw(R"({"v":1,"t":"phase","name":"compile","b":-9223372036854775807,"e":5})" "\n");
  f.raw(R"({"v":1,"t":"hb","ts":9223372036854775807})" "\n");
  f.end(10);
  auto r = report(dir);
  EXPECT_DOUBLE_EQ(r["e2e_s"], 10.0);
  EXPECT_DOUBLE_EQ(r["phases"]["compile"], 5.0);
  EXPECT_EQ(r["ledger"]["corrupt_lines"], 2);
  EXPECT_TRUE(has_warning(r, "out of range")) << r["ledger"]["warnings"];
  EXPECT_NEAR(bucket_sum(r), 100.0, 1e-9);
}

TEST(Report, AnAttemptWhoseClockStartsBeforeAttemptZeroStaysInE2EWithAWarning) {
  TempDir dir;
  LedgerFile f(dir, 0);
  // Attempt 1 ran on a host whose clock is 200 s behind: its records lie before attempt 0's.
  f.attempt(0, 200).phase("compile", 200, 205).step(1, 205, 215).hb(216);
  f.attempt(1, 0).phase("checkpoint_restore", 0, 3).step(1, 3, 13).step(2, 13, 23).end(23);
  auto r = report(dir);
  EXPECT_EQ(r["e2e_begin_us"], s(0));
  EXPECT_EQ(r["e2e_end_us"], s(216));
  EXPECT_DOUBLE_EQ(r["e2e_s"], 216.0);
  EXPECT_DOUBLE_EQ(r["phases"]["checkpoint_restore"], 3.0);  // was dropped from E2E
  EXPECT_TRUE(has_warning(r, "attempt 1 begins")) << r["ledger"]["warnings"];
  double total = 0;
  for (const auto& [name, sec] : r["phases"].items()) total += sec.get<double>();
  EXPECT_NEAR(total, 216.0, 1e-9);
  EXPECT_NEAR(bucket_sum(r), 100.0, 1e-9);
  for (const auto& a : r["attempts"]) {
    if (!a["time_to_start_s"].is_null()) {
      EXPECT_GE(a["time_to_start_s"].get<double>(), 0.0);
    }
  }
}

TEST(Report, ConcurrentStagesKeepTheirTimeUntilTheyEnd) {
  TempDir dir;
  LedgerFile f(dir, 0);
  // The C++ example's start-up (seconds for ms): model and data are built concurrently, the restore
  // follows the model, and launcher_init encloses them all. Data began after the model and outlived it;
  // under "the latest begin wins" it took 15.6 of the model's 16 s.
  f.attempt(0, 0)
      .phase("train_module_creation", 4, 20)
      .phase("checkpoint_restore", 20.5, 21.5)
      .phase("get_first_batch_data", 4.4, 46)
      .phase("launcher_init", 0, 52)
      .step(1, 52, 62)
      .end(62);
  auto r = report(dir);
  EXPECT_DOUBLE_EQ(r["substages"]["launcher_init/train_module_creation"], 16.0);  // its whole run
  EXPECT_DOUBLE_EQ(r["phases"]["checkpoint_restore"], 1.0);                        // nested in data: all of it
  EXPECT_DOUBLE_EQ(r["substages"]["launcher_init/get_first_batch_data"], 46.0 - 20.0 - 1.0);
  EXPECT_DOUBLE_EQ(r["phases"]["launcher_init"], 52.0 - 1.0);  // sub-stages roll up; the restore does not
  double total = 0;
  for (const auto& [name, sec] : r["phases"].items()) total += sec.get<double>();
  EXPECT_DOUBLE_EQ(total, r["e2e_s"].get<double>());
  EXPECT_NEAR(bucket_sum(r), 100.0, 1e-9);
}

TEST(Report, APhaseTakesPrecedenceOverEveryStepItOverlaps) {
  TempDir dir;
  LedgerFile f(dir, 0);
  // A GPU-timed eval that began in step 1 and ran past its mark into step 2.
  f.attempt(0, 0).step(1, 0, 10).phase("eval", 8, 12).step(2, 10, 20).end(20);
  auto r = report(dir);
  EXPECT_DOUBLE_EQ(r["phases"]["eval"], 4.0);  // was 2: step 2, which began later, took 10..12
  EXPECT_DOUBLE_EQ(r["phases"]["training"], 16.0);
}

TEST(Report, AProcessStartBeforeThePreviousAttemptEndedDoesNotReachBackIntoIt) {
  TempDir dir;
  LedgerFile f(dir, 0);
  // Attempt 0 restores nothing (idle), trains and is killed at 6. Attempt 1's proc_start, taken with a
  // boot time in whole seconds, reads 0.5: 5.5 s before attempt 0 ended. Its process_bootstrap, recovery
  // time and so the most severe, covered attempt 0's restore and made the phase "failure" only.
  f.attempt(0, 0).phase("checkpoint_restore", 1, 2).phase("launcher_init", 0, 3).step(1, 3, 6).hb(6);
  f.attempt(1, 7, 0.5)
      .phase("process_bootstrap", 0.5, 7)
      .phase("checkpoint_restore", 8, 9)
      .phase("launcher_init", 7, 9)
      .step(1, 9, 12)
      .end(12);
  auto r = report(dir);
  EXPECT_EQ(r["phase_buckets"]["checkpoint_restore"], "mixed");  // idle in attempt 0, failure in 1
  EXPECT_DOUBLE_EQ(r["phases"]["checkpoint_restore"], 2.0);
  EXPECT_EQ(r["attempts"][1]["begin_us"], s(6));
  EXPECT_DOUBLE_EQ(r["substages"]["launcher_init/process_bootstrap"], 1.0);  // 6..7
  EXPECT_DOUBLE_EQ(r["time_to_recover_s"][0], 9.0 - 6.0);
  EXPECT_DOUBLE_EQ(r["e2e_s"], 12.0);
  EXPECT_NEAR(bucket_sum(r), 100.0, 1e-9);
}

TEST(Report, ACrashLoopRecoversAtTheFirstAttemptThatTrainsAgain) {
  TempDir dir;
  LedgerFile f(dir, 0);
  // Attempt 0 trains and is killed; attempts 1-3 die in start-up; attempt 4 trains again. (The recovering
  // attempt is now found by a search over attempt ranges instead of a scan of every later attempt.)
  f.attempt(0, 0).step(1, 0, 10).hb(10);
  f.attempt(1, 12).phase("compile", 12, 14).hb(14);
  f.attempt(2, 16).phase("compile", 16, 18).hb(18);
  f.attempt(3, 20).phase("compile", 20, 22).hb(22);
  f.attempt(4, 24).phase("compile", 24, 26).step(2, 26, 36).end(36);
  auto r = report(dir);
  ASSERT_EQ(r["failures"], 4);
  const auto& rec = r["recoveries"];
  for (int k = 0; k < 3; ++k) {  // each start-up failure ends the previous window unrecovered
    EXPECT_FALSE(rec[k]["recovered"]) << k;
    EXPECT_TRUE(rec[k]["resumed_attempt"].is_null()) << k;
  }
  EXPECT_TRUE(rec[3]["recovered"]);
  EXPECT_EQ(rec[3]["resumed_attempt"], 4);
  EXPECT_EQ(rec[3]["resumed_us"], s(26));
  EXPECT_DOUBLE_EQ(rec[3]["total_s"], 26.0 - 22.0);
  EXPECT_DOUBLE_EQ(rec[0]["total_s"], 14.0 - 10.0);
  EXPECT_DOUBLE_EQ(rec[0]["breakdown"]["detect_and_teardown"], 2.0);
  EXPECT_DOUBLE_EQ(rec[0]["breakdown"]["compile"], 2.0);
  EXPECT_EQ(r["rank_skew"]["attempt_start_skew_s"].size(), 5u);
  EXPECT_NEAR(bucket_sum(r), 100.0, 1e-9);
}

// Badput in Google's categories: the job timeline's time by name (include/ettkit/ett/badput.h); the
// categories sum to E2E minus effective time.
TEST(Report, BadputCategoriesSumToTheTimeThatIsNotEffective) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0)
      .phase("device_init", 0, 1)
      .phase("process_group_init", 1, 3)
      .phase("get_first_batch_data", 3, 4)
      .phase("compile", 4, 6)
      .step(1, 6, 10)
      .phase("eval", 10, 12)
      .step(2, 12, 16)
      .phase("checkpoint_blocking/memory", 16, 17)
      .step(3, 16, 20)
      .hb(21);  // killed: 20..21 is lost in flight
  f.attempt(1, 24).phase("checkpoint_restore", 24, 26).step(3, 26, 28).step(4, 28, 30).end(30);
  auto r = report(dir);
  const json& b = r["badput"];
  ASSERT_EQ(b.size(), 10u);
  EXPECT_DOUBLE_EQ(b["TPU_INITIALIZATION"], 1.0);
  EXPECT_DOUBLE_EQ(b["TRAINING_PREP"], 2.0);
  EXPECT_DOUBLE_EQ(b["DATA_LOADING_SYNC"], 1.0);
  EXPECT_DOUBLE_EQ(b["PROGRAM_STARTUP"], 2.0);
  EXPECT_DOUBLE_EQ(b["CUSTOM_BADPUT_EVENTS"], 2.0);
  EXPECT_DOUBLE_EQ(b["UNPRODUCTIVE_CHECKPOINT_SAVE_TIME"], 1.0);
  EXPECT_DOUBLE_EQ(b["UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME"], 2.0);
  EXPECT_DOUBLE_EQ(b["WASTED_PROGRESS_FROM_DISRUPTION"], 1.0 + 2.0);  // lost 20..21, step 3 again 26..28
  EXPECT_DOUBLE_EQ(b["INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION"], 3.0);  // 21..24
  EXPECT_DOUBLE_EQ(b["OTHER"], 0.0);
  double sum = 0;
  for (const auto& [k, v] : b.items()) sum += v.get<double>();
  EXPECT_DOUBLE_EQ(sum, r["e2e_s"].get<double>() - r["effective_s"].get<double>());
  EXPECT_DOUBLE_EQ(r["effective_s"], 4.0 + 4.0 + 3.0 + 2.0);
  EXPECT_NEAR(r["badput_pct"]["PROGRAM_STARTUP"].get<double>(), 100.0 * 2.0 / 30.0, 1e-9);
  const auto summary = build_report(dir.str());
  ASSERT_EQ(summary.badput_s.size(), 10u);
  EXPECT_EQ(summary.badput_s.front().first, "TPU_INITIALIZATION");
  EXPECT_DOUBLE_EQ(summary.badput_s.front().second, 1.0);
}

TEST(Report, SummaryMatchesTheJson) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).phase("compile", 0, 5).step(1, 5, 10).end(10);
  auto summary = build_report(dir.str());
  EXPECT_DOUBLE_EQ(summary.e2e_s, 10.0);
  EXPECT_DOUBLE_EQ(summary.ett_pct, 50.0);
  EXPECT_EQ(summary.attempts, 1);
  ASSERT_EQ(summary.time_to_start_s.size(), 1u);
  EXPECT_DOUBLE_EQ(summary.time_to_start_s[0], 5.0);
}

// The typed model is what the JSON serializes: the same figures, with the model's own types.
TEST(Report, TheTypedModelIsWhatTheJsonSays) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).phase("compile", 0, 5).step(1, 5, 10).phase("checkpoint_blocking", 10, 11).step(2, 10, 20).hb(21);
  f.attempt(1, 25).phase("checkpoint_restore/memory", 25, 26).step(2, 26, 30).step(3, 30, 35).end(35);
  const Report model = build_report_model(dir.str());
  const json j = report(dir);
  EXPECT_EQ(model.e2e_s(), j["e2e_s"].get<double>());
  EXPECT_EQ(model.ett_pct(), j["ett_pct"].get<double>());
  ASSERT_EQ(model.recoveries.size(), 1u);
  EXPECT_EQ(model.recoveries[0].restored_from, CheckpointTier::kMemory);
  EXPECT_EQ(j["recoveries"][0]["restored_from"], "memory");
  EXPECT_EQ(model.recoveries[0].total_s, j["time_to_recover_s"][0].get<double>());
  EXPECT_EQ(model.phases.at("compile").bucket, Bucket::kIdle);
  EXPECT_EQ(model.checkpoints.disk.count, j["checkpoints"]["count"].get<int>());
  ASSERT_TRUE(model.checkpoints.memory.has_value());
  EXPECT_EQ(model.checkpoints.memory->restores, 1);
  EXPECT_EQ(model.steps.retrained, 1);
  EXPECT_EQ(model.mtbf_source, j["mtbf_source"].get<std::string>());
  EXPECT_TRUE(model.has_timeline);
  EXPECT_EQ(model.job_timeline.size(), j["job_timeline"].size());
  EXPECT_EQ(to_json(model), build_report_json(dir.str()));
}

// Notes: text facts per attempt; the last value of a key wins, and of two ranks the lower one's.
TEST(Report, NotesArePerAttemptTheLastValueWinningAndTheLowestRanksKept) {
  TempDir dir;
  LedgerFile r0(dir, 0), r1(dir, 1);
  auto note = [](const std::string& key, const std::string& value) {
    return json{{"v", 1}, {"t", "note"}, {"key", key}, {"value", value}}.dump() + "\n";
  };
  r0.attempt(0, 0).raw(note("compile_cache", "miss")).raw(note("compile_cache", "megacache")).step(1, 0, 1).end(1);
  r1.attempt(0, 0).raw(note("compile_cache", "stale")).raw(note("only_rank_1", "x")).step(1, 0, 1).end(1);
  r0.attempt(1, 2).step(2, 2, 3).end(3);
  r1.attempt(1, 2).step(2, 2, 3).end(3);
  auto r = report(dir);
  EXPECT_EQ(r["attempts"][0]["notes"], (json{{"compile_cache", "megacache"}, {"only_rank_1", "x"}}));
  EXPECT_EQ(r["attempts"][1]["notes"], json::object());
  // A note whose value is not a string is a corrupt record, skipped and counted.
  LedgerFile r2(dir, 2);
  r2.attempt(0, 0).raw(R"({"v":1,"t":"note","key":"k","value":3})" "\n").end(1);
  EXPECT_EQ(report(dir)["ledger"]["corrupt_lines"], 1);
}

TEST(Report, ARecordersNotesReachTheReportAndBadOnesAreRefused) {
  TempDir dir;
  {
    RecorderOptions o;
    o.run_dir = dir.str();
    o.rank = 0;
    o.world_size = 1;
    o.launcher_phases_from_env = false;
    Recorder rec(o);
    rec.set_note("compile_cache", "precompiled");
    rec.set_note("why", "caf\xc3\xa9: \"quoted\"\n");
    EXPECT_THROW(rec.set_note("bad key!", "x"), InvalidArgument);
    EXPECT_THROW(rec.set_note("k", std::string(Recorder::kMaxNoteBytes + 1, 'x')), InvalidArgument);
    rec.set_note("k", std::string(Recorder::kMaxNoteBytes, 'x'));
    rec.step(1);
  }
  const json notes = report(dir)["attempts"][0]["notes"];
  EXPECT_EQ(notes["compile_cache"], "precompiled");
  EXPECT_EQ(notes["why"], "caf\xc3\xa9: \"quoted\"\n");
  EXPECT_EQ(notes["k"].get<std::string>().size(), Recorder::kMaxNoteBytes);
}

// A live trainer reporting on its own run: the Recorder is still open, so the attempt has no end record.
TEST(Report, AnOpenRunIsReportedAsRunning) {
  TempDir dir;
  {
    // The README's C++ snippet: report right after recording, before the writer thread ran. The attempt
    // record was not on disk yet, so the report threw (a C++ trainer that did not catch it aborted).
    RecorderOptions o;
    o.run_dir = (dir.path() / "fresh").string();
    o.rank = 0;
    o.world_size = 1;
    o.launcher_phases_from_env = false;
    o.flush_interval_s = 3600;
    o.heartbeat_s = 3600;
    Recorder rec(o);
    rec.step(1);
    ReportSummary now = build_report(o.run_dir);
    EXPECT_EQ(now.attempts, 1);
    EXPECT_EQ(now.failures, 0);
  }
  RecorderOptions o;
  o.run_dir = dir.str();
  o.rank = 0;
  o.world_size = 1;
  o.launcher_phases_from_env = false;
  Recorder rec(o);
  { auto p = rec.phase("compile"); }
  rec.step(1);
  // At least 2 ms of training between the two steps: back to back, both can fall in the same microsecond
  // and the report then has no training time (1 run in ~30 failed that way on the CI machine).
  std::this_thread::sleep_for(std::chrono::milliseconds(2));
  rec.step(2);
  rec.flush();
  ReportSummary summary = build_report(dir.str());
  json r = report(dir);
  ASSERT_EQ(r["attempts"].size(), 1u);
  EXPECT_EQ(r["attempts"][0]["status"], "running");
  EXPECT_EQ(summary.attempts, 1);
  EXPECT_EQ(summary.failures, 0);
  EXPECT_EQ(r["failures"], 0);
  EXPECT_NEAR(bucket_sum(r), 100.0, 1e-9);
  EXPECT_GT(r["phases"]["training"].get<double>(), 0.0);
  EXPECT_EQ(r["phases"].count("lost_in_flight"), 0u);
  rec.close();
  json closed = report(dir);
  EXPECT_EQ(closed["attempts"][0]["status"], "clean");
}

// A run with a memory tier: cheap memory saves (1 s) at steps 2 and 6, durable saves (3 s) at 4 and 8; killed
// after step 7, restored from memory (step 6), step 7 re-trained. Every figure below is worked out by hand
// from these records.
TEST(Report, CheckpointFiguresPerTierAndTheTierEachRecoveryRestoredFrom) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).step(1, 0, 10).step(2, 10, 20).phase("checkpoint_blocking/memory", 20, 21, 2)
      .background("checkpoint_memory_persist", 20, 22, 2).step(3, 21, 31).step(4, 31, 41)
      .phase("checkpoint_blocking", 41, 44, 4).background("checkpoint_persist", 41, 49, 4).step(5, 44, 54)
      .step(6, 54, 64).phase("checkpoint_blocking/memory", 64, 65, 6)
      .phase("checkpoint_blocking/memory", 65, 65.5, 6)  // the optimizer's wait for the same save's copies
      .background("checkpoint_memory_persist", 64, 66, 6).step(7, 65.5, 75.5);
  f.attempt(1, 80).phase("checkpoint_restore/memory", 80, 82, 6).step(7, 82, 92).step(8, 92, 102)
      .phase("checkpoint_blocking", 102, 105, 8).end(105);
  auto r = report(dir);
  // Both tiers' blocking rolls up into checkpoint_blocking; the memory tier's is its sub-stage.
  EXPECT_DOUBLE_EQ(r["phases"]["checkpoint_blocking"], 8.5);
  EXPECT_DOUBLE_EQ(r["substages"]["checkpoint_blocking/memory"], 2.5);
  EXPECT_DOUBLE_EQ(r["substages"]["checkpoint_restore/memory"], 2.0);
  const json& mem = r["checkpoints"]["tiers"]["memory"];
  const json& disk = r["checkpoints"]["tiers"]["disk"];
  EXPECT_EQ(mem["count"], 2);
  EXPECT_DOUBLE_EQ(mem["blocking_s"], 2.5);
  EXPECT_DOUBLE_EQ(mem["blocking_mean_s"], 1.25);
  // Training between memory saves: 20 s before step 2's save, then 20 + 20 s around the disk save.
  EXPECT_DOUBLE_EQ(mem["interval_s"], 30.0);
  EXPECT_EQ(mem["interval_source"], "inferred");
  EXPECT_DOUBLE_EQ(mem["durable_latency_median_s"], 2.0);
  EXPECT_EQ(mem["restores"], 1);
  EXPECT_EQ(mem["recovered_failures"], 1);
  EXPECT_DOUBLE_EQ(mem["retraining_s"], 10.0);
  EXPECT_EQ(disk["count"], 2);
  EXPECT_DOUBLE_EQ(disk["blocking_mean_s"], 3.0);
  EXPECT_DOUBLE_EQ(disk["interval_s"], 30.0);  // median of 40 (20 + 20 around the memory save) and 20
  EXPECT_DOUBLE_EQ(disk["durable_latency_median_s"], 8.0);
  EXPECT_EQ(disk["restores"], 0);
  EXPECT_DOUBLE_EQ(disk["retraining_s"], 0.0);
  // The top level is the durable tier's, as in a run without a memory tier.
  EXPECT_EQ(r["checkpoints"]["count"], 2);
  EXPECT_DOUBLE_EQ(r["checkpoints"]["blocking_mean_s"], 3.0);
  EXPECT_EQ(r["recoveries"][0]["restored_from"], "memory");
  EXPECT_DOUBLE_EQ(r["recoveries"][0]["total_s"], 6.5);  // 75.5 -> 82
  // Effective: 20 + 20 + 20 + 10 (attempt 0) + 10 (step 8); one failure, so MTBF = 80 s.
  EXPECT_DOUBLE_EQ(r["effective_s"], 80.0);
  EXPECT_DOUBLE_EQ(r["mtbf_s"], 80.0);
  // Young: sqrt(2 * blocking * MTBF); each tier's own blocking, its own restart cost, its own floor.
  EXPECT_NEAR(mem["recommended_interval_s"].get<double>(), std::sqrt(2 * 1.25 * 80.0), 1e-9);
  EXPECT_DOUBLE_EQ(mem["recommendation"]["restart_s"], 6.5);
  EXPECT_DOUBLE_EQ(mem["recommendation"]["floor_s"], 2.0);
  EXPECT_NEAR(disk["recommended_interval_s"].get<double>(), std::sqrt(2 * 3.0 * 80.0), 1e-9);
  EXPECT_DOUBLE_EQ(disk["recommendation"]["restart_s"], 0.0);  // no failure was restored from disk
  EXPECT_DOUBLE_EQ(r["recommended_interval_s"], disk["recommended_interval_s"]);
  // Meta's estimates: blocking summed over the tiers, unsaved work at the durable interval.
  EXPECT_NEAR(r["checkpoint_blocking_s"]["estimated"].get<double>(), 80.0 / 30.0 * 1.25 + 80.0 / 30.0 * 3.0, 1e-9);
  EXPECT_DOUBLE_EQ(r["unsaved_training_s"]["estimated"], 15.0);
  EXPECT_DOUBLE_EQ(r["unsaved_training_s"]["measured"], 10.0);
}

TEST(Report, ARunWithoutAMemoryTierHasOnlyTheDiskTierAndConfiguredIntervalsPerTier) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).config("checkpoint_memory_interval_steps", 2).config("checkpoint_interval_s", 50)
      .step(1, 0, 10).step(2, 10, 20).phase("checkpoint_blocking", 20, 22, 2).step(3, 22, 32).end(32);
  auto r = report(dir);
  EXPECT_FALSE(r["checkpoints"]["tiers"].contains("memory"));
  EXPECT_EQ(r["checkpoints"]["tiers"]["disk"]["interval_source"], "configured");
  EXPECT_DOUBLE_EQ(r["checkpoints"]["interval_s"], 50.0);
  EXPECT_EQ(r["checkpoints"]["count"], 1);

  TempDir dir2;
  LedgerFile g(dir2, 0);
  g.attempt(0, 0).config("checkpoint_memory_interval_steps", 2).step(1, 0, 10).step(2, 10, 20)
      .phase("checkpoint_blocking/memory", 20, 21, 2).step(3, 21, 31).end(31);
  auto r2 = report(dir2);
  EXPECT_EQ(r2["checkpoints"]["tiers"]["memory"]["interval_source"], "configured_steps");
  EXPECT_DOUBLE_EQ(r2["checkpoints"]["tiers"]["memory"]["interval_s"], 20.0);  // 2 steps x 10 s
  // Only memory saves: the durable tier has none and makes no recommendation.
  EXPECT_EQ(r2["checkpoints"]["count"], 0);
  EXPECT_TRUE(r2["recommendation"].is_null());
  EXPECT_FALSE(r2["checkpoints"]["tiers"]["memory"]["recommendation"].is_null());
  EXPECT_TRUE(r2["recoveries"].empty());
}

// Issue #47 item 6: rank `killed` is SIGKILLed after its last step at 10 s (no end record); the other
// rank's collective fails with gloo's error. Which rank's last record comes first is a sub-millisecond
// race, and with it (old rule: the first rank to stop names the failure) the category flipped between
// killed and exception:RuntimeError. Every order, and an exception recorded up to 1 ms before the killed
// rank's last record (clocks of two hosts), reports killed.
TEST(Report, AKilledRankNamesTheFailureWhicheverLastRecordCameFirst) {
  const std::string gloo = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer";
  struct Race {
    double survivor_last, survivor_end;
  };
  for (int killed : {0, 1}) {
    for (Race race : {Race{9.9995, 10.0009}, Race{10.0005, 10.0009}, Race{9.9995, 9.9991}, Race{10.0, 10.0},
                      Race{9.9991, 10.0001}}) {
      TempDir dir;
      for (int rank : {0, 1}) {
        LedgerFile f(dir, rank);
        f.attempt(0, 0);
        for (int n = 0; n < 9; ++n) f.step(n, n, n + 1);
        f.step(9, 9, rank == killed ? 10.0 : race.survivor_last);
        if (rank != killed) f.end(race.survivor_end, "exception", gloo);
      }
      auto r = report(dir);
      SCOPED_TRACE("killed rank " + std::to_string(killed) + ", survivor's last step " +
                   std::to_string(race.survivor_last) + ", its exception " + std::to_string(race.survivor_end));
      EXPECT_EQ(r["failures_by_category"], json({{"killed", 1}}));
      EXPECT_EQ(r["attempts"][0]["status"], "killed");
      EXPECT_TRUE(r["attempts"][0]["exception_type"].is_null());
    }
  }
}

// The converse: an exception recorded while the other rank was demonstrably alive (its heartbeat 1 s later)
// caused the failure; the launcher's SIGKILL of the other rank is its consequence.
TEST(Report, AnExceptionRaisedWhileThePeerWasAliveNamesTheFailure) {
  TempDir dir;
  LedgerFile(dir, 0).attempt(0, 0).step(0, 0, 10).end(10.5, "exception", "ValueError: bad batch");
  LedgerFile(dir, 1).attempt(0, 0).step(0, 0, 10).hb(11.5);
  auto r = report(dir);
  EXPECT_EQ(r["failures_by_category"], json({{"exception:ValueError", 1}}));
  EXPECT_EQ(r["attempts"][0]["exception_type"], "ValueError");
}

// Issue #47 item 7: the process_exit record extends a clean attempt to its process's end, as the shutdown
// sub-stage process_teardown; it is ignored for another attempt or process, and for a failed attempt.
TEST(Report, ProcessExitCountsTheTeardownAfterACleanEndAsShutdown) {
  TempDir dir;
  LedgerFile f(dir, 0);
  f.attempt(0, 0).step(0, 0, 10).end(10);
  f.raw(json({{"v", 1}, {"t", "process_exit"}, {"ts", s(12.5)}, {"attempt", 0}, {"pid", 7}}).dump() + "\n");
  auto r = report(dir);
  EXPECT_DOUBLE_EQ(r["e2e_s"], 12.5);
  EXPECT_DOUBLE_EQ(r["phases"]["shutdown"], 2.5);
  EXPECT_DOUBLE_EQ(r["substages"]["shutdown/process_teardown"], 2.5);
  EXPECT_DOUBLE_EQ(r["phases"]["training"], 10.0);
  EXPECT_DOUBLE_EQ(r["ett_pct"], 80.0);

  // Attempt 1 follows: its teardown is shutdown, not restart_gap; a line naming another attempt is skipped.
  TempDir two;
  LedgerFile g(two, 0);
  g.attempt(0, 0).step(0, 0, 10).end(10);
  g.raw(json({{"v", 1}, {"t", "process_exit"}, {"ts", s(11)}, {"attempt", 0}}).dump() + "\n");
  g.attempt(1, 12).step(1, 12, 20).end(20);
  g.raw(json({{"v", 1}, {"t", "process_exit"}, {"ts", s(30)}, {"attempt", 0}}).dump() + "\n");
  auto r2 = report(two);
  EXPECT_DOUBLE_EQ(r2["e2e_s"], 20.0);
  EXPECT_DOUBLE_EQ(r2["phases"]["shutdown"], 1.0);
  EXPECT_DOUBLE_EQ(r2["phases"]["restart_gap"], 1.0);

  // A failed attempt keeps its end: the time after it is detect_and_teardown until the next attempt.
  TempDir failed;
  LedgerFile h(failed, 0);
  h.attempt(0, 0).step(0, 0, 10).end(10, "exception", "ValueError: x");
  h.raw(json({{"v", 1}, {"t", "process_exit"}, {"ts", s(11)}, {"attempt", 0}}).dump() + "\n");
  h.attempt(1, 12).step(1, 12, 20).end(20);
  auto r3 = report(failed);
  EXPECT_FALSE(r3["phases"].contains("shutdown"));
  EXPECT_DOUBLE_EQ(r3["phases"]["detect_and_teardown"], 2.0);
}

}  // namespace
}  // namespace ettkit::ett
