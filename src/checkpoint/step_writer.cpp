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

std::string header_of(const std::vector<PlanEntry>& plan, const uint8_t* arena) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(plan.size());
  std::map<std::string, std::string> metadata{{"format", "pt"}};
  for (const PlanEntry& e : plan) {
    entries.push_back({e.name, safetensors_dtype(e.dtype, e.name), e.shape, static_cast<uint64_t>(e.offset),
                       static_cast<uint64_t>(e.offset + e.nbytes)});
    if (arena != nullptr && !split_shard_name(e.name).second) {
      metadata[kWholeTensorDigestPrefix + e.name] = xxh3_of(arena + e.offset, static_cast<size_t>(e.nbytes));
    }
  }
  return encode_safetensors_header(entries, metadata);
}

StepWriter::StepWriter(const Session& session, int64_t step, Snapshot& snapshot, const std::string& extra,
                       bool whole_tensor_digests)
    : session_(session),
      step_(step),
      snapshot_(snapshot),
      extra_(extra),
      whole_tensor_digests_(whole_tensor_digests),
      base_("rank-" + std::to_string(session.rank)) {}

// Made on first use, not in the constructor: a dtype it cannot name is the save's error, which the disk
// tier reports to the vote like any other write error.
void StepWriter::use_cached_header(const std::string& header, std::string& padded) {
  ETTKIT_EXPECTS(!whole_tensor_digests_, "a header with whole-tensor digests depends on the bytes; it is never cached");
  cached_header_ = &header;
  cached_padded_ = &padded;
}

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
    files[data_file] = fused->finish();
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

std::map<std::string, FileDigest> StepWriter::write_rank_files(const Dir& dir, unsigned mode, const StepHooks& hooks) {
  std::map<std::string, FileDigest> files;
  const std::string& head = header();
  remove_rank_files(dir);
  files[base_ + ".safetensors"] = write_file_durably(
      dir, base_ + ".safetensors",
      {ConstBuffer{head.data(), head.size()},
       ConstBuffer{snapshot_.data(), static_cast<size_t>(snapshot_.total_bytes())}},
      mode);
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
