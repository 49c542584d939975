// The builder against TorchRec's published expectations, strict vs compat behaviour, the per-rank index
// and the metadata hash.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ett/test_dir.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/recorder.h"
#include "ettkit/sharding/codec.h"
#include "ettkit/sharding/metadata.h"
#include "sharding_test_util.h"

namespace ettkit::sharding {
namespace {

using testing::build;
using testing::iota_ranks;
using testing::make_table;

struct Expected {
  int64_t ro, co, rows, cols;
  int32_t rank;
  std::string placement;
};

void expect_shards(const GlobalMetadata& md, size_t table, const std::vector<Expected>& want) {
  auto got = md.shards(table);
  ASSERT_EQ(got.size(), want.size()) << md.plan().table(table).name;
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(md.plan().table(table).name + " shard " + std::to_string(i));
    EXPECT_EQ(got[i].row_offset, want[i].ro);
    EXPECT_EQ(got[i].col_offset, want[i].co);
    EXPECT_EQ(got[i].rows, want[i].rows);
    EXPECT_EQ(got[i].cols, want[i].cols);
    EXPECT_EQ(got[i].rank, want[i].rank);
    EXPECT_EQ(md.placement(got[i]), want[i].placement);
  }
}

// torchrec/distributed/tests/test_sharding_plan.py::test_construct_module_sharding_plan: world 32, local 8,
// six 1024 x 256 tables, device cuda. Expected values are written out as TorchRec's test lists them.
TEST(Builder, TorchRec32RankMixedPlan) {
  std::vector<TableSpec> tables = {
      make_table("table_0", 1024, 256, ShardingType::kDataParallel),
      make_table("table_1", 1024, 256, ShardingType::kTableWise, {1}),
      make_table("table_2", 1024, 256, ShardingType::kRowWise),
      make_table("table_3", 1024, 256, ShardingType::kColumnWise, {8, 9}),
      make_table("table_4", 1024, 256, ShardingType::kTableRowWise, iota_ranks(24, 8)),
      make_table("table_5", 1024, 256, ShardingType::kGridShard, iota_ranks(0, 16)),
  };
  auto md = build(tables, 32, 8, DeviceType::kCuda, /*strict=*/true);
  ASSERT_EQ(md.num_tables(), 6u);

  std::vector<Expected> dp;
  auto cuda = [](int r) { return "rank:" + std::to_string(r) + "/cuda:" + std::to_string(r % 8); };
  for (int r = 0; r < 32; ++r) dp.push_back({0, 0, 1024, 256, r, cuda(r)});
  expect_shards(md, 0, dp);

  expect_shards(md, 1, {{0, 0, 1024, 256, 1, "rank:1/cuda:1"}});

  std::vector<Expected> rw;
  for (int r = 0; r < 32; ++r) rw.push_back({32 * r, 0, 32, 256, r, cuda(r)});
  expect_shards(md, 2, rw);
  EXPECT_EQ(md.placement(md.shards(2)[8]), "rank:8/cuda:0");
  EXPECT_EQ(md.placement(md.shards(2)[31]), "rank:31/cuda:7");

  expect_shards(md, 3, {{0, 0, 1024, 128, 8, "rank:8/cuda:0"}, {0, 128, 1024, 128, 9, "rank:9/cuda:1"}});

  expect_shards(md, 4, {{0, 0, 128, 256, 24, "rank:24/cuda:0"},
                        {128, 0, 128, 256, 25, "rank:25/cuda:1"},
                        {256, 0, 128, 256, 26, "rank:26/cuda:2"},
                        {384, 0, 128, 256, 27, "rank:27/cuda:3"},
                        {512, 0, 128, 256, 28, "rank:28/cuda:4"},
                        {640, 0, 128, 256, 29, "rank:29/cuda:5"},
                        {768, 0, 128, 256, 30, "rank:30/cuda:6"},
                        {896, 0, 128, 256, 31, "rank:31/cuda:7"}});

  expect_shards(md, 5, {{0, 0, 128, 128, 0, "rank:0/cuda:0"},
                        {128, 0, 128, 128, 1, "rank:1/cuda:1"},
                        {256, 0, 128, 128, 2, "rank:2/cuda:2"},
                        {384, 0, 128, 128, 3, "rank:3/cuda:3"},
                        {512, 0, 128, 128, 4, "rank:4/cuda:4"},
                        {640, 0, 128, 128, 5, "rank:5/cuda:5"},
                        {768, 0, 128, 128, 6, "rank:6/cuda:6"},
                        {896, 0, 128, 128, 7, "rank:7/cuda:7"},
                        {0, 128, 128, 128, 8, "rank:8/cuda:0"},
                        {128, 128, 128, 128, 9, "rank:9/cuda:1"},
                        {256, 128, 128, 128, 10, "rank:10/cuda:2"},
                        {384, 128, 128, 128, 11, "rank:11/cuda:3"},
                        {512, 128, 128, 128, 12, "rank:12/cuda:4"},
                        {640, 128, 128, 128, 13, "rank:13/cuda:5"},
                        {768, 128, 128, 128, 14, "rank:14/cuda:6"},
                        {896, 128, 128, 128, 15, "rank:15/cuda:7"}});

  // TorchRec's test accepts the first-rank-only form of table_row_wise ranks too ("first rank").
  tables[4].ranks = {24};
  auto md2 = build(tables, 32, 8, DeviceType::kCuda, true);
  EXPECT_EQ(md2.hash(), md.hash());
}

TEST(Builder, TorchRecColumnWiseTests) {
  // test_column_wise: 4096 x 64 on ranks [0, 1] -> 2 x [4096, 32].
  auto md = build({make_table("table_0", 4096, 64, ShardingType::kColumnWise, {0, 1})}, 2, 2, DeviceType::kCuda, true);
  expect_shards(md, 0, {{0, 0, 4096, 32, 0, "rank:0/cuda:0"}, {0, 32, 4096, 32, 1, "rank:1/cuda:1"}});
  // test_column_wise_device_types geometry: 1024 x 64 on 4 ranks -> 4 x 16 (placements: ours follow ranks).
  md = build({make_table("table_0", 1024, 64, ShardingType::kColumnWise, {0, 1, 2, 3})}, 4, 4, DeviceType::kCuda, true);
  expect_shards(md, 0, {{0, 0, 1024, 16, 0, "rank:0/cuda:0"},
                        {0, 16, 1024, 16, 1, "rank:1/cuda:1"},
                        {0, 32, 1024, 16, 2, "rank:2/cuda:2"},
                        {0, 48, 1024, 16, 3, "rank:3/cuda:3"}});
  // test_column_wise_uneven_division_error: 65 columns over 2 ranks.
  try {
    build({make_table("table_0", 4096, 65, ShardingType::kColumnWise, {0, 1})}, 2, 2);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("column dim of 65 cannot be evenly divided across 2 ranks"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("table 'table_0'"), std::string::npos);
  }
}

TEST(Builder, ColumnBlockExamplesFromReference) {
  // 1000 x 64 with column block 32: 2 shards at column 0 and 32, on the given ranks (which may repeat).
  auto md = build({make_table("t", 1000, 64, ShardingType::kColumnWise, {3, 3}, 32)}, 4, 4);
  expect_shards(md, 0, {{0, 0, 1000, 32, 3, "rank:3/cpu"}, {0, 32, 1000, 32, 3, "rank:3/cpu"}});
  // TorchRec test_twcw_unbalanced_perf_host: 10 column blocks on 8 ranks of host 1.
  std::vector<int32_t> ranks = {8, 9, 10, 11, 12, 13, 14, 15, 8, 9};
  md = build({make_table("table_0", 100, 320, ShardingType::kTableColumnWise, ranks, 32)}, 16, 8, DeviceType::kCuda,
             true);
  ASSERT_EQ(md.shards(0).size(), 10u);
  for (int j = 0; j < 10; ++j) {
    EXPECT_EQ(md.shards(0)[j].col_offset, 32 * j);
    EXPECT_EQ(md.shards(0)[j].rank, ranks[j]);
  }
  EXPECT_EQ(md.local_shards(8).size(), 2u);
  EXPECT_EQ(md.local_shards(0).size(), 0u);
  // 100 columns, block 10 given as TorchRec's min_partition = 10 search result (20): 5 shards.
  md = build({make_table("t", 8, 100, ShardingType::kColumnWise, {0, 1, 2, 3, 4}, 20)}, 5, 5);
  EXPECT_EQ(md.shards(0).size(), 5u);
}

TEST(Builder, TableRowWiseHostMapping) {
  // 1000 x 64, L = 4, host 1 -> ranks 4..7 with 250 rows each.
  auto md = build({make_table("t", 1000, 64, ShardingType::kTableRowWise, {4})}, 8, 4, DeviceType::kCuda);
  expect_shards(md, 0, {{0, 0, 250, 64, 4, "rank:4/cuda:0"},
                        {250, 0, 250, 64, 5, "rank:5/cuda:1"},
                        {500, 0, 250, 64, 6, "rank:6/cuda:2"},
                        {750, 0, 250, 64, 7, "rank:7/cuda:3"}});
}

TEST(Builder, GridOrderIsColumnBlockMajor) {
  // 1000 x 64, L = 4, block 32, hosts [0, 1]: ranks 0..3 on column 0, ranks 4..7 on column 32.
  auto md = build({make_table("t", 1000, 64, ShardingType::kGridShard, iota_ranks(0, 8), 32)}, 8, 4);
  expect_shards(md, 0, {{0, 0, 250, 32, 0, "rank:0/cpu"},
                        {250, 0, 250, 32, 1, "rank:1/cpu"},
                        {500, 0, 250, 32, 2, "rank:2/cpu"},
                        {750, 0, 250, 32, 3, "rank:3/cpu"},
                        {0, 32, 250, 32, 4, "rank:4/cpu"},
                        {250, 32, 250, 32, 5, "rank:5/cpu"},
                        {500, 32, 250, 32, 6, "rank:6/cpu"},
                        {750, 32, 250, 32, 7, "rank:7/cpu"}});
  // With L = 3 each block's rows are 334, 334, 332 (and the global size stays 1000, not 3 x 334).
  md = build({make_table("t", 1000, 64, ShardingType::kGridShard, {3, 4, 5, 0, 1, 2}, 32)}, 6, 3);
  auto s = md.shards(0);
  EXPECT_EQ(s[0].rows, 334);
  EXPECT_EQ(s[2].rows, 332);
  EXPECT_EQ(s[2].row_offset, 668);
  EXPECT_EQ(s[0].rank, 3);
  EXPECT_EQ(s[3].rank, 0);
  EXPECT_EQ(s[3].col_offset, 32);
}

TEST(Builder, RowWiseOverSubsetAndBuckets) {
  auto md = build({make_table("t", 10, 4, ShardingType::kRowWise, {3, 1})}, 4, 2);
  expect_shards(md, 0, {{0, 0, 5, 4, 3, "rank:3/cpu"}, {5, 0, 5, 4, 1, "rank:1/cpu"}});
  TableSpec z = make_table("zch", 100, 8, ShardingType::kRowWise);
  z.num_buckets = 10;
  md = build({z}, 8, 4, DeviceType::kCpu, true);
  std::vector<int64_t> rows;
  for (const auto& s : md.shards(0)) rows.push_back(s.rows);
  EXPECT_EQ(rows, (std::vector<int64_t>{20, 20, 10, 10, 10, 10, 10, 10}));
}

TEST(Builder, FiveRowsOverEightRanksKeepsEmptyShards) {
  auto md = build({make_table("t", 5, 16, ShardingType::kRowWise)}, 8, 8, DeviceType::kCpu, true);
  auto s = md.shards(0);
  ASSERT_EQ(s.size(), 8u);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(s[r].rank, r);
    EXPECT_EQ(s[r].rows, r < 5 ? 1 : 0);
    EXPECT_EQ(s[r].row_offset, r < 5 ? r : 5);
  }
  EXPECT_EQ(md.local_shards(7).size(), 1u);  // the empty shard is still rank 7's
}

