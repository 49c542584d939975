#pragma once
// The ETT report as a typed model: what build_report_model returns, what to_json serializes (the JSON keys
// of docs/ett.md §8 are this model's fields, named the same) and what ReportSummary is cut from. The
// analysis fills it one pass per concern (src/ett/report_passes.h); nothing in it refers back to the ledger.
//
// Times are seconds (double) unless a field ends in _us (UTC epoch microseconds, int64). An optional that
// is empty is JSON null; so is an empty `exception_type`, `detail`, `interval_source` or `mtbf_source`.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ettkit/common/export.h"
#include "ettkit/ett/interval.h"

namespace ettkit::ett {

struct ReportSummary;  // report.h

/// Where an instant of E2E goes (docs/ett.md §7): effective training, idle, failure (Time to Recover,
/// re-training, lost work) or unattributed (no record covers it).
enum class Bucket : uint8_t { kEffective = 0, kUnattributed = 1, kIdle = 2, kFailure = 3 };
/// "effective", "unattributed", "idle" or "failure".
ETTKIT_API const char* bucket_name(Bucket b);

/// A checkpoint tier: the durable one (disk) or the in-memory one.
enum class CheckpointTier : uint8_t { kDisk = 0, kMemory = 1 };
/// "disk" or "memory".
ETTKIT_API const char* tier_name(CheckpointTier t);

/// A top-level phase's job-timeline time and the bucket it fell in (nullopt: several; JSON "mixed").
struct PhaseTotal {
  double seconds = 0;
  std::optional<Bucket> bucket;
};

/// One attempt (launch) of the job, across its ranks.
struct AttemptSummary {
  int attempt = 0;
  int64_t begin_us = 0;
  int64_t end_us = 0;
  std::string status;  ///< clean, exception, signal, killed or running
  std::string exception_type;
  std::string detail;
  std::optional<double> time_to_start_s;
  std::optional<int64_t> first_training_us;
  std::optional<int64_t> failure_us;
  std::optional<int64_t> restart_count;
  std::vector<int> ranks;
  std::optional<int64_t> first_step;
  std::optional<int64_t> last_step;
  /// Recorder::set_note facts of the attempt (e.g. "compile_cache"), each from the lowest rank that
  /// recorded the key.
  std::map<std::string, std::string> notes;
};

/// One failure and what it cost until the job trained again (its Time to Recover).
struct Recovery {
  int failed_attempt = 0;
  std::optional<int> resumed_attempt;  ///< empty when not recovered
  int64_t failure_us = 0;
  std::optional<int64_t> resumed_us;
  bool recovered = false;
  double total_s = 0;
  std::map<std::string, double> breakdown;  ///< top-level phase -> seconds of total_s
  double retraining_s = 0;
  std::optional<CheckpointTier> restored_from;
  std::string category;  ///< "killed", "signal", "exception:<Type>", ...
};

/// The checkpoint-interval recommendation (docs/ett.md §7).
struct IntervalRecommendation {
  IntervalMethod method = IntervalMethod::kYoung;
  double interval_s = 0;  ///< the optimum, raised to floor_s when saves take longer to become durable
  std::optional<int64_t> interval_steps;
  double optimum_s = 0;
  double blocking_s = 0;
  double mtbf_s = 0;
  double restart_s = 0;
  std::optional<double> current_interval_s;
  std::optional<double> waste_at_current_s;
  double waste_at_recommended_s = 0;
  std::optional<double> expected_saving_s;
  /// Every method's optimum, in IntervalMethod order (JSON "variants": young, daly, daly_series, daly_exact).
  double variants[4] = {0, 0, 0, 0};
  std::optional<double> floor_s;
  std::string note;
};

/// One tier's saves, intervals and recoveries.
struct TierStatistics {
  int count = 0;
  int refused = 0;  ///< saves refused as torn (checkpoint_refused)
  int failed = 0;   ///< saves that failed otherwise, nothing committed (checkpoint_failed)
  double blocking_s = 0;
  std::optional<double> blocking_mean_s;
  std::optional<double> interval_s;
  std::string interval_source;  ///< configured, configured_steps, inferred or empty
  std::optional<double> durable_latency_median_s;
  int restores = 0;
  int recovered_failures = 0;
  double retraining_s = 0;
  std::optional<IntervalRecommendation> recommendation;
};

struct CheckpointStatistics {
  TierStatistics disk;
  std::optional<TierStatistics> memory;  ///< only when the run used a memory tier
};

struct StepStatistics {
  int64_t recorded = 0;
  int64_t effective = 0;
  int64_t retrained = 0;
  std::optional<int64_t> max_step;
  std::optional<double> median_step_s;
};

struct MeasuredAndEstimated {
  double measured = 0;
  std::optional<double> estimated;
};

struct PhaseSkew {
  double min = 0, median = 0, max = 0, skew_s = 0;
};

struct LedgerStatistics {
  uint64_t files = 0;
  uint64_t records = 0;
  uint64_t corrupt_lines = 0;
  uint64_t torn_lines = 0;
  uint64_t orphan_records = 0;
  uint64_t dropped_events = 0;
  std::vector<std::string> warnings;
};

/// A flattened segment of a rank's timeline (rank >= 0) or of the job's (rank == -1).
struct TimelineSegment {
  int rank = -1;
  int attempt = 0;
  std::string name;
  Bucket bucket = Bucket::kUnattributed;
  int64_t begin_us = 0;
  int64_t end_us = 0;
};

/// A background record (a persist), drawn on its own track.
struct BackgroundSpan {
  int rank = 0;
  int attempt = 0;
  std::string name;
  std::optional<int64_t> step;
  int64_t begin_us = 0;
  int64_t end_us = 0;
};

/// The whole report. Every instant of E2E is in exactly one bucket: the four *_us sum to e2e_us().
struct ETTKIT_API Report {
  int format_version = 1;
  std::string run_dir;
  int world_size = 0;
  std::vector<int> ranks;
  int64_t e2e_begin_us = 0;
  int64_t e2e_end_us = 0;
  bool include_initial_queue = false;
  int64_t effective_us = 0, idle_us = 0, failure_us = 0, unattributed_us = 0;

