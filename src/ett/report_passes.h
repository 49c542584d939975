#pragma once
// The ETT report's analysis, one pass per concern (src/ett/report.cpp runs them in order). Internal: the
// passes share the per-rank and per-job working state below, which refers into the ledger; what a pass
// concludes goes into the typed Report (include/ettkit/ett/report_model.h), which does not.
//
//   timeline passes (report_timeline.cpp)
//     collect_attempts        per-rank attempts, their extents and the job's attempts with failure status
//     flatten_rank_timelines  each rank attempt's records -> non-overlapping named segments
//     assign_buckets          lost work after a job's failure point; a bucket for every segment
//     build_job_timeline      E2E and, at each instant, the most severe segment across ranks
//   figure passes (report_figures.cpp)
//     sum_buckets             bucket, phase, sub-stage and badput totals of the job timeline
//     attempts_and_recoveries attempts, Time to Start, failures, Time to Recover and what each restored from
//     checkpoint_figures      saves per tier, steps, MTBF and the interval recommendations
//     rank_skew               per-phase spread across ranks, spread of the recorder starts
//     copy_timelines          the segments themselves, for the exporters that draw them

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ett/ledger_reader.h"
#include "ettkit/ett/phases.h"
#include "ettkit/ett/report.h"
#include "ettkit/ett/report_model.h"

namespace ettkit::ett::report_detail {

using detail::AttemptLedger;
using detail::LedgerSet;

inline double seconds(int64_t us) { return static_cast<double>(us) / 1e6; }
/// The median (NaN for an empty vector).
double median(std::vector<double> v);
/// The mean (0 for an empty vector).
double mean(const std::vector<double>& v);

// What a flattened segment is, before buckets are assigned.
enum class Kind : uint8_t { kPhase, kTraining, kWasted, kUnattributed, kLostInFlight, kBetween };

struct Segment {
  int64_t b;
  int64_t e;
  std::string name;  // full phase name (sub-stages kept; top_level_phase() rolls up)
  Kind kind;
  Bucket bucket = Bucket::kUnattributed;
  int attempt = 0;
  int rank = -1;
  int severity() const {
    // Job-level precedence: failure (except re-training) > re-training > idle > unattributed > effective.
    if (bucket == Bucket::kFailure) return kind == Kind::kWasted ? 4 : 5;
    if (bucket == Bucket::kIdle) return 3;
    if (bucket == Bucket::kUnattributed) return 2;
    return 1;
  }
};

struct RankAttempt {
  const AttemptLedger* ledger = nullptr;
  std::optional<int64_t> proc_start;          // the ledger's, raised to process_start_floor
  int64_t process_start_floor = INT64_MIN;  // see process_start_floor()
  // A phase's begin; process_bootstrap begins at proc_start, so it is raised to the same floor.
  int64_t phase_begin(const detail::PhaseRecord& p, const std::vector<std::string>& names) const {
    return names[p.name] == phase::kProcessBootstrap ? std::max(p.b, process_start_floor) : p.b;
  }
  int64_t begin = 0;        // earliest record (scheduling included)
  int64_t alloc_begin = 0;  // earliest record excluding scheduling
  int64_t end = 0;
  // Where the process's teardown begins (its end record) when its process_exit record extends `end`: the
  // interval [teardown_begin, end) is the shutdown sub-stage phase::kProcessTeardown. Clean attempts only.
  std::optional<int64_t> teardown_begin;
  bool failed = false;
  int64_t failure_point = 0;  // last activity (failed attempts)
  std::optional<int64_t> first_training;
  std::vector<Segment> segments;
};


struct JobAttempt {
  int attempt = 0;
  int64_t begin = INT64_MAX;
  int64_t alloc_begin = INT64_MAX;
  int64_t end = INT64_MIN;
  bool failed = false;
  std::string status = "clean";
  std::string exception_type;
  std::string detail;
  std::optional<int64_t> failure_point;
  int cause_rank = -1;  // the failed rank that names the failure (cause_of_failure); -1: none
  std::optional<int64_t> first_training;  // max over ranks (all must train)
  bool all_ranks_trained = true;
  std::vector<int> ranks;
  std::optional<int64_t> restart_count;
  std::optional<int64_t> first_step, last_step;
};

// Which records take precedence where records of one rank overlap (docs/ett.md §4): a recorded phase over
// a step (a step is only the time between two marks, so whatever is recorded inside it is carved out),
// and a step over the report's own start-up fillers (worker_spawn, a derived process_bootstrap), which
// stand for time that nothing recorded covers.
enum class Layer : uint8_t { kFiller = 0, kStep = 1, kPhase = 2 };

struct Labelled {
  int64_t b, e;
  std::string name;
  Kind kind;
  Layer layer;
};

/// Flattens labelled intervals into non-overlapping segments within [lo, hi] (report_timeline.cpp says how
/// overlaps are resolved); uncovered time is "unattributed".
std::vector<Segment> flatten(std::vector<Labelled> items, int64_t lo, int64_t hi);

/// The working state the passes share. `set` outlives it; RankAttempt::ledger points into it.
struct Analysis {
  const LedgerSet* set = nullptr;
  std::map<int, std::vector<RankAttempt>> per_rank;  // rank -> attempts in file order
  std::map<int, JobAttempt> jobs;                     // attempt number -> job view
  std::vector<Segment> job_timeline;                  // gap-free over [e2e_begin, e2e_end), in time order
  int64_t e2e_begin = 0;
  int64_t e2e_end = 0;
  std::vector<std::string> warnings;  // the ledger's, then the analysis'
  const std::vector<std::string>& names() const { return set->names; }
};

/// What the recoveries say about each checkpoint tier, for the interval recommendation.
struct RecoveryCosts {
  int restores_from[2] = {0, 0};            // attempts that restored from each tier
  std::vector<double> recovered_ttr[2];     // TTR of the failures restored from each tier
  std::vector<double> ttr_not_memory;       // TTR of the recovered failures not restored from memory
  std::vector<double> ttr_recovered;        // TTR of every recovered failure
  double retraining_from[2] = {0, 0};       // re-training after the failures restored from each tier
};

// ---- the passes, in the order report.cpp runs them ----------------------------------------------------------
void collect_attempts(Analysis& an);
void flatten_rank_timelines(Analysis& an);
void assign_buckets(Analysis& an);
void build_job_timeline(Analysis& an, const ReportOptions& options);

void sum_buckets(const Analysis& an, Report& r);
RecoveryCosts attempts_and_recoveries(const Analysis& an, Report& r);
void checkpoint_figures(const Analysis& an, const RecoveryCosts& costs, const ReportOptions& options, Report& r);
void rank_skew(const Analysis& an, Report& r);
void copy_timelines(const Analysis& an, Report& r);

/// The interval recommendation (docs/ett.md §7) for saves that block `blocking_mean` seconds each and take
/// `durable_median` seconds to commit, against failures every `mtbf` seconds that cost `restart_s` each.
/// Empty without a positive blocking time or an MTBF.
std::optional<IntervalRecommendation> recommendation_for(const std::optional<double>& blocking_mean,
                                                         const std::optional<double>& mtbf,
                                                         const std::string& mtbf_source, double restart_s,
                                                         double durable_median,
                                                         const std::optional<double>& interval_s,
                                                         double effective_s, double median_step_s,
                                                         IntervalMethod method);

}  // namespace ettkit::ett::report_detail
