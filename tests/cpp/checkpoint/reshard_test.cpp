// Resharding reads (#20, first piece): the plan that fills a shard of one layout from the pieces of another
// reads every wanted element exactly once, from the right place, in as few contiguous runs as the layouts
// allow; replicated pieces are read once; a gap in the saved pieces or a box outside the tensor is an error
// naming it. Randomized over grid layouts (row-wise, column-wise, table-wise and block pieces) and boxes. And
// through the checkpointer: a C++ trainer's shards saved by 2 ranks load at 3 and at 1.
#include "checkpoint/reshard.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/error.h"
#include "test_scale.h"

using ettkit::InvalidArgument;
namespace ckd = ettkit::checkpoint::detail;

namespace {

using Shape = std::vector<int64_t>;

/// The global tensor's value at a flat index: the index itself (int64, 8 bytes an element).
std::vector<int64_t> values_of_box(const Shape& global, const ckd::Box& b) {
  std::vector<int64_t> out;
  std::vector<int64_t> idx(b.sizes.size(), 0);
  if (b.numel() == 0) return out;
  for (;;) {
    int64_t flat = 0;
    for (size_t d = 0; d < global.size(); ++d) flat = flat * global[d] + b.offsets[d] + idx[d];
    out.push_back(flat);
    size_t d = idx.size();
    while (d > 0 && ++idx[d - 1] == b.sizes[d - 1]) idx[--d] = 0;
    if (d == 0) break;
  }
  return out;
}

/// Every piece of a grid that cuts each dimension at `cuts[d]`.
std::vector<ckd::Box> grid(const Shape& global, const std::vector<std::vector<int64_t>>& cuts) {
  std::vector<ckd::Box> out{ckd::Box{}};
  for (size_t d = 0; d < global.size(); ++d) {
    std::vector<int64_t> edges = cuts[d];
    edges.insert(edges.begin(), 0);
    edges.push_back(global[d]);
    std::vector<ckd::Box> next;
    for (const ckd::Box& b : out) {
      for (size_t i = 0; i + 1 < edges.size(); ++i) {
        ckd::Box c = b;
        c.offsets.push_back(edges[i]);
        c.sizes.push_back(edges[i + 1] - edges[i]);
        next.push_back(c);
      }
    }
    out = std::move(next);
  }
  return out;
}

std::vector<int64_t> random_cuts(std::mt19937& rng, int64_t extent) {
  std::vector<int64_t> cuts;
  for (int64_t i = 1; i < extent; ++i) {
    if (rng() % 3 == 0) cuts.push_back(i);
  }
  return cuts;
}

struct Files {
  std::vector<std::vector<char>> bytes;  // per source
};

/// Saves `pieces` into per-source files (each piece at a random offset after the previous one).
std::vector<ckd::SavedPiece> save(std::mt19937& rng, const Shape& global, const std::vector<ckd::Box>& pieces,
                                  int sources, Files& files) {
  files.bytes.assign(static_cast<size_t>(sources), {});
  std::vector<ckd::SavedPiece> out;
  for (const ckd::Box& b : pieces) {
    int src = static_cast<int>(rng() % static_cast<unsigned>(sources));
    auto& f = files.bytes[static_cast<size_t>(src)];
    f.resize(f.size() + rng() % 17, '\xee');  // a header or another tensor before it
    std::vector<int64_t> v = values_of_box(global, b);
    uint64_t at = f.size();
    f.resize(f.size() + v.size() * 8);
    if (!v.empty()) std::memcpy(f.data() + at, v.data(), v.size() * 8);
    out.push_back({src, b, at});
  }
  return out;
}

std::vector<int64_t> execute(const std::vector<ckd::CopyRange>& plan, const Files& files, int64_t n) {
  std::vector<int64_t> dst(static_cast<size_t>(n), -1);
  for (const ckd::CopyRange& r : plan) {
    const auto& f = files.bytes.at(static_cast<size_t>(r.source));
    EXPECT_LE(r.src_offset + r.length, f.size());
    EXPECT_LE(r.dst_offset + r.length, static_cast<uint64_t>(n) * 8);
    std::memcpy(reinterpret_cast<char*>(dst.data()) + r.dst_offset, f.data() + r.src_offset, r.length);
  }
  return dst;
}

}  // namespace

