#include "ettkit/sharding/codec.h"

#include <xxhash.h>

#include <bit>
#include <cstring>
#include <limits>
#include <string>

#include "ettkit/common/error.h"
#include "sharding/codec_format.h"
#include "sharding/text.h"

namespace ettkit::sharding {

namespace {

static_assert(std::endian::native == std::endian::little, "the plan codec writes little-endian words");

// ---- writing ---------------------------------------------------------------------------------------------

class Writer {
 public:
  explicit Writer(std::vector<uint8_t>& out) : out_(out) {}
  void u8(uint8_t v) { out_.push_back(v); }
  void varint(uint64_t v) {
    while (v >= 0x80) {
      out_.push_back(static_cast<uint8_t>(v | 0x80));
      v >>= 7;
    }
    out_.push_back(static_cast<uint8_t>(v));
  }
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out_.insert(out_.end(), b, b + n);
  }

 private:
  std::vector<uint8_t>& out_;
};

uint64_t zigzag(int64_t v) { return (static_cast<uint64_t>(v) << 1) ^ static_cast<uint64_t>(v >> 63); }
int64_t unzigzag(uint64_t v) { return static_cast<int64_t>(v >> 1) ^ -static_cast<int64_t>(v & 1); }

void put_u16(uint8_t* p, uint16_t v) { std::memcpy(p, &v, 2); }
void put_u64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }
uint16_t get_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

bool is_range(const std::vector<int32_t>& r) {
  if (r.size() < 2) return false;
  for (size_t i = 1; i < r.size(); ++i) {
    if (r[i] != r[0] + static_cast<int32_t>(i)) return false;
  }
  return true;
}

// Whole hosts, host after host (grid_shard ranks; ranks_per_host > 1): stored as host indexes.
bool is_host_groups(const std::vector<int32_t>& r, int32_t L) {
  if (L < 2 || r.empty() || r.size() % static_cast<size_t>(L) != 0) return false;
  for (size_t g = 0; g < r.size(); g += static_cast<size_t>(L)) {
    if (r[g] % L != 0) return false;
    for (size_t j = 1; j < static_cast<size_t>(L); ++j) {
      if (r[g + j] != r[g] + static_cast<int32_t>(j)) return false;
    }
  }
  return true;
}

void seal(std::vector<uint8_t>& out) {
  const uint64_t body = out.size() - kPlanHeaderBytes;
  std::memcpy(out.data(), codec::kPlanMagic, 4);
  put_u16(out.data() + 4, kPlanCodecVersion);
  put_u16(out.data() + 6, 0);
  put_u64(out.data() + 8, body);
  put_u64(out.data() + 16, XXH3_64bits(out.data() + kPlanHeaderBytes, body));
}

// ---- reading ---------------------------------------------------------------------------------------------

// Bounds-checked cursor over the body. Every failure names the table (index and, once known, name) and the
// field being read, and the byte position, so a damaged broadcast can be diagnosed from the message.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : begin_(p), p_(p), end_(p + n) {}
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  size_t pos() const { return static_cast<size_t>(p_ - begin_); }

  void at(const char* field) { field_ = field; }
  void table(size_t index, const std::string* name) {
    table_ = index;
    name_ = name;
  }

  [[noreturn]] void fail(const std::string& what) const {
    std::string where = "plan bytes";
    if (table_ != kNoTable) {
      where += detail::concat(": table ", table_);
      if (name_ && !name_->empty()) where += detail::concat(" ('", text::escaped(*name_), "')");
    }
    ETTKIT_THROW(CorruptData, where, ": ", what, " (field ", field_, ", body byte ", pos(), " of ",
                 static_cast<size_t>(end_ - begin_), ")");
  }

  uint8_t u8() {
    if (p_ == end_) fail("truncated");
    return *p_++;
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ == end_) fail("truncated inside a varint");
      const uint8_t b = *p_++;
      if (shift == 63 && (b & 0x7e) != 0) fail("varint overflows 64 bits");
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail("varint longer than 10 bytes");
  }
  int64_t nonneg(uint64_t max) {
    const uint64_t v = varint();
    if (v > max) fail(detail::concat("value ", v, " exceeds ", max));
    return static_cast<int64_t>(v);
  }
  const uint8_t* take(size_t n) {
    if (n > left()) fail(detail::concat("truncated: ", n, " bytes needed, ", left(), " left"));
    const uint8_t* p = p_;
    p_ += n;
    return p;
  }

 private:
  static constexpr size_t kNoTable = static_cast<size_t>(-1);
  const uint8_t* begin_;
  const uint8_t* p_;
  const uint8_t* end_;
  const char* field_ = "header";
  size_t table_ = kNoTable;
  const std::string* name_ = nullptr;
};

