// The ledger's fast record scanner must never disagree with the full JSON parser: whenever it accepts a
// line, the fields it reads are exactly the parsed document's. These tests pin the Recorder's own lines,
// every shape it must hand to the full parser, and a randomized comparison over mutated lines.
#include "ett/flat_record.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "test_scale.h"

namespace ettkit::ett::detail {
namespace {

using nlohmann::json;

TEST(FlatRecord, ReadsTheRecordersLines) {
  FlatRecord r;
  ASSERT_TRUE(r.scan(R"({"v":1,"t":"step","n":7,"b":1700000000000000,"e":1700000000009000})"));
  EXPECT_EQ(r.size(), 5u);
  EXPECT_EQ(r.integer("v"), 1);
  EXPECT_EQ(r.string("t"), std::optional<std::string_view>("step"));
  EXPECT_EQ(r.integer("e"), 1700000000009000);
  EXPECT_EQ(r.integer("t"), std::nullopt);  // a string is not an integer
  EXPECT_EQ(r.string("n"), std::nullopt);
  EXPECT_EQ(r.integer("missing"), std::nullopt);

  ASSERT_TRUE(r.scan(R"( { "v" : 1 , "t" : "end", "status":"clean", "detail":"" , "ts":-0 } )"));
  EXPECT_EQ(r.string("detail"), std::optional<std::string_view>(""));
  EXPECT_EQ(r.integer("ts"), 0);
  ASSERT_TRUE(r.scan("{}"));
  EXPECT_EQ(r.size(), 0u);
  ASSERT_TRUE(r.scan(R"({"x":-9223372036854775808})"));
  EXPECT_EQ(r.integer("x"), INT64_MIN);
  EXPECT_EQ(r.number("x"), static_cast<double>(INT64_MIN));
}

TEST(FlatRecord, LeavesEverythingElseToTheFullParser) {
  const char* lines[] = {
      R"({"v":1.0})",                 // a float
      R"({"v":1e3})",                 // an exponent
      R"({"v":01})",                  // a leading zero (invalid JSON)
      R"({"v":-})",                   // a lone sign
      R"({"v":9223372036854775808})",  // beyond int64: the full parser reads it as unsigned
      R"({"t":"a\"b"})",              // an escape
      "{\"t\":\"caf\xc3\xa9\"}",      // UTF-8
      "{\"t\":\"a\tb\"}",             // a control character inside a string
      R"({"v":true})",
      R"({"v":null})",
      R"({"v":[1]})",
      R"({"v":{"a":1}})",
      R"({"v":1,"v":2})",             // a duplicate key
      R"({"v":1} x)",                 // trailing text
      R"({"v":1,})",                  // a trailing comma
      R"({"v" 1})",
      R"({"v":1)",
      R"([1,2])",
      R"("v")",
      "",
      R"({"a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9,"j":10,"k":11,"l":12,"m":13})",
  };
  FlatRecord r;
  for (const char* line : lines) EXPECT_FALSE(r.scan(line)) << line;
}

// Every line the scanner accepts parses to the same object; lines come from the Recorder's shapes with
// random bytes replaced, inserted or deleted (deterministic seed).
TEST(FlatRecord, AgreesWithTheFullParserOnMutatedLines) {
  const std::vector<std::string> seeds = {
      R"({"v":1,"t":"step","n":7,"b":1700000000000000,"e":1700000000009000})",
      R"({"v":1,"t":"phase","name":"checkpoint_blocking","b":17,"e":19,"step":1000,"src":"launcher"})",
      R"({"v":1,"t":"attempt","attempt":0,"rank":0,"world":2,"ts":1700000000000000,"proc_start":-5})",
      R"({"v":1,"t":"config","key":"mtbf_s","value":3600})",
  };
  const std::string alphabet = "{}[]\":,-+.0123456789eEtfnul \t\\ab\x7f\xc3";
  std::mt19937_64 rng(20261123);
  FlatRecord r;
  int accepted = 0, rejected = 0;
  const int rounds = ettkit::testing::scaled_trials(40000, 2000);
  for (int i = 0; i < rounds; ++i) {
    std::string line = seeds[rng() % seeds.size()];
    for (int m = 1 + static_cast<int>(rng() % 3); m > 0 && !line.empty(); --m) {
      size_t at = rng() % line.size();
      char c = alphabet[rng() % alphabet.size()];
      switch (rng() % 3) {
        case 0: line[at] = c; break;
        case 1: line.insert(line.begin() + static_cast<std::ptrdiff_t>(at), c); break;
        default: line.erase(at, 1); break;
      }
    }
    if (!r.scan(line)) {
      ++rejected;
      continue;
    }
    ++accepted;
    json doc = json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(doc.is_object()) << line;
    ASSERT_EQ(doc.size(), r.size()) << line;
    for (const auto& [key, value] : doc.items()) {
      if (value.is_string()) {
        ASSERT_EQ(r.string(key), std::optional<std::string_view>(value.get_ref<const std::string&>())) << line;
      } else {
        ASSERT_TRUE(value.is_number_integer()) << line;
        ASSERT_EQ(r.integer(key), value.get<int64_t>()) << line;
      }
    }
  }
  // Both paths were exercised: the comparison above proved something.
  EXPECT_GT(accepted, rounds / 20);
  EXPECT_GT(rejected, rounds / 20);
}

}  // namespace
}  // namespace ettkit::ett::detail
