#pragma once
// StoreExchange: the one way the ranks of a checkpointer trade small values through the c10d Store, with no
// collective: a value per rank gathered by every rank (or by one), a value from rank 0 to all, and the worst
// of the ranks' verdicts. The commit vote, load_latest's votes and its memory-step agreement, the list of
// candidate steps and the run id all go through it (docs/architecture.md, "StoreExchange").
//
// Why one unit: every wait goes through the PeerMonitor, so a peer that died ends it at once with PeerLost
// naming the rank instead of after the whole timeout; and every value is decoded strictly. Any client of
// the job's Store can write these keys (docs/security.md): a value that is not JSON, or not the shape the
// exchange expects, is CorruptData naming the Store key, the rank that should have written it and what was
// expected, never an exception of the JSON library escaping unexplained.
//
// Torch-free apart from the Store type. Not thread-safe by itself: one thread of a rank runs one exchange
// at a time (the Store and the PeerMonitor are thread-safe, so several exchanges may share them).
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "checkpoint/peer_monitor.h"

namespace ettkit::checkpoint::detail {

/// The Store's byte values and the text this code writes into them.
inline std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }
inline std::string string_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

/// One rank's verdict for worst_verdict: a value of the caller's enum (0..max) and why.
struct RankVerdict {
  int verdict = 0;
  std::string why;
};

class StoreExchange {
 public:
  using json = nlohmann::json;
  /// Checks a decoded value: throws CorruptData naming `source` (the key and its writer) when the value is
  /// not what that rank writes.
  using Check = std::function<void(const json& value, const std::string& source)>;

  /// `peers` may be null only before the ranks agree on a run id (there is no heartbeat to judge by yet):
  /// waits are then bounded by `timeout_s` alone and sets go to the Store as they are. `timeout_s` bounds
  /// every wait (a dead peer ends it sooner). `store` and `peers` outlive the exchange.
  StoreExchange(c10d::Store& store, PeerMonitor* peers, double timeout_s);

  /// Sets `key` to `text`; with a monitor, an unreachable Store is PeerLost.
  void publish(const std::string& key, const std::string& text);
  void publish(const std::string& key, const json& value) { publish(key, value.dump()); }

  /// The text rank `from` set under `key`, once it is there (PeerLost when `from` died first, Timeout after
  /// timeout_s). `what` names the wait in the messages ("load_latest: rank 0's list of steps").
  std::string await_from(const std::string& key, int from, const std::string& what);

  /// The values ranks `ranks` set under `prefix` + rank, in that order, each JSON-decoded strictly and
  /// passed through `check` (CorruptData naming the key for anything else). The ranks other than `self`
  /// are watched by the monitor (`self` < 0: all of them).
  std::vector<json> gather(const std::string& prefix, const std::vector<int>& ranks, int self,
                           const std::string& what, const std::string& expected, const Check& check = {});

  /// Every rank: sets `mine` under `prefix` + rank, returns every rank's value in rank order (`mine` too,
  /// as read back: every rank decides on the same bytes).
  std::vector<json> all_gather(const std::string& prefix, int rank, int world, const json& mine,
                               const std::string& what, const std::string& expected, const Check& check = {});

  /// Rank 0's text under `key` on every rank: rank 0 sets `mine` and gets it back, the others wait for it.
  std::string from_rank0(const std::string& key, int rank, const std::string& mine, const std::string& what);

  /// The worst of every rank's verdict (by `severity`; on a tie the lowest rank's), its reason prefixed
  /// with "rank <r>: ". Values travel as {"v": verdict, "why": text}; a verdict outside [0, max_verdict] is
  /// CorruptData. With world 1, `mine` as it is.
  RankVerdict worst_verdict(const std::string& prefix, int rank, int world, const RankVerdict& mine, int max_verdict,
                            const std::function<int(int)>& severity, const std::string& what);

  /// `text` as JSON, or CorruptData "<source> is not JSON (<the text, shown safely>); expected <expected>".
  static json decode(const std::string& text, const std::string& source, const std::string& expected);

 private:
  void wait(const std::vector<std::string>& keys, const std::vector<int>& watch, const std::string& what);

  c10d::Store& store_;
  PeerMonitor* peers_;
  double timeout_s_;
};

}  // namespace ettkit::checkpoint::detail
