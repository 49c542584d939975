#pragma once
// The ETT report: a pure function of a run directory's ledger files (RUN_DIR/ett/rank-*.jsonl), except that
// an attempt without an end record whose process still runs (a Recorder open in this process, flushed
// first; or a live process on this host) is reported as "running" rather than "killed" (docs/ett.md §6).
//
// Every instant of the job's end-to-end wall time is put in exactly one bucket — effective, idle,
// failure or unattributed — so the buckets sum to E2E (integer microseconds) and the percentages to 100.
// docs/ett.md defines each quantity; the JSON keys are a stable contract (format_version).

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ettkit/common/export.h"
#include "ettkit/ett/interval.h"
#include "ettkit/ett/report_model.h"

namespace ettkit::ett {

struct ETTKIT_API ReportOptions {
  /// Count attempt 0's scheduling (queue) phase in E2E. Off by default: Meta's E2E starts at allocation.
  bool include_initial_queue = false;
  /// Mean time between failures to assume when the ledger shows no failure (seconds; <= 0: use the
  /// observed training time as a lower bound).
  double mtbf_prior_s = 0.0;
  /// The method the headline recommendation uses.
  IntervalMethod method = IntervalMethod::kYoung;
  /// Include the per-rank and job timelines (needed by the Python trace and plot exporters).
  bool include_timeline = true;
  /// When not empty, also write the report's Chrome trace to this file (atomically). It is streamed from
  /// the analysis, event by event, so it needs neither include_timeline nor memory for the timeline.
  std::string chrome_trace_path;
};

/// The headline numbers, for C++ trainers (Report::summary()); the full report is Report.
struct ETTKIT_API ReportSummary {
  double e2e_s = 0;
  double ett_pct = 0;
  double idle_pct = 0;
  double failure_pct = 0;
  double unattributed_pct = 0;
  int attempts = 0;
  int failures = 0;
  std::vector<double> time_to_start_s;    ///< one per attempt that reached training
  std::vector<double> time_to_recover_s;  ///< one per failure
  std::optional<double> recommended_interval_s;
  /// The MTBF the recommendation used (observed, or ReportOptions::mtbf_prior_s; JSON "mtbf_s").
  std::optional<double> mtbf_s;
  /// Seconds of E2E in each of Google's badput categories (badput::kAll order; JSON "badput"). They sum to
  /// E2E minus effective time.
  std::vector<std::pair<std::string, double>> badput_s;
};

/// Builds the typed report (report_model.h). Throws as build_report_json does.
ETTKIT_API Report build_report_model(const std::string& run_dir, const ReportOptions& options = {});

/// Builds the report and returns it as a JSON document (one object): to_json(build_report_model(...)). Throws InvalidArgument when the run
/// directory is missing or holds no ledger, Unsupported for a ledger of a newer format version. Corrupt
/// or torn lines are skipped and counted under "ledger".
ETTKIT_API std::string build_report_json(const std::string& run_dir, const ReportOptions& options = {});

/// Builds the report and returns its headline numbers.
ETTKIT_API ReportSummary build_report(const std::string& run_dir, const ReportOptions& options = {});

}  // namespace ettkit::ett
