#pragma once
// The disk tier's commit vote: how the ranks of one save agree, through the c10d Store and with no
// collective, that every rank's files are durable before rank 0 commits the step (docs/checkpoint.md, "How
// a save works" and "Guarantees"). Per save, under its own key prefix (so saves never read each other's):
//
//   every rank r:   <prefix>rank/<r> = {"files": {name: digest}}      its files are durable
//                                   or {"error": why, "torn": bool}    it failed, or its copy was torn
//   rank 0:         waits for ranks 1..N-1 (judged by the PeerMonitor: a dead rank fails the wait at once),
//                   writes the manifest and renames the step, then
//                   <prefix>result = "ok" or {"kind": "torn"|"peer_lost"|"error", "message": why}
//   rank r > 0:     waits for the result; its save is durable only when it reads "ok".
//
// Torch-free apart from the Store type; the checkpointer's writer thread owns one CommitVote per save. The
// waits and the decoding are StoreExchange's (store_exchange.h): a dead rank ends them, a hostile value is named.
//
// DiskCommit is the whole commit of a disk-tier save once this rank's files are written: the vote, and on
// rank 0 the manifest, the rename, `latest` and retention (its CommitHistory). The writer owns one.
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <exception>
#include <map>
#include <optional>
#include <string>

#include "checkpoint/peer_monitor.h"
#include "checkpoint/storage.h"
#include "checkpoint/store_exchange.h"

// Exported (though not installed) so tests/cpp/checkpoint can drive a vote over an in-process Store.
#pragma GCC visibility push(default)
namespace ettkit::checkpoint::detail {

/// One save's vote. Not thread-safe: the writer thread of one rank uses it.
class CommitVote {
 public:
  /// `prefix`: this save's keys (the run's prefix + "save/<seq>/"); `step` names the save in messages;
  /// `timeout_s` bounds every wait (peers found dead end it sooner). `store` and `peers` outlive the vote.
  CommitVote(c10d::Store& store, PeerMonitor& peers, std::string prefix, int64_t step, double timeout_s);

  /// This rank's files are durable: their digests go to rank 0.
  void report(int rank, const std::map<std::string, FileDigest>& files);
  /// This rank failed; a TornSnapshot is reported as torn, so that rank 0 refuses the step as torn too.
  void report_failure(int rank, std::exception_ptr error);

  /// Rank 0: every other rank's file digests, once ranks 1..world-1 have reported. Throws TornSnapshot or
  /// IoError naming the first rank that failed, PeerLost/Timeout from the wait, CorruptData for a report
  /// that is not what report() writes.
  std::map<std::string, FileDigest> gather(int world);
  /// Rank 0: the step is committed.
  void publish_ok();
  /// Rank 0: the step is not committed, and why (the error's kind travels: torn, peer lost, other). Never
  /// throws: when the Store is gone too, the caller's own error says more.
  void publish_failure(std::exception_ptr error) noexcept;

  /// A rank other than 0: returns once rank 0 has committed the step; throws TornSnapshot, PeerLost or
  /// IoError with rank 0's reason when it did not, PeerLost/Timeout when rank 0 never answered.
  void await_result();

 private:
  StoreExchange exchange_;  // every wait through `peers`, every value decoded strictly
  std::string prefix_;
  int64_t step_;
};

/// The commit of one disk-tier save after this rank wrote its files into the step's temporary directory.
/// Not thread-safe: the writer thread uses it. Rank 0 of a writer holds the directory lock, so that its
/// CommitHistory is the directory's only committer.
class DiskCommit {
 public:
  struct Setup {
    std::string directory;  // canonical CKPT_DIR
    int keep_last = 0;      // retention (<= 0 keeps every step)
    int rank = 0;
    int world = 1;
    c10d::Store* store = nullptr;    // world > 1
    PeerMonitor* peers = nullptr;    // world > 1
    std::string key_prefix;          // the run's Store keys; each save votes under "save/<seq>/"
    double timeout_s = 0;            // every wait of the vote
  };
  explicit DiskCommit(Setup setup) : s_(std::move(setup)) {}

  /// The step `manifest.step`, save number `seq`: this rank's `files` are durable in `tmp` (held open as
  /// `tmp_dir`; null when it could not be made), or it failed with `local_error`. Returns once the step is
  /// committed on every rank; rethrows `local_error`, or throws why the step was not committed (another
  /// rank's failure, a lost peer, rank 0's manifest or rename). Rank 0 removes `tmp` when it fails.
  void commit(uint64_t seq, const std::string& tmp, const Dir* tmp_dir, std::map<std::string, FileDigest> files,
              std::exception_ptr local_error, Manifest manifest);

 private:
  /// Rank 0: every rank's digests into the manifest, then the manifest, the rename and the fsyncs.
  void write_manifest_and_rename(std::optional<CommitVote>& vote, const std::string& tmp, const Dir* tmp_dir,
                                 Manifest& manifest);

  Setup s_;
  CommitHistory history_;  // rank 0: commit sequence and retention
};

/// What rank 0 publishes for an error: {"kind": "torn"|"peer_lost"|"error", "message": describe(e)}.
std::string commit_result_text(std::exception_ptr e);

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
