// The replica rule and the pieces of a step's tensors (ettkit/checkpoint/step_pieces.h): one pass over every
// old rank's index, then a check per sharded tensor that its distinct boxes tile it.
#include "ettkit/checkpoint/step_pieces.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "checkpoint/reshard.h"
#include "ettkit/checkpoint/shard_names.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint {
namespace {

std::string show(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string kind(bool sharded) { return sharded ? "in pieces" : "whole"; }

/// What a message starts with: the step, when the caller named it.
std::string in_step(const std::string& source) { return source.empty() ? "" : "step '" + source + "': "; }

/// The product of `sizes`, or nullopt beyond 2^63 - 1.
std::optional<int64_t> numel(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) {
    if (__builtin_mul_overflow(n, s, &n)) return std::nullopt;
  }
  return n;
}

bool overlap(const StepPiece& a, const StepPiece& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    // Each end is a number: checked where the boxes were read.
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] || b.offsets[d] >= a.offsets[d] + a.sizes[d]) return false;
  }
  return true;
}

/// The tensors being collected, and per sharded key where each distinct box is in its `pieces`.
struct Collect {
  const std::string& source;
  std::map<std::string, StepTensor> out;
  std::map<std::string, std::map<std::vector<int64_t>, size_t>> at;
  std::map<std::string, int> first_rank;  // which old rank first saved each key (for messages)
};

/// A copy of a tensor saved whole: the first is read; the others only tell whether it is a replica.
void add_whole(StepTensor& t, StepPiece piece, const std::string& dtype, const std::optional<std::string>& digest,
               std::optional<std::string>& first_digest) {
  if (t.pieces.empty()) {
    first_digest = digest;
    t.unproven = !digest;
    t.pieces.push_back(std::move(piece));
    return;
  }
  if (!digest) t.unproven = true;
  const StepPiece& first = t.pieces.front();
  const bool same =
      dtype == t.dtype && piece.sizes == first.sizes && (!digest || !first_digest || *digest == *first_digest);
  if (!same && !t.differs) t.differs.emplace(first.rank, piece.rank);
}

/// A box of a tensor saved in pieces: kept unless an earlier rank saved the same box (a replica); empty boxes
/// (an uneven split's last ranks) count only towards the extent.
void add_box(Collect& c, const std::string& key, const std::string& name, StepTensor& t, StepPiece piece) {
  for (size_t d = 0; d < piece.sizes.size(); ++d) t.shape[d] = std::max(t.shape[d], piece.offsets[d] + piece.sizes[d]);
  if (std::find(piece.sizes.begin(), piece.sizes.end(), 0) != piece.sizes.end()) return;
  auto [it, fresh] = c.at[key].emplace(piece.offsets, t.pieces.size());
  if (fresh) {
    t.pieces.push_back(std::move(piece));
    return;
  }
  const StepPiece& kept = t.pieces[it->second];
  ETTKIT_CHECK(kept.sizes == piece.sizes, CorruptData, in_step(c.source), "'", name, "' is ", show(piece.sizes),
               " in old rank ", piece.rank, "'s file and ", show(kept.sizes), " in old rank ", kept.rank,
               "'s: two boxes at the same offsets must be the same box (a replica)");
}

void add_entry(Collect& c, int rank, const SafetensorsIndex& index, const std::string& name,
               const SafetensorsEntry& e, std::map<std::string, std::optional<std::string>>& first_digests) {
  auto [key, offsets] = split_shard_name(name);
  const bool sharded = offsets.has_value();
  StepPiece piece{rank, offsets.value_or(std::vector<int64_t>(e.shape.size(), 0)), e.shape,
                  index.data_offset + e.begin, index.data_offset + e.end};
  ETTKIT_CHECK(piece.offsets.size() == e.shape.size(), CorruptData, in_step(c.source), "'", name, "' in old rank ",
               rank, "'s file has ", piece.offsets.size(), " offsets for a tensor of ", e.shape.size(),
               " dimensions ", show(e.shape), "; a piece's name gives one offset per dimension");
  // The offsets come from the name and the sizes from the header: where the box ends must be a number (a
  // dimension of size 0 passes the header's byte check with any other dimension).
  for (size_t d = 0; d < e.shape.size(); ++d) {
    int64_t end = 0;
    ETTKIT_CHECK(!__builtin_add_overflow(piece.offsets[d], piece.sizes[d], &end), CorruptData, in_step(c.source),
                 "'", name, "' in old rank ", rank, "'s file ends beyond 2^63 in dimension ", d, " (offset ",
                 piece.offsets[d], ", size ", piece.sizes[d], ")");
  }
  auto [it, fresh] = c.out.try_emplace(key);
  StepTensor& t = it->second;
  if (fresh) {
    t.dtype = e.dtype;
    t.shape = sharded ? std::vector<int64_t>(e.shape.size(), 0) : e.shape;
    t.sharded = sharded;
    c.first_rank[key] = rank;
  }
  const int first = c.first_rank[key];
  ETTKIT_CHECK(t.sharded == sharded, CorruptData, in_step(c.source), "'", key, "' is saved ", kind(sharded),
               " in old rank ", rank, "'s file ('", name, "') and ", kind(t.sharded), " in old rank ", first,
               "'s: a tensor is saved either whole or in pieces");
  if (!sharded) {
    auto d = index.metadata.find(kWholeTensorDigestPrefix + name);
    std::optional<std::string> digest;
    if (d != index.metadata.end()) digest = d->second;
    add_whole(t, std::move(piece), e.dtype, digest, first_digests[key]);
    return;
  }
  ETTKIT_CHECK(t.dtype == e.dtype && t.shape.size() == e.shape.size(), CorruptData, in_step(c.source), "'", name,
               "' is ", e.dtype, " of ", e.shape.size(), " dimensions in old rank ", rank, "'s file; old rank ", first,
               "'s pieces of '", key, "' are ", t.dtype, " of ", t.shape.size(), ": the pieces of a tensor agree");
  add_box(c, key, name, t, std::move(piece));
}