TEST(Builder, StrictRejectsZeroRowsCompatReproduces) {
  try {
    build({make_table("user_id", 0, 64, ShardingType::kRowWise)}, 4, 4, DeviceType::kCpu, true);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("row_wise plan for table 'user_id' has 0 rows; a row_wise table needs at least 1 row"),
              std::string::npos)
        << e.message();
  }
  EXPECT_THROW(build({make_table("t", 0, 8, ShardingType::kTableWise, {0})}, 2, 2, DeviceType::kCpu, true),
               InvalidArgument);
  EXPECT_THROW(build({make_table("t", 8, 0, ShardingType::kDataParallel)}, 2, 2, DeviceType::kCpu, true),
               InvalidArgument);
  auto md = build({make_table("user_id", 0, 64, ShardingType::kRowWise)}, 4, 4);
  ASSERT_EQ(md.shards(0).size(), 4u);
  for (const auto& s : md.shards(0)) {
    EXPECT_EQ(s.rows, 0);
    EXPECT_EQ(s.row_offset, 0);
  }
  ASSERT_EQ(md.warnings().size(), 1u);
  EXPECT_NE(md.warnings()[0].find("ZeroDivisionError"), std::string::npos);
}

TEST(Builder, StrictRejectsSilentColumnDegeneration) {
  // 100 columns over 4 ranks: share 25, no multiple of 4 in [25, 100) divides 100 -> one block on ranks[0].
  auto t = make_table("t", 10, 100, ShardingType::kColumnWise, {0, 1, 2, 3});
  try {
    build({t}, 4, 4, DeviceType::kCpu, true);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("silently becomes 1 shard"), std::string::npos) << e.message();
  }
  auto md = build({t}, 4, 4);
  ASSERT_EQ(md.shards(0).size(), 1u);
  EXPECT_EQ(md.shards(0)[0].cols, 100);
  EXPECT_EQ(md.shards(0)[0].rank, 0);
  EXPECT_EQ(md.warnings().size(), 1u);
  EXPECT_EQ(md.local_shards(1).size(), 0u);
}

