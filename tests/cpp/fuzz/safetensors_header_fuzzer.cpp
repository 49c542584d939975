// libFuzzer entry point for the safetensors header decoder (Clang only: -DETTKIT_BUILD_FUZZERS=ON).
//   ./safetensors_header_fuzzer -max_total_time=600 corpus/
// Each input is written to one scratch file in $TMPDIR (the decoder reads files); a broken check aborts.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>

#include "fuzz/decoder_checks.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path =
      (std::filesystem::temp_directory_path() / ("ettkit_st_fuzz_" + std::to_string(::getpid()))).string();
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  if (ettkit::testing::check_safetensors_decoder(bytes, path) == ettkit::testing::DecoderOutcome::kBroken) {
    __builtin_trap();
  }
  return 0;
}
