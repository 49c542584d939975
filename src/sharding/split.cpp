#include "ettkit/sharding/split.h"

#include <algorithm>

#include "ettkit/common/error.h"

namespace ettkit::sharding {

void row_wise_split(int64_t rows, int64_t n, std::vector<Span>& out) {
  ETTKIT_EXPECTS(n >= 1, "row_wise_split: n=", n, " parts; at least 1 is needed");
  ETTKIT_EXPECTS(rows >= 0, "row_wise_split: rows=", rows, " is negative");
  out.reserve(out.size() + static_cast<size_t>(n));
  if (rows == 0) {
    // TorchRec divides by the block (0) here; DTensor and ChunkShardingSpec give n empty parts at 0.
    for (int64_t r = 0; r < n; ++r) out.push_back({0, 0});
    return;
  }
  // ceil(rows / n) without the overflow of rows + n - 1.
  const int64_t block = rows / n + (rows % n != 0 ? 1 : 0);
  const int64_t last_rank = rows / block;
  const int64_t last_block = rows - block * last_rank;
  int64_t offset = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t size = r < last_rank ? block : (r == last_rank ? last_block : 0);
    out.push_back({offset, size});
    offset += size;  // cumulative: trailing empty parts sit at offset == rows
  }
}

std::vector<Span> row_wise_split(int64_t rows, int64_t n) {
  std::vector<Span> out;
  row_wise_split(rows, n, out);
  return out;
}

void bucketed_row_wise_split(int64_t rows, int64_t n, int64_t num_buckets, std::vector<Span>& out) {
  ETTKIT_EXPECTS(n >= 1, "bucketed_row_wise_split: n=", n, " parts; at least 1 is needed");
  ETTKIT_EXPECTS(num_buckets >= 1, "bucketed_row_wise_split: num_buckets=", num_buckets, "; at least 1 is needed");
  ETTKIT_EXPECTS(rows >= 0 && rows % num_buckets == 0, "bucketed_row_wise_split: rows=", rows,
                 " is not divisible by num_buckets=", num_buckets, " (TorchRec asserts hash_size % num_buckets == 0)");
  const int64_t bucket = rows / num_buckets;
  const int64_t per_part = num_buckets / n;
  const int64_t extra = num_buckets % n;
  out.reserve(out.size() + static_cast<size_t>(n));
  int64_t offset = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t size = bucket * (per_part + (r < extra ? 1 : 0));
    out.push_back({offset, size});
    offset += size;
  }
}

int64_t find_base_dim(int64_t lower_bound, int64_t dim) {
  // TorchRec scans i = lower_bound, lower_bound+1, ..., dim-1 for the first i with dim % i == 0 and
  // i % 4 == 0. That scan is O(dim); this computes the same answer in O(sqrt(dim)): such an i is 4*j for
  // a divisor j of dim/4, so the answer is 4 * (the smallest divisor j of dim/4 with 4j >= lower_bound
  // and 4j < dim), or dim when there is none.
  if (lower_bound >= dim) return dim;
  lower_bound = std::max<int64_t>(lower_bound, 1);  // TorchRec never passes < 1 (0 means MIN_CW_DIM)
  if (dim % 4 != 0) return dim;
  const int64_t m = dim / 4;
  const int64_t j_min = lower_bound / 4 + (lower_bound % 4 != 0 ? 1 : 0);
  int64_t best_j = m;  // j == m means i == dim: "none found"
  for (int64_t d = 1; d <= m / d; ++d) {
    if (m % d != 0) continue;
    const int64_t e = m / d;
    if (d >= j_min && d < best_j) best_j = d;
    if (e >= j_min && e < best_j) best_j = e;
  }
  return 4 * best_j;
}

int64_t torchrec_column_block(int64_t cols, int64_t min_partition) {
  ETTKIT_EXPECTS(cols >= 1, "torchrec_column_block: cols=", cols, "; a column split needs at least 1 column");
  const int64_t lower = min_partition > 0 ? min_partition : kTorchRecMinColumnBlock;
  // TorchRec then takes min(block, cols) and falls back to cols when cols % block != 0; find_base_dim
  // only returns divisors of cols (or cols itself), so both steps are no-ops here.
  return std::min(find_base_dim(lower, cols), cols);
}

}  // namespace ettkit::sharding
