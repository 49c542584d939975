#pragma once
// Helpers shared by the sharding tests.
#include <memory>
#include <string>
#include <vector>

#include "ettkit/sharding/metadata.h"
#include "ettkit/sharding/plan.h"

namespace ettkit::sharding::testing {

inline TableSpec make_table(std::string name, int64_t rows, int64_t cols, ShardingType type,
                            std::vector<int32_t> ranks = {}, int64_t column_block = 0) {
  TableSpec t;
  t.name = std::move(name);
  t.rows = rows;
  t.cols = cols;
  t.type = type;
  t.ranks = std::move(ranks);
  t.column_block = column_block;
  return t;
}

inline std::vector<int32_t> iota_ranks(int32_t first, int32_t count) {
  std::vector<int32_t> r(static_cast<size_t>(count));
  for (int32_t i = 0; i < count; ++i) r[i] = first + i;
  return r;
}

inline GlobalMetadata build(std::vector<TableSpec> tables, int32_t ws, int32_t L,
                            DeviceType device = DeviceType::kCpu, bool strict = false) {
  BuildOptions o;
  o.strict = strict;
  return build_global_metadata(std::make_shared<const ShardingPlan>(std::move(tables), ws, L, device), o);
}

}  // namespace ettkit::sharding::testing
