#include "checkpoint/step_writer.h"

#include <unistd.h>

#include <torch/version.h>

#include <cstring>

#include "checkpoint/host_arena.h"
#include "checkpoint/in_order_digest.h"
#include "checkpoint/reshard.h"
#include "checkpoint/safetensors.h"
#include "ettkit/checkpoint/safetensors_dtypes.h"
#include "ettkit/common/clock.h"

namespace ettkit::checkpoint::detail {

std::string safetensors_dtype(at::ScalarType t, const std::string& key) {
  if (const SafetensorsDtype* d = find_safetensors_dtype(t)) return d->name;
  ETTKIT_THROW(InvalidArgument, "state dict entry '", key, "' has dtype ", t, ", which safetensors cannot store");
}

namespace {
/// The entries a disk header records a whole-tensor digest for: those not saved as a shard of a split tensor.
std::vector<size_t> whole_entries(const std::vector<PlanEntry>& plan) {
  std::vector<size_t> whole;
  for (size_t i = 0; i < plan.size(); ++i) {
    if (!split_shard_name(plan[i].name).second) whole.push_back(i);
  }
  return whole;
}
}  // namespace

std::string header_of(const std::vector<PlanEntry>& plan, const std::vector<size_t>& whole,
                      const std::vector<std::string>& digests) {
  ETTKIT_EXPECTS(whole.size() == digests.size(), "header_of: ", digests.size(), " digests for ", whole.size(),
                 " whole tensors");
  std::vector<SafetensorsEntry> entries;
  entries.reserve(plan.size());
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  for (const PlanEntry& e : plan) {
    entries.push_back({e.name, safetensors_dtype(e.dtype, e.name), e.shape, static_cast<uint64_t>(e.offset),
                       static_cast<uint64_t>(e.offset + e.nbytes)});
  }
  for (size_t k = 0; k < whole.size(); ++k) metadata[kWholeTensorDigestPrefix + plan[whole[k]].name] = digests[k];
  return encode_safetensors_header(entries, metadata);
}

std::string header_of(const std::vector<PlanEntry>& plan, const uint8_t* arena) {
  if (arena == nullptr) return header_of(plan, {}, {});
  const std::vector<size_t> whole = whole_entries(plan);
  std::vector<std::string> digests;
  digests.reserve(whole.size());
  for (size_t i : whole) {
    const PlanEntry& e = plan[i];
    digests.push_back(xxh3_of(arena + e.offset, static_cast<size_t>(e.nbytes)));
  }
  return header_of(plan, whole, digests);
}

DiskHeaderPlan plan_disk_header(const std::vector<PlanEntry>& plan) {
  DiskHeaderPlan p;
  p.whole = whole_entries(plan);
  // Any 16 hex digits give the same length: the header's JSON escapes nothing in them.
  p.bytes = header_of(plan, p.whole, std::vector<std::string>(p.whole.size(), std::string(16, '0'))).size();
  return p;
}

StepWriter::StepWriter(const Session& session, int64_t step, Snapshot& snapshot, const std::string& extra,
                       bool whole_tensor_digests)
    : session_(session),
      step_(step),
      snapshot_(snapshot),
      extra_(extra),
      whole_tensor_digests_(whole_tensor_digests),
      base_("rank-" + std::to_string(session.rank)) {}

void StepWriter::use_cached_header(const std::string& header, std::string& padded) {
  ETTKIT_EXPECTS(!whole_tensor_digests_, "a header with whole-tensor digests depends on the bytes; it is never cached");
  cached_header_ = &header;
  cached_padded_ = &padded;
}

// Made on first use, not in the constructor: a dtype it cannot name is the save's error, which the disk
// tier reports to the vote like any other write error.
const std::string& StepWriter::header() {
  if (cached_header_ != nullptr) return *cached_header_;
  if (!header_made_) {
    header_ = header_of(snapshot_.plan(), whole_tensor_digests_ ? snapshot_.data() : nullptr);
    header_made_ = true;
  }
  return header_;
}

uint64_t StepWriter::bytes() {
  const uint64_t head = links_arena() ? snapshot_.arena_file()->reserve : header().size();
  return head + static_cast<uint64_t>(snapshot_.total_bytes()) + extra_.size();
}

bool StepWriter::links_arena() {
  const Arena* a = snapshot_.arena_file();
  // An empty state still has a one-byte arena; its file would not be a safetensors file of nothing.
  return a != nullptr && snapshot_.total_bytes() > 0 && a->size == static_cast<size_t>(snapshot_.total_bytes()) &&
         header().size() <= a->reserve;
}

std::map<std::string, FileDigest> StepWriter::link_rank_files(const Dir& dir, unsigned mode, const StepHooks& hooks,
                                                              const std::function<void(const std::string&)>& link) {
  ETTKIT_EXPECTS(links_arena(), "step ", step_, ": the snapshot's arena is not a memory-tier file with room");
  const Arena& arena = *snapshot_.arena_file();
  std::map<std::string, FileDigest> files;
  remove_rank_files(dir);
  // The header goes into the room before the staged bytes; the file is then exactly a safetensors file,
  // hashed once (the chunks, and the file's xxh3 from them) from the bytes where they lie.
  std::string own;
  std::string& head = cached_padded_ != nullptr ? *cached_padded_ : own;
  if (head.size() != arena.reserve) head = pad_safetensors_header(header(), arena.reserve);
  std::memcpy(arena.map, head.data(), head.size());
  const std::string data_file = base_ + ".safetensors";
  if (InOrderDigest* fused = snapshot_.file_digest()) {
    // The copies hashed the staged bytes as they wrote them; the header room (never reported) and what
    // waited are hashed now.
    files[data_file] = fused->finish_file(nullptr, 0);
  } else {
    FileDigestBuilder digest;
    digest.update(arena.map, arena.reserve + arena.size);
    files[data_file] = digest.finish();
  }
  link(data_file);
  if (hooks.after_data) hooks.after_data();
  write_extra(dir, mode, hooks, files);
  return files;
}

void StepWriter::write_extra(const Dir& dir, unsigned mode, const StepHooks& hooks,
                             std::map<std::string, FileDigest>& files) {
  files[base_ + ".extra"] = write_file_durably(dir, base_ + ".extra", {ConstBuffer{extra_.data(), extra_.size()}}, mode);
  if (hooks.verdict) hooks.verdict();
}

bool StepWriter::use_fused_digests() {
  InOrderDigest* file = snapshot_.file_digest();
  InOrderDigest* tensors = snapshot_.tensor_digest();
  if (!whole_tensor_digests_ || file == nullptr || tensors == nullptr || header_made_) return false;
  // The copies hashed every whole tensor and the file's chunks after the header: the header from those
  // digests, whose length the chunks were planned with (plan_disk_header), then the chunks that hold it.
  const std::vector<std::string> digests = tensors->finish_tensors();
  std::string head = header_of(snapshot_.plan(), whole_entries(snapshot_.plan()), digests);
  if (head.size() != file->head_bytes()) return false;  // not the planned header: hash after all, as before
  header_ = std::move(head);
  header_made_ = true;
  fused_file_ = file->finish_file(reinterpret_cast<const uint8_t*>(header_.data()), header_.size());
  return true;
}

std::map<std::string, FileDigest> StepWriter::write_rank_files(const Dir& dir, unsigned mode, const StepHooks& hooks) {
  std::map<std::string, FileDigest> files;
  const bool fused = use_fused_digests();
  const std::string& head = header();
  remove_rank_files(dir);
  const std::vector<ConstBuffer> data = {ConstBuffer{head.data(), head.size()},
                                         ConstBuffer{snapshot_.data(), static_cast<size_t>(snapshot_.total_bytes())}};
  if (fused) {
    // The copies hashed the bytes as they staged them: the write only writes (and checks the size it wrote).
    const uint64_t wrote = write_file_durably_unhashed(dir, base_ + ".safetensors", data, mode);
    ETTKIT_CHECK(wrote == fused_file_.size, IoError, "step ", step_, ": wrote ", wrote, " bytes of ",
                 base_, ".safetensors, ", fused_file_.size, " planned");
    files[base_ + ".safetensors"] = fused_file_;
  } else {
    files[base_ + ".safetensors"] = write_file_durably(dir, base_ + ".safetensors", data, mode);
  }
  if (hooks.after_data) hooks.after_data();
  // The arena is free as soon as its bytes are durable; nothing after this needs it.
  snapshot_.release();
  write_extra(dir, mode, hooks, files);
  return files;
}

void StepWriter::remove_rank_files(const Dir& dir) noexcept {
  for (const char* ext : {".safetensors", ".extra"}) ::unlinkat(dir.fd(), (base_ + ext).c_str(), 0);
}

Manifest StepWriter::manifest() const {
  Manifest m;
  m.step = step_;
  m.world_size = session_.world;
  m.created_unix_us = epoch_us();
  m.metadata = session_.opt.metadata;
  m.torch_version = TORCH_VERSION;
  return m;
}

}  // namespace ettkit::checkpoint::detail
