#include "ettkit/sharding/plan.h"

#include <array>
#include <span>
#include <utility>

#include "ettkit/common/error.h"
#include "ettkit/sharding/split.h"
#include "sharding/text.h"

namespace ettkit::sharding {

namespace {

constexpr std::array<std::string_view, kNumShardingTypes> kTypeNames = {
    "data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "grid_shard"};

constexpr std::array<std::string_view, kNumDTypes> kDTypeNames = {
    "float32", "float16", "bfloat16", "float64",       "int8",        "uint8",    "int16",
    "int32",   "int64",   "bool",     "float8_e4m3fn", "float8_e5m2", "quint4x2", "quint2x4"};

constexpr std::array<int, kNumDTypes> kDTypeSizes = {4, 2, 2, 8, 1, 1, 2, 4, 8, 1, 1, 1, 1, 1};

std::string joined(std::span<const std::string_view> names) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i) out += ", ";
    out += names[i];
  }
  return out;
}

std::string where(std::string_view table) {
  return table.empty() ? std::string() : detail::concat("table '", table, "': ");
}

bool is_column_split(ShardingType t) {
  return t == ShardingType::kColumnWise || t == ShardingType::kTableColumnWise || t == ShardingType::kGridShard;
}

// Field checks that do not depend on strict mode; geometry and strict rules are the builder's.
void validate_table(const TableSpec& t, int32_t ws, int32_t L) {
  const std::string& n = t.name;
  ETTKIT_EXPECTS(!n.empty(), "a table has an empty name; every table needs a unique, non-empty name");
  ETTKIT_EXPECTS(n.size() <= kMaxTableNameBytes, "table '", text::escaped(n, 64), "': name is ", n.size(),
                 " bytes; at most ", kMaxTableNameBytes, " are allowed");
  // Names end up in Python str, JSON and error messages: they must be UTF-8 text without NUL.
  ETTKIT_EXPECTS(text::valid_utf8(n) && n.find('\0') == std::string::npos, "table '", text::escaped(n),
                 "': name is not UTF-8 text without NUL bytes");
  ETTKIT_EXPECTS(static_cast<int>(t.type) < kNumShardingTypes, "table '", n, "': sharding_type ",
                 static_cast<int>(t.type), " is not a sharding type");
  ETTKIT_EXPECTS(static_cast<int>(t.dtype) < kNumDTypes, "table '", n, "': dtype ", static_cast<int>(t.dtype),
                 " is not a dtype");
  ETTKIT_EXPECTS(t.rows >= 0, "table '", n, "': rows=", t.rows, " is negative; rows must be >= 0");
  ETTKIT_EXPECTS(t.cols >= 0, "table '", n, "': cols=", t.cols, " is negative; cols must be >= 0");
  ETTKIT_EXPECTS(t.cols <= kMaxCols, "table '", n, "': cols=", t.cols, " exceeds the limit of ", kMaxCols);
  int64_t volume = 0;
  ETTKIT_EXPECTS(!__builtin_mul_overflow(t.rows, t.cols, &volume), "table '", n, "': rows x cols = ", t.rows,
                 " x ", t.cols, " overflows int64; a tensor has at most 2^63-1 elements");

  const auto type = to_string(t.type);
  for (size_t i = 0; i < t.ranks.size(); ++i) {
    ETTKIT_EXPECTS(t.ranks[i] >= 0 && t.ranks[i] < ws, "table '", n, "': ranks[", i, "] = ", t.ranks[i],
                   " is outside the world of ", ws, " ranks (valid: 0..", ws - 1, ")");
  }
  ETTKIT_EXPECTS(t.column_block >= 0, "table '", n, "': column_block=", t.column_block, " is negative");
  ETTKIT_EXPECTS(t.num_buckets >= 0, "table '", n, "': num_buckets=", t.num_buckets, " is negative");
  if (t.column_block > 0) {
    ETTKIT_EXPECTS(is_column_split(t.type), "table '", n, "': column_block=", t.column_block,
                   " is only meaningful for column_wise, table_column_wise and grid_shard, not ", type);
  }
  if (t.num_buckets > 0) {
    ETTKIT_EXPECTS(t.type == ShardingType::kRowWise, "table '", n, "': num_buckets=", t.num_buckets,
                   " is only meaningful for row_wise, not ", type);
    ETTKIT_EXPECTS(t.rows % t.num_buckets == 0, "table '", n, "': rows=", t.rows,
                   " is not divisible by num_buckets=", t.num_buckets,
                   " (TorchRec asserts hash_size % num_buckets == 0); use a divisor of ", t.rows);
  }

  if (!t.shards.empty()) {
    // An explicit layout replaces the rule: its ranks are the shards' ranks (TorchRec keeps ranks
    // parallel to sharding_spec.shards), and no rule parameter may silently be ignored.
    ETTKIT_EXPECTS(t.type != ShardingType::kDataParallel, "table '", n,
                   "': data_parallel tables are replicated and take no explicit shards");
    ETTKIT_EXPECTS(t.column_block == 0 && t.num_buckets == 0, "table '", n,
                   "': explicit shards replace the split rule; leave column_block and num_buckets unset");
    ETTKIT_EXPECTS(t.ranks.empty() || t.ranks.size() == t.shards.size(), "table '", n, "': ranks has ",
                   t.ranks.size(), " entries but there are ", t.shards.size(),
                   " explicit shards; give one rank per shard or leave ranks empty");
    for (size_t i = 0; i < t.ranks.size(); ++i) {
      ETTKIT_EXPECTS(t.ranks[i] == t.shards[i].rank, "table '", n, "': ranks[", i, "] = ", t.ranks[i],
                     " but shards[", i, "] is on rank ", t.shards[i].rank, "; ranks must list the shards' ranks");
    }
    return;
  }

  switch (t.type) {
    case ShardingType::kDataParallel:
      if (!t.ranks.empty()) {
        bool all = t.ranks.size() == static_cast<size_t>(ws);
        for (size_t i = 0; all && i < t.ranks.size(); ++i) all = t.ranks[i] == static_cast<int32_t>(i);
        ETTKIT_EXPECTS(all, "table '", n, "': data_parallel ranks must be empty or [0, 1, ..., ", ws - 1,
                       "] (a replica on every rank)");
      }
      break;
    case ShardingType::kTableWise:
      ETTKIT_EXPECTS(t.ranks.size() == 1, "table '", n, "': table_wise needs exactly one rank in ranks, got ",
                     t.ranks.size());
      break;
    case ShardingType::kRowWise: {
      // Row block i goes to ranks[i]; a rank holding two blocks would break TorchRec's routing by rank.
      std::vector<bool> seen(t.ranks.empty() ? 0 : static_cast<size_t>(ws));
      for (size_t i = 0; i < t.ranks.size(); ++i) {
        ETTKIT_EXPECTS(!seen[t.ranks[i]], "table '", n, "': row_wise ranks[", i, "] = ", t.ranks[i],
                       " is listed twice; each rank holds at most one row block");
        seen[t.ranks[i]] = true;
      }
      break;
    }
    case ShardingType::kColumnWise:
    case ShardingType::kTableColumnWise: {
      ETTKIT_EXPECTS(!t.ranks.empty(), "table '", n, "': ", type, " needs the rank of each column block in ranks");
      ETTKIT_EXPECTS(t.cols >= 1, "table '", n, "': ", type, " has 0 cols; a column split needs at least 1 column");
      if (t.column_block > 0) {
        ETTKIT_EXPECTS(t.cols % t.column_block == 0, "table '", n, "': column_block=", t.column_block,
                       " does not divide cols=", t.cols, "; use a divisor of ", t.cols,
                       " or leave column_block unset for TorchRec's search");
        const int64_t k = t.cols / t.column_block;
        ETTKIT_EXPECTS(static_cast<int64_t>(t.ranks.size()) == k, "table '", n, "': column_block=", t.column_block,
                       " makes ", k, " column blocks of cols=", t.cols, " but ranks has ", t.ranks.size(),
                       " entries; give one rank per column block");
      } else {
        // TorchRec's column_wise(ranks): the block is searched from cols / len(ranks), which must divide.
        ETTKIT_EXPECTS(t.cols % static_cast<int64_t>(t.ranks.size()) == 0, "table '", n, "': column dim of ",
                       t.cols, " cannot be evenly divided across ", t.ranks.size(),
                       " ranks; use a number of ranks that divides ", t.cols, " or set column_block");
      }
      break;
    }
    case ShardingType::kTableRowWise: {
      ETTKIT_EXPECTS(!t.ranks.empty(), "table '", n, "': table_row_wise needs the host's ranks in ranks");
      const int32_t first = t.ranks[0];
      ETTKIT_EXPECTS(first % L == 0, "table '", n, "': table_row_wise ranks[0] = ", first,
                     " is not the first rank of a host (ranks_per_host=", L, "); use ", (first / L) * L);
      ETTKIT_EXPECTS(t.ranks.size() == 1 || t.ranks.size() == static_cast<size_t>(L), "table '", n,
                     "': table_row_wise ranks must be the host's first rank or all ", L, " of its ranks, got ",
                     t.ranks.size());
      for (size_t j = 1; j < t.ranks.size(); ++j) {
        ETTKIT_EXPECTS(t.ranks[j] == first + static_cast<int32_t>(j), "table '", n, "': table_row_wise ranks[", j,
                       "] = ", t.ranks[j], " but host ", first / L, " has rank ", first + static_cast<int32_t>(j),
                       " there");
      }
      break;
    }
    case ShardingType::kGridShard: {
      ETTKIT_EXPECTS(t.cols >= 1, "table '", n, "': grid_shard has 0 cols; a column split needs at least 1 column");
      ETTKIT_EXPECTS(!t.ranks.empty() && t.ranks.size() % static_cast<size_t>(L) == 0, "table '", n,
                     "': grid_shard ranks must hold the ", L, " ranks of one host per column block; got ",
                     t.ranks.size(), " ranks");
      for (size_t g = 0; g < t.ranks.size(); g += static_cast<size_t>(L)) {
        const int32_t first = t.ranks[g];
        for (size_t j = 0; j < static_cast<size_t>(L); ++j) {
          ETTKIT_EXPECTS(first % L == 0 && t.ranks[g + j] == first + static_cast<int32_t>(j), "table '", n,
                         "': grid_shard ranks[", g, "..", g + L - 1, "] must be one host's ranks h*", L, " .. h*", L,
                         "+", L - 1, "; ranks[", g + j, "] = ", t.ranks[g + j]);
        }
      }
      if (t.column_block > 0) {
        ETTKIT_EXPECTS(t.cols % t.column_block == 0, "table '", n, "': column_block=", t.column_block,
                       " does not divide cols=", t.cols, "; use a divisor of ", t.cols,
                       " or leave column_block unset for TorchRec's search");
      }
      const int64_t block = t.column_block > 0 ? t.column_block : torchrec_column_block(t.cols, 0);
      const int64_t k = t.cols / block;
      const int64_t hosts = static_cast<int64_t>(t.ranks.size()) / L;
      ETTKIT_EXPECTS(hosts == k, "table '", n, "': grid_shard has ", hosts, " hosts' ranks but column block ", block,
                     t.column_block > 0 ? "" : " (TorchRec's default search from 128)", " makes ", k,
                     " column blocks of cols=", t.cols, "; give one host per column block or set column_block");
      break;
    }
  }
}

}  // namespace

