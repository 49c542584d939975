// A load candidate's read plan at the job's own world size, and the one executor of every plan (read_plan.h).
#include "checkpoint/read_plan.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <set>

#include "checkpoint/file_checksums.h"
#include "common/logging.h"
#include "ettkit/checkpoint/safetensors_dtypes.h"
#include "ettkit/checkpoint/step_format.h"  // kMaxListedInMessage

namespace ettkit::checkpoint::detail {

int severity(Verdict v) {
  switch (v) {
    case Verdict::kOk: return 0;
    case Verdict::kVanished: return 1;
    case Verdict::kBad: return 2;
    case Verdict::kMismatch: return 3;
  }
  return 2;
}

bool under_prefix(const std::string& name, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes) {
    if (p.empty()) return true;
    if (name.size() >= p.size() && name.compare(0, p.size(), p) == 0 &&
        (name.size() == p.size() || name[p.size()] == '.')) {
      return true;
    }
  }
  return false;
}

namespace {
/// The first kShown of `items`, each written by `put`, joined by `sep`, and how many more there are (the cap
/// is step_format.h's, which Python's messages take too).
template <class Put>
std::string bounded_list(const std::vector<std::string>& items, const char* sep, Put put) {
  constexpr size_t kShown = kMaxListedInMessage;
  std::string out;
  for (size_t i = 0; i < std::min(items.size(), kShown); ++i) out += (i ? sep : "") + put(items[i]);
  if (items.size() > kShown) out += sep + std::string("... (") + std::to_string(items.size() - kShown) + " more)";
  return out;
}
}  // namespace

std::string quoted_list(const std::vector<std::string>& names) {
  return bounded_list(names, ", ", [](const std::string& n) { return "'" + n + "'"; });
}
std::string plain_list(const std::vector<std::string>& items) {
  return bounded_list(items, "; ", [](const std::string& n) { return n; });
}

std::optional<at::ScalarType> scalar_type_of(const std::string& dtype) {
  if (const SafetensorsDtype* d = find_safetensors_dtype(std::string_view(dtype))) return d->type;
  return std::nullopt;
}

/// Runs the caller's `validate_extra` (the decoder of the non-tensor state) on a candidate's extra bytes. It is
/// called last, once the step's manifest, file sizes, checksums and safetensors index have been checked and its
/// tensor names compared with the state's: the decoder sees only bytes the manifest vouches for, of a step that
/// is otherwise loadable or a mismatch (still decoded then, so that the message can name a sharded tensor's
/// plan; Python's decoder runs no code from the bytes, docs/security.md). An InvalidArgument is the caller
/// saying its state does not match the step: its message goes to `mismatch` (no fallback). Returns why the bytes
/// do not decode ("" when they do): the step is then corrupt, and the load falls back.
std::string undecodable_extra(const std::function<void(const std::string&)>& validate_extra, const std::string& extra,
                              const std::string& path, std::string& mismatch) {
  if (!validate_extra) return {};
  try {
    validate_extra(extra);
  } catch (const InvalidArgument& e) {
    mismatch = e.message();
  } catch (const std::exception& e) {
    std::string why = e.what();
    if (const auto* err = dynamic_cast<const Error*>(&e)) why = err->message();
    return "'" + path + "' cannot be decoded: " + why;
  }
  return {};
}

ReadPlan refused(ReadPlan p, Verdict verdict, std::string why) {
  p.verdict = verdict;
  p.reason = std::move(why);
  p.sources.clear();
  return p;
}

