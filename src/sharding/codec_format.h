#pragma once
// Private details of the plan codec (codec.cpp) that tests and the fuzz harnesses need.

#include <cstdint>
#include <vector>

#include "ettkit/common/export.h"

namespace ettkit::sharding::codec {

inline constexpr char kPlanMagic[4] = {'E', 'T', 'S', 'P'};
/// Upper bound on an encoded plan (header + body) that a receiver will allocate for.
inline constexpr uint64_t kMaxEncodedBytes = uint64_t{1} << 32;

// Per-table flag bits of format version 1.
inline constexpr uint8_t kHasColumnBlock = 1u << 0;
inline constexpr uint8_t kHasBuckets = 1u << 1;
inline constexpr uint8_t kHasShards = 1u << 2;
inline constexpr uint8_t kRanksShift = 3;  // 2 bits: 0 none, 1 range (start, count), 2 delta list, 3 hosts
inline constexpr uint8_t kRanksMask = 3u << kRanksShift;
inline constexpr uint8_t kKnownFlags = kHasColumnBlock | kHasBuckets | kHasShards | kRanksMask;

/// Rewrites the header's body length and checksum to match the body, so that mutated bodies reach the
/// parser instead of failing the checksum (fuzzing only). Requires at least a full header.
ETTKIT_API void reseal_for_testing(std::vector<uint8_t>& bytes);

}  // namespace ettkit::sharding::codec