ShardingPlan::ShardingPlan(std::vector<TableSpec> tables, int32_t world_size, int32_t ranks_per_host,
                           DeviceType device)
    : tables_(std::move(tables)), world_size_(world_size), ranks_per_host_(ranks_per_host), device_(device) {
  ETTKIT_EXPECTS(world_size >= 1 && world_size <= kMaxWorldSize, "world_size=", world_size,
                 " is out of range; valid: 1..", kMaxWorldSize);
  ETTKIT_EXPECTS(ranks_per_host >= 1 && ranks_per_host <= world_size, "ranks_per_host=", ranks_per_host,
                 " is out of range; valid: 1..world_size (", world_size, ")");
  ETTKIT_EXPECTS(world_size % ranks_per_host == 0, "ranks_per_host=", ranks_per_host, " does not divide world_size=",
                 world_size, "; every host must hold the same number of ranks");
  ETTKIT_EXPECTS(device == DeviceType::kCpu || device == DeviceType::kCuda, "device ", static_cast<int>(device),
                 " is not a device type; use cpu or cuda");
  by_name_.reserve(tables_.size());
  for (size_t i = 0; i < tables_.size(); ++i) {
    validate_table(tables_[i], world_size, ranks_per_host);
    auto [it, inserted] = by_name_.emplace(tables_[i].name, i);
    ETTKIT_EXPECTS(inserted, "table '", tables_[i].name, "' appears twice (tables ", it->second, " and ", i,
                   "); table names must be unique");
  }
}