TEST(Reshard, RandomLayoutsFillEveryWantedBoxExactlyOnce) {
  std::mt19937 rng(1234);
  const int trials = ettkit::testing::scaled_trials(400, 40);
  for (int t = 0; t < trials; ++t) {
    Shape global;
    int dims = static_cast<int>(rng() % 4);  // 0-d (a scalar) to 3-d
    for (int d = 0; d < dims; ++d) global.push_back(1 + static_cast<int64_t>(rng() % 7));
    std::vector<std::vector<int64_t>> cuts;
    for (int64_t e : global) cuts.push_back(random_cuts(rng, e));
    std::vector<ckd::Box> pieces = grid(global, cuts);
    std::shuffle(pieces.begin(), pieces.end(), rng);
    Files files;
    auto saved = save(rng, global, pieces, 1 + static_cast<int>(rng() % 4), files);
    for (int w = 0; w < 5; ++w) {
      ckd::Box want;
      for (int64_t e : global) {
        int64_t lo = static_cast<int64_t>(rng() % static_cast<unsigned>(e));
        int64_t hi = lo + 1 + static_cast<int64_t>(rng() % static_cast<unsigned>(e - lo));
        want.offsets.push_back(lo);
        want.sizes.push_back(hi - lo);
      }
      auto plan = ckd::plan_reshard("t", global, saved, want, 8);
      ASSERT_EQ(ckd::planned_bytes(plan), static_cast<uint64_t>(want.numel()) * 8) << "trial " << t;
      // Destination ranges are disjoint and in order: each element is read once.
      for (size_t i = 1; i < plan.size(); ++i) ASSERT_LE(plan[i - 1].dst_offset + plan[i - 1].length, plan[i].dst_offset);
      ASSERT_EQ(execute(plan, files, want.numel()), values_of_box(global, want)) << "trial " << t;
    }
  }
}

TEST(Reshard, RowWiseToFewerRanksReadsOneRunPerOverlappingPiece) {
  // 10 rows of 4 saved by 4 ranks (3, 3, 2, 2 rows); rank 0 of 2 wants rows 0-4: two runs, whole rows.
  Shape global{10, 4};
  Files files;
  std::mt19937 rng(7);
  std::vector<ckd::Box> pieces{{{0, 0}, {3, 4}}, {{3, 0}, {3, 4}}, {{6, 0}, {2, 4}}, {{8, 0}, {2, 4}}};
  std::vector<ckd::SavedPiece> saved;
  files.bytes.resize(4);
  for (int r = 0; r < 4; ++r) {
    std::vector<int64_t> v = values_of_box(global, pieces[static_cast<size_t>(r)]);
    files.bytes[static_cast<size_t>(r)].resize(v.size() * 8 + 16);
    std::memcpy(files.bytes[static_cast<size_t>(r)].data() + 16, v.data(), v.size() * 8);
    saved.push_back({r, pieces[static_cast<size_t>(r)], 16});
  }
  ckd::Box want{{0, 0}, {5, 4}};
  auto plan = ckd::plan_reshard("emb", global, saved, want, 8);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].source, 0);
  EXPECT_EQ(plan[0].length, 3u * 4 * 8);
  EXPECT_EQ(plan[1].source, 1);
  EXPECT_EQ(plan[1].src_offset, 16u);
  EXPECT_EQ(plan[1].length, 2u * 4 * 8);
  EXPECT_EQ(execute(plan, files, want.numel()), values_of_box(global, want));
  // Column-wise: one run per row (the columns are a slice of each row).
  ckd::Box cols{{0, 1}, {10, 2}};
  auto col_plan = ckd::plan_reshard("emb", global, saved, cols, 8);
  EXPECT_EQ(col_plan.size(), 10u);
  EXPECT_EQ(execute(col_plan, files, cols.numel()), values_of_box(global, cols));
}

