// The plan codec: round trips, compactness, clear errors for damaged bytes, and a bounded, seeded
// mutation fuzz loop over the decoder (no crash, no hang, only CorruptData). ETTKIT_FUZZ_SECONDS=N runs
// the loop for N seconds instead of a fixed number of iterations (the slow CI job sets it).
#include "ettkit/sharding/codec.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ettkit/common/error.h"
#include "sharding/codec_format.h"
#include "sharding_test_util.h"

namespace ettkit::sharding {
namespace {

using testing::iota_ranks;
using testing::make_table;

ShardingPlan mixed_plan(int tables, int32_t ws, int32_t L, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<TableSpec> specs;
  for (int i = 0; i < tables; ++i) {
    const std::string name = "sparse.ebc.embedding_bags.table_" + std::to_string(i);
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 5'000'000);
    const int64_t cols = 32 * (1 + static_cast<int64_t>(rng() % 8));
    TableSpec t;
    switch (rng() % 7) {
      case 0: t = make_table(name, rows, cols, ShardingType::kDataParallel); break;
      case 1: t = make_table(name, rows, cols, ShardingType::kTableWise, {static_cast<int32_t>(rng() % ws)}); break;
      case 2: t = make_table(name, rows, cols, ShardingType::kRowWise); break;
      case 3: {
        std::vector<int32_t> ranks;
        for (int64_t j = 0; j < cols / 32; ++j) ranks.push_back(static_cast<int32_t>(rng() % ws));
        t = make_table(name, rows, cols, ShardingType::kColumnWise, ranks, 32);
        break;
      }
      case 4: {
        const auto host = static_cast<int32_t>(rng() % (ws / L));
        t = make_table(name, rows, cols, ShardingType::kTableRowWise, iota_ranks(host * L, L));
        break;
      }
      case 5:
        t = make_table(name, rows, cols, ShardingType::kTableColumnWise, std::vector<int32_t>(cols / 32, 0), 32);
        break;
      default: {
        std::vector<int32_t> ranks;
        for (int64_t b = 0; b < cols / 32; ++b) {
          auto host = iota_ranks(static_cast<int32_t>(rng() % (ws / L)) * L, L);
          ranks.insert(ranks.end(), host.begin(), host.end());
        }
        t = make_table(name, rows, cols, ShardingType::kGridShard, ranks, 32);
      }
    }
    t.dtype = static_cast<DType>(rng() % kNumDTypes);
    specs.push_back(std::move(t));
  }
  // One explicit layout and one bucketed table so every optional field is encoded.
  auto uneven = make_table("uneven", 1000, 8, ShardingType::kRowWise);
  uneven.shards = {{0, 0, 500, 8, 0}, {500, 0, 250, 8, 1}, {750, 0, 250, 8, ws - 1}};
  specs.push_back(uneven);
  auto zch = make_table("zch", 100, 8, ShardingType::kRowWise);
  zch.num_buckets = 10;
  specs.push_back(zch);
  return ShardingPlan(std::move(specs), ws, L, DeviceType::kCuda);
}

std::string corrupt_message(const std::vector<uint8_t>& bytes) {
  try {
    decode(bytes);
  } catch (const CorruptData& e) {
    return e.message();
  }
  return "";
}

TEST(Codec, RoundTripIsExactAndDeterministic) {
  const auto plan = mixed_plan(300, 16, 4, 1);
  const auto bytes = encode(plan);
  EXPECT_EQ(decode(bytes), plan);
  EXPECT_EQ(encode(decode(bytes)), bytes);
  EXPECT_EQ(plan_hash(plan), plan_hash(decode(bytes)));
  EXPECT_EQ(encoded_size(std::span<const uint8_t>(bytes).first(kPlanHeaderBytes)), bytes.size());
  // An empty plan is valid too.
  ShardingPlan empty({}, 1, 1);
  EXPECT_EQ(decode(encode(empty)), empty);
}

TEST(Codec, IsCompact) {
  // ~1000 tables in a few bytes each: names share prefixes, ranks are ranges or deltas.
  const auto bytes = encode(mixed_plan(1000, 128, 8, 2));
  EXPECT_LT(bytes.size(), 40u * 1000u) << bytes.size();
}

TEST(Codec, HashDiffersWhenAnyFieldDiffers) {
  auto a = mixed_plan(20, 8, 4, 3);
  auto tables = a.tables();
  tables[5].dtype = tables[5].dtype == DType::kFloat16 ? DType::kFloat32 : DType::kFloat16;
  ShardingPlan b(tables, 8, 4, DeviceType::kCuda);
  EXPECT_NE(plan_hash(a), plan_hash(b));
  EXPECT_NE(plan_hash(a), plan_hash(ShardingPlan(a.tables(), 8, 4, DeviceType::kCpu)));
}

TEST(Codec, TruncatedBytes) {
  const auto bytes = encode(mixed_plan(10, 8, 4, 4));
  for (size_t n : {size_t{0}, size_t{3}, size_t{23}, size_t{24}, bytes.size() / 2, bytes.size() - 1}) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<long>(n));
    const auto msg = corrupt_message(cut);
    EXPECT_NE(msg.find("truncated"), std::string::npos) << n << ": " << msg;
  }
}

