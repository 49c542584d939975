#include "ettkit/sharding/validate.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "ettkit/common/error.h"

namespace ettkit::sharding {

namespace {

// 128-bit accumulator for shard volumes (__extension__: a GCC/Clang type, fine under -Wpedantic).
__extension__ typedef unsigned __int128 u128;

std::string describe(const Shard& s) {
  return detail::concat("rows [", s.row_offset, ", ", s.row_offset + s.rows, ") x cols [", s.col_offset, ", ",
                        s.col_offset + s.cols, ") on rank ", s.rank);
}

[[noreturn]] void overlap(std::string_view table, std::span<const Shard> shards, size_t a, size_t b) {
  if (a > b) std::swap(a, b);
  ETTKIT_THROW(InvalidArgument, "table '", table, "': shards[", a, "] (", describe(shards[a]), ") and shards[", b,
               "] (", describe(shards[b]), ") overlap; every element must belong to exactly one shard");
}

[[noreturn]] void gap(std::string_view table, int64_t rows, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                      int64_t c1) {
  ETTKIT_THROW(InvalidArgument, "table '", table, "': rows [", r0, ", ", r1, ") x cols [", c0, ", ", c1,
               ") are not covered by any shard; the shards must cover the whole ", rows, " x ", cols, " table");
}

// Shards that all span the full extent of one dimension reduce to intervals on the other: sort by offset
// and walk. `along_rows` selects the split dimension.
void check_1d(std::string_view table, std::span<const Shard> shards, int64_t rows, int64_t cols, bool along_rows) {
  auto off = [&](size_t i) { return along_rows ? shards[i].row_offset : shards[i].col_offset; };
  auto len = [&](size_t i) { return along_rows ? shards[i].rows : shards[i].cols; };
  const int64_t extent = along_rows ? rows : cols;
  std::vector<uint32_t> order;
  order.reserve(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].rows > 0 && shards[i].cols > 0) order.push_back(static_cast<uint32_t>(i));
  }
  // Rule-generated layouts arrive sorted; skip the sort for them.
  auto by_offset = [&](uint32_t a, uint32_t b) { return off(a) < off(b); };
  if (!std::is_sorted(order.begin(), order.end(), by_offset)) std::stable_sort(order.begin(), order.end(), by_offset);
  int64_t covered = 0;  // [0, covered) is covered exactly once so far
  for (size_t k = 0; k < order.size(); ++k) {
    const size_t i = order[k];
    if (off(i) < covered) overlap(table, shards, order[k - 1], i);
    if (off(i) > covered) {
      if (along_rows) gap(table, rows, cols, covered, off(i), 0, cols);
      gap(table, rows, cols, 0, rows, covered, off(i));
    }
    covered = off(i) + len(i);
  }
  if (covered < extent && rows > 0 && cols > 0) {
    if (along_rows) gap(table, rows, cols, covered, rows, 0, cols);
    gap(table, rows, cols, 0, rows, covered, cols);
  }
}

// General 2-D case (grid layouts, explicit layouts): a sweep over rows. The active set holds the column
// intervals of the shards that cross the current row band; they are pairwise disjoint (otherwise an overlap
// was already reported), so a new interval only has to be compared with its two neighbours. Between two
// consecutive event rows the active intervals must cover all columns, else that band has a gap.
void check_2d(std::string_view table, std::span<const Shard> shards, int64_t rows, int64_t cols) {
  std::vector<uint32_t> starts;
  starts.reserve(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) {
    if (shards[i].rows > 0 && shards[i].cols > 0) starts.push_back(static_cast<uint32_t>(i));
  }
  if (rows == 0 || cols == 0) return;
  if (starts.empty()) gap(table, rows, cols, 0, rows, 0, cols);
  std::vector<uint32_t> ends = starts;
  std::stable_sort(starts.begin(), starts.end(),
                   [&](uint32_t a, uint32_t b) { return shards[a].row_offset < shards[b].row_offset; });
  auto end_row = [&](uint32_t i) { return shards[i].row_offset + shards[i].rows; };
  std::stable_sort(ends.begin(), ends.end(), [&](uint32_t a, uint32_t b) { return end_row(a) < end_row(b); });

  if (shards[starts[0]].row_offset > 0) gap(table, rows, cols, 0, shards[starts[0]].row_offset, 0, cols);

  std::map<int64_t, std::pair<int64_t, uint32_t>> active;  // col_offset -> (col end, shard index)
  int64_t width = 0;
  size_t si = 0, ei = 0;
  const size_t n = starts.size();
  while (si < n || ei < n) {
    int64_t y = ei < n ? end_row(ends[ei]) : INT64_MAX;
    if (si < n) y = std::min(y, shards[starts[si]].row_offset);
    // Half-open intervals: shards ending at y leave before shards starting at y arrive.
    for (; ei < n && end_row(ends[ei]) == y; ++ei) {
      const Shard& s = shards[ends[ei]];
      active.erase(s.col_offset);
      width -= s.cols;
    }
    for (; si < n && shards[starts[si]].row_offset == y; ++si) {
      const uint32_t i = starts[si];
      const int64_t c0 = shards[i].col_offset, c1 = c0 + shards[i].cols;
      auto next = active.lower_bound(c0);
      if (next != active.end() && next->first < c1) overlap(table, shards, next->second.second, i);
      if (next != active.begin()) {
        auto prev = std::prev(next);
        if (prev->second.first > c0) overlap(table, shards, prev->second.second, i);
      }
      active.emplace_hint(next, c0, std::make_pair(c1, i));
      width += shards[i].cols;
    }
    if (y >= rows) break;
    const int64_t next_y = std::min(ei < n ? end_row(ends[ei]) : rows, si < n ? shards[starts[si]].row_offset : rows);
    if (width != cols) {
      int64_t expected = 0;
      for (const auto& [c0, rest] : active) {
        if (c0 > expected) gap(table, rows, cols, y, next_y, expected, c0);
        expected = rest.first;
      }
      gap(table, rows, cols, y, next_y, expected, cols);
    }
  }
}

}  // namespace