TEST(Reshard, AReplicatedTensorIsReadFromOneCopyOnly) {
  Shape global{6, 3};
  Files files;
  std::mt19937 rng(3);
  ckd::Box all{{0, 0}, {6, 3}};
  auto saved = save(rng, global, {all, all, all}, 3, files);
  auto plan = ckd::plan_reshard("bias", global, saved, all, 8);
  ASSERT_EQ(plan.size(), 1u);
  EXPECT_EQ(plan[0].source, saved[0].source);
  EXPECT_EQ(execute(plan, files, all.numel()), values_of_box(global, all));
}

TEST(Reshard, AGapOrABoxOutsideTheTensorIsAnErrorNamingIt) {
  Shape global{8, 2};
  std::vector<ckd::SavedPiece> saved{{0, {{0, 0}, {3, 2}}, 0}, {1, {{5, 0}, {3, 2}}, 0}};  // rows 3-4 missing
  try {
    ckd::plan_reshard("table.weight", global, saved, {{0, 0}, {8, 2}}, 4);
    FAIL() << "a gap was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'table.weight': no saved piece holds offsets [3, 0] sizes [2, 2]"),
              std::string::npos) << e.what();
  }
  EXPECT_THROW(ckd::plan_reshard("t", global, saved, {{6, 0}, {3, 2}}, 4), InvalidArgument);  // past row 8
  EXPECT_THROW(ckd::plan_reshard("t", global, saved, {{0}, {8}}, 4), InvalidArgument);        // wrong rank
  std::vector<ckd::SavedPiece> negative{{0, {{-1, 0}, {3, 2}}, 0}};
  EXPECT_THROW(ckd::plan_reshard("t", global, negative, {{0, 0}, {1, 2}}, 4), InvalidArgument);
  EXPECT_TRUE(ckd::plan_reshard("t", global, saved, {{4, 0}, {0, 2}}, 4).empty());  // an empty shard reads nothing
}

// ---- the checkpointer: a C++ trainer's shards reshard through load_latest --------------------------------

namespace {

namespace ck = ettkit::checkpoint;

/// `world` ranks of one job in threads (HashStore), each running `fn(rank, checkpointer)`; with a memory tier
/// under `shm` when it is not empty (kept at close, as a crash would leave it).
template <class F>
void ranks(const std::string& dir, int world, F fn, const std::string& shm = {}) {
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::thread> t;
  for (int r = 0; r < world; ++r) {
    t.emplace_back([&, r] {
      ck::CheckpointerOptions o;
      o.directory = dir;
      o.use_current_recorder = false;
      o.rank = r;
      o.world_size = world;
      o.commit_timeout_s = 30;
      o.memory_tier.root = shm;
      o.memory_tier.job_id = "reshard-test";
      ck::AsyncCheckpointer c(o, world > 1 ? store : c10::intrusive_ptr<c10d::Store>());
      fn(r, c);
      c.close(/*discard_memory_tier=*/shm.empty());
    });
  }
  for (auto& x : t) x.join();
}

/// Rows [lo, hi) of the 10 x 4 table whose element (i, j) is 4i + j, named like the Python layer names a shard.
std::pair<std::string, at::Tensor> rows(int64_t lo, int64_t hi) {
  return {"table@" + std::to_string(lo) + ",0", at::arange(lo * 4, hi * 4, at::kFloat).reshape({hi - lo, 4})};
}

}  // namespace

