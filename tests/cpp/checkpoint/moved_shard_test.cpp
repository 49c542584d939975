// The moved verdict (step_format.h, first_moved_shard): the one rule the C++ loader and Python's skeleton
// check (_restore.py) ask of a rank's shards. Each case is one way a step saved under another layout differs
// from the state, and the ways that are not a move.
#include <gtest/gtest.h>

#include <string>

#include "ettkit/checkpoint/step_format.h"

using ettkit::checkpoint::first_moved_shard;
using ettkit::checkpoint::ShardBox;
using ettkit::checkpoint::ShardLayout;

namespace {

ShardLayout rows(const std::string& key, std::initializer_list<int64_t> starts, int64_t n = 4) {
  ShardLayout l;
  std::vector<ShardBox>& boxes = l.sharded[key];
  for (int64_t s : starts) boxes.push_back({{s, 0}, {n, 8}, std::nullopt});
  return l;
}

}  // namespace

TEST(MovedShard, TheSameBoxesInAnyOrderAreNotAMove) {
  EXPECT_EQ(first_moved_shard(rows("t", {0, 4}), rows("t", {4, 0}), false), "");
  ShardLayout whole;
  whole.whole = {"w"};
  EXPECT_EQ(first_moved_shard(whole, whole, false), "");
}

TEST(MovedShard, ABoxAtOtherOffsetsOrOfAnotherSizeIsNamed) {
  EXPECT_EQ(first_moved_shard(rows("t", {0}), rows("t", {4}), false), "t@4,0");
  EXPECT_EQ(first_moved_shard(rows("t", {0}, 4), rows("t", {0}, 2), false), "t@0,0");
  // A box the step holds beyond the wanted ones moved too, partial or not: the key is wanted.
  EXPECT_EQ(first_moved_shard(rows("t", {0, 4}), rows("t", {0}), true), "t@4,0");
}

TEST(MovedShard, PlacementsAreComparedWhereBothSidesRecordThem) {
  ShardLayout a = rows("t", {0}), b = rows("t", {0});
  a.sharded["t"][0].placement = "S(0)";
  EXPECT_EQ(first_moved_shard(a, b, false), "t@0,0");  // one side records none (Python's None): differs
  b.sharded["t"][0].placement = "S(0)";
  EXPECT_EQ(first_moved_shard(a, b, false), "");
  b.sharded["t"][0].placement = "R, S(0)";
  EXPECT_EQ(first_moved_shard(a, b, false), "t@0,0");
}

TEST(MovedShard, AKeyOnlyOneSideListsIsAMoveUnlessAPartialLoadLeavesIt) {
  ShardLayout none;
  EXPECT_EQ(first_moved_shard(none, rows("t", {0}), false), "t@0,0");
  EXPECT_EQ(first_moved_shard(rows("t", {0}), none, false), "t@0,0");
  EXPECT_EQ(first_moved_shard(rows("t", {0}), none, true), "");
  // A key this rank holds no shard of (Python's skeletons list it): named by the key.
  ShardLayout empty;
  empty.sharded["t"];
  EXPECT_EQ(first_moved_shard(none, empty, false), "t");
  EXPECT_EQ(first_moved_shard(empty, empty, false), "");
}

TEST(MovedShard, ATensorWantedWholeThatTheStepHoldsInPiecesIsAMove) {
  ShardLayout wanted;
  wanted.whole = {"t"};
  EXPECT_EQ(first_moved_shard(rows("t", {0}), wanted, true), "t");
  ShardLayout both = rows("t", {0});
  both.whole = {"t"};  // the step also holds it whole: read from there
  EXPECT_EQ(first_moved_shard(both, wanted, true), "");
}
