#pragma once
// The manifest of a committed step (step-<N>/manifest.json): its codec, strict on decode, and the JSON form
// of a FileDigest, which the commit vote sends over the Store in the same shape as the manifest lists it.

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <string>

#include "checkpoint/checksums.h"

#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

struct Manifest {
  int64_t step = -1;
  int world_size = 0;
  int64_t created_unix_us = 0;
  /// Position in the directory's commit history (see the commit order in directory_layout.h); 0 in older
  /// manifests.
  uint64_t commit_seq = 0;
  std::map<std::string, FileDigest> files;  // file name (inside the step dir) -> digest
  std::map<std::string, std::string> metadata;
  std::string torch_version;
};
std::string encode_manifest(const Manifest& m);
/// Checks every field's type and range. Throws CorruptData naming `source` and the bad field (Unsupported
/// for a version newer than 1); never anything else.
Manifest decode_manifest(const std::string& text, const std::string& source);
/// How many times decode_manifest has run in this process (every thread): what a test counts to prove that a
/// load decodes each candidate's manifest once (tests/cpp/checkpoint/loader_test.cpp).
uint64_t manifest_decodes();
/// A manifest's "ettkit.run_id" metadata (what memory-tier steps carry), checked. CorruptData naming
/// `source` when it is missing or not a run id.
std::string manifest_run_id(const Manifest& m, const std::string& source);

/// {"size", "xxh3"} and, when the digest has chunk checksums, {"chunk_bytes", "chunks"}.
nlohmann::json encode_file_digest(const FileDigest& d);
/// The inverse, checked as strictly as decode_manifest checks each file (types, 16-hex-digit checksums,
/// chunks that cover the size exactly). CorruptData "<where>: field '<field>.<key>' is ...; expected ..."
/// (`field` empty: just the key), never a JSON-library exception.
FileDigest decode_file_digest(const nlohmann::json& f, const std::string& where, const std::string& field);

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
