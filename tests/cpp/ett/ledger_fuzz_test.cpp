// A seeded mutation loop over the ledger reader and the report built from it (issue #17 item 4): a ledger
// is written line by line by processes that may be killed mid-line, so its reader must take any bytes,
// skip (and count) what it cannot read, and still build the report; only InvalidArgument (nothing usable)
// and Unsupported (a newer format version) may come out. ETTKIT_FUZZ_SECONDS=N runs for N seconds.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>

#include "ett/test_dir.h"
#include "ettkit/common/log_sink.h"
#include "fuzz/decoder_checks.h"
#include "fuzz/mutate.h"

using ettkit::testing::DecoderOutcome;
using ettkit::testing::FuzzBudget;

namespace {

std::vector<std::string> ledger_corpus() {
  const std::string a = R"({"v":1,"t":"attempt","attempt":0,"rank":0,"world":1,"pid":12,"host":"h","ts":1700000000000000,"proc_start":1699999999000000,"restart_count":0})";
  const std::string phases =
      R"({"v":1,"t":"phase","name":"init","b":1700000000000000,"e":1700000001000000})" "\n"
      R"({"v":1,"t":"step","n":1,"b":1700000001000000,"e":1700000001500000})" "\n"
      R"({"v":1,"t":"phase","name":"checkpoint_blocking","b":1700000001500000,"e":1700000001600000,"step":1})" "\n"
      R"({"v":1,"t":"bg","name":"checkpoint_persist","b":1700000001600000,"e":1700000002600000,"step":1})" "\n"
      R"({"v":1,"t":"hb","ts":1700000003000000})" "\n"
      R"({"v":1,"t":"config","key":"checkpoint_interval_s","value":60})" "\n"
      R"({"v":1,"t":"dropped","n":2,"ts":1700000003000000})" "\n";
  const std::string end = R"({"v":1,"t":"end","ts":1700000004000000,"status":"signal","detail":"SIGKILL"})";
  const std::string again = R"({"v":1,"t":"attempt","attempt":1,"rank":0,"world":1,"ts":1700000010000000})";
  return {a + "\n" + phases + end + "\n", a + "\n" + phases + again + "\n" + phases, a + "\n"};
}

}  // namespace

TEST(LedgerFuzz, MutatedLedgersAreReadAndReportedOrRefused) {
  ettkit::testing::TempDir dir;
  std::filesystem::create_directories(dir.path() / "ett");
  const std::vector<std::string> corpus = ledger_corpus();
  // The reader warns about every corrupt line it skips: counted here instead of printed 1,500 times.
  long skipped_warnings = 0;
  ettkit::set_log_sink(
      [&](const ettkit::LogRecord& r) {
        skipped_warnings += r.message.find("corrupt lines skipped") != std::string_view::npos;
        return true;
      },
      ettkit::LogLevel::kWarn);
  std::mt19937_64 rng(0x1ED6E25);
  FuzzBudget budget(1500);
  long reported = 0, refused = 0, n = 0;
  for (; budget.more(n); ++n) {
    std::string text = corpus[rng() % corpus.size()];
    ettkit::testing::mutate(text, corpus, rng);
    switch (ettkit::testing::check_ledger_reader(text, dir.str())) {
      case DecoderOutcome::kDecoded:
        ++reported;
        break;
      case DecoderOutcome::kRefused:
        ++refused;
        break;
      case DecoderOutcome::kBroken:
        ettkit::set_log_sink({}, ettkit::LogLevel::kWarn);
        ADD_FAILURE() << "iteration " << n << ": " << ettkit::testing::last_decoder_problem() << "\ninput: " << text;
        return;
    }
  }
  ettkit::set_log_sink({}, ettkit::LogLevel::kWarn);
  EXPECT_GT(skipped_warnings, n / 4) << "the reader said it skipped corrupt lines in " << skipped_warnings;
  // Most mutations hit one line of several: the reader skips it and the report still builds.
  EXPECT_GT(reported, n / 2) << reported << " of " << n;
  EXPECT_GT(refused, 0) << "no mutation made the ledger unusable in " << n << " iterations";
}
