// The manifest codec and the JSON form of a FileDigest (manifest.h).
#include "checkpoint/manifest.h"

#include <atomic>
#include <climits>
#include <nlohmann/json.hpp>

#include "checkpoint/identifiers.h"
#include "ettkit/checkpoint/step_format.h"  // kMaxWorldSize, checked_world_size
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

using nlohmann::json;

namespace {
/// Typed, range-checked reads of the fields of a JSON document named `where` ("manifest '<path>'", "rank 1's
/// digest of ..."): a wrong type or an out-of-range value is CorruptData naming the document and the field,
/// never a JSON-library exception or a silent conversion (a float step, a version that wraps to 1 in an int).
struct JsonFields {
  const std::string& where;

  [[noreturn]] void bad(const std::string& field, const json& v, const char* want) const {
    std::string shown = v.dump();
    if (shown.size() > 80) shown = shown.substr(0, 77) + "...";
    ETTKIT_THROW(CorruptData, where, ": field '", field, "' is ", shown, "; expected ", want);
  }
  /// `field` inside `obj`; `path` is how the message names it (e.g. files.rank-0.extra.size).
  const json* find(const json& obj, const std::string& field, bool required, const std::string& path = "") const {
    auto it = obj.find(field);
    if (it != obj.end()) return &*it;
    ETTKIT_CHECK(!required, CorruptData, where, " lacks the field '", path.empty() ? field : path, "'");
    return nullptr;
  }
  int64_t integer(const json& v, const std::string& field, int64_t lo, int64_t hi) const {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (hi >= 0 && u <= static_cast<uint64_t>(hi) && static_cast<int64_t>(u) >= lo) return static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
      int64_t x = v.get<int64_t>();
      if (x >= lo && x <= hi) return x;
    } else {
      bad(field, v, "an integer");
    }
    bad(field, v, ettkit::detail::concat("an integer in [", lo, ", ", hi, "]").c_str());
  }
  uint64_t unsigned_integer(const json& v, const std::string& field) const {
    if (!v.is_number_unsigned()) bad(field, v, "a non-negative integer");
    return v.get<uint64_t>();
  }
  std::string string(const json& v, const std::string& field) const {
    if (!v.is_string()) bad(field, v, "a string");
    return v.get<std::string>();
  }
};

/// The chunk checksums of a digest whose "chunk_bytes" is `cb`. Their count must cover the size exactly, so
/// that a hostile chunk_bytes cannot make a loader skip bytes or loop over chunks that do not exist.
void decode_chunks(const JsonFields& r, const json& f, const json& cb, const std::string& field, FileDigest& d) {
  d.chunk_bytes = r.unsigned_integer(cb, field + "chunk_bytes");
  if (d.chunk_bytes < (uint64_t{1} << 20)) r.bad(field + "chunk_bytes", cb, "an integer >= 1048576");
  const json& chunks = *r.find(f, "chunks", true, field + "chunks");
  uint64_t want = d.size / d.chunk_bytes + (d.size % d.chunk_bytes != 0);
  if (!chunks.is_array() || chunks.size() != want) {
    r.bad(field + "chunks", chunks,
          ettkit::detail::concat("an array of ", want, " checksums (size / chunk_bytes, rounded up)").c_str());
  }
  for (const json& c : chunks) {
    if (!c.is_string() || !is_hex64(c.get<std::string>())) r.bad(field + "chunks", c, "16 lowercase hex digits per chunk");
    d.chunks.push_back(c.get<std::string>());
  }
}

FileDigest decode_digest(const JsonFields& r, const json& f, const std::string& name) {
  if (!f.is_object()) r.bad(name, f, "an object {size, xxh3}");
  const std::string field = name.empty() ? "" : name + ".";
  FileDigest d;
  d.size = r.unsigned_integer(*r.find(f, "size", true, field + "size"), field + "size");
  d.xxh3 = r.string(*r.find(f, "xxh3", true, field + "xxh3"), field + "xxh3");
  if (!is_hex64(d.xxh3)) r.bad(field + "xxh3", f["xxh3"], "16 lowercase hex digits");
  // Chunk checksums are optional: older manifests have none.
  if (const json* cb = r.find(f, "chunk_bytes", false)) {
    decode_chunks(r, f, *cb, field, d);
  } else if (f.contains("chunks")) {
    r.bad(field + "chunk_bytes", json(nullptr), "an integer >= 1048576 beside 'chunks'");
  }
  return d;
}

/// The "format" and "version" fields: CorruptData for another format, Unsupported for a newer version.
void check_format_and_version(const JsonFields& r, const json& j) {
  const json& format = *r.find(j, "format", true);
  if (!format.is_string() || format.get<std::string>() != "ettkit-checkpoint") {
    r.bad("format", format, "\"ettkit-checkpoint\"");
  }
  const json& version = *r.find(j, "version", true);
  if (!version.is_number_integer()) r.bad("version", version, "an integer");
  bool newer = version.is_number_unsigned() ? version.get<uint64_t>() > 1 : version.get<int64_t>() > 1;
  ETTKIT_CHECK(!newer, Unsupported, r.where, " has version ", version.dump(), "; this ettkit reads version 1");
  if (version.get<int64_t>() != 1) r.bad("version", version, "1");
}
}  // namespace