TEST(Builder, StrictTableColumnWiseStaysOnOneHost) {
  auto t = make_table("t", 10, 64, ShardingType::kTableColumnWise, {2, 4}, 32);
  EXPECT_THROW(build({t}, 8, 4, DeviceType::kCpu, true), InvalidArgument);
  auto md = build({t}, 8, 4);  // compat: TorchRec's layout, and the sharp edge listed
  ASSERT_EQ(md.shards(0).size(), 2u);
  EXPECT_EQ(md.shards(0)[1].rank, 4);
  ASSERT_EQ(md.warnings().size(), 1u);
  EXPECT_NE(md.warnings()[0].find("ranks[1] = 4 is on host 1"), std::string::npos) << md.warnings()[0];
}

// Compat mode promises to list every sharp edge strict mode refuses: for each plan below, strict throws and
// compat builds with exactly one warning naming the table.
TEST(Builder, CompatWarnsWhereStrictRefuses) {
  auto zch = make_table("zch", 12, 4, ShardingType::kRowWise);
  zch.num_buckets = 3;
  const std::vector<TableSpec> edges = {
      make_table("rw0", 0, 8, ShardingType::kRowWise),
      make_table("rw_nocols", 8, 0, ShardingType::kRowWise),
      make_table("tw0", 0, 8, ShardingType::kTableWise, {1}),
      make_table("dp0", 8, 0, ShardingType::kDataParallel),
      make_table("cw100", 10, 100, ShardingType::kColumnWise, {0, 1, 2, 3}),
      make_table("tcw", 10, 64, ShardingType::kTableColumnWise, {0, 2}, 32),
      zch,
  };
  for (const auto& t : edges) {
    SCOPED_TRACE(t.name);
    EXPECT_THROW(build({t}, 4, 2, DeviceType::kCpu, true), InvalidArgument);
    auto md = build({t}, 4, 2);
    ASSERT_EQ(md.warnings().size(), 1u);
    EXPECT_NE(md.warnings()[0].find("table '" + t.name + "'"), std::string::npos) << md.warnings()[0];
  }
  // And a plan without sharp edges builds the same in both modes, with no warning.
  auto fine = make_table("fine", 12, 4, ShardingType::kRowWise);
  fine.num_buckets = 4;
  EXPECT_TRUE(build({fine}, 4, 2).warnings().empty());
  EXPECT_NO_THROW(build({fine}, 4, 2, DeviceType::kCpu, true));
}

