// The read plan of a step written at another world size (read_plan.h, plan_reshard_read): every old rank's
// files are opened and indexed (their headers only), each destination tensor gets the reads that fill it
// (reshard.h), and, with `verify`, the checksum chunks those reads touch are checked. At another world size
// the non-tensor state is old rank 0's (there is no rank it belongs to: it is taken as the same on every rank,
// like a whole tensor). At the same world size (this rank's shards were saved under another layout) it is this
// rank's own, and so are its whole tensors: only the shards move.
#include <ATen/ATen.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "checkpoint/file_checksums.h"
#include "checkpoint/read_plan.h"
#include "common/logging.h"

namespace ettkit::checkpoint::detail {

namespace {

/// Opens every old rank's files from the one decoded manifest and reads their headers and old rank 0's extra
/// bytes. false when the step vanished meanwhile. Throws Error for a bad step.
bool open_old_ranks(ReadPlan& p, const StepDirectory& step_dir, const LoadRequest& req) {
  for (int r = 0; r < p.saved_world; ++r) {
    std::optional<OpenedStep> f = step_dir.open_rank(r);
    if (!f) return false;
    listed_digest(*f, f->data);  // listed, and of its size; its chunks are checked as they are read
    p.indexes.push_back(read_safetensors_index(f->data));
    p.sources.push_back(std::move(*f));
  }
  p.extra = read_checked_extra(p.sources.at(static_cast<size_t>(p.home)), req.verify);
  return true;
}

/// What planning found wrong or doubtful with the state's names.
struct ReshardFindings {
  std::vector<std::string> problems;   // the step cannot be loaded into this state by resharding
  std::vector<std::string> unproven;   // saved whole by an older ettkit: no digest proves it a replica
  std::vector<std::string> differing;  // saved whole, differing, taken from old rank 0 anyway (whole_from_rank0)
};

/// What the old ranks saved, per key (step_tensors, step_pieces.h: the replica rule's one owner).
using SavedTensors = std::map<std::string, StepTensor>;

/// A tensor saved whole is read from one old rank's copy, which is right only for a replica: the same bytes
/// on every old rank that saved it. The digests in the old headers prove it (or show per-rank state, which
/// is refused rather than silently replaced by old rank 0's values); step_tensors compared them. Steps saved
/// before the digests existed cannot prove it: they load as before, with a warning.
void check_replicated(const SavedTensors& saved, const std::string& name, bool whole_from_rank0,
                      ReshardFindings& out) {
  auto it = saved.find(name);
  if (it == saved.end() || it->second.sharded) return;
  const StepTensor& t = it->second;
  if (!t.differs && t.unproven) {
    out.unproven.push_back(name);
  } else if (t.differs && whole_from_rank0) {
    out.differing.push_back(name);
  } else if (t.differs) {
    out.problems.push_back(ettkit::detail::concat(
        "'", name, "' was saved whole and differs between old ranks ", t.differs->first, " and ", t.differs->second,
        ": per-rank state cannot be mapped onto another number of ranks (only a tensor every rank holds the "
        "same, such as a DDP replica, can); save it as a DTensor or ShardedTensor, keep it out of the "
        "checkpoint, or, when old rank 0's copy is the right one (a DDP model's buffers with "
        "broadcast_buffers), load with reshard_whole_from_rank0"));
  }
}

/// This rank's own copy of `name`, saved whole in its file `home` (a same-world load keeps per-rank state):
/// nullopt when its file has no such tensor.
std::optional<StepTensor> own_copy(const SafetensorsIndex& home, int rank, const std::string& name) {
  auto e = home.tensors.find(name);
  if (e == home.tensors.end()) return std::nullopt;
  StepTensor t;
  t.dtype = e->second.dtype;
  t.shape = e->second.shape;
  t.pieces.push_back({rank, std::vector<int64_t>(t.shape.size(), 0), t.shape, home.data_offset + e->second.begin,
                      home.data_offset + e->second.end});
  return t;
}

/// Each destination's reads, and the whole tensors that are proven (or not) replicas.
void plan_fills(ReadPlan& p, const LoadRequest& req, const SavedTensors& saved, std::set<std::string>& wanted_keys,
                ReshardFindings& out) {
  const bool same_world = p.saved_world == req.world;
  const SafetensorsIndex& home = p.indexes[static_cast<size_t>(p.home)];
  auto saved_in_pieces = [&saved](const std::string& key) {
    auto it = saved.find(key);
    return it != saved.end() && it->second.sharded;
  };
  std::set<std::string> from_whole;  // shards read from a tensor saved whole: it must be a replica
  for (const auto& [name, t] : req.tensors) {
    auto [key, offsets] = split_shard_name(name);
    wanted_keys.insert(key);
    const std::vector<int64_t>* global = nullptr;
    if (offsets && req.global_shapes) {
      auto g = req.global_shapes->find(key);
      if (g != req.global_shapes->end()) global = &g->second;
    }
    const std::string dtype = safetensors_dtype(t.scalar_type(), name);
    try {
      if (same_world && !offsets && (home.tensors.count(name) || !saved_in_pieces(key))) {
        // This rank's own copy (its per-rank state), not the first rank's that has one. (A tensor every old
        // rank saved in pieces is read from them all below: a layout change.)
        std::optional<StepTensor> own = own_copy(home, p.home, name);
        p.fills.push_back(plan_destination(name, t.sizes().vec(), dtype, own ? &*own : nullptr));
      } else {
        auto it = saved.find(key);
        p.fills.push_back(
            plan_destination(name, t.sizes().vec(), dtype, it == saved.end() ? nullptr : &it->second, global));
        if (offsets && it != saved.end() && !it->second.sharded) from_whole.insert(key);
      }
      p.planned += planned_bytes(p.fills.back());
    } catch (const InvalidArgument& e) {
      out.problems.push_back(e.message());
      p.fills.emplace_back();
    }
  }
  for (const auto& [name, t] : req.tensors) {
    auto [key, offsets] = split_shard_name(name);
    // A whole destination at another world size reads one old rank's copy, and so does every shard of a
    // tensor saved whole, at any world size: right only for a replica.
    if (!same_world && !offsets && !saved_in_pieces(key)) check_replicated(saved, name, req.whole_from_rank0, out);
  }
  for (const std::string& key : from_whole) check_replicated(saved, key, req.whole_from_rank0, out);
}

/// What no destination asks for. A piece of a sharded tensor: another rank's now (a rank may hold no shard
/// of a table; the caller checks that the state has the sharded tensor). A whole tensor under a read prefix
/// (lazily created state): the home rank's copy. Any other whole tensor: a mismatch, as at the same world size.
void plan_unplaced(ReadPlan& p, const LoadRequest& req, const SavedTensors& saved,
                   const std::set<std::string>& wanted_keys, ReshardFindings& out) {
  std::vector<std::string> unexpected;
  for (size_t r = 0; r < p.indexes.size(); ++r) {
    for (const auto& [name, entry] : p.indexes[r].tensors) {
      auto [key, offsets] = split_shard_name(name);
      if (wanted_keys.count(key) || offsets) continue;
      if (under_prefix(name, req.read_prefixes) && scalar_type_of(entry.dtype)) {
        if (r == static_cast<size_t>(p.home)) {
          p.to_read.push_back(&entry);
          p.planned += entry.end - entry.begin;
          if (p.saved_world != req.world) check_replicated(saved, name, req.whole_from_rank0, out);
        }
      } else if (!req.partial && std::find(unexpected.begin(), unexpected.end(), key) == unexpected.end()) {
        unexpected.push_back(key);
      }
    }
  }
  if (!unexpected.empty()) {
    out.problems.push_back("unexpected in the checkpoint (the state dict lacks them): " + quoted_list(unexpected));
  }
}

/// Checks the chunks that hold a header or a byte this rank reads, per old file (the whole file for a manifest
/// from before chunk checksums); counts their bytes in `p.verified`. Throws CorruptData naming the file.
void verify_touched_chunks(ReadPlan& p, int threads) {
  std::vector<std::set<size_t>> chunks(p.sources.size());
  for (size_t r = 0; r < p.sources.size(); ++r) {
    const FileDigest& d = p.sources[r].manifest.files.at("rank-" + std::to_string(r) + ".safetensors");
    auto touch = [&](uint64_t begin, uint64_t length) {
      if (length == 0 || d.chunk_bytes == 0) return;
      for (uint64_t k = begin / d.chunk_bytes; k <= (begin + length - 1) / d.chunk_bytes; ++k) chunks[r].insert(k);
    };
    touch(0, p.indexes[r].data_offset);
    for (const auto& fill : p.fills) {
      for (const CopyRange& x : fill) {
        if (x.source == static_cast<int>(r)) touch(x.src_offset, x.length);
      }
    }
    if (r == static_cast<size_t>(p.home)) {
      for (const SafetensorsEntry* e : p.to_read) touch(p.indexes[r].data_offset + e->begin, e->end - e->begin);
    }
    if (chunks[r].empty()) continue;
    const ReadFile& data = p.sources[r].data;
    if (d.chunks.empty()) {
      std::string h = file_xxh3(data);
      ETTKIT_CHECK(h == d.xxh3, CorruptData, "'", data.path(), "' has XXH3 ", h, "; the manifest says ", d.xxh3);
      p.verified += d.size;
      continue;
    }
    std::vector<size_t> which(chunks[r].begin(), chunks[r].end());
    verify_file_chunks(data, d, threads, which);
    for (size_t k : which) p.verified += std::min(d.chunk_bytes, d.size - k * d.chunk_bytes);
  }
}

/// The warnings of a loadable step whose whole tensors are not all proven replicas.
void warn_unproven(int64_t step, int saved_world, const ReshardFindings& f) {
  if (!f.differing.empty()) {
    ETTKIT_LOG_WARN("checkpoint: step ", step, " was written by ", saved_world, " ranks whose copies of ",
                    f.differing.size(), " tensor(s) saved whole differ (", quoted_list(f.differing),
                    "); old rank 0's copy is used (reshard_whole_from_rank0)");
  }
  if (!f.unproven.empty()) {
    ETTKIT_LOG_WARN("checkpoint: step ", step, " was saved without per-tensor digests (by an older ettkit), so ",
                    f.unproven.size(), " tensor(s) saved whole (", quoted_list(f.unproven),
                    ") cannot be proven the same on every old rank; old rank 0's copy is used");
  }
}

}  // namespace

ReadPlan plan_reshard_read(const StepDirectory& step_dir, int64_t step, const LoadRequest& req) {
  ReadPlan p;
  p.reshard = true;
  p.saved_world = step_dir.manifest().world_size;
  p.home = p.saved_world == req.world ? req.rank : 0;
  SavedTensors saved;
  try {
    if (!open_old_ranks(p, step_dir, req)) {
      return refused(std::move(p), Verdict::kVanished,
                     "step " + std::to_string(step) + " was removed while it was being loaded");
    }
    std::vector<const SafetensorsIndex*> indexes;
    for (const SafetensorsIndex& i : p.indexes) indexes.push_back(&i);
    saved = step_tensors(indexes, step_dir.path());
  } catch (const Error& e) {
    return refused(std::move(p), Verdict::kBad, e.message());
  }
  ReshardFindings found;
  std::set<std::string> wanted_keys;
  plan_fills(p, req, saved, wanted_keys, found);
  plan_unplaced(p, req, saved, wanted_keys, found);
  // The names are checked: the non-tensor state may be decoded now.
  std::string extra_mismatch;
  if (std::string why = undecodable_extra(req.validate_extra, p.extra,
                                          p.sources.at(static_cast<size_t>(p.home)).extra.path(), extra_mismatch);
      !why.empty()) {
    return refused(std::move(p), Verdict::kBad, std::move(why));
  }
  if (found.problems.empty()) warn_unproven(step, p.saved_world, found);
  if (!found.problems.empty() || !extra_mismatch.empty()) {
    p.verdict = Verdict::kMismatch;
    p.reason = ettkit::detail::concat("the state dict cannot be loaded from checkpoint step ", step, " (written by ",
                                      p.saved_world, " ranks) by resharding");
    if (!extra_mismatch.empty()) p.reason += ": " + extra_mismatch;
    if (!found.problems.empty()) p.reason += "; " + plain_list(found.problems);
    return p;
  }
  if (req.verify) {
    try {
      verify_touched_chunks(p, req.threads);
    } catch (const Error& e) {
      return refused(std::move(p), Verdict::kBad, e.message());
    }
  }
  p.verdict = Verdict::kOk;
  return p;
}

}  // namespace ettkit::checkpoint::detail
