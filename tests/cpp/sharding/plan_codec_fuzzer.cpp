// libFuzzer entry point for the plan decoder (built only with Clang: -DETTKIT_BUILD_FUZZERS=ON).
//   ./plan_codec_fuzzer -max_total_time=600 corpus/
// The input is resealed (length and checksum rewritten) when it has a full header, so mutations reach the
// parser instead of stopping at the checksum. Anything but success or CorruptData aborts the run.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ettkit/common/error.h"
#include "ettkit/sharding/codec.h"
#include "sharding/codec_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ettkit::sharding;
  std::vector<uint8_t> bytes(data, data + size);
  if (bytes.size() >= kPlanHeaderBytes && size % 2 == 0) codec::reseal_for_testing(bytes);
  try {
    const ShardingPlan plan = decode(bytes);
    if (!(decode(encode(plan)) == plan)) __builtin_trap();
  } catch (const ettkit::CorruptData&) {
  }
  return 0;
}