constexpr uint64_t kI64Max = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
constexpr uint64_t kI32Max = static_cast<uint64_t>(std::numeric_limits<int32_t>::max());
// The fewest bytes one table can take (name prefix, suffix length + 1 byte, flags, type, dtype, rows, cols):
// bounds the table count before anything is allocated for it.
constexpr size_t kMinTableBytes = 7;
constexpr size_t kMinShardBytes = 5;
// Range-encoded ranks expand without consuming bytes; their total is capped like a build's shard count.
constexpr uint64_t kMaxDecodedRankEntries = uint64_t{1} << 27;

void check_header(std::span<const uint8_t> bytes) {
  if (bytes.size() < kPlanHeaderBytes) {
    ETTKIT_THROW(CorruptData, "plan bytes are truncated: ", bytes.size(), " bytes, shorter than the ",
                 kPlanHeaderBytes, "-byte header");
  }
  if (std::memcmp(bytes.data(), codec::kPlanMagic, 4) != 0) {
    ETTKIT_THROW(CorruptData, "plan bytes do not start with the magic 'ETSP'; they are not an encoded ShardingPlan");
  }
  const uint16_t version = get_u16(bytes.data() + 4);
  if (version != kPlanCodecVersion) {
    ETTKIT_THROW(CorruptData, "plan bytes have format version ", version, "; this ettkit reads version ",
                 kPlanCodecVersion, " (every rank must run the same ettkit)");
  }
  const uint16_t flags = get_u16(bytes.data() + 6);
  if (flags != 0) ETTKIT_THROW(CorruptData, "plan bytes have unknown header flags 0x", std::hex, flags);
  const uint64_t body = get_u64(bytes.data() + 8);
  if (body > codec::kMaxEncodedBytes - kPlanHeaderBytes) {
    ETTKIT_THROW(CorruptData, "plan bytes announce a body of ", body, " bytes, more than the limit of ",
                 codec::kMaxEncodedBytes - kPlanHeaderBytes);
  }
}

}  // namespace

std::vector<uint8_t> encode(const ShardingPlan& plan) {
  std::vector<uint8_t> out(kPlanHeaderBytes);
  out.reserve(64 + plan.tables().size() * 16);
  Writer w(out);
  w.varint(static_cast<uint64_t>(plan.world_size()));
  w.varint(static_cast<uint64_t>(plan.ranks_per_host()));
  w.u8(static_cast<uint8_t>(plan.device()));
  w.varint(plan.tables().size());
  const std::string* prev = nullptr;
  for (const TableSpec& t : plan.tables()) {
    // Names share long prefixes ("sparse.ebc.table_0042"): store only what differs from the previous one.
    size_t shared = 0;
    if (prev) {
      const size_t limit = std::min(prev->size(), t.name.size());
      while (shared < limit && (*prev)[shared] == t.name[shared]) ++shared;
    }
    w.varint(shared);
    w.varint(t.name.size() - shared);
    w.bytes(t.name.data() + shared, t.name.size() - shared);
    prev = &t.name;

    uint8_t flags = 0;
    if (t.column_block > 0) flags |= codec::kHasColumnBlock;
    if (t.num_buckets > 0) flags |= codec::kHasBuckets;
    if (!t.shards.empty()) flags |= codec::kHasShards;
    const int32_t L = plan.ranks_per_host();
    const uint8_t ranks_mode =
        t.ranks.empty() ? 0 : (is_range(t.ranks) ? 1 : (is_host_groups(t.ranks, L) ? 3 : 2));
    flags |= static_cast<uint8_t>(ranks_mode << codec::kRanksShift);
    w.u8(flags);
    w.u8(static_cast<uint8_t>(t.type));
    w.u8(static_cast<uint8_t>(t.dtype));
    w.varint(static_cast<uint64_t>(t.rows));
    w.varint(static_cast<uint64_t>(t.cols));
    if (t.column_block > 0) w.varint(static_cast<uint64_t>(t.column_block));
    if (t.num_buckets > 0) w.varint(static_cast<uint64_t>(t.num_buckets));
    if (ranks_mode == 1) {
      w.varint(static_cast<uint64_t>(t.ranks[0]));
      w.varint(t.ranks.size());
    } else if (ranks_mode == 3) {
      w.varint(t.ranks.size() / static_cast<size_t>(L));
      for (size_t g = 0; g < t.ranks.size(); g += static_cast<size_t>(L)) {
        w.varint(static_cast<uint64_t>(t.ranks[g] / L));
      }
    } else if (ranks_mode == 2) {
      w.varint(t.ranks.size());
      int64_t last = 0;
      for (int32_t r : t.ranks) {
        w.varint(zigzag(static_cast<int64_t>(r) - last));
        last = r;
      }
    }
    if (!t.shards.empty()) {
      w.varint(t.shards.size());
      for (const Shard& s : t.shards) {
        w.varint(static_cast<uint64_t>(s.row_offset));
        w.varint(static_cast<uint64_t>(s.col_offset));
        w.varint(static_cast<uint64_t>(s.rows));
        w.varint(static_cast<uint64_t>(s.cols));
        w.varint(static_cast<uint64_t>(s.rank));
      }
    }
  }
  seal(out);
  return out;
}