TEST(Builder, StrictRejectsFewerBucketsThanRanks) {
  auto t = make_table("t", 12, 4, ShardingType::kRowWise);
  t.num_buckets = 3;
  EXPECT_THROW(build({t}, 4, 4, DeviceType::kCpu, true), InvalidArgument);
  auto md = build({t}, 4, 4);
  EXPECT_EQ(md.shards(0)[3].rows, 0);
  EXPECT_EQ(md.shards(0)[3].row_offset, 12);
  ASSERT_EQ(md.warnings().size(), 1u);
  EXPECT_NE(md.warnings()[0].find("num_buckets=3 over 4 ranks: ranks[3:4] hold no bucket"), std::string::npos)
      << md.warnings()[0];
}

TEST(Builder, PerRankIndexCoversEveryShardOnce) {
  std::vector<TableSpec> tables = {
      make_table("a", 100, 64, ShardingType::kRowWise),
      make_table("b", 100, 64, ShardingType::kColumnWise, {1, 0}, 32),
      make_table("c", 100, 64, ShardingType::kTableWise, {2}),
      make_table("d", 100, 64, ShardingType::kDataParallel),
  };
  auto md = build(tables, 4, 2);
  size_t total = 0;
  for (int32_t r = 0; r < 4; ++r) {
    uint32_t last_table = 0;
    for (const ShardRef& ref : md.local_shards(r)) {
      EXPECT_EQ(md.shard(ref).rank, r);
      EXPECT_GE(ref.table, last_table);  // ordered by table
      last_table = ref.table;
      ++total;
    }
  }
  EXPECT_EQ(total, md.total_shards());
  EXPECT_EQ(md.total_shards(), 4u + 2u + 1u + 4u);
  EXPECT_EQ(md.local_shards(2).size(), 3u);  // a, c, d
  EXPECT_THROW(md.local_shards(4), InvalidArgument);
  EXPECT_THROW(md.local_shards(-1), InvalidArgument);
}