json encode_file_digest(const FileDigest& d) {
  json f = {{"size", d.size}, {"xxh3", d.xxh3}};
  if (!d.chunks.empty()) {
    f["chunk_bytes"] = d.chunk_bytes;
    f["chunks"] = d.chunks;
  }
  return f;
}

FileDigest decode_file_digest(const json& f, const std::string& where, const std::string& field) {
  return decode_digest(JsonFields{where}, f, field);
}

std::string encode_manifest(const Manifest& m) {
  json j;
  j["format"] = "ettkit-checkpoint";
  j["version"] = 1;
  j["step"] = m.step;
  j["world_size"] = m.world_size;
  j["created_unix_us"] = m.created_unix_us;
  j["commit_seq"] = m.commit_seq;
  j["torch_version"] = m.torch_version;
  json files = json::object();
  for (const auto& [name, d] : m.files) files[name] = encode_file_digest(d);
  j["files"] = files;
  j["metadata"] = m.metadata;
  return j.dump(2) + "\n";
}

namespace {
std::atomic<uint64_t> g_decodes{0};
}  // namespace

uint64_t manifest_decodes() { return g_decodes.load(std::memory_order_relaxed); }

Manifest decode_manifest(const std::string& text, const std::string& source) {
  g_decodes.fetch_add(1, std::memory_order_relaxed);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  ETTKIT_CHECK(!j.is_discarded(), CorruptData, "manifest '", source, "' is not valid JSON");
  ETTKIT_CHECK(j.is_object(), CorruptData, "manifest '", source, "' is not a JSON object");
  const std::string where = "manifest '" + source + "'";
  JsonFields r{where};
  check_format_and_version(r, j);
  Manifest m;
  m.step = r.integer(*r.find(j, "step", true), "step", 0, kMaxStep);
  m.world_size = static_cast<int>(r.integer(*r.find(j, "world_size", true), "world_size", 1, kMaxWorldSize));
  if (const json* v = r.find(j, "created_unix_us", false)) {
    m.created_unix_us = r.integer(*v, "created_unix_us", 0, INT64_MAX);
  }
  if (const json* v = r.find(j, "commit_seq", false)) m.commit_seq = r.unsigned_integer(*v, "commit_seq");
  if (const json* v = r.find(j, "torch_version", false)) m.torch_version = r.string(*v, "torch_version");
  const json& files = *r.find(j, "files", true);
  if (!files.is_object()) r.bad("files", files, "an object mapping file names to {size, xxh3}");
  for (auto it = files.begin(); it != files.end(); ++it) {
    // A file name is opened inside the step directory: a path in it would reach outside.
    if (!is_plain_file_name(it.key())) r.bad("files", json(it.key()), "file names without '/' (not '.' or '..')");
    m.files[it.key()] = decode_digest(r, it.value(), "files." + it.key());
  }
  if (const json* meta = r.find(j, "metadata", false)) {
    if (!meta->is_object()) r.bad("metadata", *meta, "an object of strings");
    for (auto it = meta->begin(); it != meta->end(); ++it) {
      m.metadata[it.key()] = r.string(it.value(), "metadata." + it.key());
    }
  }
  return m;
}

std::string manifest_run_id(const Manifest& m, const std::string& source) {
  auto it = m.metadata.find("ettkit.run_id");
  ETTKIT_CHECK(it != m.metadata.end(), CorruptData, source, " has no ettkit.run_id in its metadata");
  return checked_run_id(it->second, source + "'s metadata 'ettkit.run_id'");
}

}  // namespace ettkit::checkpoint::detail

namespace ettkit::checkpoint {

int checked_world_size(const std::string& value_json, const std::string& source) {
  const std::string where = "manifest '" + source + "'";
  detail::JsonFields r{where};
  nlohmann::json v = nlohmann::json::parse(value_json, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) r.bad("world_size", nullptr, "an integer");
  return static_cast<int>(r.integer(v, "world_size", 1, kMaxWorldSize));
}

ManifestFileEntry decode_manifest_file_entry(const std::string& entry_json, const std::string& source,
                                             const std::string& field) {
  const std::string where = "manifest '" + source + "'";
  nlohmann::json v = nlohmann::json::parse(entry_json, nullptr, /*allow_exceptions=*/false);
  if (v.is_discarded()) detail::JsonFields{where}.bad(field, nullptr, "an object {size, xxh3}");
  detail::FileDigest d = detail::decode_file_digest(v, where, field);
  return {d.size, std::move(d.xxh3), d.chunk_bytes, std::move(d.chunks)};
}

}  // namespace ettkit::checkpoint
