// The disk tier's commit vote (commit.h).
#include "checkpoint/commit.h"

#include <nlohmann/json.hpp>

#include <vector>

#include "common/describe.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {
namespace {

using nlohmann::json;
using ::ettkit::detail::describe;

std::string text_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

json digest_json(const FileDigest& d) {
  return {{"size", d.size}, {"xxh3", d.xxh3}, {"chunk_bytes", d.chunk_bytes}, {"chunks", d.chunks}};
}

// What report() writes, checked field by field (nlohmann's getters would turn -1 into 2^64 - 1).
FileDigest digest_of(const json& f, const std::string& where) {
  auto unsigned_field = [&](const char* key, bool required) -> uint64_t {
    auto it = f.find(key);
    if (it == f.end() && !required) return 0;
    ETTKIT_CHECK(it != f.end() && it->is_number_unsigned(), CorruptData, where, " has no unsigned '", key, "'");
    return it->get<uint64_t>();
  };
  ETTKIT_CHECK(f.is_object(), CorruptData, where, " is not an object");
  FileDigest d;
  d.size = unsigned_field("size", true);
  d.chunk_bytes = unsigned_field("chunk_bytes", false);
  auto x = f.find("xxh3");
  ETTKIT_CHECK(x != f.end() && x->is_string(), CorruptData, where, " has no string 'xxh3'");
  d.xxh3 = x->get<std::string>();
  if (auto c = f.find("chunks"); c != f.end()) {
    ETTKIT_CHECK(c->is_array(), CorruptData, where, "'s 'chunks' is not an array");
    for (const json& h : *c) {
      ETTKIT_CHECK(h.is_string(), CorruptData, where, "'s 'chunks' holds a non-string");
      d.chunks.push_back(h.get<std::string>());
    }
  }
  return d;
}

}  // namespace

std::string commit_result_text(std::exception_ptr e) {
  const char* kind = "error";
  try {
    std::rethrow_exception(e);
  } catch (const TornSnapshot&) {
    kind = "torn";
  } catch (const PeerLost&) {
    kind = "peer_lost";
  } catch (...) {
  }
  return json{{"kind", kind}, {"message", describe(e)}}.dump();
}

CommitVote::CommitVote(c10d::Store& store, PeerMonitor& peers, std::string prefix, int64_t step, double timeout_s)
    : store_(store), peers_(peers), prefix_(std::move(prefix)), step_(step), timeout_s_(timeout_s) {}

void CommitVote::report(int rank, const std::map<std::string, FileDigest>& files) {
  json report;
  report["files"] = json::object();
  for (const auto& [name, d] : files) report["files"][name] = digest_json(d);
  peers_.set(prefix_ + "rank/" + std::to_string(rank), report.dump());
}

void CommitVote::report_failure(int rank, std::exception_ptr error) {
  json report{{"error", describe(error)}, {"torn", json::parse(commit_result_text(error))["kind"] == "torn"}};
  peers_.set(prefix_ + "rank/" + std::to_string(rank), report.dump());
}

std::map<std::string, FileDigest> CommitVote::gather(int world) {
  std::vector<std::string> keys;
  std::vector<int> others;
  for (int r = 1; r < world; ++r) {
    keys.push_back(prefix_ + "rank/" + std::to_string(r));
    others.push_back(r);
  }
  peers_.wait_keys(keys, others, timeout_s_, "checkpoint step " + std::to_string(step_) + ": the votes of the other ranks");
  std::map<std::string, FileDigest> files;
  for (int r = 1; r < world; ++r) {
    const std::string& key = keys[static_cast<size_t>(r - 1)];
    json rep = json::parse(text_of(store_.get(key)), nullptr, /*allow_exceptions=*/false);
    ETTKIT_CHECK(rep.is_object(), CorruptData, "rank ", r, "'s vote for checkpoint step ", step_, " is not JSON");
    if (rep.contains("error")) {
      std::string why = rep["error"].is_string() ? rep["error"].get<std::string>() : rep["error"].dump();
      const bool torn = rep.contains("torn") && rep["torn"].is_boolean() && rep["torn"].get<bool>();
      if (torn) ETTKIT_THROW(checkpoint::TornSnapshot, "rank ", r, ": ", why);
      ETTKIT_THROW(IoError, "checkpoint step ", step_, ": rank ", r, " failed: ", why);
    }
    ETTKIT_CHECK(rep.contains("files") && rep["files"].is_object(), CorruptData, "rank ", r,
                 "'s vote for checkpoint step ", step_, " lists no files");
    // The names go into the manifest, and loaders open them inside the step directory: a rank reports its
    // own two files (what report() sends), nothing else and nothing with a path in it.
    const std::string base = "rank-" + std::to_string(r);
    ETTKIT_CHECK(rep["files"].size() == 2, CorruptData, "rank ", r, "'s vote for checkpoint step ", step_, " lists ",
                 rep["files"].size(), " file(s); a rank reports ", base, ".safetensors and ", base, ".extra");
    for (auto it = rep["files"].begin(); it != rep["files"].end(); ++it) {
      const std::string where = "rank " + std::to_string(r) + "'s digest of '" + it.key() + "'";
      ETTKIT_CHECK(it.key() == base + ".safetensors" || it.key() == base + ".extra", CorruptData, "rank ", r,
                   "'s vote for checkpoint step ", step_, " names a file '", it.key(), "'; a rank reports ", base,
                   ".safetensors and ", base, ".extra");
      FileDigest d = digest_of(it.value(), where);
      check_file_digest(d, where);
      files[it.key()] = std::move(d);
    }
  }
  return files;
}

void CommitVote::publish_ok() { peers_.set(prefix_ + "result", "ok"); }

void CommitVote::publish_failure(std::exception_ptr error) noexcept {
  try {
    peers_.set(prefix_ + "result", commit_result_text(error));
  } catch (...) {  // the Store is gone too: the caller's error says more
  }
}

void CommitVote::await_result() {
  peers_.wait_keys({prefix_ + "result"}, {0}, timeout_s_, "checkpoint step " + std::to_string(step_) + ": rank 0's commit result");
  std::string result = text_of(store_.get(prefix_ + "result"));
  if (result == "ok") return;
  json r = json::parse(result, nullptr, /*allow_exceptions=*/false);
  std::string why = r.is_object() && r.contains("message") && r["message"].is_string() ? r["message"].get<std::string>() : result;
  std::string kind = r.is_object() && r.contains("kind") && r["kind"].is_string() ? r["kind"].get<std::string>() : "";
  if (kind == "torn") ETTKIT_THROW(checkpoint::TornSnapshot, "checkpoint step ", step_, " was refused by the commit vote: ", why);
  if (kind == "peer_lost") ETTKIT_THROW(checkpoint::PeerLost, "rank 0: ", why);
  ETTKIT_THROW(IoError, "checkpoint step ", step_, " was not committed by rank 0: ", why);
}

}  // namespace ettkit::checkpoint::detail
