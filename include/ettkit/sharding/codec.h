#pragma once
// The plan codec: a compact, versioned, checksummed binary encoding of a ShardingPlan, the payload of
// broadcast_plan (one byte-tensor broadcast over a c10d process group).
//
// Format version 1 (little-endian; full layout in docs/sharding.md):
//   header (24 bytes): "ETSP" | u16 version | u16 flags (0) | u64 body length | u64 XXH3-64(body)
//   body: varint world_size, ranks_per_host, u8 device, varint table count, then per table: the name as
//         (bytes shared with the previous name, suffix), u8 flags, u8 type, u8 dtype, varint rows, cols,
//         [column_block], [num_buckets], ranks (none | range | delta list | host indexes), [explicit shards].
// encode() is deterministic: equal plans give equal bytes, so plan_hash() can be compared across ranks.
//
// decode() never trusts its input: every read is bounds-checked, every count is checked against the
// bytes left before anything is allocated, and the decoded plan goes through ShardingPlan's validation.
// Bad input throws CorruptData naming what was wrong (truncated, bad magic, wrong version, checksum
// mismatch, and for a damaged table its index/name and field); it never crashes or hangs.

#include <cstdint>
#include <span>
#include <vector>

#include "ettkit/common/export.h"
#include "ettkit/sharding/plan.h"

namespace ettkit::sharding {

inline constexpr uint16_t kPlanCodecVersion = 1;
inline constexpr size_t kPlanHeaderBytes = 24;

ETTKIT_API std::vector<uint8_t> encode(const ShardingPlan& plan);
ETTKIT_API ShardingPlan decode(std::span<const uint8_t> bytes);
/// XXH3-64 of the encoded body: a one-word fingerprint of the plan, equal on ranks with equal plans.
ETTKIT_API uint64_t plan_hash(const ShardingPlan& plan);
/// The total encoded size (header + body) announced by the first kPlanHeaderBytes bytes of an encoding.
/// Checks the magic and the version (CorruptData otherwise); used by receivers of a broadcast.
ETTKIT_API size_t encoded_size(std::span<const uint8_t> header);

}  // namespace ettkit::sharding