size_t encoded_size(std::span<const uint8_t> header) {
  check_header(header);
  return kPlanHeaderBytes + static_cast<size_t>(get_u64(header.data() + 8));
}

uint64_t plan_hash(const ShardingPlan& plan) {
  const auto bytes = encode(plan);
  return get_u64(bytes.data() + 16);
}

ShardingPlan decode(std::span<const uint8_t> bytes) {
  check_header(bytes);
  const uint64_t body = get_u64(bytes.data() + 8);
  const size_t present = bytes.size() - kPlanHeaderBytes;
  if (body != present) {
    ETTKIT_THROW(CorruptData, "plan bytes are ", body > present ? "truncated" : "followed by extra bytes",
                 ": the header announces ", body, " body bytes, ", present, " are present");
  }
  const uint8_t* p = bytes.data() + kPlanHeaderBytes;
  const uint64_t want = get_u64(bytes.data() + 16);
  const uint64_t got = XXH3_64bits(p, present);
  if (want != got) {
    ETTKIT_THROW(CorruptData, "plan bytes fail their checksum (header 0x", std::hex, want, ", body 0x", got,
                 "); the bytes were damaged in transit or storage");
  }

  Reader r(p, present);
  r.at("world_size");
  const auto ws = static_cast<int32_t>(r.nonneg(kMaxWorldSize));
  r.at("ranks_per_host");
  const auto L = static_cast<int32_t>(r.nonneg(kMaxWorldSize));
  r.at("device");
  const uint8_t device = r.u8();
  if (device > static_cast<uint8_t>(DeviceType::kCuda)) r.fail(detail::concat("device ", int{device}, " is unknown"));
  r.at("table count");
  const uint64_t count = r.varint();
  if (count > r.left() / kMinTableBytes) {
    r.fail(detail::concat(count, " tables cannot fit in the ", r.left(), " bytes left"));
  }
  std::vector<TableSpec> tables(static_cast<size_t>(count));
  uint64_t rank_entries = 0;  // bounds what range-encoded ranks may expand to
  for (size_t i = 0; i < tables.size(); ++i) {
    TableSpec& t = tables[i];
    r.table(i, &t.name);
    r.at("name");
    const uint64_t shared = r.varint();
    const uint64_t suffix = r.varint();
    const size_t prev_size = i ? tables[i - 1].name.size() : 0;
    if (shared > prev_size) r.fail(detail::concat("name shares ", shared, " bytes with a ", prev_size, "-byte name"));
    if (suffix > kMaxTableNameBytes || shared + suffix > kMaxTableNameBytes) r.fail("name is too long");
    const uint8_t* s = r.take(static_cast<size_t>(suffix));
    t.name.reserve(static_cast<size_t>(shared + suffix));
    if (shared) t.name.assign(tables[i - 1].name, 0, static_cast<size_t>(shared));
    t.name.append(reinterpret_cast<const char*>(s), static_cast<size_t>(suffix));

    r.at("flags");
    const uint8_t flags = r.u8();
    if (flags & ~codec::kKnownFlags) r.fail(detail::concat("unknown flag bits 0x", std::hex, int{flags}));
    r.at("sharding_type");
    const uint8_t type = r.u8();
    if (type >= kNumShardingTypes) r.fail(detail::concat("sharding type ", int{type}, " is unknown"));
    t.type = static_cast<ShardingType>(type);
    r.at("dtype");
    const uint8_t dtype = r.u8();
    if (dtype >= kNumDTypes) r.fail(detail::concat("dtype ", int{dtype}, " is unknown"));
    t.dtype = static_cast<DType>(dtype);
    r.at("rows");
    t.rows = r.nonneg(kI64Max);
    r.at("cols");
    t.cols = r.nonneg(kI64Max);
    if (flags & codec::kHasColumnBlock) {
      r.at("column_block");
      t.column_block = r.nonneg(kI64Max);
      if (t.column_block == 0) r.fail("column_block is flagged present but 0");
    }
    if (flags & codec::kHasBuckets) {
      r.at("num_buckets");
      t.num_buckets = r.nonneg(kI64Max);
      if (t.num_buckets == 0) r.fail("num_buckets is flagged present but 0");
    }
    r.at("ranks");
    const int mode = (flags & codec::kRanksMask) >> codec::kRanksShift;
    if (mode == 1) {
      const int64_t start = r.nonneg(kI32Max);
      const int64_t n = r.nonneg(kI32Max);
      if (n < 2 || n > ws || start > ws - n) {
        r.fail(detail::concat("rank range [", start, ", ", start + n, ") does not fit a world of ", ws, " ranks"));
      }
      rank_entries += static_cast<uint64_t>(n);
      if (rank_entries > kMaxDecodedRankEntries) r.fail("too many ranks in total");
      t.ranks.resize(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) t.ranks[j] = static_cast<int32_t>(start + j);
    } else if (mode == 2) {
      const uint64_t n = r.varint();
      if (n == 0 || n > r.left()) r.fail(detail::concat(n, " ranks cannot fit in the ", r.left(), " bytes left"));
      t.ranks.resize(static_cast<size_t>(n));
      int64_t last = 0;
      for (auto& rank : t.ranks) {
        const int64_t v = last + unzigzag(r.varint());
        if (v < 0 || v > static_cast<int64_t>(kI32Max)) r.fail(detail::concat("rank ", v, " is out of range"));
        rank = static_cast<int32_t>(v);
        last = v;
      }
    } else if (mode == 3) {
      const uint64_t hosts = r.varint();
      if (L < 1 || hosts == 0 || hosts > r.left()) {
        r.fail(detail::concat(hosts, " hosts cannot fit in the ", r.left(), " bytes left"));
      }
      rank_entries += hosts * static_cast<uint64_t>(L);
      if (rank_entries > kMaxDecodedRankEntries) r.fail("too many ranks in total");
      t.ranks.reserve(static_cast<size_t>(hosts) * static_cast<size_t>(L));
      for (uint64_t h = 0; h < hosts; ++h) {
        const int64_t host = r.nonneg(static_cast<uint64_t>(ws / L));
        if (host >= ws / L) r.fail(detail::concat("host ", host, " is outside the ", ws / L, " hosts"));
        for (int32_t j = 0; j < L; ++j) t.ranks.push_back(static_cast<int32_t>(host * L + j));
      }
    }
    if (flags & codec::kHasShards) {
      r.at("shards");
      const uint64_t n = r.varint();
      if (n == 0 || n > r.left() / kMinShardBytes) {
        r.fail(detail::concat(n, " shards cannot fit in the ", r.left(), " bytes left"));
      }
      t.shards.resize(static_cast<size_t>(n));
      for (Shard& sh : t.shards) {
        sh.row_offset = r.nonneg(kI64Max);
        sh.col_offset = r.nonneg(kI64Max);
        sh.rows = r.nonneg(kI64Max);
        sh.cols = r.nonneg(kI64Max);
        sh.rank = static_cast<int32_t>(r.nonneg(kI32Max));
      }
    }
  }
  if (r.left() != 0) {
    r.table(static_cast<size_t>(-1), nullptr);
    r.at("end");
    r.fail(detail::concat(r.left(), " unexpected bytes after the last table"));
  }
  try {
    return ShardingPlan(std::move(tables), ws, L, static_cast<DeviceType>(device));
  } catch (const InvalidArgument& e) {
    // The checksum matched, so the encoder was handed (or built) an invalid plan: report it as bad data.
    ETTKIT_THROW(CorruptData, "plan bytes decode to an invalid plan: ", e.message());
  }
}

namespace codec {

void reseal_for_testing(std::vector<uint8_t>& bytes) {
  ETTKIT_EXPECTS(bytes.size() >= kPlanHeaderBytes, "reseal_for_testing needs at least a header");
  const uint64_t body = bytes.size() - kPlanHeaderBytes;
  put_u64(bytes.data() + 8, body);
  put_u64(bytes.data() + 16, XXH3_64bits(bytes.data() + kPlanHeaderBytes, body));
}

}  // namespace codec

}  // namespace ettkit::sharding
