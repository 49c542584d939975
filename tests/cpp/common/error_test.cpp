#include "ettkit/common/error.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <stdexcept>

#include "common/describe.h"
#include "ettkit/common/config.h"

#if ETTKIT_WITH_CUDA
#include "common/cuda_check.h"
#endif

namespace ettkit {
namespace {

TEST(Error, MessageNamesTheFieldAndLocation) {
  try {
    int rank = 7;
    ETTKIT_EXPECTS(rank < 4, "rank ", rank, " is outside [0, world_size=4)");
    FAIL() << "expected a throw";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.message(), "rank 7 is outside [0, world_size=4)");
    std::string what = e.what();
    EXPECT_NE(what.find("rank 7 is outside"), std::string::npos);
    EXPECT_NE(what.find("error_test.cpp:"), std::string::npos) << what;
  }
}

TEST(Error, HierarchyIsCatchableAsBase) {
  EXPECT_THROW(ETTKIT_THROW(CorruptData, "x"), Error);
  EXPECT_THROW(ETTKIT_THROW(IoError, "x"), std::runtime_error);
  EXPECT_NO_THROW(ETTKIT_CHECK(true, Timeout, "never"));
}

template <class F>
std::exception_ptr thrown(F&& f) {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

TEST(Describe, GivesTheMessageWithoutLocationOrBacktrace) {
  using detail::describe;
  EXPECT_EQ(describe(thrown([] { ETTKIT_THROW(IoError, "disk ", 3, " is full"); })), "disk 3 is full");
  const std::string c10 = describe(thrown([] { TORCH_CHECK(false, "bad shape [", 2, "]"); }));
  EXPECT_NE(c10.find("bad shape [2]"), std::string::npos) << c10;
  EXPECT_EQ(c10.find("Exception raised from"), std::string::npos) << c10;  // c10's C++ backtrace
  EXPECT_EQ(describe(thrown([] { throw std::runtime_error("line 1\nline 2"); })), "line 1\nline 2");
  EXPECT_EQ(describe(thrown([] { throw 42; })), "an exception that is not a std::exception");
  EXPECT_EQ(describe(nullptr), "");
  EXPECT_EQ(detail::first_line(std::runtime_error("line 1\nline 2")), "line 1");
}

#if ETTKIT_WITH_CUDA
// Needs no GPU: the check only reads CUDA's names for an error code.
TEST(CudaCheck, NamesTheCallTheCudaErrorAndWhatWasBeingDone) {
  auto fails = [] { return cudaErrorInvalidValue; };
  size_t bytes = 4096;
  try {
    ETTKIT_CUDA_CHECK(fails(), "allocating a ", bytes, "-byte arena");
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message(), std::string("fails() failed: cudaErrorInvalidValue (") +
                               cudaGetErrorString(cudaErrorInvalidValue) + ") while allocating a 4096-byte arena");
  }
  try {
    ETTKIT_CUDA_CHECK(fails());
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.message().rfind("fails() failed: cudaErrorInvalidValue (", 0), 0u) << e.message();
    EXPECT_EQ(e.message().find("while"), std::string::npos) << e.message();
  }
  EXPECT_NO_THROW(ETTKIT_CUDA_CHECK(cudaSuccess));
}
#endif

}  // namespace
}  // namespace ettkit