namespace {

std::string vanished_reason(int64_t step) {
  return "step " + std::to_string(step) + " was removed while it was being loaded";
}

/// Whether the prefetch's step is still the one committed under its name (`now`: the manifest on disk): a
/// re-save of the same step number commits another snapshot (another manifest) in its place.
bool same_commit(const PrefetchedStep& pre, const Manifest& now) {
  const Manifest& then = pre.files->manifest;
  return now.commit_seq == then.commit_seq && now.created_unix_us == then.created_unix_us &&
         now.world_size == then.world_size && now.files.size() == then.files.size() &&
         std::equal(now.files.begin(), now.files.end(), then.files.begin(),
                    [](const auto& a, const auto& b) { return a.first == b.first && a.second.xxh3 == b.second.xxh3; });
}

/// Takes the prefetch's verification of this rank's files: its open files and the extra bytes in memory as
/// they were hashed; of the data, the chunks whose pages the page cache has dropped since (a re-read from
/// the device) are hashed again. Sizes are checked again: the files are the same open files, but cheap to ask.
void take_prefetched(ReadPlan& p, PrefetchedStep& pre, const LoadRequest& req) {
  p.sources.push_back(std::move(*pre.files));
  p.prefetched = true;
  const OpenedStep& f = p.sources.front();
  const int threads = req.threads;
  const FileDigest& d = listed_digest(f, f.data);
  listed_digest(f, f.extra);
  p.extra = std::move(pre.extra);
  if (req.verify && !d.chunks.empty()) {
    std::vector<size_t> again = nonresident_chunks(f.data, d);
    if (!again.empty()) verify_file_chunks(f.data, d, threads, again);
    for (size_t i : again) p.reverified += std::min(d.size - i * d.chunk_bytes, d.chunk_bytes);
  }
}

/// The caller's state dict must match the checkpoint exactly (a user error, not a corrupt step), except for
/// the tensors under `read_prefixes` that have no destination: those are read into new tensors. Every
/// difference is collected, so that one message names all the keys to fix. Fills `p.fills` and `p.to_read`.
struct NameCheck {
  std::vector<std::string> missing, unexpected, different;
  bool empty() const { return missing.empty() && unexpected.empty() && different.empty(); }
};
NameCheck match_names(ReadPlan& p, const LoadRequest& req) {
  NameCheck out;
  const SafetensorsIndex& index = p.indexes.front();
  std::set<std::string> have;
  for (const auto& [name, t] : req.tensors) {
    have.insert(name);
    p.fills.emplace_back();
    auto it = index.tensors.find(name);
    if (it == index.tensors.end()) {
      out.missing.push_back(name);
      continue;
    }
    std::string want;
    try {
      want = safetensors_dtype(t.scalar_type(), name);
    } catch (const InvalidArgument& e) {
      out.different.push_back(e.message());  // a verdict all ranks vote on, not an exception out of one rank
      continue;
    }
    const SafetensorsEntry& e = it->second;
    if (e.dtype != want || !std::equal(e.shape.begin(), e.shape.end(), t.sizes().begin(), t.sizes().end())) {
      out.different.push_back(ettkit::detail::concat("'", name, "' is ", want, " ", t.sizes(), " in the state dict, ",
                                                     e.dtype, " ", c10::IntArrayRef(e.shape),
                                                     " in the checkpoint (dtype or shape differs)"));
      continue;
    }
    p.fills.back().push_back({0, index.data_offset + e.begin, 0, e.end - e.begin});
  }
  for (const auto& [name, entry] : index.tensors) {
    if (have.count(name)) continue;
    if (!under_prefix(name, req.read_prefixes)) {
      if (!req.partial) out.unexpected.push_back(name);
    } else if (!scalar_type_of(entry.dtype)) {
      out.different.push_back(ettkit::detail::concat("'", name, "' has dtype ", entry.dtype,
                                                     " in the checkpoint, which ettkit cannot read"));
    } else {
      p.to_read.push_back(&entry);
    }
  }
  return out;
}

/// The verdict on a same-world plan whose files are checked: the non-tensor state is decoded only now that
/// the names are checked, and still before any tensor is overwritten (a step whose extra is unreadable falls
/// back like any corrupt step: checksums off, this is the only check that would see it). A mismatch it
/// reports (InvalidArgument) is reported together with the tensors that differ.
ReadPlan judge_same_world(ReadPlan p, int64_t step, const LoadRequest& req) {
  NameCheck names = match_names(p, req);
  std::string extra_mismatch;
  const std::string data_path = p.sources.front().data.path();
  if (std::string why = undecodable_extra(req.validate_extra, p.extra, p.sources.front().extra.path(), extra_mismatch);
      !why.empty()) {
    return refused(std::move(p), Verdict::kBad, std::move(why));
  }
  if (!names.empty() || !extra_mismatch.empty()) {
    std::string reason =
        ettkit::detail::concat("the state dict does not match checkpoint step ", step, " ('", data_path, "')");
    if (!extra_mismatch.empty()) reason += ": " + extra_mismatch;
    if (!names.missing.empty()) reason += "; missing in the checkpoint: " + quoted_list(names.missing);
    if (!names.unexpected.empty()) {
      reason += "; unexpected in the checkpoint (the state dict lacks them): " + quoted_list(names.unexpected);
    }
    if (!names.different.empty()) reason += "; " + plain_list(names.different);
    p.verdict = Verdict::kMismatch;
    p.reason = std::move(reason);
    return p;
  }
  p.verdict = Verdict::kOk;
  return p;
}

/// This rank's file and the state, as the moved verdict (first_moved_shard, step_format.h) compares them: a
/// name "key@offsets" is a box of `key` at those offsets whose size is the entry's shape (a shard's name is
/// its box's offsets and its shape the box's size: the same name and shape are the same elements); a file
/// records no placements.
ShardLayout layout_of(const SafetensorsIndex& index) {
  ShardLayout out;
  for (const auto& [name, entry] : index.tensors) {
    auto [key, offsets] = split_shard_name(name);
    if (!offsets) {
      out.whole.insert(name);
    } else {
      out.sharded[key].push_back({std::move(*offsets), entry.shape, std::nullopt});
    }
  }
  return out;
}

ShardLayout layout_of(const NamedTensors& tensors) {
  ShardLayout out;
  for (const auto& [name, t] : tensors) {
    auto [key, offsets] = split_shard_name(name);
    if (!offsets) {
      out.whole.insert(name);
    } else {
      out.sharded[key].push_back({std::move(*offsets), t.sizes().vec(), std::nullopt});
    }
  }
  return out;
}

/// Whether the state wants whole a tensor that this rank's file of a judged plan holds no copy of.
bool wants_whole_tensor_it_lacks(const ReadPlan& p, const LoadRequest& req) {
  if (p.indexes.empty()) return false;
  for (const auto& [name, t] : req.tensors) {
    if (!split_shard_name(name).second && !p.indexes.front().tensors.count(name)) return true;
  }
  return false;
}

/// The plan of a step of the job's own world size: this rank's files, checked (or taken from the prefetch),
/// unless they hold this rank's shards of another layout: then every rank's files, by resharding.
ReadPlan plan_same_world(const StepDirectory& step_dir, int64_t step, const LoadRequest& req,
                         std::optional<PrefetchedStep>& pre) {
  ReadPlan p;
  try {
    if (pre) {
      take_prefetched(p, *pre, req);
    } else {
      std::optional<OpenedStep> f = step_dir.open_rank(req.rank);
      if (!f) return refused(std::move(p), Verdict::kVanished, vanished_reason(step));
      p.sources.push_back(std::move(*f));
      p.extra = *check_step_files(p.sources.front(), req.verify, req.threads);
    }
    p.indexes.push_back(read_safetensors_index(p.sources.front().data));
  } catch (const Error& e) {
    return refused(std::move(p), Verdict::kBad, e.message());
  }
  if (std::string moved = first_moved_shard(layout_of(p.indexes.front()), layout_of(req.tensors), req.partial);
      !moved.empty()) {
    if (!req.reads_other_ranks) {
      return refused(std::move(p), Verdict::kBad,
                     ettkit::detail::concat("this rank's snapshot of step ", step, " holds its shards of another layout "
                                            "than the state's (first: '", moved, "'; another sharding plan, mesh shape "
                                            "or placements), and this tier holds no other rank's shards to reshard "
                                            "from"));
    }
    ETTKIT_LOG_INFO("checkpoint: step ", step, " holds rank ", req.rank, "'s shards of another layout than the state's "
                    "(first: '", moved, "'): resharding from every rank's files");
    return plan_reshard_read(step_dir, step, req);
  }
  ReadPlan judged = judge_same_world(std::move(p), step, req);
  if (judged.verdict == Verdict::kMismatch && req.reads_other_ranks && wants_whole_tensor_it_lacks(judged, req)) {
    // This rank's file lacks a tensor the state wants whole: other ranks' files may hold it in pieces (a
    // table that was sharded onto other ranks, wanted whole here). Resharding reads it if they do; the
    // mismatch stands as it was found if they do not.
    ReadPlan again = plan_reshard_read(step_dir, step, req);
    if (again.verdict == Verdict::kOk) return again;
  }
  return judged;
}

}  // namespace

