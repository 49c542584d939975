#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <optional>

#include "common/logging.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/recorder.h"
#include "ettkit/sharding/metadata.h"
#include "ettkit/sharding/split.h"
#include "ettkit/sharding/validate.h"

namespace ettkit::sharding {

namespace {

// Upper bound of the shard count of one table, for the one reservation and the max_shards guard.
int64_t shard_bound(const TableSpec& t, int32_t ws, int32_t L) {
  if (!t.shards.empty()) return static_cast<int64_t>(t.shards.size());
  switch (t.type) {
    case ShardingType::kDataParallel:
      return ws;
    case ShardingType::kRowWise:
      return t.ranks.empty() ? ws : static_cast<int64_t>(t.ranks.size());
    case ShardingType::kTableRowWise:
      return L;
    default:
      return static_cast<int64_t>(t.ranks.size());
  }
}

void reject_empty_dims(const TableSpec& t) {
  // Strict mode: TorchRec raises ZeroDivisionError for row splits of 0 rows and for column splits of 0
  // columns, and a 0-sized table is almost always a config bug, so strict mode refuses all of them.
  ETTKIT_EXPECTS(t.rows > 0, to_string(t.type), " plan for table '", t.name, "' has 0 rows; a ", to_string(t.type),
                 " table needs at least 1 row (strict mode)");
  ETTKIT_EXPECTS(t.cols > 0, to_string(t.type), " plan for table '", t.name, "' has 0 cols; a ", to_string(t.type),
                 " table needs at least 1 column (strict mode)");
}

// Compat mode lists every sharp edge strict mode refuses (docs/sharding.md, "Strict and compat mode"), so a
// plan that builds in compat mode with no warning builds the same in strict mode.
void warn_empty_dims(const TableSpec& t, std::vector<std::string>& warnings) {
  if (t.rows > 0 && t.cols > 0) return;
  warnings.push_back(detail::concat("table '", t.name, "': ", to_string(t.type), " of ", t.rows, " x ", t.cols,
                                    " is empty; every shard holds nothing (strict mode refuses a table with 0 ",
                                    t.rows == 0 ? "rows" : "cols", ")"));
}

// The plan's shard count (an upper bound), refused before anything is allocated when it passes
// `max_shards`: a plan is a few bytes per table, its expansion 48 bytes per shard.
int64_t checked_shard_bound(const ShardingPlan& plan, int64_t max_shards) {
  ETTKIT_EXPECTS(max_shards >= 1 && max_shards <= kMaxTotalShards, "max_shards=", max_shards,
                 " is out of range; valid: 1..", kMaxTotalShards);
  constexpr int64_t kBytesPerShard = sizeof(Shard) + sizeof(ShardRef);
  int64_t bound = 0;
  for (const auto& t : plan.tables()) {
    const int64_t n = shard_bound(t, plan.world_size(), plan.ranks_per_host());
    bound += n;  // no overflow: every term is <= 2^32 and the sum stops at the first one past max_shards
    ETTKIT_EXPECTS(bound <= max_shards, "table '", t.name, "' (", to_string(t.type), ", up to ", n,
                   " shards) brings the plan to ", bound, " shards, more than max_shards=", max_shards, " (about ",
                   max_shards * kBytesPerShard >> 20, " MiB of metadata); raise max_shards (at most ",
                   kMaxTotalShards, ") if the plan is meant to be this large");
  }
  return bound;
}

void push_row_blocks(const std::vector<Span>& spans, int64_t col_offset, int64_t block_cols, const int32_t* ranks,
                     std::vector<Shard>& out) {
  for (size_t j = 0; j < spans.size(); ++j) {
    out.push_back({spans[j].offset, col_offset, spans[j].size, block_cols, ranks[j]});
  }
}

}  // namespace

void expand_table(const TableSpec& t, int32_t ws, int32_t L, bool strict, std::vector<Shard>& out,
                  std::vector<std::string>& warnings) {
  if (strict) reject_empty_dims(t);
  const bool row_split = t.type == ShardingType::kRowWise || t.type == ShardingType::kTableRowWise ||
                         t.type == ShardingType::kGridShard;
  if (!strict && t.rows == 0 && row_split) {
    warnings.push_back(detail::concat("table '", t.name, "': ", to_string(t.type),
                                      " with 0 rows; TorchRec raises ZeroDivisionError here, ettkit gives empty row "
                                      "blocks at offset 0 (DTensor's convention)"));
  } else if (!strict) {
    warn_empty_dims(t, warnings);
  }
  std::vector<Span> spans;
  std::vector<int32_t> host_ranks;
  switch (t.type) {
    case ShardingType::kDataParallel:
      for (int32_t r = 0; r < ws; ++r) out.push_back({0, 0, t.rows, t.cols, r});
      return;
    case ShardingType::kTableWise:
      out.push_back({0, 0, t.rows, t.cols, t.ranks.at(0)});
      return;
    case ShardingType::kRowWise: {
      std::vector<int32_t> all;
      const int32_t* ranks = t.ranks.data();
      int64_t n = static_cast<int64_t>(t.ranks.size());
      if (t.ranks.empty()) {
        all.resize(static_cast<size_t>(ws));
        for (int32_t r = 0; r < ws; ++r) all[r] = r;
        ranks = all.data();
        n = ws;
      }
      if (t.num_buckets > 0) {
        ETTKIT_EXPECTS(!strict || t.num_buckets >= n, "table '", t.name, "': num_buckets=", t.num_buckets,
                       " is fewer than the ", n, " ranks of its row_wise split; a bucket cannot be split across ranks, "
                       "so some ranks would hold nothing (strict mode); use at least ", n, " buckets");
        if (t.num_buckets < n) {
          warnings.push_back(detail::concat("table '", t.name, "': row_wise with num_buckets=", t.num_buckets,
                                            " over ", n, " ranks: ranks[", t.num_buckets, ":", n,
                                            "] hold no bucket (empty shards at offset ", t.rows,
                                            "); TorchRec 1.9 raises ValueError here"));
        }
        bucketed_row_wise_split(t.rows, n, t.num_buckets, spans);
      } else {
        row_wise_split(t.rows, n, spans);
      }
      push_row_blocks(spans, 0, t.cols, ranks, out);
      return;
    }
    case ShardingType::kTableRowWise: {
      // TorchRec's TWRW sharder: table_node = ranks[0] // L; rank table_node*L + j holds row block j.
      const int32_t first = (t.ranks.at(0) / L) * L;
      host_ranks.resize(static_cast<size_t>(L));
      for (int32_t j = 0; j < L; ++j) host_ranks[j] = first + j;
      row_wise_split(t.rows, L, spans);
      push_row_blocks(spans, 0, t.cols, host_ranks.data(), out);
      return;
    }
    case ShardingType::kColumnWise:
    case ShardingType::kTableColumnWise: {
      const auto n = static_cast<int64_t>(t.ranks.size());
      int64_t block = t.column_block;
      if (block == 0) block = torchrec_column_block(t.cols, t.cols / n);  // TorchRec's column_wise(ranks)
      const int64_t k = t.cols / block;
      if (k < n) {
        // TorchRec zips the k blocks with the ranks and silently drops ranks[k:].
        ETTKIT_EXPECTS(!strict, "table '", t.name, "': ", to_string(t.type), " over ", n,
                       " ranks: TorchRec's block search from cols/", n, " = ", t.cols / n, " gives block ", block,
                       ", so the split silently becomes ", k, " shard(s) on ranks[0:", k,
                       "] (strict mode); set column_block or use a number of ranks whose share of ", t.cols,
                       " columns is a multiple of 4");
        warnings.push_back(detail::concat("table '", t.name, "': ", to_string(t.type), " over ", n,
                                          " ranks becomes ", k, " shard(s) of ", block, " columns (TorchRec's block "
                                          "search); ranks after ranks[", k - 1, "] hold nothing"));
      }
      if (t.type == ShardingType::kTableColumnWise) {
        for (int64_t j = 0; j < k; ++j) {
          if (t.ranks[j] / L == t.ranks[0] / L) continue;
          ETTKIT_EXPECTS(!strict, "table '", t.name, "': table_column_wise ranks[", j, "] = ", t.ranks[j],
                         " is on host ", t.ranks[j] / L, " but ranks[0] is on host ", t.ranks[0] / L,
                         "; table_column_wise keeps a table on one host (strict mode)");
          warnings.push_back(detail::concat("table '", t.name, "': table_column_wise ranks[", j, "] = ", t.ranks[j],
                                            " is on host ", t.ranks[j] / L, ", not on ranks[0]'s host ",
                                            t.ranks[0] / L, "; TorchRec accepts it, strict mode refuses it"));
          break;
        }
      }
      for (int64_t j = 0; j < k; ++j) out.push_back({0, j * block, t.rows, block, t.ranks[j]});
      return;
    }
    case ShardingType::kGridShard: {
      const int64_t block = t.column_block > 0 ? t.column_block : torchrec_column_block(t.cols, 0);
      const int64_t k = t.cols / block;  // == number of hosts in ranks (checked by ShardingPlan)
      row_wise_split(t.rows, L, spans);
      // TorchRec's order: for each column block, for each row block within the block's host.
      for (int64_t b = 0; b < k; ++b) push_row_blocks(spans, b * block, block, &t.ranks[b * L], out);
      return;
    }
  }
  ETTKIT_THROW(InvalidArgument, "table '", t.name, "': sharding_type ", static_cast<int>(t.type),
               " is not a sharding type");
}

GlobalMetadata build_global_metadata(std::shared_ptr<const ShardingPlan> plan, const BuildOptions& options) {
  ETTKIT_EXPECTS(plan != nullptr, "build_global_metadata: plan is null");
  std::optional<ett::ScopedPhase> phase;
  if (options.recorder) phase.emplace(options.recorder->phase("launcher_init/sharding"));

  const int32_t ws = plan->world_size();
  const int32_t L = plan->ranks_per_host();
  const auto& tables = plan->tables();
  const int64_t bound = checked_shard_bound(*plan, options.max_shards);

  GlobalMetadata md;
  md.plan_ = std::move(plan);
  md.shards_.reserve(static_cast<size_t>(bound));
  md.table_begin_.reserve(tables.size() + 1);
  md.table_begin_.push_back(0);
  for (const auto& t : tables) {
    const size_t begin = md.shards_.size();
    if (t.shards.empty()) {
      expand_table(t, ws, L, options.strict, md.shards_, md.warnings_);
    } else {
      if (options.strict) reject_empty_dims(t);
      else warn_empty_dims(t, md.warnings_);
      md.shards_.insert(md.shards_.end(), t.shards.begin(), t.shards.end());
    }
    validate_shards(t.name, t.type, t.rows, t.cols, std::span<const Shard>(md.shards_).subspan(begin), ws);
    md.table_begin_.push_back(static_cast<uint32_t>(md.shards_.size()));
  }
  for (const auto& w : md.warnings_) ETTKIT_LOG_WARN("sharding: ", w);

  // Per-rank index by counting sort: O(S), ordered by table then shard position.
  md.rank_begin_.assign(static_cast<size_t>(ws) + 1, 0);
  for (const auto& s : md.shards_) ++md.rank_begin_[static_cast<size_t>(s.rank) + 1];
  for (size_t r = 0; r < static_cast<size_t>(ws); ++r) md.rank_begin_[r + 1] += md.rank_begin_[r];
  md.rank_refs_.resize(md.shards_.size());
  std::vector<uint32_t> cursor(md.rank_begin_.begin(), md.rank_begin_.end() - 1);
  for (uint32_t t = 0; t < tables.size(); ++t) {
    for (uint32_t i = md.table_begin_[t]; i < md.table_begin_[t + 1]; ++i) {
      md.rank_refs_[cursor[md.shards_[i].rank]++] = ShardRef{t, i - md.table_begin_[t]};
    }
  }
  return md;
}

std::span<const Shard> GlobalMetadata::shards(size_t table) const {
  ETTKIT_EXPECTS(table < num_tables(), "table index ", table, " is out of range; the plan has ", num_tables(),
                 " tables");
  return std::span<const Shard>(shards_).subspan(table_begin_[table], table_begin_[table + 1] - table_begin_[table]);
}

std::span<const ShardRef> GlobalMetadata::local_shards(int32_t rank) const {
  ETTKIT_EXPECTS(rank >= 0 && rank < plan_->world_size(), "rank ", rank, " is outside the world of ",
                 plan_->world_size(), " ranks (valid: 0..", plan_->world_size() - 1, ")");
  return std::span<const ShardRef>(rank_refs_).subspan(rank_begin_[rank], rank_begin_[rank + 1] - rank_begin_[rank]);
}

const Shard& GlobalMetadata::shard(ShardRef ref) const {
  auto table = shards(ref.table);
  ETTKIT_EXPECTS(ref.shard < table.size(), "shard index ", ref.shard, " is out of range; table '",
                 plan_->table(ref.table).name, "' has ", table.size(), " shards");
  return table[ref.shard];
}

std::string GlobalMetadata::placement(const Shard& shard) const {
  if (plan_->device() == DeviceType::kCuda) {
    return detail::concat("rank:", shard.rank, "/cuda:", shard.rank % plan_->ranks_per_host());
  }
  return detail::concat("rank:", shard.rank, "/cpu");
}

uint64_t GlobalMetadata::hash() const {
  // Canonical little-endian words; x86-64 and aarch64 are little-endian, others are refused at build time.
  static_assert(std::endian::native == std::endian::little, "GlobalMetadata::hash assumes a little-endian host");
  XXH3_state_t* state = XXH3_createState();
  ETTKIT_CHECK(state != nullptr, Error, "XXH3_createState failed (out of memory)");
  XXH3_64bits_reset(state);
  auto put = [&](int64_t v) { XXH3_64bits_update(state, &v, sizeof v); };
  put(plan_->world_size());
  put(plan_->ranks_per_host());
  put(static_cast<int64_t>(plan_->device()));
  put(static_cast<int64_t>(num_tables()));
  for (size_t t = 0; t < num_tables(); ++t) {
    const TableSpec& spec = plan_->table(t);
    put(static_cast<int64_t>(spec.name.size()));
    XXH3_64bits_update(state, spec.name.data(), spec.name.size());
    put(static_cast<int64_t>(spec.dtype));
    put(static_cast<int64_t>(spec.type));
    put(spec.rows);
    put(spec.cols);
    auto table = shards(t);
    put(static_cast<int64_t>(table.size()));
    for (const Shard& s : table) {
      const int64_t words[5] = {s.row_offset, s.col_offset, s.rows, s.cols, s.rank};
      XXH3_64bits_update(state, words, sizeof words);
    }
  }
  const uint64_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  return h;
}

}  // namespace ettkit::sharding
