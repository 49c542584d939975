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
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <exception>
#include <map>
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

/// What rank 0 publishes for an error: {"kind": "torn"|"peer_lost"|"error", "message": describe(e)}.
std::string commit_result_text(std::exception_ptr e);

}  // namespace ettkit::checkpoint::detail
#pragma GCC visibility pop
