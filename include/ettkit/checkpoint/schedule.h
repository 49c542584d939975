#pragma once
// When to save: the interval policy of AsyncCheckpointer, for C++ trainers and for the Python layer (which
// binds it). Two tiers, each with its own interval (never, every N steps, every D seconds, or "auto": Daly's
// interval from the tier's own measured costs and the job's failure history, docs/checkpoint.md "When to
// save"). The schedule decides; it saves nothing and owns nothing but its counters.
//
//   ckpt::CheckpointSchedule when(ckpt::Every::parse("auto"), {},
//                                 ckpt::FailureHistory::from_run(run_dir, 24 * 3600.0));
//   for (...) {
//     train_step();
//     if (auto tier = when.due(step, ck)) {
//       ck.save(step, state.tensors(), "", *tier);
//       when.saved(step, *tier);
//     }
//   }
//
// when.record_intervals(recorder) puts fixed intervals into the ETT report as the configured interval.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/export.h"

namespace ettkit::ett {
class Recorder;
}

namespace ettkit::checkpoint {

/// One tier's interval.
struct ETTKIT_API Every {
  enum class Kind : uint8_t {
    kNever,    ///< the policy never saves to this tier
    kSteps,    ///< at every step that is a multiple of `value`
    kSeconds,  ///< once `value` seconds have passed since the tier's last save
    kAuto,     ///< once the tier's recommended interval (CheckpointSchedule::auto_interval_s) has passed
  };
  Kind kind = Kind::kNever;
  double value = 0;  ///< steps or seconds; 0 for kNever and kAuto

  /// "" or "never"; "auto"; a positive integer of steps ("500"); a positive duration with a unit: "90s",
  /// "1.5min", "10m", "2h" (also "sec"). Throws InvalidArgument naming `field` and what is valid.
  static Every parse(std::string_view text, std::string_view field = "every");
  /// A positive number of steps; InvalidArgument naming `field` otherwise.
  static Every steps(int64_t n, std::string_view field = "every");
  /// A positive, finite number of seconds; InvalidArgument naming `field` otherwise.
  static Every seconds(double s, std::string_view field = "every");
  static Every automatic() { return {Kind::kAuto, 0}; }
  /// "never", "steps", "seconds" or "auto".
  const char* kind_name() const;
};

/// The interval "auto" uses before a save of the tier has committed (nothing measured yet): 10 minutes.
inline constexpr double kAutoUnmeasuredIntervalS = 600.0;

/// The failures "auto" holds an interval against.
struct ETTKIT_API FailureHistory {
  double mtbf_s = 24 * 3600.0;  ///< mean time between failures
  double restart_s = 0.0;       ///< mean Time to Recover of the failures seen (0: none yet)

  /// From the ETT report of `run_dir` (its ledger): the report's MTBF (`prior_mtbf_s` when the ledger shows
  /// no failure) and the mean of its Times to Recover. A run directory without a ledger yet gives the prior
  /// and no restart cost; a ledger that cannot be read gives the same and logs a warning saying why: the
  /// interval is advice, and a job must not fail to start over it. InvalidArgument for a prior that is not
  /// positive and finite.
  static FailureHistory from_run(const std::string& run_dir, double prior_mtbf_s);
};

/// What a tier's saves cost, as the checkpointer measured them.
struct ETTKIT_API TierCosts {
  int64_t committed = 0;  ///< saves of the tier committed so far
  double blocking_s = 0;  ///< mean time a save blocked training
  double durable_s = 0;   ///< mean time from save() to committed
  static TierCosts of(const AsyncCheckpointer& ck, Tier tier);
};

/// Decides, step by step, whether a save is due and to which tier. The disk interval wins a step where both
/// are due; the two intervals run separately (a memory save does not reset the disk interval, a disk save
/// satisfies a step-count memory interval at the same step). Times are seconds on a clock the caller
/// chooses (the overloads without one use the steady clock); `saved` and `restored` must be told what
/// happened, the schedule does not watch the checkpointer. Not thread-safe: one owner, the training loop.
class ETTKIT_API CheckpointSchedule {
 public:
  /// InvalidArgument for a history whose MTBF is not positive and finite or whose restart cost is negative.
  CheckpointSchedule(Every disk, Every memory = {}, FailureHistory history = {}, double start_s = now_s());

  /// The tier a save is due to at `step`, or nullopt. `disk` and `memory` are the tiers' measured costs.
  std::optional<Tier> due(int64_t step, double now, const TierCosts& disk, const TierCosts& memory) const;
  /// The same with the checkpointer's own measured costs (TierCosts::of) at `now`: what a caller with its
  /// own clock uses (the Python layer), so that the costs are read where they are kept, never handed back.
  std::optional<Tier> due(int64_t step, double now, const AsyncCheckpointer& ck) const;
  /// The same on the steady clock.
  std::optional<Tier> due(int64_t step, const AsyncCheckpointer& ck) const;

  /// A save of `step` to `tier` was queued (not skipped) at `now`.
  void saved(int64_t step, Tier tier, double now = now_s());
  /// `step` was restored: neither tier saves it again at once.
  void restored(int64_t step);

  /// The interval "auto" gives `tier` for these costs: Daly's first-order interval from the mean blocking
  /// time (at least 0.1 ms) and the history, never below the time a save of the tier takes to commit;
  /// kAutoUnmeasuredIntervalS before one has committed.
  double auto_interval_s(const TierCosts& costs) const;
  /// The same for `tier` with the checkpointer's own measured costs.
  double auto_interval_s(const AsyncCheckpointer& ck, Tier tier) const;

  /// Records the fixed intervals into `recorder` as the run's configured checkpoint interval (the ETT config
  /// records checkpoint_interval_steps or checkpoint_interval_s, checkpoint_memory_* for the memory tier;
  /// docs/ett.md, "interval in use"), so that a trainer need not repeat them in set_config. "auto" and "never"
  /// record nothing: the report infers "auto"'s interval from the saves. A trainer calls it once, with the
  /// recorder its checkpointer records into (the Python AsyncCheckpointer does, unless read_only).
  void record_intervals(ett::Recorder& recorder) const;

  const Every& every(Tier tier) const { return state(tier).every; }
  const FailureHistory& history() const { return history_; }
  /// Seconds on the steady clock.
  static double now_s();

 private:
  struct TierState {
    Every every;
    std::optional<int64_t> last_step;
    double last_time = 0;
    int64_t made = 0;
  };
  const TierState& state(Tier t) const { return t == Tier::kMemory ? memory_ : disk_; }
  bool tier_due(const TierState& s, int64_t step, double now, const TierCosts& costs) const;

  TierState disk_;
  TierState memory_;
  FailureHistory history_;
};

}  // namespace ettkit::checkpoint
