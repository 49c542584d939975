// Validation of shard lists: every kind of bad layout gives an InvalidArgument naming the table and the
// shard, and the O(S log S) sweeps agree with a brute-force cell count on thousands of random layouts.
#include "ettkit/sharding/validate.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "ettkit/common/error.h"

namespace ettkit::sharding {
namespace {

std::string error_of(ShardingType type, int64_t rows, int64_t cols, const std::vector<Shard>& shards, int32_t ws = 4) {
  try {
    validate_shards("emb", type, rows, cols, shards, ws);
  } catch (const InvalidArgument& e) {
    return e.message();
  }
  return "";
}

void expect_error(const std::string& message, const std::string& needle) {
  EXPECT_NE(message.find(needle), std::string::npos) << "message: '" << message << "' lacks '" << needle << "'";
  EXPECT_NE(message.find("table 'emb'"), std::string::npos) << message;
}

constexpr auto RW = ShardingType::kRowWise;
constexpr auto CW = ShardingType::kColumnWise;
constexpr auto GRID = ShardingType::kGridShard;

TEST(Validate, AcceptsTorchRecLayouts) {
  EXPECT_EQ(error_of(RW, 1000, 64, {{0, 0, 334, 64, 0}, {334, 0, 334, 64, 1}, {668, 0, 332, 64, 2}}), "");
  // Trailing empty shards at offset = rows.
  EXPECT_EQ(error_of(RW, 5, 8, {{0, 0, 2, 8, 0}, {2, 0, 2, 8, 1}, {4, 0, 1, 8, 2}, {5, 0, 0, 8, 3}}), "");
  EXPECT_EQ(error_of(CW, 10, 64, {{0, 0, 10, 32, 1}, {0, 32, 10, 32, 1}}), "");
  EXPECT_EQ(error_of(GRID, 10, 64, {{0, 0, 5, 32, 0}, {5, 0, 5, 32, 1}, {0, 32, 5, 32, 2}, {5, 32, 5, 32, 3}}), "");
  // Out-of-order explicit shards are fine too.
  EXPECT_EQ(error_of(RW, 10, 8, {{6, 0, 4, 8, 0}, {0, 0, 6, 8, 1}}), "");
  EXPECT_EQ(error_of(ShardingType::kDataParallel, 10, 8, {{0, 0, 10, 8, 0}, {0, 0, 10, 8, 1}}), "");
}

TEST(Validate, OverlappingShards) {
  expect_error(error_of(RW, 1000, 64, {{0, 0, 334, 64, 0}, {300, 0, 700, 64, 1}}),
               "shards[0] (rows [0, 334) x cols [0, 64) on rank 0) and shards[1] (rows [300, 1000) x cols [0, 64) on "
               "rank 1) overlap");
  expect_error(error_of(CW, 10, 64, {{0, 0, 10, 40, 0}, {0, 32, 10, 32, 1}}), "overlap");
  expect_error(error_of(GRID, 10, 64, {{0, 0, 6, 40, 0}, {5, 30, 5, 34, 1}, {0, 40, 5, 24, 2}, {6, 0, 4, 30, 3}}),
               "overlap");
  // Replicas of a non-data-parallel table are overlaps.
  expect_error(error_of(RW, 10, 8, {{0, 0, 10, 8, 0}, {0, 0, 10, 8, 1}}), "overlap");
}

TEST(Validate, ShardsOutOfBounds) {
  expect_error(error_of(RW, 1000, 64, {{0, 0, 500, 64, 0}, {500, 0, 600, 64, 1}}),
               "shards[1] starts at row 500 with 600 rows, beyond the table's 1000 rows");
  expect_error(error_of(CW, 10, 64, {{0, 0, 10, 32, 0}, {0, 48, 10, 32, 1}}),
               "shards[1] starts at column 48 with 32 cols, beyond the table's 64 cols");
  expect_error(error_of(RW, 10, 8, {{-1, 0, 11, 8, 0}}), "offsets must be >= 0");
  expect_error(error_of(RW, 10, 8, {{0, 0, -10, 8, 0}}), "sizes must be >= 0");
  // Offsets near INT64_MAX must not wrap around and pass.
  expect_error(error_of(RW, 10, 8, {{INT64_MAX - 2, 0, 5, 8, 0}}), "beyond the table's 10 rows");
}

TEST(Validate, Gaps) {
  expect_error(error_of(RW, 1000, 64, {{0, 0, 334, 64, 0}, {334, 0, 334, 64, 1}}),
               "rows [668, 1000) x cols [0, 64) are not covered by any shard");
  expect_error(error_of(RW, 1000, 64, {{0, 0, 300, 64, 0}, {334, 0, 666, 64, 1}}),
               "rows [300, 334) x cols [0, 64) are not covered");
  expect_error(error_of(CW, 10, 64, {{0, 0, 10, 32, 0}}), "rows [0, 10) x cols [32, 64) are not covered");
  expect_error(error_of(GRID, 10, 64, {{0, 0, 5, 32, 0}, {5, 0, 5, 32, 1}, {0, 32, 5, 32, 2}}),
               "rows [5, 10) x cols [32, 64) are not covered");
  expect_error(error_of(GRID, 10, 64, {{2, 0, 8, 32, 0}, {0, 32, 10, 32, 1}, {0, 0, 1, 32, 2}}),
               "rows [1, 2) x cols [0, 32) are not covered");
  expect_error(error_of(RW, 10, 8, {{0, 0, 0, 8, 0}}), "rows [0, 10) x cols [0, 8) are not covered");
}

TEST(Validate, RankOutsideWorld) {
  expect_error(error_of(RW, 10, 8, {{0, 0, 10, 8, 4}}, 4),
               "shards[0] is on rank 4, outside the world of 4 ranks (valid: 0..3)");
  expect_error(error_of(RW, 10, 8, {{0, 0, 10, 8, -1}}, 4), "outside the world");
}

TEST(Validate, DataParallelReplicasMustBeWhole) {
  expect_error(error_of(ShardingType::kDataParallel, 10, 8, {{0, 0, 10, 8, 0}, {0, 0, 9, 8, 1}}),
               "is not the whole 10 x 8 table");
  expect_error(error_of(ShardingType::kDataParallel, 10, 8, {{0, 0, 10, 8, 1}, {0, 0, 10, 8, 1}}),
               "two replicas on rank 1");
}

TEST(Validate, EmptyListAndOverflow) {
  expect_error(error_of(RW, 10, 8, {}), "has no shards");
  expect_error(error_of(RW, INT64_MAX, 2, {{0, 0, INT64_MAX, 2, 0}}), "overflows int64");
}

// Brute force: paint every cell and compare with the sweep's verdict.
bool brute_force_ok(int64_t rows, int64_t cols, const std::vector<Shard>& shards) {
  std::vector<int> cells(static_cast<size_t>(rows * cols), 0);
  for (const auto& s : shards) {
    if (s.row_offset < 0 || s.col_offset < 0 || s.rows < 0 || s.cols < 0) return false;
    if (s.row_offset + s.rows > rows || s.col_offset + s.cols > cols) return false;
    for (int64_t r = s.row_offset; r < s.row_offset + s.rows; ++r) {
      for (int64_t c = s.col_offset; c < s.col_offset + s.cols; ++c) ++cells[r * cols + c];
    }
  }
  for (int v : cells) {
    if (v != 1) return false;
  }
  return !shards.empty();
}

// A random guillotine partition of [r0, r1) x [c0, c1): always a valid tiling.
void partition(std::mt19937_64& rng, int64_t r0, int64_t r1, int64_t c0, int64_t c1, int depth,
               std::vector<Shard>& out) {
  const bool split_rows = rng() % 2 == 0;
  const int64_t extent = split_rows ? r1 - r0 : c1 - c0;
  if (depth == 0 || extent < 2 || rng() % 4 == 0) {
    out.push_back({r0, c0, r1 - r0, c1 - c0, static_cast<int32_t>(rng() % 8)});
    return;
  }
  const int64_t cut = 1 + static_cast<int64_t>(rng() % static_cast<uint64_t>(extent - 1));
  if (split_rows) {
    partition(rng, r0, r0 + cut, c0, c1, depth - 1, out);
    partition(rng, r0 + cut, r1, c0, c1, depth - 1, out);
  } else {
    partition(rng, r0, r1, c0, c0 + cut, depth - 1, out);
    partition(rng, r0, r1, c0 + cut, c1, depth - 1, out);
  }
}

TEST(Validate, SweepAgreesWithBruteForceOnRandomLayouts) {
  std::mt19937_64 rng(20240511);
  int valid = 0, invalid = 0;
  for (int iter = 0; iter < 4000; ++iter) {
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 24);
    const int64_t cols = 1 + static_cast<int64_t>(rng() % 24);
    std::vector<Shard> shards;
    partition(rng, 0, rows, 0, cols, 6, shards);
    std::shuffle(shards.begin(), shards.end(), rng);
    // Damage about half of them: move, grow, shrink or drop a shard.
    if (iter % 2 == 1) {
      Shard& s = shards[rng() % shards.size()];
      switch (rng() % 5) {
        case 0: s.row_offset += 1 + static_cast<int64_t>(rng() % 3); break;
        case 1: s.cols += 1; break;
        case 2: s.rows = std::max<int64_t>(0, s.rows - 1); break;
        case 3: s.col_offset = std::max<int64_t>(0, s.col_offset - 1); break;
        default: shards.erase(shards.begin() + static_cast<long>(rng() % shards.size())); break;
      }
    }
    const bool expected = brute_force_ok(rows, cols, shards);
    bool got = true;
    try {
      validate_shards("emb", GRID, rows, cols, shards, 8);
    } catch (const InvalidArgument&) {
      got = false;
    }
    ASSERT_EQ(got, expected) << "iteration " << iter << " (" << rows << " x " << cols << ", " << shards.size()
                             << " shards)";
    (expected ? valid : invalid)++;
  }
  EXPECT_GT(valid, 1000);
  EXPECT_GT(invalid, 1000);
}

TEST(Validate, LargeGridIsFast) {
  // 256 x 256 = 65,536 shards through the 2-D sweep (the O(n^2) check DCP used to run took minutes here).
  std::vector<Shard> shards;
  for (int64_t i = 0; i < 256; ++i) {
    for (int64_t j = 0; j < 256; ++j) shards.push_back({i * 4, j * 4, 4, 4, static_cast<int32_t>((i + j) % 8)});
  }
  EXPECT_NO_THROW(validate_shards("grid", GRID, 1024, 1024, shards, 8));
  shards.back().cols = 5;
  EXPECT_THROW(validate_shards("grid", GRID, 1024, 1024, shards, 8), InvalidArgument);
}

}  // namespace
}  // namespace ettkit::sharding