TEST(Codec, WrongVersionMagicFlagsAndChecksum) {
  auto bytes = encode(mixed_plan(10, 8, 4, 5));
  auto v = bytes;
  v[4] = 2;
  EXPECT_NE(corrupt_message(v).find("format version 2; this ettkit reads version 1"), std::string::npos)
      << corrupt_message(v);
  auto m = bytes;
  m[0] = 'X';
  EXPECT_NE(corrupt_message(m).find("magic"), std::string::npos);
  auto f = bytes;
  f[6] = 1;
  EXPECT_NE(corrupt_message(f).find("header flags"), std::string::npos);
  auto c = bytes;
  c[bytes.size() - 3] ^= 0x40;
  EXPECT_NE(corrupt_message(c).find("checksum"), std::string::npos);
  auto extra = bytes;
  extra.push_back(0);
  EXPECT_NE(corrupt_message(extra).find("extra bytes"), std::string::npos);
}

TEST(Codec, DamagedTableNamesTableAndField) {
  // A valid checksum over an invalid body (e.g. an encoder bug): the error names the table and field.
  ShardingPlan plan({make_table("user_id", 10, 8, ShardingType::kTableWise, {1})}, 2, 2);
  auto bytes = encode(plan);
  // Body: ws(1) L(1) device(1) count(1) shared(1) len(1) "user_id"(7) flags type dtype rows cols ...
  const size_t type_at = kPlanHeaderBytes + 4 + 2 + 7 + 1;
  ASSERT_EQ(bytes[type_at], static_cast<uint8_t>(ShardingType::kTableWise));
  bytes[type_at] = 9;
  codec::reseal_for_testing(bytes);
  auto msg = corrupt_message(bytes);
  EXPECT_NE(msg.find("table 0 ('user_id')"), std::string::npos) << msg;
  EXPECT_NE(msg.find("field sharding_type"), std::string::npos) << msg;
  // A decodable body that is not a valid plan: rank 1 becomes rank 5 in a world of 2.
  bytes = encode(plan);
  ASSERT_EQ(bytes.back(), 2);  // the last byte is the one delta-encoded rank: zigzag(1)
  bytes.back() = 10;           // zigzag(5)
  codec::reseal_for_testing(bytes);
  msg = corrupt_message(bytes);
  EXPECT_NE(msg.find("invalid plan: table 'user_id': ranks[0] = 5 is outside the world of 2 ranks"), std::string::npos)
      << msg;
}

