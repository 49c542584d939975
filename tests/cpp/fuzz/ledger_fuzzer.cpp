// libFuzzer entry point for the ledger reader and the report built from it (Clang only:
// -DETTKIT_BUILD_FUZZERS=ON). Each input is the only ledger of a scratch run directory in $TMPDIR.
//   ./ledger_fuzzer -max_total_time=600 corpus/
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "fuzz/decoder_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string run_dir = [] {
    auto p = std::filesystem::temp_directory_path() / ("ettkit_ledger_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(p / "ett");
    return p.string();
  }();
  const std::string text(reinterpret_cast<const char*>(data), size);
  if (ettkit::testing::check_ledger_reader(text, run_dir) == ettkit::testing::DecoderOutcome::kBroken) {
    __builtin_trap();
  }
  return 0;
}