void validate_shards(std::string_view table, ShardingType type, int64_t rows, int64_t cols,
                     std::span<const Shard> shards, int32_t world_size) {
  ETTKIT_EXPECTS(rows >= 0 && cols >= 0, "table '", table, "': shape ", rows, " x ", cols, " is negative");
  int64_t volume = 0;
  ETTKIT_EXPECTS(!__builtin_mul_overflow(rows, cols, &volume), "table '", table, "': rows x cols = ", rows, " x ",
                 cols, " overflows int64");
  ETTKIT_EXPECTS(!shards.empty(), "table '", table, "' has no shards; every table needs at least one shard");
  // Volumes add up in 128 bits: at most 2^27 shards of at most 2^63 elements each cannot overflow.
  u128 total = 0;
  bool full_width = true, full_height = true;
  for (size_t i = 0; i < shards.size(); ++i) {
    const Shard& s = shards[i];
    ETTKIT_EXPECTS(s.rank >= 0 && s.rank < world_size, "table '", table, "': shards[", i, "] is on rank ", s.rank,
                   ", outside the world of ", world_size, " ranks (valid: 0..", world_size - 1, ")");
    ETTKIT_EXPECTS(s.row_offset >= 0 && s.col_offset >= 0, "table '", table, "': shards[", i, "] has offsets (",
                   s.row_offset, ", ", s.col_offset, "); offsets must be >= 0");
    ETTKIT_EXPECTS(s.rows >= 0 && s.cols >= 0, "table '", table, "': shards[", i, "] has sizes (", s.rows, ", ",
                   s.cols, "); sizes must be >= 0");
    // off + size <= dim, written so that neither side can overflow.
    ETTKIT_EXPECTS(s.rows <= rows && s.row_offset <= rows - s.rows, "table '", table, "': shards[", i,
                   "] starts at row ", s.row_offset, " with ", s.rows, " rows, beyond the table's ", rows,
                   " rows; row offset + rows must be <= ", rows);
    ETTKIT_EXPECTS(s.cols <= cols && s.col_offset <= cols - s.cols, "table '", table, "': shards[", i,
                   "] starts at column ", s.col_offset, " with ", s.cols, " cols, beyond the table's ", cols,
                   " cols; column offset + cols must be <= ", cols);
    total += static_cast<u128>(s.rows) * static_cast<u128>(s.cols);
    if (s.rows > 0 && s.cols > 0) {
      full_width = full_width && s.col_offset == 0 && s.cols == cols;
      full_height = full_height && s.row_offset == 0 && s.rows == rows;
    }
  }

  if (type == ShardingType::kDataParallel) {
    std::vector<bool> seen(static_cast<size_t>(world_size));
    for (size_t i = 0; i < shards.size(); ++i) {
      const Shard& s = shards[i];
      ETTKIT_EXPECTS(s.row_offset == 0 && s.col_offset == 0 && s.rows == rows && s.cols == cols, "table '", table,
                     "': data_parallel shards[", i, "] (", describe(s), ") is not the whole ", rows, " x ", cols,
                     " table; a replica must be complete");
      ETTKIT_EXPECTS(!seen[s.rank], "table '", table, "': data_parallel has two replicas on rank ", s.rank);
      seen[s.rank] = true;
    }
    return;
  }

  if (full_width) {
    check_1d(table, shards, rows, cols, /*along_rows=*/true);
  } else if (full_height) {
    check_1d(table, shards, rows, cols, /*along_rows=*/false);
  } else {
    check_2d(table, shards, rows, cols);
  }
  // No overlap and no gap imply equal volume; checking it anyway guards the sweeps themselves.
  ETTKIT_CHECK(total == static_cast<u128>(volume), InvalidArgument, "table '", table,
               "': the shards hold ", static_cast<uint64_t>(total), " elements but the table has ", volume);
}

}  // namespace ettkit::sharding