ReadPlan plan_read(const std::string& dir, int64_t step, const LoadRequest& req, std::optional<PrefetchedStep> pre) {
  std::optional<StepDirectory> step_dir;
  try {
    step_dir = StepDirectory::open(dir, step);  // the one decode of this candidate's manifest
  } catch (const Error& e) {
    return refused(ReadPlan{}, Verdict::kBad, e.message());
  }
  if (!step_dir) return refused(ReadPlan{}, Verdict::kVanished, vanished_reason(step));
  // A step of another world size is loaded by resharding (its own rank's files may not even exist); one of
  // this world size too when this rank's shards in it are of another layout (plan_same_world).
  if (step_dir->manifest().world_size != req.world) return plan_reshard_read(*step_dir, step, req);
  if (pre && !(pre->verified && pre->files && same_commit(*pre, step_dir->manifest()))) pre.reset();
  return plan_same_world(*step_dir, step, req, pre);
}

namespace {
/// Whether a destination is read straight into its storage: contiguous CPU tensors. The others go through a
/// contiguous CPU copy: a conjugate or negative view's storage holds other values than it shows, and copy_
/// writes what it shows.
bool reads_in_place(const at::Tensor& t) {
  return t.device().is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

/// Reads `ranges` (per source) of the plan's files, each file's ranges on several threads at once (one
/// thread's pread from the page cache runs well below memory bandwidth).
void read_sources(const ReadPlan& p, const std::vector<std::vector<ReadRange>>& ranges, int threads) {
  for (size_t s = 0; s < ranges.size(); ++s) {
    if (!ranges[s].empty()) read_ranges(p.sources[s].data.fd(), ranges[s], threads, p.sources[s].data.path());
  }
}

void add_fill(std::vector<std::vector<ReadRange>>& ranges, const std::vector<CopyRange>& fill, void* dst) {
  char* base = static_cast<char*>(dst);
  for (const CopyRange& r : fill) {
    ranges[static_cast<size_t>(r.source)].push_back({base + r.dst_offset, r.length, r.src_offset});
  }
}
}  // namespace

NamedTensors run_read_plan(const ReadPlan& p, const NamedTensors& tensors, int threads) {
  at::NoGradGuard no_grad;
  std::vector<std::vector<ReadRange>> direct(p.sources.size());
  std::vector<size_t> staged;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].second;
    if (reads_in_place(t)) {
      add_fill(direct, p.fills[i], t.data_ptr());
    } else {
      staged.push_back(i);
    }
  }
  read_sources(p, direct, threads);
  // One staged tensor at a time: a GPU state is copied through one tensor's worth of CPU memory.
  for (size_t i : staged) {
    const at::Tensor& t = tensors[i].second;
    at::Tensor tmp = at::empty(t.sizes(), t.options().device(c10::kCPU).memory_format(at::MemoryFormat::Contiguous));
    std::vector<std::vector<ReadRange>> ranges(p.sources.size());
    add_fill(ranges, p.fills[i], tmp.data_ptr());
    read_sources(p, ranges, threads);
    t.copy_(tmp);
  }
  NamedTensors read;
  read.reserve(p.to_read.size());
  const ReadFile& home = p.sources.at(static_cast<size_t>(p.home)).data;
  const uint64_t data_offset = p.indexes.at(static_cast<size_t>(p.home)).data_offset;
  for (const SafetensorsEntry* e : p.to_read) {
    // read_safetensors_index() checked that the byte range matches dtype and shape.
    at::Tensor t = at::empty(e->shape, at::TensorOptions().dtype(*scalar_type_of(e->dtype)));
    read_exact(home.fd(), t.data_ptr(), e->end - e->begin, data_offset + e->begin, home.path());
    read.emplace_back(e->name, std::move(t));
  }
  return read;
}

}  // namespace ettkit::checkpoint::detail
