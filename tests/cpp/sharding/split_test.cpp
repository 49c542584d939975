// TorchRec's split rules, pinned to the values TorchRec's own tests and the reference's worked examples
// expect (docs/sharding.md, "Split rules"; torchrec/distributed/tests/test_sharding_plan.py,
// torchrec/distributed/planner/tests/test_enumerators.py).
#include "ettkit/sharding/split.h"

#include <gtest/gtest.h>

#include <vector>

#include "ettkit/common/error.h"

namespace ettkit::sharding {
namespace {

std::vector<int64_t> sizes(const std::vector<Span>& spans) {
  std::vector<int64_t> out;
  for (const auto& s : spans) out.push_back(s.size);
  return out;
}
std::vector<int64_t> offsets(const std::vector<Span>& spans) {
  std::vector<int64_t> out;
  for (const auto& s : spans) out.push_back(s.offset);
  return out;
}

TEST(RowWiseSplit, CeilBlocksNotBalanced) {
  // 1000 over 3 is 334, 334, 332 (not the balanced 334, 333, 333).
  auto s = row_wise_split(1000, 3);
  EXPECT_EQ(sizes(s), (std::vector<int64_t>{334, 334, 332}));
  EXPECT_EQ(offsets(s), (std::vector<int64_t>{0, 334, 668}));
}

TEST(RowWiseSplit, TorchRecNonZchCases) {
  // RowWiseShardingTest.test_non_zch_rw_sharding
  EXPECT_EQ(sizes(row_wise_split(10, 4)), (std::vector<int64_t>{3, 3, 3, 1}));
  EXPECT_EQ(offsets(row_wise_split(10, 4)), (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(sizes(row_wise_split(5, 4)), (std::vector<int64_t>{2, 2, 1, 0}));
  EXPECT_EQ(offsets(row_wise_split(5, 4)), (std::vector<int64_t>{0, 2, 4, 5}));
}

TEST(RowWiseSplit, TrailingEmptyShardsSitAtRows) {
  auto s = row_wise_split(5, 8);
  EXPECT_EQ(sizes(s), (std::vector<int64_t>{1, 1, 1, 1, 1, 0, 0, 0}));
  EXPECT_EQ(offsets(s), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 5, 5}));
  s = row_wise_split(9, 4);
  EXPECT_EQ(sizes(s), (std::vector<int64_t>{3, 3, 3, 0}));
  EXPECT_EQ(offsets(s), (std::vector<int64_t>{0, 3, 6, 9}));
  s = row_wise_split(1000, 64);
  ASSERT_EQ(s.size(), 64u);
  EXPECT_EQ(s[61].size, 16);
  EXPECT_EQ(s[62].size, 8);
  EXPECT_EQ(s[62].offset, 992);
  EXPECT_EQ(s[63].size, 0);
  EXPECT_EQ(s[63].offset, 1000);
  s = row_wise_split(1000, 128);
  EXPECT_EQ(s[124].size, 8);
  for (int r = 125; r < 128; ++r) {
    EXPECT_EQ(s[r].size, 0) << r;
    EXPECT_EQ(s[r].offset, 1000) << r;
  }
}

TEST(RowWiseSplit, ReferenceTable) {
  auto s = row_wise_split(1000, 8);
  for (int r = 0; r < 8; ++r) EXPECT_EQ(s[r], (Span{125 * r, 125}));
  s = row_wise_split(1000, 16);
  EXPECT_EQ(s[14], (Span{882, 63}));
  EXPECT_EQ(s[15], (Span{945, 55}));
  s = row_wise_split(1000, 32);
  EXPECT_EQ(s[30], (Span{960, 32}));
  EXPECT_EQ(s[31], (Span{992, 8}));
}

TEST(RowWiseSplit, EnumeratorExpectations) {
  // test_enumerators.py EXPECTED_RW_SHARD_SIZES / OFFSETS: tables of 100 + 10 i rows over 8 ranks.
  const std::vector<std::vector<int64_t>> expected = {
      {13, 13, 13, 13, 13, 13, 13, 9},
      {14, 14, 14, 14, 14, 14, 14, 12},
      {15, 15, 15, 15, 15, 15, 15, 15},
      {17, 17, 17, 17, 17, 17, 17, 11},
  };
  const std::vector<std::vector<int64_t>> expected_offsets = {
      {0, 13, 26, 39, 52, 65, 78, 91},
      {0, 14, 28, 42, 56, 70, 84, 98},
      {0, 15, 30, 45, 60, 75, 90, 105},
      {0, 17, 34, 51, 68, 85, 102, 119},
  };
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(sizes(row_wise_split(100 + 10 * i, 8)), expected[i]) << i;
    EXPECT_EQ(offsets(row_wise_split(100 + 10 * i, 8)), expected_offsets[i]) << i;
  }
  // EXPECTED_TWRW_SHARD_SIZES: the same tables over one host of 4.
  EXPECT_EQ(sizes(row_wise_split(100, 4)), (std::vector<int64_t>{25, 25, 25, 25}));
  EXPECT_EQ(sizes(row_wise_split(110, 4)), (std::vector<int64_t>{28, 28, 28, 26}));
  EXPECT_EQ(sizes(row_wise_split(120, 4)), (std::vector<int64_t>{30, 30, 30, 30}));
  EXPECT_EQ(sizes(row_wise_split(130, 4)), (std::vector<int64_t>{33, 33, 33, 31}));
  EXPECT_EQ(offsets(row_wise_split(130, 4)), (std::vector<int64_t>{0, 33, 66, 99}));
}

TEST(RowWiseSplit, ZeroRowsGiveEmptyPartsAtZero) {
  auto s = row_wise_split(0, 3);
  EXPECT_EQ(s, (std::vector<Span>{{0, 0}, {0, 0}, {0, 0}}));
}

TEST(RowWiseSplit, HugeRowsDoNotOverflow) {
  const int64_t big = INT64_MAX;
  auto s = row_wise_split(big, 3);
  int64_t total = 0;
  for (const auto& p : s) total += p.size;
  EXPECT_EQ(total, big);
  EXPECT_EQ(s[2].offset + s[2].size, big);
}

TEST(RowWiseSplit, RejectsBadArguments) {
  EXPECT_THROW(row_wise_split(10, 0), InvalidArgument);
  EXPECT_THROW(row_wise_split(-1, 2), InvalidArgument);
}

TEST(BucketedRowWiseSplit, TorchRecZchCases) {
  std::vector<Span> s;
  bucketed_row_wise_split(10, 4, 5, s);
  EXPECT_EQ(sizes(s), (std::vector<int64_t>{4, 2, 2, 2}));
  s.clear();
  bucketed_row_wise_split(100, 4, 10, s);
  EXPECT_EQ(sizes(s), (std::vector<int64_t>{30, 30, 20, 20}));
  s.clear();
  bucketed_row_wise_split(18, 3, 6, s);
  EXPECT_EQ(sizes(s), (std::vector<int64_t>{6, 6, 6}));
  s.clear();
  bucketed_row_wise_split(1000, 3, 10, s);
  EXPECT_EQ(sizes(s), (std::vector<int64_t>{400, 300, 300}));
  // EXPECTED_RW_SHARD_SIZES_WITH_BUCKETS / OFFSETS (10 buckets, 8 ranks).
  s.clear();
  bucketed_row_wise_split(110, 8, 10, s);
  EXPECT_EQ(sizes(s), (std::vector<int64_t>{22, 22, 11, 11, 11, 11, 11, 11}));
  EXPECT_EQ(offsets(s), (std::vector<int64_t>{0, 22, 44, 55, 66, 77, 88, 99}));
}

TEST(BucketedRowWiseSplit, RowsMustDivideIntoBuckets) {
  std::vector<Span> s;
  EXPECT_THROW(bucketed_row_wise_split(10, 4, 3, s), InvalidArgument);
}

TEST(ColumnBlock, FindBaseDimMatchesTorchRecScan) {
  // The O(sqrt) search must agree with TorchRec's linear scan everywhere.
  auto scan = [](int64_t lb, int64_t dim) {
    for (int64_t i = lb; i < dim; ++i) {
      if (dim % i == 0 && i % 4 == 0) return i;
    }
    return dim;
  };
  for (int64_t dim = 1; dim <= 1200; ++dim) {
    for (int64_t lb = 1; lb <= dim + 2; lb += (lb < 40 ? 1 : 7)) {
      ASSERT_EQ(find_base_dim(lb, dim), scan(lb, dim)) << "lb=" << lb << " dim=" << dim;
    }
  }
}

TEST(ColumnBlock, ReferenceExamples) {
  EXPECT_EQ(torchrec_column_block(64, 32), 32);
  EXPECT_EQ(torchrec_column_block(64, 0), 64);  // MIN_CW_DIM 128 > 64: column-wise degenerates to one block
  EXPECT_EQ(torchrec_column_block(64, 20), 32);
  EXPECT_EQ(torchrec_column_block(64, 48), 64);
  EXPECT_EQ(torchrec_column_block(100, 10), 20);
  EXPECT_EQ(torchrec_column_block(96, 24), 24);
  EXPECT_EQ(torchrec_column_block(256, 0), 128);
  EXPECT_EQ(torchrec_column_block(384, 0), 128);
  EXPECT_EQ(torchrec_column_block(100, 25), 100);  // column_wise over 4 ranks of 100 columns: one block
  // Enumerator constraints (min_partition 20/20/20/40 on 20/40/60/80 columns).
  EXPECT_EQ(torchrec_column_block(20, 20), 20);
  EXPECT_EQ(torchrec_column_block(40, 20), 20);
  EXPECT_EQ(torchrec_column_block(60, 20), 20);
  EXPECT_EQ(torchrec_column_block(80, 40), 40);
  EXPECT_THROW(torchrec_column_block(0, 0), InvalidArgument);
}

TEST(ColumnBlock, LargeDimensionIsFast) {
  // 2^40 columns would take TorchRec's scan ~2^39 steps; the divisor search answers at once.
  const int64_t dim = int64_t{1} << 40;
  EXPECT_EQ(find_base_dim(1000, dim), 1024);
  EXPECT_EQ(find_base_dim(3, (int64_t{1} << 40) - 4), 4);
}

}  // namespace
}  // namespace ettkit::sharding