TEST(Builder, HashIsAFunctionOfThePlan) {
  auto t = make_table("a", 100, 64, ShardingType::kRowWise);
  auto h1 = build({t}, 4, 2).hash();
  EXPECT_EQ(build({t}, 4, 2).hash(), h1);
  t.dtype = DType::kFloat16;  // TorchRec's backout: a different dtype must change the fingerprint
  EXPECT_NE(build({t}, 4, 2).hash(), h1);
  t.dtype = DType::kFloat32;
  t.rows = 101;
  EXPECT_NE(build({t}, 4, 2).hash(), h1);
  t.rows = 100;
  EXPECT_NE(build({t}, 4, 2, DeviceType::kCuda).hash(), h1);
}

TEST(Builder, PlanFieldErrorsNameTableAndField) {
  auto expect_error = [](std::vector<TableSpec> tables, int32_t ws, int32_t L, const std::string& needle) {
    try {
      ShardingPlan plan(std::move(tables), ws, L);
      FAIL() << "expected InvalidArgument containing: " << needle;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(e.message().find(needle), std::string::npos) << e.message();
    }
  };
  expect_error({make_table("emb", 10, 4, ShardingType::kTableWise, {8})}, 8, 4,
               "table 'emb': ranks[0] = 8 is outside the world of 8 ranks (valid: 0..7)");
  expect_error({make_table("emb", 10, 64, ShardingType::kColumnWise, {0, 1}, 20)}, 2, 2,
               "table 'emb': column_block=20 does not divide cols=64");
  expect_error({make_table("emb", 10, 64, ShardingType::kColumnWise, {0, 1, 2}, 32)}, 4, 2,
               "makes 2 column blocks");
  expect_error(
      {make_table("emb", 10, 4, ShardingType::kTableWise, {0}), make_table("emb", 3, 4, ShardingType::kTableWise, {0})},
      2, 2, "table 'emb' appears twice");
  expect_error({make_table("emb", -1, 4, ShardingType::kTableWise, {0})}, 2, 2, "rows=-1 is negative");
  expect_error({make_table("emb", 10, 4, ShardingType::kTableRowWise, {5})}, 8, 4, "is not the first rank of a host");
  expect_error({make_table("emb", 10, 4, ShardingType::kRowWise, {1, 1})}, 2, 2, "is listed twice");
  expect_error({make_table("emb", 10, 256, ShardingType::kGridShard, iota_ranks(0, 4))}, 4, 4, "makes 2 column blocks");
  expect_error({make_table("emb", 10, 4, ShardingType::kRowWise, {}, 2)}, 2, 2, "column_block=2 is only meaningful");
  expect_error({make_table("", 10, 4, ShardingType::kRowWise)}, 2, 2, "empty name");
  expect_error({make_table("bad\xff\xfe", 10, 4, ShardingType::kRowWise)}, 2, 2,
               "table 'bad\\xff\\xfe': name is not UTF-8 text");
  EXPECT_NO_THROW(ShardingPlan({make_table("\xe8\xa1\xa8", 10, 4, ShardingType::kRowWise)}, 2, 2));  // U+8868
  expect_error({}, 6, 4, "ranks_per_host=4 does not divide world_size=6");
  expect_error({make_table("emb", int64_t{1} << 40, int64_t{1} << 30, ShardingType::kRowWise)}, 2, 2,
               "overflows int64");
  try {
    parse_sharding_type("diagonal", "emb");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(
        e.message().find("table 'emb': sharding_type 'diagonal' is not a sharding type; use one of data_parallel"),
        std::string::npos)
        << e.message();
  }
  EXPECT_EQ(parse_dtype("torch.float16"), DType::kFloat16);
  EXPECT_EQ(parse_dtype("half"), DType::kFloat16);
  EXPECT_THROW(parse_dtype("complex64", "emb"), InvalidArgument);
}