std::optional<size_t> ShardingPlan::find(std::string_view name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  return it->second;
}

bool operator==(const ShardingPlan& a, const ShardingPlan& b) {
  return a.world_size_ == b.world_size_ && a.ranks_per_host_ == b.ranks_per_host_ && a.device_ == b.device_ &&
         a.tables_ == b.tables_;
}

std::string_view to_string(ShardingType type) {
  const auto i = static_cast<size_t>(type);
  return i < kTypeNames.size() ? kTypeNames[i] : std::string_view("<invalid sharding type>");
}

std::string_view to_string(DType dtype) {
  const auto i = static_cast<size_t>(dtype);
  return i < kDTypeNames.size() ? kDTypeNames[i] : std::string_view("<invalid dtype>");
}

std::string_view to_string(DeviceType device) {
  switch (device) {
    case DeviceType::kCpu:
      return "cpu";
    case DeviceType::kCuda:
      return "cuda";
  }
  return "<invalid device>";
}

ShardingType parse_sharding_type(std::string_view name, std::string_view table) {
  for (size_t i = 0; i < kTypeNames.size(); ++i) {
    if (name == kTypeNames[i]) return static_cast<ShardingType>(i);
  }
  ETTKIT_THROW(InvalidArgument, where(table), "sharding_type '", name, "' is not a sharding type; use one of ",
               joined(kTypeNames));
}

DType parse_dtype(std::string_view name, std::string_view table) {
  if (name.starts_with("torch.")) name.remove_prefix(6);
  // torch's aliases of the canonical names.
  if (name == "float") name = "float32";
  if (name == "half") name = "float16";
  if (name == "double") name = "float64";
  if (name == "short") name = "int16";
  if (name == "int") name = "int32";
  if (name == "long") name = "int64";
  for (size_t i = 0; i < kDTypeNames.size(); ++i) {
    if (name == kDTypeNames[i]) return static_cast<DType>(i);
  }
  ETTKIT_THROW(InvalidArgument, where(table), "dtype '", name, "' is not supported; use one of ", joined(kDTypeNames));
}

DeviceType parse_device(std::string_view name) {
  if (name == "cpu") return DeviceType::kCpu;
  if (name == "cuda") return DeviceType::kCuda;
  ETTKIT_THROW(InvalidArgument, "device '", name, "' is not a device type; use 'cpu' or 'cuda'");
}

int element_size(DType dtype) {
  const auto i = static_cast<size_t>(dtype);
  ETTKIT_EXPECTS(i < kDTypeSizes.size(), "dtype ", i, " is not a dtype");
  return kDTypeSizes[i];
}

}  // namespace ettkit::sharding