TEST(Reshard, ACppTrainersShardsLoadAtAnotherWorldSize) {
  ettkit::testing::TempDir d;
  const std::string dir = d.str() + "/ck";
  // Saved by 2 ranks: rows 0-4 and 5-9, and a replicated bias.
  ranks(dir, 2, [](int r, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{rows(5 * r, 5 * r + 5), {"bias", at::full({3}, 7.0)}};
    ASSERT_TRUE(c.save(3, t, "extra-of-" + std::to_string(r)).wait());
  });
  // Loaded by 3 ranks: rows 0-3, 4-7, 8-9.
  const int64_t cut[4] = {0, 4, 8, 10};
  ranks(dir, 3, [&](int r, ck::AsyncCheckpointer& c) {
    auto [name, want] = rows(cut[r], cut[r + 1]);
    ck::NamedTensors t{{name, at::zeros_like(want)}, {"bias", at::zeros({3})}};
    auto got = c.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_EQ(got->step, 3);
    EXPECT_EQ(got->saved_world_size, 2);
    EXPECT_EQ(got->extra, "extra-of-0");  // the non-tensor state is old rank 0's
    EXPECT_TRUE(at::equal(t[0].second, want)) << r;
    EXPECT_TRUE(at::equal(t[1].second, at::full({3}, 7.0)));
    EXPECT_EQ(got->reshard_bytes_read, static_cast<uint64_t>(want.numel() * 4 + 3 * 4));
  });
  // And by 1 rank: the whole table.
  ranks(dir, 1, [&](int, ck::AsyncCheckpointer& c) {
    auto [name, want] = rows(0, 10);
    ck::NamedTensors t{{name, at::zeros_like(want)}, {"bias", at::zeros({3})}};
    auto got = c.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_TRUE(at::equal(t[0].second, want));
  });
  // A shard past the saved table is a mismatch naming it, not a partial load.
  ranks(dir, 1, [&](int, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{{"table@0,0", at::zeros({12, 4})}, {"bias", at::zeros({3})}};
    try {
      c.load_latest(t);
      ADD_FAILURE() << "a shard past the saved rows was loaded";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'table': no saved piece holds offsets [10, 0] sizes [2, 4]"),
                std::string::npos) << e.what();
    }
  });
}

TEST(Reshard, PerRankStateSavedWholeIsRefusedNotReplacedByOldRankZerosCopy) {
  ettkit::testing::TempDir d;
  const std::string dir = d.str() + "/ck";
  // Saved by 2 ranks: the table's rows, a replicated bias, and "noise": a tensor saved whole that differs per
  // rank (a per-rank RNG state, a tensor-parallel slice kept as a plain tensor).
  ranks(dir, 2, [](int r, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{rows(5 * r, 5 * r + 5), {"bias", at::full({3}, 7.0)}, {"noise", at::full({2}, 1.0 + r)}};
    ASSERT_TRUE(c.save(3, t, "").wait());
  });
  // Every header records the digest of each tensor saved whole, and none of a shard.
  for (int r = 0; r < 2; ++r) {
    auto idx = ckd::read_safetensors_index(dir + "/step-3/rank-" + std::to_string(r) + ".safetensors",
                                           *ckd::file_size(dir + "/step-3/rank-" + std::to_string(r) + ".safetensors"));
    at::Tensor noise = at::full({2}, 1.0 + r);
    EXPECT_EQ(idx.metadata.at("ettkit.xxh3.noise"), ckd::xxh3_of(noise.data_ptr(), 8));
    EXPECT_EQ(idx.metadata.count("ettkit.xxh3.bias"), 1u);
    EXPECT_EQ(idx.metadata.count("ettkit.xxh3.table@" + std::to_string(5 * r) + ",0"), 0u);
    EXPECT_EQ(idx.metadata.at("format"), "pt");
  }
  // At 3 ranks, and at 1, "noise" has no right value: refused naming it and the ranks, nothing copied.
  for (int world : {3, 1}) {
    ranks(dir, world, [&](int r, ck::AsyncCheckpointer& c) {
      const int64_t lo = world == 1 ? 0 : std::vector<int64_t>{0, 4, 8}[static_cast<size_t>(r)];
      const int64_t hi = world == 1 ? 10 : std::vector<int64_t>{4, 8, 10}[static_cast<size_t>(r)];
      auto [name, want] = rows(lo, hi);
      ck::NamedTensors t{{name, at::full_like(want, -1)}, {"bias", at::zeros({3})}, {"noise", at::zeros({2})}};
      try {
        c.load_latest(t);
        ADD_FAILURE() << "per-rank state was resharded";
      } catch (const InvalidArgument& e) {
        std::string m = e.what();
        EXPECT_NE(m.find("'noise' was saved whole and differs between old ranks 0 and 1"), std::string::npos) << m;
        EXPECT_EQ(m.find("'bias'"), std::string::npos) << m;  // the replica is fine
      }
      EXPECT_TRUE(at::equal(t[0].second, at::full_like(want, -1)));
      EXPECT_TRUE(at::equal(t[2].second, at::zeros({2})));
    });
  }
  // Told that old rank 0 is the authority (a DDP model's buffers): its copy, on every new rank.
  {
    ck::CheckpointerOptions o;
    o.directory = dir;
    o.use_current_recorder = false;
    o.reshard_whole_from_rank0 = true;
    ck::AsyncCheckpointer c(o);
    auto [name, want] = rows(0, 10);
    ck::NamedTensors t{{name, at::zeros_like(want)}, {"bias", at::zeros({3})}, {"noise", at::zeros({2})}};
    auto got = c.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_EQ(got->saved_world_size, 2);
    EXPECT_TRUE(at::equal(t[0].second, want));
    EXPECT_TRUE(at::equal(t[2].second, at::full({2}, 1.0)));  // old rank 0's
    c.close();
  }
  // At the world size that saved it, each rank gets its own copy back, as always.
  ranks(dir, 2, [&](int r, ck::AsyncCheckpointer& c) {
    auto [name, want] = rows(5 * r, 5 * r + 5);
    ck::NamedTensors t{{name, at::zeros_like(want)}, {"bias", at::zeros({3})}, {"noise", at::zeros({2})}};
    ASSERT_TRUE(c.load_latest(t));
    EXPECT_TRUE(at::equal(t[2].second, at::full({2}, 1.0 + r)));
  });
}

