// The replica rule and a step's pieces (ettkit/checkpoint/step_pieces.h, step_tensors): the one function the
// C++ loader's resharding plan and both Python step readers read a step through. Which copy of a tensor saved
// whole is read and when it is per-rank state; which box of a replicated piece is read; and a hostile index
// (overlapping boxes, a box past 2^63, a hole, a replica of another size, a key saved both ways, pieces of
// different dtypes) refused with CorruptData naming the tensor, the old rank and what would be valid.
#include "ettkit/checkpoint/step_pieces.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "ettkit/checkpoint/shard_names.h"
#include "ettkit/common/error.h"

using ettkit::CorruptData;
using ettkit::checkpoint::assemble_pieces;
using ettkit::checkpoint::SafetensorsEntry;
using ettkit::checkpoint::SafetensorsIndex;
using ettkit::checkpoint::step_tensors;
using ettkit::checkpoint::StepTensor;

namespace {

/// A rank's index: F32 entries laid out one after the other from data offset 100.
struct Rank {
  SafetensorsIndex index;
  uint64_t at = 0;
  Rank() { index.data_offset = 100; }
  Rank& add(const std::string& name, std::vector<int64_t> shape, const std::string& dtype = "F32") {
    uint64_t n = 4;
    for (int64_t s : shape) n *= static_cast<uint64_t>(s);
    index.tensors[name] = SafetensorsEntry{name, dtype, std::move(shape), at, at + n};
    at += n;
    return *this;
  }
  Rank& digest(const std::string& name, const std::string& d) {
    index.metadata[ettkit::checkpoint::kWholeTensorDigestPrefix + name] = d;
    return *this;
  }
};

std::map<std::string, StepTensor> tensors_of(const std::vector<Rank>& ranks) {
  std::vector<const SafetensorsIndex*> p;
  for (const Rank& r : ranks) p.push_back(&r.index);
  return step_tensors(p, "ckpt/step-7");
}

std::string refusal(const std::vector<Rank>& ranks) {
  try {
    tensors_of(ranks);
  } catch (const CorruptData& e) {
    return e.what();
  }
  return "(accepted)";
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST(StepPieces, AReplicatedBoxIsReadOnceFromTheLowestRankAndPiecesTileTheTensor) {
  // A 2 x 2 mesh's (Replicate, Shard(0)) pieces: ranks 2 and 3 repeat ranks 0 and 1's rows.
  std::vector<Rank> r(4);
  r[0].add("w@0,0", {2, 3});
  r[1].add("w@2,0", {2, 3});
  r[2].add("w@0,0", {2, 3});
  r[3].add("pad", {1}).add("w@2,0", {2, 3});
  auto t = tensors_of(r);
  const StepTensor& w = t.at("w");
  EXPECT_TRUE(w.sharded);
  EXPECT_EQ(w.shape, (std::vector<int64_t>{4, 3}));
  ASSERT_EQ(w.pieces.size(), 2u);
  EXPECT_EQ(w.pieces[0].rank, 0);
  EXPECT_EQ(w.pieces[1].rank, 1);
  EXPECT_EQ(w.pieces[1].offsets, (std::vector<int64_t>{2, 0}));
  EXPECT_EQ(w.pieces[1].begin, 100u);  // absolute in the file: data offset + the entry's begin
  EXPECT_EQ(w.pieces[1].end, 124u);
  // An uneven split's empty last box counts towards nothing but the extent.
  std::vector<Rank> uneven(3);
  uneven[0].add("e@0", {3});
  uneven[1].add("e@3", {2});
  uneven[2].add("e@5", {0});
  EXPECT_EQ(tensors_of(uneven).at("e").pieces.size(), 2u);
}

TEST(StepPieces, AWholeTensorIsTheLowestRanksCopyAndDigestsSayWhetherItIsAReplica) {
  std::vector<Rank> r(3);
  r[0].add("b", {4}).digest("b", "aa").add("rng", {2}).digest("rng", "01").add("old", {1});
  r[1].add("b", {4}).digest("b", "aa").add("rng", {2}).digest("rng", "02").add("old", {1});
  r[2].add("b", {4}).digest("b", "aa").add("rng", {2}).digest("rng", "03").add("old", {2});
  auto t = tensors_of(r);
  EXPECT_FALSE(t.at("b").sharded);
  ASSERT_EQ(t.at("b").pieces.size(), 1u);
  EXPECT_EQ(t.at("b").pieces[0].rank, 0);
  EXPECT_FALSE(t.at("b").differs);
  EXPECT_FALSE(t.at("b").unproven);
  ASSERT_TRUE(t.at("rng").differs);
  EXPECT_EQ(*t.at("rng").differs, std::make_pair(0, 1));  // the first copy and the first that differs from it
  // Without digests (an older ettkit): unproven, and another shape is per-rank state whatever the bytes.
  EXPECT_TRUE(t.at("old").unproven);
  ASSERT_TRUE(t.at("old").differs);
  EXPECT_EQ(*t.at("old").differs, std::make_pair(0, 2));
  // A whole tensor one rank lacks is still read from the lowest rank that has it.
  std::vector<Rank> some(2);
  some[1].add("x", {3});
  EXPECT_EQ(tensors_of(some).at("x").pieces.at(0).rank, 1);
}

TEST(StepPieces, OverlappingBoxesAreRefusedNamingBoth) {
  std::vector<Rank> r(2);
  r[0].add("w@0,0", {3, 5});
  r[1].add("w@2,0", {2, 5});  // rows 2..4: row 2 is in both
  std::string m = refusal(r);
  EXPECT_TRUE(has(m, "step 'ckpt/step-7': the saved pieces of 'w' hold 25 elements of its [4, 5] (20): pieces "
                     "overlap or are missing")) << m;
  // As many elements as the tensor, but two boxes share some and some are in none.
  std::vector<Rank> same(3);
  same[0].add("g@0,0", {2, 2});
  same[1].add("g@1,1", {2, 2});
  same[2].add("g@0,2", {1, 1});  // 9 elements in all; (1, 1) is in two boxes and (2, 0) in none
  m = refusal(same);
  EXPECT_TRUE(has(m, "the saved pieces of 'g' at offsets ")) << m;
  EXPECT_TRUE(has(m, "overlap, so part of [3, 3] is missing")) << m;
}

TEST(StepPieces, AMissingBoxABoxBeyondTwoToThe63AndAnotherBoxAtTheSameOffsetsAreRefused) {
  std::vector<Rank> hole(2);
  hole[0].add("w@0,0", {2, 4});
  hole[1].add("w@2,2", {2, 2});  // rows 2..3, columns 0..1 saved by no rank
  EXPECT_TRUE(has(refusal(hole), "the saved pieces of 'w' hold 12 elements of its [4, 4] (16)"));
  std::vector<Rank> past(1);
  past[0].add("t@0,999999999999999999", {0, INT64_MAX});
  std::string m = refusal(past);
  EXPECT_TRUE(has(m, "'t@0,999999999999999999' in old rank 0's file ends beyond 2^63 in dimension 1")) << m;
  std::vector<Rank> replica(2);
  replica[0].add("w@0", {4});
  replica[1].add("w@0", {3});
  m = refusal(replica);
  EXPECT_TRUE(has(m, "'w@0' is [3] in old rank 1's file and [4] in old rank 0's: two boxes at the same offsets "
                     "must be the same box")) << m;
}

TEST(StepPieces, AKeySavedBothWaysPiecesThatDisagreeAndOffsetsOfAnotherRankAreRefused) {
  std::vector<Rank> both(2);
  both[0].add("w@0", {2});
  both[1].add("w", {4});
  std::string m = refusal(both);
  EXPECT_TRUE(has(m, "'w' is saved whole in old rank 1's file ('w') and in pieces in old rank 0's")) << m;
  std::vector<Rank> dtypes(2);
  dtypes[0].add("w@0", {2});
  dtypes[1].add("w@2", {2}, "BF16");
  m = refusal(dtypes);
  EXPECT_TRUE(has(m, "'w@2' is BF16 of 1 dimensions in old rank 1's file; old rank 0's pieces of 'w' are F32")) << m;
  std::vector<Rank> offsets(1);
  offsets[0].add("w@0,0", {4});
  m = refusal(offsets);
  EXPECT_TRUE(has(m, "'w@0,0' in old rank 0's file has 2 offsets for a tensor of 1 dimensions [4]")) << m;
}

TEST(StepPieces, AssemblyPutsAColumnSplitTogetherWithTheLoadersPlan) {
  // A [2, 3] tensor of int32 values 0..5 split by columns [0, 2) and [2, 3), put together row-major.
  std::vector<Rank> r(2);
  r[0].add("w@0,0", {2, 2});
  r[1].add("w@0,2", {2, 1});
  StepTensor w = tensors_of(r).at("w");
  const int32_t left[] = {0, 1, 3, 4}, right[] = {2, 5};
  std::vector<std::string_view> data{{reinterpret_cast<const char*>(left), sizeof left},
                                     {reinterpret_cast<const char*>(right), sizeof right}};
  int32_t out[6] = {-1, -1, -1, -1, -1, -1};
  assemble_pieces("w", w, 4, data, reinterpret_cast<char*>(out));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out[i], i);
  data.pop_back();
  EXPECT_THROW(assemble_pieces("w", w, 4, data, reinterpret_cast<char*>(out)), ettkit::InvalidArgument);
}