TEST(Codec, HostileCountsDoNotAllocate) {
  // A tiny body that claims 2^60 tables must fail before reserving anything.
  std::vector<uint8_t> bytes(kPlanHeaderBytes);
  for (uint8_t b : {uint8_t{2}, uint8_t{1}, uint8_t{0}, uint8_t{0x80}, uint8_t{0x80}, uint8_t{0x80}, uint8_t{0x80},
                    uint8_t{0x80}, uint8_t{0x80}, uint8_t{0x80}, uint8_t{0x80}, uint8_t{0x10}}) {
    bytes.push_back(b);
  }
  std::memcpy(bytes.data(), "ETSP\x01\x00\x00\x00", 8);
  codec::reseal_for_testing(bytes);
  EXPECT_NE(corrupt_message(bytes).find("tables cannot fit"), std::string::npos) << corrupt_message(bytes);
  // A header that announces a body larger than the limit is refused by encoded_size().
  std::vector<uint8_t> header(bytes.begin(), bytes.begin() + kPlanHeaderBytes);
  for (int i = 8; i < 16; ++i) header[i] = 0xff;
  EXPECT_THROW(encoded_size(header), CorruptData);
}

// Seeded mutation fuzzing: flips, byte sets, insertions, deletions, truncations and splices of valid
// encodings, each resealed so that the parser (not just the checksum) sees the damage. Anything other than
// success or CorruptData fails the test; a crash or hang fails CI.
TEST(Codec, MutationFuzzDecoder) {
  std::vector<std::vector<uint8_t>> corpus;
  for (uint64_t seed = 0; seed < 6; ++seed) {
    corpus.push_back(encode(mixed_plan(3 + static_cast<int>(seed) * 2, 8, 4, seed)));
  }
  corpus.push_back(encode(ShardingPlan({}, 1, 1)));
  double seconds = 0;
  if (const char* env = std::getenv("ETTKIT_FUZZ_SECONDS")) seconds = std::atof(env);
  const long iterations = seconds > 0 ? -1 : 100000;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  std::mt19937_64 rng(0xE77C0DEC);
  long ok = 0, corrupt = 0, n = 0;
  for (; iterations < 0 ? std::chrono::steady_clock::now() < deadline : n < iterations; ++n) {
    std::vector<uint8_t> b = corpus[rng() % corpus.size()];
    const int mutations = 1 + static_cast<int>(rng() % 4);
    for (int m = 0; m < mutations; ++m) {
      const size_t body = b.size() > kPlanHeaderBytes ? b.size() - kPlanHeaderBytes : 1;
      const size_t at = kPlanHeaderBytes + rng() % body;
      switch (rng() % 7) {
        case 0:
          if (at < b.size()) b[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
          break;
        case 1:
          if (at < b.size()) b[at] = static_cast<uint8_t>(rng());
          break;
        case 2:
          b.insert(b.begin() + static_cast<long>(std::min(at, b.size())), static_cast<uint8_t>(rng()));
          break;
        case 3:
          if (at < b.size()) b.erase(b.begin() + static_cast<long>(at));
          break;
        case 4:
          b.resize(std::max(kPlanHeaderBytes, std::min(b.size(), at)));
          break;
        case 5: {  // splice a run from another encoding
          const auto& other = corpus[rng() % corpus.size()];
          const size_t from = rng() % other.size(), len = 1 + rng() % 16;
          for (size_t k = 0; k < len && from + k < other.size() && at + k < b.size(); ++k) b[at + k] = other[from + k];
          break;
        }
        default:
          if (at < b.size()) b[at] = static_cast<uint8_t>(rng() % 2 ? 0xff : 0x80);  // varint continuation bytes
      }
    }
    const bool reseal = rng() % 8 != 0;  // mostly resealed; sometimes test the checksum path
    if (reseal) codec::reseal_for_testing(b);
    try {
      const ShardingPlan p = decode(b);
      // Whatever decodes must re-encode to a plan that decodes to itself.
      ASSERT_EQ(decode(encode(p)), p);
      ++ok;
    } catch (const CorruptData&) {
      ++corrupt;
    }
  }
  EXPECT_GT(corrupt, 0);
  EXPECT_GT(ok + corrupt, 1000);
  std::printf("decoder fuzz: %ld inputs, %ld decoded, %ld rejected as CorruptData\n", n, ok, corrupt);
}

}  // namespace
}  // namespace ettkit::sharding
