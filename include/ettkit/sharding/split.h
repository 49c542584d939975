#pragma once
// TorchRec's split rules as pure functions, bit-exact with torchrec/distributed/sharding_plan.py
// (calculate_shard_sizes_and_offsets and helpers; docs/sharding.md, "Split rules"). They are
// public so that callers (and tests) can ask "what would TorchRec do" without building a whole plan.
//
// All functions are pure and thread-safe; they throw InvalidArgument for inputs TorchRec rejects.

#include <cstdint>
#include <vector>

#include "ettkit/common/export.h"

namespace ettkit::sharding {

/// A contiguous range of one dimension: [offset, offset + size).
struct ETTKIT_API Span {
  int64_t offset = 0;
  int64_t size = 0;
  friend bool operator==(const Span&, const Span&) = default;
};

/// TorchRec's MIN_CW_DIM: the lower bound of the column-block search when none is given.
inline constexpr int64_t kTorchRecMinColumnBlock = 128;

/// Row-wise split of `rows` over `n` parts with TorchRec's ceil rule (also DTensor's Shard and
/// ChunkShardingSpec): block = ceil(rows/n); parts < rows/block get a full block, the next one the
/// remainder, later ones 0. Offsets are cumulative, so trailing empty parts sit at offset `rows`
/// (1000 over 3 -> 334, 334, 332; 5 over 8 -> 1,1,1,1,1,0,0,0 at 0,1,2,3,4,5,5,5).
/// rows == 0 gives n empty parts at offset 0 (TorchRec raises ZeroDivisionError there; DTensor does this).
/// Appends to `out`. Requires n >= 1 and rows >= 0.
ETTKIT_API void row_wise_split(int64_t rows, int64_t n, std::vector<Span>& out);
ETTKIT_API std::vector<Span> row_wise_split(int64_t rows, int64_t n);

/// TorchRec's bucketed (ZCH) row-wise split: rows are cut into `num_buckets` buckets of rows/num_buckets
/// rows; part r gets floor(num_buckets/n) buckets plus one if r < num_buckets % n (10 rows, 4 parts,
/// 5 buckets -> 4, 2, 2, 2). Requires rows % num_buckets == 0 (TorchRec asserts it).
ETTKIT_API void bucketed_row_wise_split(int64_t rows, int64_t n, int64_t num_buckets, std::vector<Span>& out);

/// TorchRec's _find_base_dim: the first i in [lower_bound, dim) with dim % i == 0 and i % 4 == 0, else dim.
ETTKIT_API int64_t find_base_dim(int64_t lower_bound, int64_t dim);

/// TorchRec's column-block choice (_get_block_size_for_cw_shard): find_base_dim(min_partition, cols),
/// with min_partition <= 0 meaning MIN_CW_DIM (128). Examples: (64, 32) -> 32; (64, 0) -> 64 (one
/// block: column-wise degenerates to table-wise); (64, 20) -> 32; (100, 10) -> 20; (256, 0) -> 128.
ETTKIT_API int64_t torchrec_column_block(int64_t cols, int64_t min_partition);

}  // namespace ettkit::sharding
