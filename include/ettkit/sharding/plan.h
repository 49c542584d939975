#pragma once
// ettkit::sharding::ShardingPlan: the compact, rank-independent description of how every embedding table
// (or any 2-D parameter) of a model is sharded. It is the only input of the local metadata builder
// (metadata.h) and the unit the codec (codec.h) encodes and broadcast_plan sends.
//
// What it promises
//  - Every field is a plain value that is the same on every rank: global shape, dtype from the table
//    config, sharding type, ranks, column block, world size, ranks per host, device type. Nothing is read
//    from a rank's own tensors (TorchRec's first local-metadata change was backed out because the dtype
//    came from a rank's own shard, so ranks disagreed).
//  - A constructed plan is valid field by field (names, sizes, ranks, parameters per sharding type);
//    anything wrong throws InvalidArgument naming the table and the field. The geometry of explicit
//    shard lists (overlap, gaps) and the strict-mode rules are checked by the builder.
//  - Immutable after construction; safe to share between threads. Owns its tables.
//
// The meaning of `ranks` follows TorchRec's ParameterSharding.ranks ("the rank of each shard, in plan
// order"), see docs/sharding.md for the table per sharding type.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ettkit/common/export.h"

namespace ettkit::sharding {

/// TorchRec's ShardingType values. The numeric values are part of the codec format: never renumber.
enum class ShardingType : uint8_t {
  kDataParallel = 0,     ///< "data_parallel": a full replica on every rank
  kTableWise = 1,        ///< "table_wise": the whole table on one rank
  kRowWise = 2,          ///< "row_wise": ceil-block row split over all (listed) ranks
  kColumnWise = 3,       ///< "column_wise": column blocks, one rank per block (ranks may repeat)
  kTableRowWise = 4,     ///< "table_row_wise": row split over the ranks of one host
  kTableColumnWise = 5,  ///< "table_column_wise": column blocks on the ranks of one host
  kGridShard = 6,        ///< "grid_shard": column blocks across hosts x row split inside each host
};
inline constexpr int kNumShardingTypes = 7;

/// Element types (torch names). Numeric values are part of the codec format: never renumber.
enum class DType : uint8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt8 = 4,
  kUInt8 = 5,
  kInt16 = 6,
  kInt32 = 7,
  kInt64 = 8,
  kBool = 9,
  kFloat8E4M3FN = 10,
  kFloat8E5M2 = 11,
  kQUInt4x2 = 12,  ///< TorchRec INT4
  kQUInt2x4 = 13,  ///< TorchRec INT2
};
inline constexpr int kNumDTypes = 14;

/// Where shards live; decides the placement string (`rank:r/cpu` or `rank:r/cuda:<r % ranks_per_host>`).
enum class DeviceType : uint8_t { kCpu = 0, kCuda = 1 };

/// One shard of a 2-D table: rows [row_offset, row_offset+rows) x cols [col_offset, col_offset+cols) on
/// `rank`. Used both for explicit layouts in a plan and for the builder's output.
struct ETTKIT_API Shard {
  int64_t row_offset = 0;
  int64_t col_offset = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int32_t rank = 0;
  friend bool operator==(const Shard&, const Shard&) = default;
};

/// One table (parameter) of a plan. Plain data; validated when a ShardingPlan is built from it.
struct ETTKIT_API TableSpec {
  std::string name;
  int64_t rows = 0;
  int64_t cols = 0;
  DType dtype = DType::kFloat32;
  ShardingType type = ShardingType::kTableWise;
  /// TorchRec's ParameterSharding.ranks. Per type: data_parallel: empty or 0..W-1; table_wise: [r];
  /// row_wise: empty (= 0..W-1) or distinct ranks, block i on ranks[i]; column_wise /
  /// table_column_wise: the rank of each column block; table_row_wise: the host's ranks
  /// [h*L, ..., h*L+L-1] or just [h*L]; grid_shard: one host's L ranks per column block, in block order.
  std::vector<int32_t> ranks;
  /// Width of each column block (column_wise, table_column_wise, grid_shard); must divide `cols`.
  /// 0 = TorchRec's default search (see torchrec_column_block in split.h).
  int64_t column_block = 0;
  /// Row-wise only: TorchRec's ZCH bucket count (rows are split in whole buckets); 0 = unset.
  int64_t num_buckets = 0;
  /// An explicit layout (e.g. a planner's uneven split), used verbatim instead of the rule of `type`.
  /// Empty = derive the shards from the rule.
  std::vector<Shard> shards;
  friend bool operator==(const TableSpec&, const TableSpec&) = default;
};

/// Limits that bound the work and memory of decoding and building (documented in docs/sharding.md).
inline constexpr int32_t kMaxWorldSize = 1 << 20;
/// Column counts above this are rejected: TorchRec's column-block search costs O(sqrt(cols)).
inline constexpr int64_t kMaxCols = int64_t{1} << 40;
inline constexpr size_t kMaxTableNameBytes = 4096;

class ETTKIT_API ShardingPlan {
 public:
  /// Validates every field (see the class comment) and indexes the tables by name.
  /// `ranks_per_host` (TorchRec's local_world_size) must divide `world_size`.
  ShardingPlan(std::vector<TableSpec> tables, int32_t world_size, int32_t ranks_per_host,
               DeviceType device = DeviceType::kCpu);

  const std::vector<TableSpec>& tables() const noexcept { return tables_; }
  const TableSpec& table(size_t index) const { return tables_.at(index); }
  /// Index of the table called `name`, or nullopt.
  std::optional<size_t> find(std::string_view name) const;
  int32_t world_size() const noexcept { return world_size_; }
  int32_t ranks_per_host() const noexcept { return ranks_per_host_; }
  DeviceType device() const noexcept { return device_; }

  friend ETTKIT_API bool operator==(const ShardingPlan& a, const ShardingPlan& b);

 private:
  std::vector<TableSpec> tables_;
  int32_t world_size_;
  int32_t ranks_per_host_;
  DeviceType device_;
  // Owns copies of the names (not views into tables_) so the plan stays valid when copied or moved.
  struct NameHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  std::unordered_map<std::string, size_t, NameHash, std::equal_to<>> by_name_;
};

/// Names as used in TorchRec and torch: "row_wise", "float16", "cuda", ...
ETTKIT_API std::string_view to_string(ShardingType type);
ETTKIT_API std::string_view to_string(DType dtype);
ETTKIT_API std::string_view to_string(DeviceType device);
/// Parse the names above; `table` only names the table in the error message (InvalidArgument).
ETTKIT_API ShardingType parse_sharding_type(std::string_view name, std::string_view table = {});
ETTKIT_API DType parse_dtype(std::string_view name, std::string_view table = {});
ETTKIT_API DeviceType parse_device(std::string_view name);
/// Bytes per element of `dtype` (sub-byte types round up to 1).
ETTKIT_API int element_size(DType dtype);

}  // namespace ettkit::sharding
