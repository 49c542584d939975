// Seeded mutation loops over the checkpoint's decoders (issue #17 item 4): the manifest and the safetensors
// header. Every mutated input must decode into something that satisfies the decoder's promises, or be
// refused with CorruptData (Unsupported for a newer manifest version); nothing else may come out. CI runs a
// fixed number of iterations; ETTKIT_FUZZ_SECONDS=N runs for N seconds instead. The libFuzzer harnesses
// (tests/cpp/fuzz/*_fuzzer.cpp, Clang with -DETTKIT_BUILD_FUZZERS=ON) drive the same checks.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "checkpoint/storage.h"
#include "ett/test_dir.h"
#include "ettkit/common/error.h"
#include "fuzz/decoder_checks.h"
#include "fuzz/mutate.h"

namespace ckd = ettkit::checkpoint::detail;
using ettkit::testing::FuzzBudget;
using ettkit::testing::mutate;

namespace {

std::vector<std::string> manifest_corpus() {
  std::vector<std::string> out;
  ckd::Manifest a;
  a.step = 42;
  a.world_size = 2;
  a.created_unix_us = 1700000000000000;
  a.commit_seq = 7;
  a.torch_version = "2.14.1";
  a.files["rank-0.safetensors"] = {size_t{70} << 20, "0123456789abcdef", ckd::kHashChunkBytes,
                                   {"00000000000000aa", "00000000000000bb", "00000000000000cc"}};
  a.files["rank-0.extra"] = {120, "fedcba9876543210", ckd::kHashChunkBytes, {"0000000000000001"}};
  a.metadata["job"] = "fuzz";
  out.push_back(ckd::encode_manifest(a));
  ckd::Manifest b;  // a manifest from before chunk checksums, one rank
  b.step = 0;
  b.world_size = 1;
  b.files["rank-0.safetensors"] = {0, "0000000000000000", 0, {}};
  out.push_back(ckd::encode_manifest(b));
  return out;
}

std::vector<std::string> safetensors_corpus() {
  std::vector<std::string> out;
  std::vector<ckd::SafetensorsEntry> entries = {
      {"a", "F32", {2, 3}, 0, 24}, {"b.c", "BF16", {5}, 24, 34}, {"empty", "I64", {0, 4}, 34, 34},
      {"u8", "U8", {3}, 34, 37}};
  for (int variant = 0; variant < 2; ++variant) {
    std::string file = ckd::encode_safetensors_header(entries, variant ? std::map<std::string, std::string>{
                                                                             {"format", "pt"}}
                                                                       : std::map<std::string, std::string>{});
    file.append(37, '\x5a');
    out.push_back(file);
    entries.resize(2);
    entries[1].end = 24;
    entries[1].shape = {0};
  }
  return out;
}

}  // namespace

TEST(DecoderFuzz, ManifestMutationsDecodeConsistentlyOrAreRefused) {
  const std::vector<std::string> corpus = manifest_corpus();
  std::mt19937_64 rng(0x3A41F357);
  FuzzBudget budget(20000);
  long decoded = 0, refused = 0, n = 0;
  for (; budget.more(n); ++n) {
    std::string text = corpus[rng() % corpus.size()];
    mutate(text, corpus, rng);
    switch (ettkit::testing::check_manifest_decoder(text)) {
      case ettkit::testing::DecoderOutcome::kDecoded:
        ++decoded;
        break;
      case ettkit::testing::DecoderOutcome::kRefused:
        ++refused;
        break;
      case ettkit::testing::DecoderOutcome::kBroken:
        ADD_FAILURE() << "iteration " << n << ": " << ettkit::testing::last_decoder_problem() << "\ninput: " << text;
        return;
    }
  }
  // Both outcomes happen: the loop reaches the decoder's checks and past them.
  EXPECT_GT(decoded, n / 50) << decoded << " of " << n;
  EXPECT_GT(refused, n / 2) << refused << " of " << n;
}

TEST(DecoderFuzz, SafetensorsHeaderMutationsIndexConsistentlyOrAreRefused) {
  const std::vector<std::string> corpus = safetensors_corpus();
  ettkit::testing::TempDir dir;
  const std::string path = (dir.path() / "f.safetensors").string();
  std::mt19937_64 rng(0x5AFE7E25);
  FuzzBudget budget(4000);
  long indexed = 0, refused = 0, n = 0;
  for (; budget.more(n); ++n) {
    std::string bytes = corpus[rng() % corpus.size()];
    mutate(bytes, corpus, rng);
    switch (ettkit::testing::check_safetensors_decoder(bytes, path)) {
      case ettkit::testing::DecoderOutcome::kDecoded:
        ++indexed;
        break;
      case ettkit::testing::DecoderOutcome::kRefused:
        ++refused;
        break;
      case ettkit::testing::DecoderOutcome::kBroken:
        ADD_FAILURE() << "iteration " << n << ": " << ettkit::testing::last_decoder_problem();
        return;
    }
  }
  EXPECT_GT(indexed, n / 50) << indexed << " of " << n;
  EXPECT_GT(refused, n / 2) << refused << " of " << n;
}