  std::map<std::string, PhaseTotal> phases;
  std::map<std::string, double> substages;  ///< "parent/child" -> seconds (within the parent's phase)
  /// Seconds per badput category (include/ettkit/ett/badput.h), badput::kAll order.
  std::vector<std::pair<std::string, double>> badput_s;

  std::vector<AttemptSummary> attempts;
  std::vector<Recovery> recoveries;  ///< one per failure, in failure order
  int failures = 0;
  std::map<std::string, int> failures_by_category;

  MeasuredAndEstimated unsaved_training_s;
  MeasuredAndEstimated checkpoint_blocking_s;
  CheckpointStatistics checkpoints;  ///< checkpoints.disk.recommendation is the headline recommendation
  StepStatistics steps;
  std::optional<double> mtbf_s;
  std::string mtbf_source;  ///< measured, prior, lower_bound_no_failures or empty

  std::map<std::string, PhaseSkew> phase_skew;  ///< top-level phase -> spread across ranks
  std::vector<double> attempt_start_skew_s;     ///< per attempt: latest minus earliest recorder start

  LedgerStatistics ledger;

  /// Only with ReportOptions::include_timeline.
  bool has_timeline = false;
  std::vector<TimelineSegment> timeline;      ///< per rank
  std::vector<TimelineSegment> job_timeline;  ///< rank == -1
  std::vector<BackgroundSpan> background;

  int64_t e2e_us() const { return e2e_end_us - e2e_begin_us; }
  double e2e_s() const { return static_cast<double>(e2e_us()) / 1e6; }
  /// A bucket's time as a percentage of E2E (0 for an empty E2E).
  double pct(int64_t us) const {
    return e2e_us() > 0 ? 100.0 * static_cast<double>(us) / static_cast<double>(e2e_us()) : 0.0;
  }
  double ett_pct() const { return pct(effective_us); }
  /// TTS of each attempt that reached training, in attempt order.
  std::vector<double> time_to_start_s() const;
  /// TTR of each failure (recoveries[].total_s).
  std::vector<double> time_to_recover_s() const;
  /// The disk tier's recommendation, if any.
  const std::optional<IntervalRecommendation>& recommendation() const { return checkpoints.disk.recommendation; }
  /// The headline numbers (report.h).
  ReportSummary summary() const;
};

/// The report as the JSON document of docs/ett.md §8 (the one serializer: the CLI, Python's dict and C++
/// build_report_json all come from it).
ETTKIT_API std::string to_json(const Report& report);

}  // namespace ettkit::ett
