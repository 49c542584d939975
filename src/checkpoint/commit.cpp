// The disk tier's commit vote (commit.h).
#include "checkpoint/commit.h"

#include <nlohmann/json.hpp>

#include <vector>

#include "checkpoint/store_exchange.h"

#include "common/describe.h"
#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/clock.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {
namespace {

using nlohmann::json;
using ::ettkit::detail::describe;

/// The kind of error that travels with a refusal: "torn", "peer_lost" or "error".
const char* error_kind(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const TornSnapshot&) {
    return "torn";
  } catch (const PeerLost&) {
    return "peer_lost";
  } catch (...) {
    return "error";
  }
}
}  // namespace

std::string commit_result_text(std::exception_ptr e) {
  return json{{"kind", error_kind(e)}, {"message", describe(e)}}.dump();
}

CommitVote::CommitVote(c10d::Store& store, PeerMonitor& peers, std::string prefix, int64_t step, double timeout_s)
    : exchange_(store, &peers, timeout_s), prefix_(std::move(prefix)), step_(step) {}

void CommitVote::report(int rank, const std::map<std::string, FileDigest>& files) {
  json report;
  report["files"] = json::object();
  for (const auto& [name, d] : files) report["files"][name] = encode_file_digest(d);
  exchange_.publish(prefix_ + "rank/" + std::to_string(rank), report);
}

void CommitVote::report_failure(int rank, std::exception_ptr error) {
  json report{{"error", describe(error)}, {"torn", error_kind(error) == std::string("torn")}};
  exchange_.publish(prefix_ + "rank/" + std::to_string(rank), report);
}

std::map<std::string, FileDigest> CommitVote::gather(int world) {
  std::vector<int> others;
  for (int r = 1; r < world; ++r) others.push_back(r);
  const std::vector<json> votes =
      exchange_.gather(prefix_ + "rank/", others, /*self=*/0, "checkpoint step " + std::to_string(step_) +
                       ": the votes of the other ranks", "a vote {\"files\": {name: digest}} or {\"error\": why}");
  std::map<std::string, FileDigest> files;
  for (int r = 1; r < world; ++r) {
    const json& rep = votes[static_cast<size_t>(r - 1)];
    ETTKIT_CHECK(rep.is_object(), CorruptData, "rank ", r, "'s vote for checkpoint step ", step_, " is not a JSON object");
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
      FileDigest d = decode_file_digest(it.value(), where, "");
      check_file_digest(d, where);
      files[it.key()] = std::move(d);
    }
  }
  return files;
}

void CommitVote::publish_ok() { exchange_.publish(prefix_ + "result", std::string("ok")); }

void CommitVote::publish_failure(std::exception_ptr error) noexcept {
  try {
    exchange_.publish(prefix_ + "result", commit_result_text(error));
  } catch (...) {  // the Store is gone too: the caller's error says more
  }
}

void CommitVote::await_result() {
  const std::string result = exchange_.await_from(prefix_ + "result", 0, "checkpoint step " + std::to_string(step_) +
                                                  ": rank 0's commit result");
  if (result == "ok") return;
  // Rank 0's {"kind", "message"}; anything else still fails the wait, with what it says.
  json r = json::parse(result, nullptr, /*allow_exceptions=*/false);
  std::string why = r.is_object() && r.contains("message") && r["message"].is_string() ? r["message"].get<std::string>() : result;
  std::string kind = r.is_object() && r.contains("kind") && r["kind"].is_string() ? r["kind"].get<std::string>() : "";
  if (kind == "torn") ETTKIT_THROW(checkpoint::TornSnapshot, "checkpoint step ", step_, " was refused by the commit vote: ", why);
  if (kind == "peer_lost") ETTKIT_THROW(checkpoint::PeerLost, "rank 0: ", why);
  ETTKIT_THROW(IoError, "checkpoint step ", step_, " was not committed by rank 0: ", why);
}

void DiskCommit::commit(uint64_t seq, const std::string& tmp, const Dir* tmp_dir,
                        std::map<std::string, FileDigest> files, std::exception_ptr local_error, Manifest manifest) {
  std::optional<CommitVote> vote;
  if (s_.world > 1) {
    vote.emplace(*s_.store, *s_.peers, s_.key_prefix + "save/" + std::to_string(seq) + "/", manifest.step,
                 s_.timeout_s);
    if (local_error) {
      vote->report_failure(s_.rank, local_error);
    } else {
      vote->report(s_.rank, files);
    }
  }
  if (local_error && (s_.world == 1 || s_.rank != 0)) std::rethrow_exception(local_error);
  if (s_.rank != 0) {
    vote->await_result();
    return;
  }
  try {
    if (local_error) std::rethrow_exception(local_error);
    manifest.files = std::move(files);
    write_manifest_and_rename(vote, tmp, tmp_dir, manifest);
  } catch (...) {
    remove_tree_quietly(tmp);
    if (vote) vote->publish_failure(std::current_exception());
    throw;
  }
  // Committed and durable: `latest` and retention cannot fail the step (they warn instead).
  history_.after_commit(s_.directory, manifest.step, s_.keep_last);
  if (vote) vote->publish_ok();
}

void DiskCommit::write_manifest_and_rename(std::optional<CommitVote>& vote, const std::string& tmp,
                                           const Dir* tmp_dir, Manifest& manifest) {
  if (vote) {
    for (auto& [name, d] : vote->gather(s_.world)) manifest.files[name] = std::move(d);
  }
  manifest.created_unix_us = epoch_us();  // the commit's time: after every rank's files are durable
  manifest.commit_seq = history_.next_seq(s_.directory);
  std::string text = encode_manifest(manifest);
  write_file_durably(*tmp_dir, "manifest.json", {ConstBuffer{text.data(), text.size()}});
  fsync_directory(*tmp_dir);
  commit_step_directory(s_.directory, tmp, manifest.step);
}

}  // namespace ettkit::checkpoint::detail