TEST(Builder, ExpansionIsCappedBeforeAllocatingAndTheErrorNamesTheTable) {
  // 16 data_parallel tables over a 2^20-rank world: a plan of ~160 bytes that expands to 16.7 million
  // shards (~800 MB) unless the build refuses it.
  std::vector<TableSpec> tables;
  for (int i = 0; i < 16; ++i) {
    std::string name = "t";  // not "t" + to_string(i): GCC 12 warns about that falsely (-Wrestrict)
    name += std::to_string(i);
    tables.push_back(make_table(name, 10, 4, ShardingType::kDataParallel));
  }
  auto plan = std::make_shared<const ShardingPlan>(tables, 1 << 20, 8, DeviceType::kCpu);
  EXPECT_LT(encode(*plan).size(), 300u);
  try {
    build_global_metadata(plan);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(e.message().find("table 't4' (data_parallel, up to 1048576 shards) brings the plan to 5242880 shards, "
                               "more than max_shards=4194304 (about 192 MiB of metadata); raise max_shards"),
              std::string::npos)
        << e.message();
  }
  // The limit is configurable and counts every table's shards.
  auto small = std::make_shared<const ShardingPlan>(
      std::vector<TableSpec>{make_table("a", 100, 8, ShardingType::kRowWise), make_table("b", 100, 8, ShardingType::kRowWise)},
      4, 2, DeviceType::kCpu);
  BuildOptions o;
  o.max_shards = 8;
  EXPECT_EQ(build_global_metadata(small, o).total_shards(), 8u);
  o.max_shards = 7;
  EXPECT_THROW(
      {
        try {
          build_global_metadata(small, o);
        } catch (const InvalidArgument& e) {
          EXPECT_NE(e.message().find("table 'b' (row_wise, up to 4 shards) brings the plan to 8 shards, more than "
                                     "max_shards=7"),
                    std::string::npos)
              << e.message();
          throw;
        }
      },
      InvalidArgument);
  for (int64_t bad : {int64_t{0}, kMaxTotalShards + 1}) {
    o.max_shards = bad;
    EXPECT_THROW(build_global_metadata(small, o), InvalidArgument) << bad;
  }
}

TEST(Builder, ExplicitShardsAreUsedVerbatimAndValidated) {
  // A planner's uneven row split by device memory (TorchRec: 1000 rows, mem [1, 1, 1] -> 333, 333, 334).
  auto t = make_table("uneven", 1000, 8, ShardingType::kRowWise);
  t.shards = {{0, 0, 333, 8, 0}, {333, 0, 333, 8, 1}, {666, 0, 334, 8, 2}};
  auto md = build({t}, 3, 3, DeviceType::kCpu, true);
  EXPECT_EQ(md.shards(0)[2].rows, 334);
  t.shards[2].rows = 300;  // a gap
  EXPECT_THROW(build({t}, 3, 3), InvalidArgument);
}

TEST(Builder, RecordsItsTimeAsALauncherInitSubstage) {
  ettkit::testing::TempDir dir;
  ett::RecorderOptions o;
  o.run_dir = dir.str();
  o.rank = 0;
  o.world_size = 1;
  o.launcher_phases_from_env = false;
  std::string ledger;
  {
    ett::Recorder rec(o);
    BuildOptions b;
    b.recorder = &rec;
    build_global_metadata(std::make_shared<const ShardingPlan>(
                              std::vector<TableSpec>{make_table("t", 100, 8, ShardingType::kRowWise)}, 4, 2),
                          b);
    ledger = rec.ledger_path();
    rec.close();
  }
  int found = 0;
  for (const auto& line : ettkit::testing::read_lines(ledger)) {
    auto j = nlohmann::json::parse(line);
    if (j["t"] == "phase" && j["name"] == "launcher_init/sharding") {
      ++found;
      EXPECT_LE(j["b"].get<int64_t>(), j["e"].get<int64_t>());
    }
  }
  EXPECT_EQ(found, 1);
}

}  // namespace
}  // namespace ettkit::sharding
