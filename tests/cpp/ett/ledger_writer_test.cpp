// The LedgerWriter on its own (src/ett/ledger_writer.h): what it reads from an earlier attempt's file, the
// order it writes records in, drop accounting and the flush/close protocol. Every verdict waits on flush()
// or close(), never on time: events enqueued before start() sit in the queue until the thread drains them.
#include "ett/ledger_writer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ett/test_dir.h"
#include "ettkit/common/error.h"

namespace ettkit::ett::detail {
namespace {

using nlohmann::json;
using testing::read_lines;
using testing::TempDir;

LedgerWriterOptions options_for(const std::string& path) {
  LedgerWriterOptions o;
  o.path = path;
  o.heartbeat_s = 3600;  // one heartbeat, in the first round: the records under test are not interleaved
  o.flush_interval_s = 3600;
  o.fsync = FsyncPolicy::kNever;
  o.queue_capacity = 1024;
  return o;
}

std::vector<json> records_of(const std::string& path, const std::string& type) {
  std::vector<json> out;
  for (const auto& line : read_lines(path)) {
    auto j = json::parse(line, nullptr, false);
    if (j.is_object() && j["t"] == type) out.push_back(j);
  }
  return out;
}

std::string end_line() { return record_line({{"v", 1}, {"t", "end"}, {"ts", 7}, {"status", "clean"}}); }

TEST(LedgerWriter, PreparePathCreatesTheLedgerDirectoryAndNamesTheRanksFile) {
  TempDir dir;
  const std::string path = LedgerWriter::prepare_path(dir.str(), 3);
  EXPECT_EQ(path, (dir.path() / "ett" / "rank-3.jsonl").string());
  EXPECT_TRUE(std::filesystem::is_directory(dir.path() / "ett"));
  EXPECT_FALSE(std::filesystem::exists(path));  // the file is the writer's to create

  std::ofstream(dir.path() / "not-a-dir") << "x";
  try {
    LedgerWriter::prepare_path((dir.path() / "not-a-dir").string(), 0);
    FAIL() << "a run directory that is a file must be refused";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("not-a-dir/ett"), std::string::npos) << e.what();
  }
}

TEST(LedgerWriter, NumbersTheAttemptFromTheFileAndTerminatesATornLastLine) {
  TempDir dir;
  const std::string path = LedgerWriter::prepare_path(dir.str(), 0);
  // Two earlier attempts; the second was killed in the middle of a record.
  std::ofstream(path) << "{\"v\":1,\"t\":\"attempt\",\"attempt\":0,\"ts\":100}\n"
                      << "{\"v\":1,\"t\":\"phase\",\"name\":\"x\",\"b\":120,\"e\":250}\n"
                      << "{\"v\":1,\"t\":\"attempt\",\"attempt\":1,\"ts\":200}\n"
                      << "{\"v\":1,\"t\":\"step\",\"n\":4,\"b\":300,\"e\":9";  // torn: no newline
  LedgerWriter writer(options_for(path));
  EXPECT_EQ(writer.attempts_before(), 2);
  EXPECT_EQ(writer.last_ts_us(), 250);  // the latest complete record's; the torn one is not a record

  AttemptHeader header;
  header.attempt = writer.attempts_before();
  header.ts_us = 400;
  header.metadata = {{"job", "j1"}};
  writer.append_attempt_header(header);
  writer.start();
  ASSERT_TRUE(writer.close(end_line(), 10.0));

  const auto lines = read_lines(path);
  ASSERT_GE(lines.size(), 5u);
  EXPECT_EQ(lines[3], "{\"v\":1,\"t\":\"step\",\"n\":4,\"b\":300,\"e\":9");  // left as it was, then ended
  const json attempt = json::parse(lines[4], nullptr, false);  // stands alone: not glued to the torn line
  ASSERT_TRUE(attempt.is_object()) << lines[4];
  EXPECT_EQ(attempt["t"], "attempt");
  EXPECT_EQ(attempt["attempt"], 2);
  EXPECT_EQ(attempt["ts"], 400);
  EXPECT_EQ(attempt["meta"]["job"], "j1");
  EXPECT_TRUE(attempt["proc_start"].is_null());
  EXPECT_TRUE(attempt["run_id"].is_null());
}

TEST(LedgerWriter, WritesTheHeaderFirstThenEventsAndTheEndRecordLast) {
  TempDir dir;
  const std::string path = LedgerWriter::prepare_path(dir.str(), 0);
  LedgerWriter writer(options_for(path));
  EXPECT_EQ(writer.attempts_before(), 0);
  writer.append_attempt_header(AttemptHeader{});
  const uint32_t compile = writer.names().intern("compile");
  EXPECT_EQ(writer.names().intern("compile"), compile);
  writer.enqueue(Event{1'000, 2'000, -1, compile, EventKind::kPhaseEpoch});
  writer.enqueue(Event{5'000'000, 9'000'000, 12, 0, EventKind::kStepSteady});
  writer.start();
  writer.flush(10.0);
  ASSERT_TRUE(writer.close(end_line(), 10.0));

  const auto lines = read_lines(path);
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(json::parse(lines.front())["t"], "attempt");
  EXPECT_EQ(json::parse(lines.back())["t"], "end");
  const auto phases = records_of(path, "phase");
  ASSERT_EQ(phases.size(), 1u);
  EXPECT_EQ(phases[0]["name"], "compile");
  EXPECT_EQ(phases[0]["b"], 1'000);
  EXPECT_EQ(phases[0]["e"], 2'000);
  EXPECT_FALSE(phases[0].contains("step"));
  const auto steps = records_of(path, "step");
  ASSERT_EQ(steps.size(), 1u);
  EXPECT_EQ(steps[0]["n"], 12);
  // Steady-clock events are mapped onto the epoch through the writer's one anchor.
  EXPECT_EQ(steps[0]["b"], writer.anchor().to_epoch_us(5'000'000));
  EXPECT_EQ(steps[0]["e"], writer.anchor().to_epoch_us(9'000'000));
}

TEST(LedgerWriter, AFullQueueCountsEveryDropAndRecordsTheTotal) {
  TempDir dir;
  const std::string path = LedgerWriter::prepare_path(dir.str(), 0);
  LedgerWriter writer(options_for(path));  // capacity 1024, and no thread drains it before start()
  for (int64_t n = 0; n < 1500; ++n) writer.enqueue(Event{0, 1, n, 0, EventKind::kStepSteady});
  EXPECT_EQ(writer.dropped(), 1500u - 1024u);
  writer.start();
  writer.flush(10.0);
  EXPECT_EQ(records_of(path, "step").size(), 1024u);
  const auto dropped = records_of(path, "dropped");
  ASSERT_EQ(dropped.size(), 1u);
  EXPECT_EQ(dropped[0]["n"], 1500 - 1024);
  ASSERT_TRUE(writer.close(end_line(), 10.0));
}

TEST(LedgerWriter, FlushAfterCloseIsRefusedNamingTheLedger) {
  TempDir dir;
  const std::string path = LedgerWriter::prepare_path(dir.str(), 0);
  LedgerWriter writer(options_for(path));
  writer.start();
  ASSERT_TRUE(writer.close(end_line(), 10.0));
  try {
    writer.flush(1.0);
    FAIL() << "flush() after close() must throw";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(LedgerWriter, DestroyingAStartedWriterWithoutCloseJoinsItsThread) {
  // The Recorder constructor that throws after start(): the writer must stop its thread, not terminate.
  TempDir dir;
  const std::string path = LedgerWriter::prepare_path(dir.str(), 0);
  {
    LedgerWriter writer(options_for(path));
    writer.append_line(record_line({{"v", 1}, {"t", "config"}, {"key", "k"}, {"value", 1.5}}));
    writer.start();
  }
  const auto configs = records_of(path, "config");
  ASSERT_EQ(configs.size(), 1u);  // the last round still wrote what was queued
  EXPECT_EQ(configs[0]["value"], 1.5);
}

TEST(PhaseNames, InternsOnceAndRefusesBadNames) {
  PhaseNames names;
  const uint32_t a = names.intern("data_load");
  const uint32_t b = names.intern("compile");
  EXPECT_NE(a, b);
  EXPECT_EQ(names.intern("data_load"), a);
  EXPECT_STREQ(names.name_of(b), "compile");
  EXPECT_STREQ(names.name_of(b + 1), "unknown");
  EXPECT_STREQ(names.name_of(kMaxPhases + 7), "unknown");
  EXPECT_THROW(names.intern("has space"), InvalidArgument);
}

}  // namespace
}  // namespace ettkit::ett::detail
