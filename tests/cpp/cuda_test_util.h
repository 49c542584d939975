#pragma once
// The CUDA gate for the C++ tests: a test that needs a GPU skips without one, except when
// ETTKIT_REQUIRE_CUDA=1 (set wherever a GPU is expected: tools/gpu_check.sh), which turns a missing GPU, or
// an ettkit built without CUDA, into a failure, so a GPU job can never pass by skipping.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ettkit::testing {

inline bool cuda_required() {
  const char* r = std::getenv("ETTKIT_REQUIRE_CUDA");
  return r != nullptr && std::string(r) == "1";
}

#if ETTKIT_WITH_CUDA
inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}
#endif

}  // namespace ettkit::testing

// Macros, not functions: GTEST_SKIP and FAIL return only from the function they are written in.
#if ETTKIT_WITH_CUDA
#define ETTKIT_GPU_OR_SKIP()                                                              \
  do {                                                                                    \
    if (!::ettkit::testing::have_gpu()) {                                                 \
      if (::ettkit::testing::cuda_required()) {                                           \
        FAIL() << "ETTKIT_REQUIRE_CUDA=1 but no CUDA device is visible";                  \
      }                                                                                   \
      GTEST_SKIP() << "no CUDA device";                                                   \
    }                                                                                     \
  } while (0)
#endif

/// The one test a build without CUDA has in place of a suite of CUDA tests.
#define ETTKIT_CUDA_NOT_BUILT_TEST(suite)                                                 \
  TEST(suite, NotBuilt) {                                                                 \
    if (::ettkit::testing::cuda_required()) {                                             \
      FAIL() << "ETTKIT_REQUIRE_CUDA=1 but ettkit was built without CUDA";                \
    }                                                                                     \
    GTEST_SKIP() << "ettkit was built without CUDA";                                      \
  }
