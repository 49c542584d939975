#pragma once
// How a step names what it saved, the one definition of the grammar that the C++ loader, the resharding
// planner and Python's DCP reader (through ettkit._C.checkpoint.split_shard_name) all parse: a local shard of
// a sharded tensor is saved as "<key>@<offsets>" ("emb.t1.weight@24,0"), and a tensor saved whole carries its
// XXH3 in the file's __metadata__ under kWholeTensorDigestPrefix + its name.

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ettkit/common/export.h"

namespace ettkit::checkpoint {

/// A saved tensor name split into the tensor it belongs to and, for a local shard of a sharded tensor
/// ("emb.t1.weight@24,0", the Python layer's names for a ShardedTensor's shards), its offsets in it. A name
/// without '@' (or whose suffix is not a list of integers of at most 18 digits each) is a whole tensor: no
/// offsets.
ETTKIT_API std::pair<std::string, std::optional<std::vector<int64_t>>> split_shard_name(const std::string& name);

/// The __metadata__ key under which a disk save records the XXH3-64 (hex) of a tensor it saved whole (no
/// `@offsets` in its name): "ettkit.xxh3.<name>". Why: a step resharded onto another number of ranks gives
/// every new rank one old rank's copy of such a tensor, which is right only when every old rank held the
/// same bytes (a DDP replica); these digests prove it, or show the tensor was per-rank state, from the
/// headers alone.
inline constexpr const char* kWholeTensorDigestPrefix = "ettkit.xxh3.";

}  // namespace ettkit::checkpoint
