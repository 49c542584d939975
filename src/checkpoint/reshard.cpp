// Resharding reads (reshard.h): box intersection and difference, and the contiguous runs of an overlap.
#include "checkpoint/reshard.h"

#include <algorithm>
#include <map>
#include <optional>

#include "ettkit/common/error.h"

namespace ettkit::checkpoint {

std::pair<std::string, std::optional<std::vector<int64_t>>> split_shard_name(const std::string& name) {
  size_t at = name.rfind('@');
  if (at == std::string::npos || at + 1 == name.size()) return {name, std::nullopt};
  std::vector<int64_t> offsets;
  size_t i = at + 1;
  for (;;) {
    size_t j = i;
    while (j < name.size() && name[j] >= '0' && name[j] <= '9') ++j;
    if (j == i || j - i > 18) return {name, std::nullopt};
    offsets.push_back(std::stoll(name.substr(i, j - i)));
    if (j == name.size()) break;
    if (name[j] != ',') return {name, std::nullopt};
    i = j + 1;
  }
  return {name.substr(0, at), offsets};
}

}  // namespace ettkit::checkpoint

namespace ettkit::checkpoint::detail {

namespace {

std::string show(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string show(const Box& b) { return "offsets " + show(b.offsets) + " sizes " + show(b.sizes); }

std::optional<Box> intersect(const Box& a, const Box& b) {
  Box out;
  for (size_t d = 0; d < a.sizes.size(); ++d) {
    int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    int64_t hi = std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d]);
    if (hi <= lo) return std::nullopt;
    out.offsets.push_back(lo);
    out.sizes.push_back(hi - lo);
  }
  return out;
}

/// `a` minus `cut` (which lies inside `a`) as disjoint boxes: slab by slab, one dimension at a time.
std::vector<Box> subtract(Box a, const Box& cut) {
  std::vector<Box> out;
  for (size_t d = 0; d < a.sizes.size(); ++d) {
    int64_t lo = cut.offsets[d], hi = cut.offsets[d] + cut.sizes[d];
    int64_t a_lo = a.offsets[d], a_hi = a.offsets[d] + a.sizes[d];
    if (lo > a_lo) {
      Box below = a;
      below.sizes[d] = lo - a_lo;
      out.push_back(below);
    }
    if (hi < a_hi) {
      Box above = a;
      above.offsets[d] = hi;
      above.sizes[d] = a_hi - hi;
      out.push_back(above);
    }
    a.offsets[d] = lo;  // what is left of `a` lies inside the cut along d
    a.sizes[d] = hi - lo;
  }
  return out;
}

/// Row-major element strides of a box.
std::vector<int64_t> strides_of(const Box& b) {
  std::vector<int64_t> s(b.sizes.size(), 1);
  for (size_t d = b.sizes.size(); d-- > 1;) s[d - 1] = s[d] * b.sizes[d];
  return s;
}

/// The runs that copy the overlap `part` from `piece` into `want`.
void emit(const SavedPiece& piece, const Box& want, const Box& part, uint64_t elem, std::vector<CopyRange>& out) {
  const size_t n = part.sizes.size();
  const std::vector<int64_t> ps = strides_of(piece.box), ws = strides_of(want);
  // Dimensions [k, n) are one contiguous run in both layouts: every dimension after k is whole in the
  // piece, in the wanted box and in the overlap.
  size_t k = n;
  int64_t run = 1;
  while (k > 0) {
    size_t d = k - 1;
    run *= part.sizes[d];
    k = d;
    if (part.sizes[d] != piece.box.sizes[d] || part.sizes[d] != want.sizes[d]) break;
  }
  std::vector<int64_t> idx(k, 0);  // position inside `part` over dimensions [0, k)
  for (;;) {
    int64_t src = 0, dst = 0;
    for (size_t d = 0; d < n; ++d) {
      int64_t g = part.offsets[d] + (d < k ? idx[d] : 0);
      src += (g - piece.box.offsets[d]) * ps[d];
      dst += (g - want.offsets[d]) * ws[d];
    }
    out.push_back({piece.source, piece.byte_offset + static_cast<uint64_t>(src) * elem,
                   static_cast<uint64_t>(dst) * elem, static_cast<uint64_t>(run) * elem});
    size_t d = k;
    while (d > 0 && ++idx[d - 1] == part.sizes[d - 1]) idx[--d] = 0;
    if (d == 0) break;
  }
}

void check_box(const std::string& name, const std::vector<int64_t>& global, const Box& b, const std::string& what) {
  ETTKIT_EXPECTS(b.offsets.size() == global.size() && b.sizes.size() == global.size(), "'", name, "': ", what,
                 " has ", b.offsets.size(), " offsets and ", b.sizes.size(), " sizes; the tensor has ",
                 global.size(), " dimensions ", show(global));
  for (size_t d = 0; d < global.size(); ++d) {
    // Compared without adding offset and size: their sum may not be a number.
    const bool inside = b.offsets[d] >= 0 && b.sizes[d] >= 0 && b.offsets[d] <= global[d] &&
                        b.sizes[d] <= global[d] - b.offsets[d];
    ETTKIT_EXPECTS(inside, "'", name, "': ", what, " (", show(b), ") lies outside the global shape ", show(global),
                   " in dimension ", d);
  }
}

}  // namespace

