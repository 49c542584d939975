#pragma once
// ettkit::sharding::build_global_metadata: expands a ShardingPlan into every table's shards and a
// per-rank index, locally, with no communication. Every rank that holds the same plan builds the same
// metadata (bit for bit: GlobalMetadata::hash() is a function of the plan alone).
//
// What it promises
//  - Shards follow TorchRec's rules exactly (split.h; docs/sharding.md), in TorchRec's plan order:
//    row-wise block i on ranks[i], trailing empty blocks at offset = rows; column blocks in order;
//    table-row-wise on host ranks h*L + j; grid: for each column block, for each row block.
//  - Every table's shards are validated (validate.h) before the metadata is returned: in bounds,
//    overflow-safe volume, no overlap, full coverage, ranks in [0, world_size). O(S log S) in total.
//  - strict mode rejects TorchRec's sharp edges (0 rows/cols; a column split that silently yields
//    fewer shards than ranks; table_column_wise ranks on several hosts; fewer ZCH buckets than ranks).
//    Compat mode reproduces them and records a warning per table in warnings().
//  - GlobalMetadata is immutable, owns its arrays and shares the plan (shared_ptr); safe to read from
//    any thread.

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ettkit/common/export.h"
#include "ettkit/sharding/plan.h"

namespace ettkit::ett {
class Recorder;
}

namespace ettkit::sharding {

/// Hard ceiling of BuildOptions::max_shards (about 6 GiB of metadata; indexes are 32-bit).
inline constexpr int64_t kMaxTotalShards = int64_t{1} << 27;
/// Default BuildOptions::max_shards: 4,194,304 shards, about 200 MB of metadata at 48 bytes a shard. A
/// TorchRec plan has at most world_size shards per table, so this holds 4,096 ranks x 1,024 row-wise
/// tables; a plan of a few hundred bytes (data_parallel tables over a 2^20-rank world) cannot make a
/// rank allocate gigabytes.
inline constexpr int64_t kDefaultMaxShards = int64_t{1} << 22;

struct ETTKIT_API BuildOptions {
  /// Reject TorchRec's sharp edges instead of reproducing them (see the header comment).
  bool strict = false;
  /// Most shards the build may create over all tables (1..kMaxTotalShards); a plan that expands to more
  /// is refused with InvalidArgument naming the table that crosses the limit, before anything is
  /// allocated. Explicit shards count too.
  int64_t max_shards = kDefaultMaxShards;
  /// When set, the build is recorded as phase "launcher_init/sharding" (a launcher_init sub-stage).
  ett::Recorder* recorder = nullptr;
};

/// A reference to shard `shard` of table `table` (indexes into GlobalMetadata).
struct ETTKIT_API ShardRef {
  uint32_t table = 0;
  uint32_t shard = 0;
  friend bool operator==(const ShardRef&, const ShardRef&) = default;
};

class ETTKIT_API GlobalMetadata {
 public:
  const ShardingPlan& plan() const noexcept { return *plan_; }
  std::shared_ptr<const ShardingPlan> shared_plan() const noexcept { return plan_; }
  size_t num_tables() const noexcept { return plan_->tables().size(); }
  /// All shards of table `table`, in TorchRec's plan order.
  std::span<const Shard> shards(size_t table) const;
  /// Total number of shards over all tables.
  size_t total_shards() const noexcept { return shards_.size(); }
  /// The shards held by `rank`: ordered by table, then by position in the table's shard list.
  std::span<const ShardRef> local_shards(int32_t rank) const;
  const Shard& shard(ShardRef ref) const;
  /// `rank:<r>/cpu` or `rank:<r>/cuda:<r % ranks_per_host>` (TorchRec's placement()).
  std::string placement(const Shard& shard) const;
  /// XXH3-64 of the canonical metadata (plan header, every table's name, dtype, type, shape and shards).
  /// Equal on two ranks iff they built the same metadata (up to hash collisions).
  uint64_t hash() const;
  /// Compat-mode notes about sharp edges that were reproduced (empty in strict mode).
  const std::vector<std::string>& warnings() const noexcept { return warnings_; }

 private:
  friend ETTKIT_API GlobalMetadata build_global_metadata(std::shared_ptr<const ShardingPlan>, const BuildOptions&);
  GlobalMetadata() = default;
  std::shared_ptr<const ShardingPlan> plan_;
  std::vector<Shard> shards_;            // all tables' shards, table after table
  std::vector<uint32_t> table_begin_;    // table t owns shards_[table_begin_[t], table_begin_[t+1])
  std::vector<uint32_t> rank_begin_;     // rank r owns rank_refs_[rank_begin_[r], rank_begin_[r+1])
  std::vector<ShardRef> rank_refs_;
  std::vector<std::string> warnings_;
};

/// Builds (and validates) the global metadata of `plan`. Throws InvalidArgument naming the table and
/// field when the plan cannot be expanded (strict-mode rules, explicit shards that overlap or leave a gap,
/// more shards than options.max_shards).
ETTKIT_API GlobalMetadata build_global_metadata(std::shared_ptr<const ShardingPlan> plan,
                                                const BuildOptions& options = {});

/// The shards of one table by its sharding rule (no explicit layout, no validation); used by the builder
/// and exposed for tests. Appends to `out`; compat-mode notes are appended to `warnings`.
ETTKIT_API void expand_table(const TableSpec& table, int32_t world_size, int32_t ranks_per_host, bool strict,
                             std::vector<Shard>& out, std::vector<std::string>& warnings);

}  // namespace ettkit::sharding
