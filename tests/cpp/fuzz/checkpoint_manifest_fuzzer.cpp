// libFuzzer entry point for the manifest decoder (Clang only: -DETTKIT_BUILD_FUZZERS=ON).
//   ./checkpoint_manifest_fuzzer -max_total_time=600 corpus/
// The checks are the seeded loop's (tests/cpp/checkpoint/decoder_fuzz_test.cpp); a broken one aborts.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/decoder_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (ettkit::testing::check_manifest_decoder(text) == ettkit::testing::DecoderOutcome::kBroken) __builtin_trap();
  return 0;
}
