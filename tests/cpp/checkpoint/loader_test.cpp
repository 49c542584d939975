// The Loader (src/checkpoint/loader.h, read_plan.h): each candidate load_latest considers reads and decodes its
// manifest once, whatever its plan (the job's own world size, a prefetched step, a step to reshard). Counted
// with manifest_decodes(), which counts every decode_manifest call of the process: a load decodes the
// manifests of one directory listing (load_candidates) and then one per candidate, so a second decode
// anywhere on the way fails these tests.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <fstream>
#include <thread>

#include "checkpoint/storage.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"

using ettkit::testing::TempDir;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

NamedTensors state(int64_t step) {
  return {{"w", at::full({4096}, static_cast<double>(step))}, {"i", at::arange(100, at::kLong) * step}};
}
NamedTensors zeros() { return {{"w", at::zeros({4096})}, {"i", at::zeros({100}, at::kLong)}}; }

CheckpointerOptions options(const std::string& dir, bool read_only = false) {
  CheckpointerOptions o;
  o.directory = dir;
  o.use_current_recorder = false;
  o.read_only = read_only;
  return o;
}

/// The manifest decodes (of every thread) while `fn` runs.
template <class F>
uint64_t decodes_during(F fn) {
  const uint64_t before = ckd::manifest_decodes();
  fn();
  return ckd::manifest_decodes() - before;
}

/// The manifest decodes of one listing of `dir` (what load_latest's candidate list costs).
uint64_t listing_decodes(const std::string& dir) {
  return decodes_during([&] { ckd::load_candidates(dir); });
}

/// Flips one byte of `path` at `offset`.
void flip(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(offset);
  f.write(&c, 1);
}

}  // namespace

TEST(Loader, EachDiskCandidateDecodesItsManifestOnce) {
  TempDir d;
  const std::string dir = d.str() + "/ck";
  {
    AsyncCheckpointer w(options(dir));
    for (int64_t s = 1; s <= 3; ++s) ASSERT_TRUE(w.save(s, state(s)).wait());
    w.close();
  }
  flip(dir + "/step-3/rank-0.safetensors", 200);  // step 3 is refused, step 2 loads: two candidates
  AsyncCheckpointer r(options(dir, /*read_only=*/true));
  const uint64_t listing = listing_decodes(dir);
  NamedTensors t = zeros();
  std::optional<LoadResult> got;
  const uint64_t decodes = decodes_during([&] { got = r.load_latest(t); });
  ASSERT_TRUE(got);
  EXPECT_EQ(got->step, 2);
  EXPECT_EQ(got->skipped_steps, std::vector<int64_t>{3});
  EXPECT_EQ(decodes, listing + 2) << "one listing, then one decode per candidate considered (steps 3 and 2)";
  EXPECT_TRUE(at::equal(t[0].second, state(2)[0].second));
}

TEST(Loader, APrefetchedCandidateDecodesItsManifestOnceAtLoad) {
  TempDir d;
  const std::string dir = d.str() + "/ck";
  {
    AsyncCheckpointer w(options(dir));
    ASSERT_TRUE(w.save(5, state(5)).wait());
    w.close();
  }
  AsyncCheckpointer r(options(dir, /*read_only=*/true));
  EXPECT_EQ(r.prefetch(), std::vector<int64_t>{5});
  ASSERT_TRUE(r.wait_prefetch());
  const uint64_t listing = listing_decodes(dir);
  NamedTensors t = zeros();
  std::optional<LoadResult> got;
  const uint64_t decodes = decodes_during([&] { got = r.load_latest(t); });
  ASSERT_TRUE(got);
  EXPECT_TRUE(got->prefetched);
  EXPECT_EQ(decodes, listing + 1) << "the manifest on disk is compared with the prefetched one from one decode";
  EXPECT_TRUE(at::equal(t[1].second, state(5)[1].second));
}

namespace {
/// Step 7 saved by 3 ranks, each with rows [2r, 2r + 2) of a 6 x 4 table filled with r.
void save_by_three_ranks(const std::string& dir) {
  constexpr int kOldWorld = 3;
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> ranks;
  for (int r = 0; r < kOldWorld; ++r) {
    ranks.emplace_back([&, r] {
      CheckpointerOptions o = options(dir);
      o.rank = r;
      o.world_size = kOldWorld;
      o.commit_timeout_s = 30;
      AsyncCheckpointer c(o, store);
      NamedTensors t{{"table@" + std::to_string(2 * r) + ",0", at::full({2, 4}, static_cast<float>(r))}};
      EXPECT_TRUE(c.save(7, t).wait());
      c.close();
    });
  }
  for (auto& x : ranks) x.join();
}
}  // namespace

TEST(Loader, AReshardCandidateDecodesItsManifestOnceForEveryOldRank) {
  TempDir d;
  const std::string dir = d.str() + "/ck";
  save_by_three_ranks(dir);
  AsyncCheckpointer one(options(dir, /*read_only=*/true));
  const uint64_t listing = listing_decodes(dir);
  NamedTensors t{{"table@0,0", at::zeros({6, 4})}};
  std::optional<LoadResult> got;
  const uint64_t decodes = decodes_during([&] { got = one.load_latest(t); });
  ASSERT_TRUE(got);
  EXPECT_EQ(got->saved_world_size, 3);
  EXPECT_EQ(decodes, listing + 1) << "the old ranks' files are opened with the one decoded manifest";
  EXPECT_EQ(t[0].second[5][0].item<float>(), 2.0f);
}

// The one executor runs a reshard plan into a destination it cannot read in place (strided) through a
// contiguous copy, as it does a same-world plan (checkpointer_test's non-contiguous tensor).
TEST(Loader, AReshardPlanFillsAStridedDestination) {
  TempDir d;
  const std::string dir = d.str() + "/ck";
  save_by_three_ranks(dir);
  AsyncCheckpointer one(options(dir, /*read_only=*/true));
  NamedTensors t{{"table@0,0", at::zeros({4, 6}).t()}};
  ASSERT_FALSE(t[0].second.is_contiguous());
  auto got = one.load_latest(t);
  ASSERT_TRUE(got);
  at::Tensor want = at::arange(6, at::kFloat).floor_divide(2).reshape({6, 1}).expand({6, 4});
  EXPECT_TRUE(at::equal(t[0].second, want)) << t[0].second;
}
