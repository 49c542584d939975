#pragma once
// Validation of one table's shard list, in O(S log S) for S shards, with errors that name the table, the
// shard and what would be valid. The builder runs it on every table; it is public so that layouts from
// elsewhere (a TorchRec plan, a checkpoint) can be checked the same way.
//
// Rules (docs/sharding.md, "Validation"):
//  - at least one shard; every rank in [0, world_size);
//  - offsets and sizes >= 0 and offset + size <= the table's dimension (checked without overflow);
//  - the table's volume rows*cols fits int64 and the shards' volumes add up without overflow;
//  - data_parallel: every shard is the whole table, one per rank (replicas, so no overlap check);
//  - every other type: non-empty shards do not overlap and together cover every element exactly once.
//    Empty shards (0 rows or 0 cols) cover nothing and may sit anywhere in bounds (TorchRec and DTensor
//    put trailing empty row blocks at offset = rows).

#include <cstdint>
#include <span>
#include <string_view>

#include "ettkit/common/export.h"
#include "ettkit/sharding/plan.h"

namespace ettkit::sharding {

/// Throws InvalidArgument naming `table`, the offending shard(s) and the valid range.
ETTKIT_API void validate_shards(std::string_view table, ShardingType type, int64_t rows, int64_t cols,
                                std::span<const Shard> shards, int32_t world_size);

}  // namespace ettkit::sharding
