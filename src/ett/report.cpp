// The ETT report: reads the ledger, runs the analysis passes (src/ett/report_passes.h) into the typed Report
// (include/ettkit/ett/report_model.h) and serializes it once (report_json.cpp). docs/ett.md §7 defines every
// quantity.

#include "ettkit/ett/report.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ett/chrome_trace.h"
#include "ett/ledger_format.h"
#include "ett/ledger_reader.h"
#include "ett/open_recorders.h"
#include "ett/process_info.h"
#include "ett/report_passes.h"
#include "ettkit/common/error.h"

using nlohmann::json;

namespace ettkit::ett {

namespace {

using report_detail::Analysis;
using report_detail::Segment;
using detail::LedgerSet;

// Streams the Chrome trace (docs/ett.md §9) from the analysis' segments, in the layout of
// python/ettkit/ett/trace.py: a process per rank (thread 0 its segments, thread 1 its background records),
// one for the job, attempt markers and the ETT% counter. Nothing of the timeline is copied: a 10^6-step
// report writes its trace in bounded memory.
void stream_chrome_trace(const std::string& path, const std::string& run_dir, int job_pid, double ett_pct,
                         const Analysis& an) {
  const auto& per_rank = an.per_rank;
  const auto& job_timeline = an.job_timeline;
  const auto& jobs = an.jobs;
  const auto& names = an.names();
  const int64_t origin = an.e2e_begin;
  const int64_t e2e_end = an.e2e_end;
  detail::ChromeTraceFile out(path);
  for (const auto& [rank, vec] : per_rank) {
    out.process(rank, "rank " + std::to_string(rank));
    out.thread(rank, 0, "phases");
    out.thread(rank, 1, "background");
  }
  out.process(job_pid, "job");
  out.thread(job_pid, 0, "phases");

  // Each track in time order; attempts are in file order, which a clock reset can make differ.
  for (const auto& [rank, vec] : per_rank) {
    std::vector<const Segment*> track;
    for (const auto& ra : vec) {
      for (const auto& seg : ra.segments) track.push_back(&seg);
    }
    std::stable_sort(track.begin(), track.end(), [](const Segment* x, const Segment* y) { return x->b < y->b; });
    for (const Segment* seg : track) {
      const char* bucket = bucket_name(seg->bucket);
      out.complete(rank, 0, seg->name, bucket, seg->b - origin, seg->e - seg->b, seg->attempt, bucket, std::nullopt);
    }
  }
  for (const auto& [rank, vec] : per_rank) {
    std::vector<std::pair<const detail::PhaseRecord*, int>> track;  // (record, attempt)
    for (const auto& ra : vec) {
      for (const auto& p : ra.ledger->background) track.emplace_back(&p, ra.ledger->attempt);
    }
    std::stable_sort(track.begin(), track.end(), [](const auto& x, const auto& y) { return x.first->b < y.first->b; });
    for (const auto& [p, attempt] : track) {
      out.complete(rank, 1, names[p->name], "background", p->b - origin, p->e - p->b, attempt, "",
                   p->step >= 0 ? std::optional<int64_t>(p->step) : std::nullopt);
    }
  }
  for (const auto& seg : job_timeline) {
    const char* bucket = bucket_name(seg.bucket);
    out.complete(job_pid, 0, seg.name, bucket, seg.b - origin, seg.e - seg.b, seg.attempt, bucket, std::nullopt);
  }
  for (const auto& [n, job] : jobs) {
    std::vector<int> pids = job.ranks;
    pids.push_back(job_pid);
    const json begin_args = {{"attempt", n}};
    const json end_args = {{"attempt", n},
                           {"status", job.status},
                           {"exception_type", job.exception_type.empty() ? json(nullptr) : json(job.exception_type)},
                           {"detail", job.detail.empty() ? json(nullptr) : json(job.detail)}};
    const std::string begin_text = begin_args.dump(-1, ' ', false, json::error_handler_t::replace);
    const std::string end_text = end_args.dump(-1, ' ', false, json::error_handler_t::replace);
    const std::string begin_name = "attempt " + std::to_string(n) + " begin";
    const std::string end_name = "attempt " + std::to_string(n) + " end (" + job.status + ")";
    for (int pid : pids) out.instant(pid, 0, begin_name, "attempt", job.begin - origin, begin_text);
    for (int pid : pids) out.instant(pid, 0, end_name, "attempt", job.end - origin, end_text);
  }
  out.counter(job_pid, 0, "ETT%", e2e_end - origin, ett_pct);
  const json other = {{"run_dir", run_dir}, {"e2e_begin_us", origin}, {"ett_pct", ett_pct}};
  out.commit(other.dump(-1, ' ', false, json::error_handler_t::replace));
}

// Reads the ledger for a report. An attempt with no end record is "running" rather than "killed" when its
// process still runs: a Recorder open in this process (flushed first, so the report sees what it recorded
// so far: a trainer may report on its own run), or a live process on this host with the pid and start time
// of the attempt record. An attempt of another host without an end record reads as killed until it ends.
LedgerSet read_for_report(const std::string& run_dir) {
  const auto open_here =
      detail::flush_open_ledgers_in((std::filesystem::path(run_dir) / ledger::kDirName).string(), 10.0);
  LedgerSet set = detail::read_ledger_dir(run_dir);
  const std::string this_host = detail::host_name();
  for (auto& rank : set.ranks) {
    if (rank.attempts.empty() || rank.attempts.back().has_end) continue;
    auto& a = rank.attempts.back();  // only a rank's last attempt can still be running
    std::error_code ec;
    const std::string path = std::filesystem::weakly_canonical(rank.path, ec).string();
    for (const auto& [open_path, attempt] : open_here) {
      a.running = a.running || (open_path == path && attempt == a.attempt);
    }
    if (!a.running && a.proc_start && !a.host.empty() && a.host == this_host) {
      a.running = detail::process_is_running(a.pid, *a.proc_start);
    }
  }
  return set;
}

Report analyse(const LedgerSet& set, const std::string& run_dir, const ReportOptions& options) {
  Analysis an;
  an.set = &set;
  report_detail::collect_attempts(an);
  report_detail::flatten_rank_timelines(an);
  report_detail::assign_buckets(an);
  report_detail::build_job_timeline(an, options);

  Report r;
  r.run_dir = run_dir;
  r.world_size = std::max<int>(set.world_size, static_cast<int>(an.per_rank.size()));
  for (const auto& [rank, vec] : an.per_rank) r.ranks.push_back(rank);
  r.e2e_begin_us = an.e2e_begin;
  r.e2e_end_us = an.e2e_end;
  r.include_initial_queue = options.include_initial_queue;
  report_detail::sum_buckets(an, r);
  const auto costs = report_detail::attempts_and_recoveries(an, r);
  report_detail::checkpoint_figures(an, costs, options, r);
  report_detail::rank_skew(an, r);
  r.ledger.files = set.files;
  r.ledger.records = set.records;
  r.ledger.corrupt_lines = set.corrupt_lines;
  r.ledger.torn_lines = set.torn_lines;
  r.ledger.orphan_records = set.orphan_records;
  for (const auto& rl : set.ranks) {
    for (const auto& a : rl.attempts) r.ledger.dropped_events += a.dropped;
  }
  r.ledger.warnings = an.warnings;
  if (!options.chrome_trace_path.empty()) {
    stream_chrome_trace(options.chrome_trace_path, run_dir, r.world_size, r.ett_pct(), an);
  }
  if (options.include_timeline) report_detail::copy_timelines(an, r);
  return r;
}

}  // namespace

Report build_report_model(const std::string& run_dir, const ReportOptions& options) {
  try {
    auto set = read_for_report(run_dir);
    return analyse(set, run_dir, options);
  } catch (const std::filesystem::filesystem_error& e) {
    // The ledger reader works on file descriptors; this catches what a std::filesystem call on the way
    // (resolving an open Recorder's path, the trace file) throws, so that every OS error of a report is
    // ettkit's IoError naming the path, never a bare std::exception.
    const std::string path = e.path1().empty() ? run_dir : e.path1().string();
    ETTKIT_THROW(IoError, "report of '", run_dir, "': cannot access '", path, "': ", e.code().message());
  }
}

std::string build_report_json(const std::string& run_dir, const ReportOptions& options) {
  return to_json(build_report_model(run_dir, options));
}

ReportSummary Report::summary() const {
  ReportSummary s;
  s.e2e_s = e2e_s();
  s.ett_pct = pct(effective_us);
  s.idle_pct = pct(idle_us);
  s.failure_pct = pct(failure_us);
  s.unattributed_pct = pct(unattributed_us);
  s.attempts = static_cast<int>(attempts.size());
  s.failures = failures;
  s.time_to_start_s = time_to_start_s();
  s.time_to_recover_s = time_to_recover_s();
  if (recommendation()) s.recommended_interval_s = recommendation()->interval_s;
  s.mtbf_s = mtbf_s;
  s.badput_s = badput_s;
  return s;
}

ReportSummary build_report(const std::string& run_dir, const ReportOptions& options) {
  ReportOptions lean = options;
  lean.include_timeline = false;
  return build_report_model(run_dir, lean).summary();
}

}  // namespace ettkit::ett