/// The dimension along which the boxes have the most distinct offsets: sorted along it, a box overlaps only
/// the few that start before it ends there.
size_t sweep_dimension(const std::vector<StepPiece>& pieces, size_t dims) {
  size_t best = 0, most = 0;
  for (size_t d = 0; d < dims; ++d) {
    std::set<int64_t> starts;
    for (const StepPiece& p : pieces) starts.insert(p.offsets[d]);
    if (starts.size() > most) best = d, most = starts.size();
  }
  return best;
}

/// The distinct boxes of a sharded tensor hold exactly its elements: as many as it has, and no two sharing one.
void check_tiling(const std::string& source, const std::string& key, StepTensor& t) {
  std::sort(t.pieces.begin(), t.pieces.end(),
            [](const StepPiece& a, const StepPiece& b) { return a.offsets < b.offsets; });
  std::optional<int64_t> total = numel(t.shape);
  ETTKIT_CHECK(total, CorruptData, in_step(source), "the saved pieces of '", key, "' make up ", show(t.shape),
               ", more than 2^63 elements");
  // Summed without overflowing: a sum past 2^63 - 1 is more than any tensor of this extent holds.
  std::optional<int64_t> held = 0;
  for (const StepPiece& p : t.pieces) {
    std::optional<int64_t> n = numel(p.sizes);
    if (!held || !n || __builtin_add_overflow(*held, *n, &*held)) held.reset();
  }
  ETTKIT_CHECK(held == total, CorruptData, in_step(source), "the saved pieces of '", key, "' hold ",
               held ? std::to_string(*held) : std::string("more than 2^63"),
               " elements of its ", show(t.shape), " (", *total, "): pieces overlap or are missing");
  if (t.shape.empty()) return;
  const size_t d = sweep_dimension(t.pieces, t.shape.size());
  std::vector<const StepPiece*> order;
  for (const StepPiece& p : t.pieces) order.push_back(&p);
  std::sort(order.begin(), order.end(),
            [d](const StepPiece* a, const StepPiece* b) { return a->offsets[d] < b->offsets[d]; });
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t end = order[i]->offsets[d] + order[i]->sizes[d];
    for (size_t j = i + 1; j < order.size() && order[j]->offsets[d] < end; ++j) {
      ETTKIT_CHECK(!overlap(*order[i], *order[j]), CorruptData, in_step(source), "the saved pieces of '", key,
                   "' at offsets ", show(order[i]->offsets), " (old rank ", order[i]->rank, ", sizes ",
                   show(order[i]->sizes), ") and ", show(order[j]->offsets), " (old rank ", order[j]->rank, ", sizes ",
                   show(order[j]->sizes), ") overlap, so part of ", show(t.shape),
                   " is missing: the pieces of a tensor tile it");
    }
  }
}

}  // namespace

std::map<std::string, StepTensor> step_tensors(const std::vector<const SafetensorsIndex*>& ranks,
                                               const std::string& source) {
  Collect c{source, {}, {}, {}};
  std::map<std::string, std::optional<std::string>> first_digests;
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (const auto& [name, entry] : ranks[r]->tensors) {
      add_entry(c, static_cast<int>(r), *ranks[r], name, entry, first_digests);
    }
  }
  for (auto& [key, t] : c.out) {
    if (t.sharded) check_tiling(source, key, t);
  }
  return std::move(c.out);
}

void assemble_pieces(const std::string& key, const StepTensor& t, uint64_t element_size,
                     const std::vector<std::string_view>& data, char* out) {
  ETTKIT_EXPECTS(data.size() == t.pieces.size(), "'", key, "': ", data.size(), " byte strings for ", t.pieces.size(),
                 " pieces");
  std::vector<detail::SavedPiece> saved;
  for (size_t i = 0; i < t.pieces.size(); ++i) {
    const StepPiece& p = t.pieces[i];
    const uint64_t want = static_cast<uint64_t>(numel(p.sizes).value_or(INT64_MAX)) * element_size;
    ETTKIT_EXPECTS(data[i].size() == want, "'", key, "': the piece at offsets ", show(p.offsets), " has ",
                   data[i].size(), " bytes; its sizes ", show(p.sizes), " are ", want);
    saved.push_back({static_cast<int>(i), {p.offsets, p.sizes}, 0});
  }
  detail::Box whole{std::vector<int64_t>(t.shape.size(), 0), t.shape};
  // The loader's plan (reshard.h), which reads each element once from the first piece that holds it.
  for (const detail::CopyRange& r : detail::plan_reshard(key, t.shape, saved, whole, element_size)) {
    std::memcpy(out + r.dst_offset, data[static_cast<size_t>(r.source)].data() + r.src_offset, r.length);
  }
}

}  // namespace ettkit::checkpoint