int64_t Box::numel() const {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::vector<CopyRange> plan_reshard(const std::string& name, const std::vector<int64_t>& global_shape,
                                    const std::vector<SavedPiece>& saved, const Box& want, uint64_t element_size) {
  check_box(name, global_shape, want, "the wanted shard");
  for (const SavedPiece& p : saved) check_box(name, global_shape, p.box, "the piece saved by " + std::to_string(p.source));
  std::vector<CopyRange> out;
  if (want.numel() == 0) return out;
  std::vector<Box> remaining{want};
  for (const SavedPiece& p : saved) {
    if (p.box.numel() == 0) continue;
    std::vector<Box> next;
    for (const Box& r : remaining) {
      std::optional<Box> part = intersect(r, p.box);
      if (!part) {
        next.push_back(r);
        continue;
      }
      emit(p, want, *part, element_size, out);
      for (Box& rest : subtract(r, *part)) next.push_back(std::move(rest));
    }
    remaining = std::move(next);
    if (remaining.empty()) break;
  }
  ETTKIT_EXPECTS(remaining.empty(), "'", name, "': no saved piece holds ", show(remaining.front()),
                 " of the wanted shard (", show(want), "); the checkpoint's pieces do not cover the tensor ",
                 show(global_shape));
  std::sort(out.begin(), out.end(), [](const CopyRange& a, const CopyRange& b) { return a.dst_offset < b.dst_offset; });
  // Neighbours that continue each other in both files become one read.
  std::vector<CopyRange> merged;
  for (const CopyRange& r : out) {
    if (!merged.empty()) {
      CopyRange& m = merged.back();
      if (m.source == r.source && m.src_offset + m.length == r.src_offset && m.dst_offset + m.length == r.dst_offset) {
        m.length += r.length;
        continue;
      }
    }
    merged.push_back(r);
  }
  return merged;
}

namespace {

SavedPiece saved_piece(const StepPiece& p) { return {p.rank, Box{p.offsets, p.sizes}, p.begin}; }

}  // namespace

std::vector<CopyRange> plan_destination(const std::string& name, const std::vector<int64_t>& shape,
                                        const std::string& dtype, const StepTensor* saved,
                                        const std::vector<int64_t>* global_shape) {
  auto [key, offsets] = split_shard_name(name);
  const uint64_t elem = static_cast<uint64_t>(safetensors_dtype_size(dtype));
  ETTKIT_EXPECTS(elem > 0, "'", name, "': dtype ", dtype, " cannot be resharded");
  ETTKIT_EXPECTS(saved != nullptr, "'", name, "': no rank of the checkpoint saved ", offsets ? "a piece of '" : "'",
                 key, "'");
  // Which copy and which boxes are read is step_tensors' (the replica rule); what is checked here is that they
  // are this state's tensor.
  const int rank = saved->pieces.empty() ? 0 : saved->pieces.front().rank;
  ETTKIT_EXPECTS(saved->dtype == dtype, "'", key, "' is ", saved->dtype, " in old rank ", rank,
                 "'s file; the state's '", name, "' is ", dtype);
  ETTKIT_EXPECTS(saved->shape.size() == shape.size(), "'", key, "' has ", saved->shape.size(),
                 " dimensions in old rank ", rank, "'s file; the state's '", name, "' has ", shape.size());
  Box want;
  want.sizes = shape;
  want.offsets = offsets.value_or(std::vector<int64_t>(shape.size(), 0));
  ETTKIT_EXPECTS(want.offsets.size() == shape.size(), "'", name, "': ", want.offsets.size(),
                 " offsets for a tensor of ", shape.size(), " dimensions");
  std::vector<SavedPiece> pieces;
  for (const StepPiece& p : saved->pieces) pieces.push_back(saved_piece(p));
  if (!saved->sharded && !offsets) {
    // A whole tensor: the copy read must be the whole tensor.
    ETTKIT_EXPECTS(saved->shape == shape, "'", name, "' is ", show(saved->shape), " in old rank ", rank,
                   "'s file; the state's is ", show(shape));
    return plan_reshard(key, shape, pieces, want, elem);
  }
  if (!offsets) {
    // Saved sharded, wanted whole (one rank's plain model, a data-parallel table): the pieces must make up
    // exactly this tensor, not a larger one of which it would be a corner.
    const std::vector<int64_t>& extent = saved->shape;
    ETTKIT_EXPECTS(extent == shape, "'", name, "' is ", show(shape), " in the state; the checkpoint saved it "
                   "sharded, its pieces making up ", show(extent), " (another global shape)");
    return plan_reshard(key, shape, pieces, want, elem);
  }
  if (!saved->sharded) {
    // Saved whole, wanted as a shard: the whole copy must be the state's global tensor, which the shard's
    // box alone does not tell.
    ETTKIT_EXPECTS(global_shape != nullptr, "'", key, "' was saved whole and the state holds it sharded ('", name,
                   "'): its global shape is needed to check it is the same tensor (load_latest's global_shapes)");
    const std::vector<int64_t>& whole_shape = saved->shape;
    ETTKIT_EXPECTS(whole_shape == *global_shape, "'", key, "' is ", show(*global_shape),
                   " in the state (sharded); the checkpoint saved it whole as ", show(whole_shape), " in old rank ",
                   rank, "'s file (another global shape)");
    return plan_reshard(key, *global_shape, pieces, want, elem);
  }
  std::vector<int64_t> global = saved->shape;
  if (global_shape) {
    ETTKIT_EXPECTS(global_shape->size() == shape.size(), "'", key, "': its global shape ", show(*global_shape),
                   " has ", global_shape->size(), " dimensions; the state's shard '", name, "' has ", shape.size());
    ETTKIT_EXPECTS(saved->shape == *global_shape, "'", key, "' is ", show(*global_shape),
                   " in the state; the checkpoint's pieces of it make up ", show(saved->shape),
                   " (another global shape)");
  }
  for (size_t d = 0; d < shape.size(); ++d) global[d] = std::max(global[d], want.offsets[d] + want.sizes[d]);
  return plan_reshard(key, global, pieces, want, elem);
}

std::vector<CopyRange> plan_destination(const std::string& name, const std::vector<int64_t>& shape,
                                        const std::string& dtype, const std::vector<const SafetensorsIndex*>& indexes,
                                        const std::vector<int64_t>* global_shape) {
  const std::map<std::string, StepTensor> saved = step_tensors(indexes, "");
  auto it = saved.find(split_shard_name(name).first);
  return plan_destination(name, shape, dtype, it == saved.end() ? nullptr : &it->second, global_shape);
}

uint64_t planned_bytes(const std::vector<CopyRange>& plan) {
  uint64_t n = 0;
  for (const CopyRange& r : plan) n += r.length;
  return n;
}

}  // namespace ettkit::checkpoint::detail
