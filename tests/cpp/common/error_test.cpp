#include "ettkit/common/error.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace ettkit