TEST(Reshard, AnotherLayoutAtTheSameWorldSizeReshardsAndKeepsEachRanksOwnState) {
  ettkit::testing::TempDir d;
  const std::string dir = d.str() + "/ck", shm = d.str() + "/shm";
  std::filesystem::create_directories(shm);
  // Saved by 2 ranks with rows 0-4 and 5-9, per-rank "noise" and extra; step 3 on disk, step 4 (the newer,
  // rows + 100) in the memory tier.
  auto save = [](int r, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{rows(5 * r, 5 * r + 5), {"noise", at::full({2}, 1.0 + r)}};
    ASSERT_TRUE(c.save(3, t, "extra-of-" + std::to_string(r)).wait());
    t[0].second.add_(100);
    ASSERT_TRUE(c.save(4, t, "extra-of-" + std::to_string(r), ck::Tier::kMemory).wait());
  };
  ranks(dir, 2, save, shm);
  // Loaded by 2 ranks cut elsewhere: rows 0-7 and 8-9 (a re-plan). Neither rank's rows are in its own file:
  // the memory tier, which holds only this rank's files, is passed over for the disk tier, which reshards;
  // "noise" and the extra are each rank's own, not old rank 0's.
  const int64_t cut[3] = {0, 8, 10};
  auto load_replanned = [&](int r, ck::AsyncCheckpointer& c) {
    auto [name, want] = rows(cut[r], cut[r + 1]);
    ck::NamedTensors t{{name, at::zeros_like(want)}, {"noise", at::zeros({2})}};
    auto got = c.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_EQ(got->step, 3);
    EXPECT_EQ(got->tier, ck::Tier::kDisk);
    EXPECT_NE(got->memory_fallback.find("holds its shards of another layout than the state's (first: 'table@"),
              std::string::npos) << got->memory_fallback;
    EXPECT_TRUE(got->resharded);
    EXPECT_EQ(got->saved_world_size, 2);
    EXPECT_EQ(got->extra, "extra-of-" + std::to_string(r));
    EXPECT_TRUE(at::equal(t[0].second, want)) << r;
    EXPECT_TRUE(at::equal(t[1].second, at::full({2}, 1.0 + r))) << r;
    EXPECT_EQ(got->reshard_bytes_read, static_cast<uint64_t>(want.numel() * 4 + 2 * 4));
  };
  ranks(dir, 2, load_replanned, shm);
  // Rows of another table size are still a mismatch naming the table, nothing copied.
  ranks(dir, 2, [&](int r, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{{"table@" + std::to_string(6 * r) + ",0", at::full({6, 4}, -1.0)}, {"noise", at::zeros({2})}};
    EXPECT_THROW(c.load_latest(t), InvalidArgument);
    EXPECT_TRUE(at::equal(t[0].second, at::full({6, 4}, -1.0)));
  });
  // Shards of a tensor that no old rank saved (state this rank would hold after a re-plan, but nobody saved)
  // are a mismatch naming it.
  ranks(dir, 2, [&](int r, ck::AsyncCheckpointer& c) {
    auto [name, want] = rows(5 * r, 5 * r + 5);
    ck::NamedTensors t{{name, at::zeros_like(want)}, {"noise", at::zeros({2})}, {"momentum@0,0", at::zeros({3, 4})}};
    try {
      c.load_latest(t);
      ADD_FAILURE() << "a shard nobody saved was loaded";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'momentum@0,0': no rank of the checkpoint saved a piece of 'momentum'"),
                std::string::npos) << e.what();
    }
    EXPECT_TRUE(at::equal(t[0].second, at::zeros_like(want)));
  });
  // In the saved layout every rank reads its own file only.
  ranks(dir, 2, [&](int r, ck::AsyncCheckpointer& c) {
    auto [name, want] = rows(5 * r, 5 * r + 5);
    ck::NamedTensors t{{name, at::zeros_like(want)}, {"noise", at::zeros({2})}};
    auto got = c.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_FALSE(got->resharded);
    EXPECT_TRUE(at::equal(t[0].second, want));
  });
  // A byte of old rank 1's file that rank 0 needs only for the re-cut rows is flipped: rank 0's check of the
  // chunk it reads from that file fails, every rank refuses the step together, and with no other valid step
  // (the memory step is of another layout) the load is an error naming the file; nothing is copied.
  {
    const std::string victim = dir + "/step-3/rank-1.safetensors";
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char b = 0;
    f.read(&b, 1);
    b = static_cast<char>(b ^ 0x5a);
    f.seekp(-1, std::ios::end);
    f.write(&b, 1);
  }
  auto load_corrupt = [&](int r, ck::AsyncCheckpointer& c) {
    auto [name, want] = rows(cut[r], cut[r + 1]);
    ck::NamedTensors t{{name, at::full_like(want, -1)}, {"noise", at::zeros({2})}};
    try {
      c.load_latest(t);
      ADD_FAILURE() << "a re-cut load read a corrupt chunk";
    } catch (const ck::CorruptCheckpoint& e) {
      EXPECT_NE(std::string(e.what()).find("rank-1.safetensors"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(at::equal(t[0].second, at::full_like(want, -1))) << r;
  };
  ranks(dir, 2, load_corrupt, shm);
}

TEST(Reshard, ATensorSavedInPiecesLoadsWholeAndOneSavedWholeLoadsAsShards) {
  ettkit::testing::TempDir d;
  const std::string dir = d.str() + "/ck", shm = d.str() + "/shm";
  std::filesystem::create_directories(shm);
  // Saved by 2 ranks: rows 0-4 and 5-9 of the table (step 3 on disk, step 4 in the memory tier) and a replica.
  ranks(dir, 2, [](int r, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{rows(5 * r, 5 * r + 5), {"bias", at::full({3}, 7.0)}};
    ASSERT_TRUE(c.save(3, t, "").wait());
    ASSERT_TRUE(c.save(4, t, "", ck::Tier::kMemory).wait());
  }, shm);
  const at::Tensor table = rows(0, 10).second;
  // Wanted whole on both ranks (a data-parallel table): every piece is read, from both files. The memory tier
  // holds each rank's own file only, so the disk tier reshards.
  ranks(dir, 2, [&](int r, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{{"table", at::zeros({10, 4})}, {"bias", at::zeros({3})}};
    auto got = c.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_EQ(got->step, 3);
    EXPECT_EQ(got->tier, ck::Tier::kDisk);
    EXPECT_NE(got->memory_fallback.find("(first: 'table'"), std::string::npos) << got->memory_fallback;
    EXPECT_TRUE(got->resharded);
    EXPECT_TRUE(at::equal(t[0].second, table)) << r;
    EXPECT_TRUE(at::equal(t[1].second, at::full({3}, 7.0)));
    EXPECT_EQ(got->reshard_bytes_read, static_cast<uint64_t>(40 * 4 + 3 * 4));
  }, shm);
  // And on one rank (a plain model, for evaluation).
  ranks(dir, 1, [&](int, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{{"table", at::zeros({10, 4})}, {"bias", at::zeros({3})}};
    auto got = c.load_latest(t);
    ASSERT_TRUE(got);
    EXPECT_EQ(got->saved_world_size, 2);
    EXPECT_TRUE(at::equal(t[0].second, table));
  });
  // Wanted whole at another size: not a corner of the saved table, a mismatch naming both shapes.
  ranks(dir, 2, [&](int, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{{"table", at::full({8, 4}, -1.0)}, {"bias", at::zeros({3})}};
    try {
      c.load_latest(t);
      ADD_FAILURE() << "an 8-row table was loaded from a 10-row one";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'table' is [8, 4] in the state; the checkpoint saved it sharded, its "
                                           "pieces making up [10, 4]"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(at::equal(t[0].second, at::full({8, 4}, -1.0)));
  });

  // Saved whole by one process: the table and the bias.
  const std::string one = d.str() + "/one";
  ranks(one, 1, [&](int, ck::AsyncCheckpointer& c) {
    ck::NamedTensors t{{"table", table.clone()}, {"bias", at::full({3}, 7.0)}};
    ASSERT_TRUE(c.save(5, t, "").wait());
  });
  // Wanted as rows 0-5 and 6-9 at 2 ranks, the global shape given: each rank reads its box of the one copy.
  const std::map<std::string, std::vector<int64_t>> global{{"table", {10, 4}}};
  const int64_t cut[3] = {0, 6, 10};
  ranks(one, 2, [&](int r, ck::AsyncCheckpointer& c) {
    auto [name, want] = rows(cut[r], cut[r + 1]);
    ck::NamedTensors t{{name, at::zeros_like(want)}, {"bias", at::zeros({3})}};
    auto got = c.load_latest(t, {}, {}, false, global);
    ASSERT_TRUE(got);
    EXPECT_TRUE(at::equal(t[0].second, want)) << r;
    EXPECT_EQ(got->reshard_bytes_read, static_cast<uint64_t>(want.numel() * 4 + 3 * 4));
  });
  // Without the global shape the box alone cannot say which tensor it belongs to; with another one it is not
  // this tensor. Both refused naming the table, nothing copied.
  const std::map<std::string, std::vector<int64_t>> larger{{"table", {12, 4}}};
  for (const auto* g : {static_cast<const std::map<std::string, std::vector<int64_t>>*>(nullptr), &larger}) {
    ranks(one, 2, [&](int r, ck::AsyncCheckpointer& c) {
      ck::NamedTensors t{{"table@" + std::to_string(6 * r) + ",0", at::full({6, 4}, -1.0)}, {"bias", at::zeros({3})}};
      try {
        c.load_latest(t, {}, {}, false, g ? *g : std::map<std::string, std::vector<int64_t>>{});
        ADD_FAILURE() << "rows of a tensor saved whole were read without checking its global shape";
      } catch (const InvalidArgument& e) {
        const std::string want = g ? "'table' is [12, 4] in the state (sharded); the checkpoint saved it whole as "
                                     "[10, 4]"
                                   : "'table' was saved whole and the state holds it sharded";
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
      EXPECT_TRUE(at::equal(t[0].second, at::full({6, 4}, -1.0)));
    });
  }
}
