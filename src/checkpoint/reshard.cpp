// Resharding reads (reshard.h): box intersection and difference, and the contiguous runs of an overlap.
#include "checkpoint/reshard.h"

#include <algorithm>
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

void add_piece_keys(const SafetensorsIndex& index, std::set<std::string>& out) {
  for (const auto& entry : index.tensors) {
    auto [key, offsets] = split_shard_name(entry.first);
    if (offsets) out.insert(std::move(key));
  }
}

namespace {

/// What the step holds of `key`: its saved pieces ("key@offsets"), the first old rank's copy of it saved
/// whole, and the global shape the pieces make up. `name`, `shape` and `dtype` are the state's tensor's, for
/// the checks and their messages.
struct SavedOfKey {
  std::vector<SavedPiece> pieces;
  std::optional<SavedPiece> whole;
  std::vector<int64_t> extent;  // of the pieces: the global shape they make up
};

SavedOfKey saved_of_key(const std::string& key, const std::string& name, const std::vector<int64_t>& shape,
                        const std::string& dtype, const std::vector<const SafetensorsIndex*>& indexes) {
  SavedOfKey saved;
  saved.extent.assign(shape.size(), 0);
  std::vector<SavedPiece>& pieces = saved.pieces;
  std::optional<SavedPiece>& whole = saved.whole;
  std::vector<int64_t>& extent = saved.extent;
  for (size_t r = 0; r < indexes.size(); ++r) {
    for (const auto& [saved_name, e] : indexes[r]->tensors) {
      auto [saved_key, saved_offsets] = split_shard_name(saved_name);
      if (saved_key != key || (!saved_offsets && whole)) continue;
      ETTKIT_EXPECTS(e.dtype == dtype, "'", saved_name, "' is ", e.dtype, " in old rank ", r, "'s file; the state's '",
                     name, "' is ", dtype);
      SavedPiece p;
      p.source = static_cast<int>(r);
      p.box.sizes = e.shape;
      p.box.offsets = saved_offsets.value_or(std::vector<int64_t>(e.shape.size(), 0));
      ETTKIT_EXPECTS(p.box.offsets.size() == shape.size() && e.shape.size() == shape.size(), "'", saved_name,
                     "' has ", e.shape.size(), " dimensions; the state's '", name, "' has ", shape.size());
      // The offsets come from the file's tensor names and the sizes from its header: where they end must be
      // a number (a dimension of size 0 passes the header's byte check with any other dimension).
      for (size_t d = 0; d < shape.size(); ++d) {
        int64_t end = 0;
        ETTKIT_CHECK(!__builtin_add_overflow(p.box.offsets[d], p.box.sizes[d], &end), CorruptData, "'", saved_name,
                     "' in old rank ", r, "'s file ends beyond 2^63 in dimension ", d, " (offset ", p.box.offsets[d],
                     ", size ", p.box.sizes[d], ")");
        if (saved_offsets) extent[d] = std::max(extent[d], end);
      }
      p.byte_offset = indexes[r]->data_offset + e.begin;
      if (saved_offsets) {
        pieces.push_back(std::move(p));
      } else {
        whole = std::move(p);  // one copy is enough
      }
    }
  }
  return saved;
}

}  // namespace

std::vector<CopyRange> plan_destination(const std::string& name, const std::vector<int64_t>& shape,
                                        const std::string& dtype, const std::vector<const SafetensorsIndex*>& indexes,
                                        const std::vector<int64_t>* global_shape) {
  auto [key, offsets] = split_shard_name(name);
  const uint64_t elem = static_cast<uint64_t>(safetensors_dtype_size(dtype));
  ETTKIT_EXPECTS(elem > 0, "'", name, "': dtype ", dtype, " cannot be resharded");
  // A destination of the same kind reads what is of its kind; one of the other kind reads the other (a layout
  // change: a sharded tensor read whole, or a tensor saved whole read as a shard).
  auto [pieces, whole, extent] = saved_of_key(key, name, shape, dtype, indexes);
  Box want;
  want.sizes = shape;
  want.offsets = offsets.value_or(std::vector<int64_t>(shape.size(), 0));
  ETTKIT_EXPECTS(want.offsets.size() == shape.size(), "'", name, "': ", want.offsets.size(),
                 " offsets for a tensor of ", shape.size(), " dimensions");
  if (!offsets && whole) {
    // A whole tensor: every copy must be the whole tensor.
    ETTKIT_EXPECTS(whole->box.sizes == shape, "'", name, "' is ", show(whole->box.sizes), " in old rank ",
                   whole->source, "'s file; the state's is ", show(shape));
    return plan_reshard(key, shape, {*whole}, want, elem);
  }
  if (!offsets && !pieces.empty()) {
    // Saved sharded, wanted whole (one rank's plain model, a data-parallel table): the pieces must make up
    // exactly this tensor, not a larger one of which it would be a corner.
    ETTKIT_EXPECTS(extent == shape, "'", name, "' is ", show(shape), " in the state; the checkpoint saved it sharded, "
                   "its pieces making up ", show(extent), " (another global shape)");
    return plan_reshard(key, shape, pieces, want, elem);
  }
  if (offsets && pieces.empty() && whole) {
    // Saved whole, wanted as a shard: the whole copy must be the state's global tensor, which the shard's
    // box alone does not tell.
    ETTKIT_EXPECTS(global_shape != nullptr, "'", key, "' was saved whole and the state holds it sharded ('", name,
                   "'): its global shape is needed to check it is the same tensor (load_latest's global_shapes)");
    ETTKIT_EXPECTS(whole->box.sizes == *global_shape, "'", key, "' is ", show(*global_shape),
                   " in the state (sharded); the checkpoint saved it whole as ", show(whole->box.sizes),
                   " in old rank ", whole->source, "'s file (another global shape)");
    return plan_reshard(key, *global_shape, {*whole}, want, elem);
  }
  ETTKIT_EXPECTS(!pieces.empty(), "'", name, "': no rank of the checkpoint saved ", offsets ? "a piece of '" : "'",
                 key, "'");
  std::vector<int64_t> global = extent;
  if (global_shape) {
    ETTKIT_EXPECTS(global_shape->size() == shape.size(), "'", key, "': its global shape ", show(*global_shape),
                   " has ", global_shape->size(), " dimensions; the state's shard '", name, "' has ", shape.size());
    ETTKIT_EXPECTS(extent == *global_shape, "'", key, "' is ", show(*global_shape),
                   " in the state; the checkpoint's pieces of it make up ", show(extent), " (another global shape)");
  }
  for (size_t d = 0; d < shape.size(); ++d) global[d] = std::max(global[d], want.offsets[d] + want.sizes[d]);
  return plan_reshard(key, global, pieces, want, elem);
}

uint64_t planned_bytes(const std::vector<CopyRange>& plan) {
  uint64_t n = 0;
  for (const CopyRange& r : plan) n += r.length;
  return n;
}

}  // namespace ettkit::checkpoint::detail
