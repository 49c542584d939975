#pragma once
// The load side of AsyncCheckpointer: which step to restore and from which tier, decided with the other
// ranks, and the restore itself. The Loader chooses the memory-tier candidate (agreed by every rank) or walks
// the disk candidates newest first; each candidate is planned once (read_plan.h), every rank's verdict on it
// is voted through the Session's StoreExchange (the worst wins), and the first plan every rank finds loadable
// is run. It also owns the verify-ahead of those candidates (RestorePrefetch).
//
// Ownership: borrows the Session (session.h), which outlives it; owns the prefetch and its open files.
// Threading: the owner thread only, after the writer is drained (AsyncCheckpointer::load_latest waits for it).
// The ledger: every record a load writes is written by record_restore, and nowhere else.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/read_plan.h"
#include "checkpoint/restore_prefetch.h"
#include "checkpoint/session.h"

namespace ettkit::checkpoint::detail {

class Loader {
 public:
  explicit Loader(Session& session) : s_(session) {}
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  /// AsyncCheckpointer::load_latest (checkpointer.h), once the writer is drained.
  std::optional<LoadResult> load_latest(const NamedTensors& tensors,
                                        const std::function<void(const std::string&)>& validate_extra,
                                        const std::vector<std::string>& read_prefixes, bool partial,
                                        const std::map<std::string, std::vector<int64_t>>& global_shapes);
  /// Starts verifying the steps load_latest will most likely take, in the order it considers them; returns them.
  std::vector<int64_t> prefetch();
  bool wait_prefetch(double timeout_s) { return prefetch_.wait(timeout_s); }
  std::pair<double, uint64_t> prefetch_figures() const { return {prefetch_.seconds(), prefetch_.bytes_verified()}; }
  /// Drops the prefetch's results and closes its files (a save, close()).
  void cancel_prefetch() { prefetch_.cancel(); }
  /// Whether a load has begun its votes (enable_peer_replica must come before: the sequence numbers of the
  /// ranks' votes must stay in step).
  bool started() const { return seq_ != 0; }

 private:
  /// What the ranks agreed to restore from the memory tier.
  struct MemoryChoice {
    int64_t step = -1;
    bool take = false;  ///< this rank lacks the step: its partner gives its replica back
    bool give = false;  ///< the rank this one keeps replicas for lacks it: this rank gives it back
  };
  std::optional<MemoryChoice> agree_on_memory_step(const std::vector<MemoryStep>& held, uint64_t seq);
  /// Tries the agreed memory-tier step; true when it was loaded into `out`, else its reason is in `reasons`.
  bool load_memory(const LoadRequest& req, LoadResult& out, std::string& reasons);
  /// Tries the disk candidates; true when one was loaded into `out`. `listed_any`: some step was listed.
  bool load_disk(const LoadRequest& req, LoadResult& out, std::string& reasons, bool& listed_any);
  /// Every rank's verdict on its plan for one step, combined: the worst wins, with its reason.
  std::pair<Verdict, std::string> vote(const std::string& key, const ReadPlan& plan);
  /// The rank-0 list of disk candidates, the same on every rank.
  std::vector<int64_t> agreed_candidates(uint64_t seq);
  /// Runs a plan every rank found loadable into `out`.
  void run(ReadPlan& plan, const LoadRequest& req, int64_t step, LoadResult& out);
  /// The ledger record (and note) of a restore that began at `begin_us`.
  void record_restore(int64_t begin_us, int64_t step, Tier tier, const LoadResult& out);

  Session& s_;
  RestorePrefetch prefetch_;  // the owner thread only
  uint64_t seq_ = 0;          // the sequence number of the next vote's Store keys
  int64_t begin_us_ = 0;      // when the current load_latest began
};

}  // namespace ettkit::checkpoint::detail
