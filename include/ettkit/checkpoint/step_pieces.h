#pragma once
// The replica rule and the pieces of a step's tensors, in one place (#64, one owner per rule): which old
// rank's copy of a tensor saved whole is read, which saved boxes of a sharded tensor count (one copy of each
// box that several ranks saved), and whether those boxes make up the whole tensor. The C++ loader's
// resharding plan (src/checkpoint/reshard.cpp, reshard_plan.cpp), the DCP StorageReader
// (python/ettkit/checkpoint/_dcp_reader.py) and export's step reader (python/ettkit/integrations/
// step_reader.py, through ettkit._C.checkpoint.step_tensors) all read a step through this function, so that
// none of them can take a piece another would refuse or read another copy.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ettkit/checkpoint/step_format.h"
#include "ettkit/common/export.h"

namespace ettkit::checkpoint {

/// One saved box of a tensor to read: the old rank whose file holds it, where it lies in the whole tensor,
/// and its bytes in that file (absolute offsets; row-major and contiguous).
struct StepPiece {
  int rank = 0;
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  uint64_t begin = 0;
  uint64_t end = 0;
};

/// A tensor of a step (its key: the saved name without "@<offsets>") as every reader reads it.
struct StepTensor {
  std::string dtype;           ///< safetensors dtype ("F32", ...): the same in every piece
  std::vector<int64_t> shape;  ///< saved whole: the first copy's shape; sharded: the extent of its boxes
  bool sharded = false;        ///< saved as "<key>@<offsets>" pieces (never also whole)
  /// Sharded: the distinct non-empty boxes, sorted by offsets, each from the lowest old rank that saved it;
  /// they tile `shape` exactly. Whole: one piece, the lowest old rank's copy (empty or not).
  std::vector<StepPiece> pieces;
  /// Saved whole: the first old rank's copy and the first other rank whose copy differs from it (another
  /// digest, dtype or shape): per-rank state, which has no single value. nullopt when none differs.
  std::optional<std::pair<int, int>> differs;
  /// Saved whole: some copy carries no digest (a step of an older ettkit), so it cannot be proven a replica.
  bool unproven = false;
};

/// The tensors of a step whose old rank r's safetensors index is `ranks[r]`, applying the replica rule above.
/// `source` names the step in messages ("" for none). Throws CorruptData naming the tensor, the old rank and
/// what would be valid when the index is hostile: a shard name with another number of offsets than the
/// entry has dimensions, a box ending beyond 2^63 or a tensor of more than 2^63 elements, a key saved both
/// whole and in pieces or in pieces of different dtypes or ranks, two boxes at the same offsets of different
/// sizes, boxes that overlap, or boxes that leave part of the tensor out.
ETTKIT_API std::map<std::string, StepTensor> step_tensors(const std::vector<const SafetensorsIndex*>& ranks,
                                                          const std::string& source);

/// Puts tensor `key` (`t`, of `element_size` bytes an element) together into `out` (row-major, its
/// numel * element_size bytes) from `data[i]`, the bytes of `t.pieces[i]`, with the loader's resharding plan:
/// one owner of how pieces make up a tensor. InvalidArgument when a piece's bytes are not of its size or the
/// pieces do not cover the tensor.
ETTKIT_API void assemble_pieces(const std::string& key, const StepTensor& t, uint64_t element_size,
                                const std::vector<std::string_view>& data, char* out);

}  // namespace ettkit::checkpoint
