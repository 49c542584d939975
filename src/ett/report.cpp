// The ETT report: ledger records -> per-rank timelines -> one job timeline -> buckets and metrics.
//
// 1. Per rank and attempt, the recorded intervals (phases, steps) are flattened into non-overlapping
//    segments: a phase wins over a step (a checkpoint_blocking phase inside a step is checkpoint time, not
//    training), and among overlapping phases (or steps) the one that ends first wins (see flatten()).
//    Uncovered time is "unattributed", or "lost_in_flight" after the last record of an attempt that failed.
// 2. Steps at or below the step high-water mark of the rank's earlier attempts are wasted_training.
// 3. Each segment gets a bucket. Time in a recovery attempt (one that follows a failed attempt) before the
//    job trains again is failure time (Time to Recover), whatever the phase; otherwise phases are idle.
// 4. The job timeline takes, at each instant, the most severe segment across ranks (failure > idle >
//    unattributed > effective): a synchronous job trains only when every rank trains. Time no rank covers
//    is detect_and_teardown after a failed attempt, restart_gap after a clean one.
// Every instant of E2E falls in exactly one job segment, so the buckets sum to E2E in integer µs.
#include "ettkit/ett/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <queue>
#include <set>
#include <string>
#include <vector>

#include "common/logging.h"
#include "ett/chrome_trace.h"
#include "ett/ledger_format.h"
#include "ett/ledger_reader.h"
#include "ett/open_recorders.h"
#include "ett/process_info.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/badput.h"
#include "ettkit/ett/interval.h"
#include "ettkit/ett/phases.h"

using nlohmann::json;

namespace ettkit::ett {

namespace {

using detail::AttemptLedger;
using detail::LedgerSet;

enum class Bucket : uint8_t { kEffective = 0, kUnattributed = 1, kIdle = 2, kFailure = 3 };

const char* bucket_name(Bucket b) {
  switch (b) {
    case Bucket::kEffective: return "effective";
    case Bucket::kUnattributed: return "unattributed";
    case Bucket::kIdle: return "idle";
    case Bucket::kFailure: return "failure";
  }
  return "?";
}

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
  bool failed = false;
  int64_t failure_point = 0;  // last activity (failed attempts)
  std::optional<int64_t> first_training;
  std::vector<Segment> segments;
};

// The earliest time an attempt's process can have started, given that the same rank's previous attempt
// ended at `previous_end`. On one rank, attempts are consecutive processes. proc_start, from /proc, has
// clock-tick resolution (10 ms), and ledgers of earlier ettkit versions took the boot time in whole seconds
// (up to 1 s early). A process start before the previous attempt's end is that imprecision, so the start is
// raised to that end; otherwise this attempt's process_bootstrap would cover the end of the previous attempt
// and, as recovery time, override it in the job view. Only when the attempt's own recorder start (ts) is
// after that end: otherwise the two attempts' clocks disagree and nothing is moved (see e2e_begin_of).
int64_t process_start_floor(const AttemptLedger& a, int64_t previous_end) {
  return a.proc_start && *a.proc_start < previous_end && previous_end <= a.ts ? previous_end : INT64_MIN;
}

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
  std::optional<int64_t> first_training;  // max over ranks (all must train)
  bool all_ranks_trained = true;
  std::vector<int> ranks;
  std::optional<int64_t> restart_count;
  std::optional<int64_t> first_step, last_step;
};

double seconds(int64_t us) { return static_cast<double>(us) / 1e6; }

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

json opt(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }
json opt_i(const std::optional<int64_t>& v) { return v ? json(*v) : json(nullptr); }
json num_or_null(double v) { return std::isfinite(v) ? json(v) : json(nullptr); }

// "Type: message" -> "Type". Split at ": " (not ':') so that C++ names keep their namespace
// ("std::runtime_error: boom" -> "std::runtime_error").
std::string exception_type_of(const std::string& detail) {
  auto sep = detail.find(": ");
  return sep == std::string::npos ? detail : detail.substr(0, sep);
}

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

// Flattens labelled intervals into non-overlapping segments within [lo, hi]; uncovered time gets the name
// "unattributed". At each instant the covering interval of the highest layer wins; within a layer, the one
// that ends first, then the one that began last, then the one listed first. Ending first makes the
// innermost of nested intervals win (a checkpoint inside a step, a sub-stage inside launcher_init), and
// of two concurrent intervals that overlap without nesting, the one that started first keeps its time until
// it ends: a stage is never cut short by one that started after it and outlived it.
std::vector<Segment> flatten(std::vector<Labelled> items, int64_t lo, int64_t hi) {
  std::vector<Segment> out;
  if (hi <= lo) return out;
  for (auto& it : items) {
    it.b = std::clamp(it.b, lo, hi);
    it.e = std::clamp(it.e, lo, hi);
  }
  std::erase_if(items, [](const Labelled& l) { return l.e <= l.b; });
  // Stable: "listed first" (file order) stays the last tie-break.
  std::stable_sort(items.begin(), items.end(), [](const Labelled& x, const Labelled& y) { return x.b < y.b; });
  std::vector<int64_t> points;
  points.reserve(items.size() * 2 + 2);
  points.push_back(lo);
  points.push_back(hi);
  for (const auto& it : items) {
    points.push_back(it.b);
    points.push_back(it.e);
  }
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  // std::priority_queue puts the "largest" on top: `outranked(x, y)` says y wins over x.
  auto outranked = [&](size_t x, size_t y) {
    const Labelled& a = items[x];
    const Labelled& b = items[y];
    if (a.layer != b.layer) return a.layer < b.layer;
    if (a.e != b.e) return a.e > b.e;
    if (a.b != b.b) return a.b < b.b;
    return x > y;
  };
  std::priority_queue<size_t, std::vector<size_t>, decltype(outranked)> active(outranked);
  size_t next = 0;
  for (size_t i = 0; i + 1 < points.size(); ++i) {
    int64_t p = points[i];
    int64_t q = points[i + 1];
    while (next < items.size() && items[next].b <= p) active.push(next++);
    // Lazy deletion: an interval that ended is dropped once it reaches the top.
    while (!active.empty() && items[active.top()].e <= p) active.pop();
    Segment seg{p, q, "", Kind::kUnattributed};
    if (!active.empty()) {
      const auto& top = items[active.top()];
      seg.name = top.name;
      seg.kind = top.kind;
    } else {
      seg.name = std::string(phase::kUnattributed);
    }
    if (!out.empty() && out.back().e == p && out.back().name == seg.name && out.back().kind == seg.kind) {
      out.back().e = q;
    } else {
      out.push_back(std::move(seg));
    }
  }
  return out;
}

// A coalescing appender for segments with buckets.
void append_coalesced(std::vector<Segment>& out, Segment seg) {
  if (!out.empty() && out.back().e == seg.b && out.back().name == seg.name && out.back().kind == seg.kind &&
      out.back().bucket == seg.bucket && out.back().attempt == seg.attempt && out.back().rank == seg.rank) {
    out.back().e = seg.e;
  } else {
    out.push_back(std::move(seg));
  }
}

// E2E begins at attempt 0's allocation (its queue too with include_initial_queue). A later attempt
// normally begins after that; one that begins earlier ran on a clock behind attempt 0's (a clock reset, a
// different host). Its time is real job time, so E2E is extended to cover it rather than clipping it
// away unseen, and a warning says which attempt and by how much.
int64_t e2e_begin_of(const std::map<int, JobAttempt>& jobs, const ReportOptions& options,
                     std::vector<std::string>& warnings) {
  const JobAttempt& first = jobs.begin()->second;
  const int64_t first_begin = options.include_initial_queue ? first.begin : first.alloc_begin;
  int64_t begin = first_begin;
  for (auto it = std::next(jobs.begin()); it != jobs.end(); ++it) {
    const JobAttempt& job = it->second;
    if (job.begin >= first_begin) continue;
    char lead[32];
    std::snprintf(lead, sizeof(lead), "%.3f", seconds(first_begin - job.begin));
    warnings.push_back("attempt " + std::to_string(job.attempt) + " begins " + lead + " s before attempt " +
                       std::to_string(first.attempt) +
                       " (clocks differ between attempts?); E2E starts at the earliest attempt");
    ETTKIT_LOG_WARN(warnings.back());
    begin = std::min(begin, job.begin);
  }
  return begin;
}

// The first attempt after a failed one whose job first trains after the failure point: where a failure
// is recovered. A sparse table of the maximum first-training time over attempt ranges turns each question
// into a binary search: O(log A) instead of a scan of the later attempts (quadratic in a crash loop).
class NextTraining {
 public:
  explicit NextTraining(const std::map<int, JobAttempt>& jobs) {
    std::vector<int64_t> first_training;
    for (const auto& [n, job] : jobs) {
      numbers_.push_back(n);
      first_training.push_back(job.first_training.value_or(INT64_MIN));
    }
    table_.push_back(std::move(first_training));
    for (size_t width = 1; 2 * width <= numbers_.size(); width *= 2) {
      const auto& prev = table_.back();
      std::vector<int64_t> level(numbers_.size() - 2 * width + 1);
      for (size_t i = 0; i < level.size(); ++i) level[i] = std::max(prev[i], prev[i + width]);
      table_.push_back(std::move(level));
    }
  }

  /// The number of the first attempt after `attempt` that first trains later than `t`, or -1.
  int after(int attempt, int64_t t) const {
    size_t lo = std::upper_bound(numbers_.begin(), numbers_.end(), attempt) - numbers_.begin();
    if (lo == numbers_.size() || range_max(lo, numbers_.size()) <= t) return -1;
    // Invariant: the range [lo, hi) holds such an attempt; narrow it to its first one.
    size_t hi = numbers_.size();
    while (hi - lo > 1) {
      size_t mid = lo + (hi - lo) / 2;
      if (range_max(lo, mid) > t) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    return numbers_[lo];
  }

 private:
  // Maximum first-training time of the attempts [lo, hi), hi > lo: two overlapping power-of-two windows.
  int64_t range_max(size_t lo, size_t hi) const {
    size_t level = 0;
    while ((size_t{2} << level) <= hi - lo) ++level;
    return std::max(table_[level][lo], table_[level][hi - (size_t{1} << level)]);
  }

  std::vector<int> numbers_;                 // attempt numbers, ascending
  std::vector<std::vector<int64_t>> table_;  // table_[k][i]: max first training of attempts [i, i + 2^k)
};

// Streams the Chrome trace (docs/ett.md §9) from the analysis' segments, in the layout of
// python/ettkit/ett/trace.py: a process per rank (thread 0 its segments, thread 1 its background records),
// one for the job, attempt markers and the ETT% counter. Nothing of the timeline is copied: a 10^6-step
// report writes its trace in bounded memory.
void stream_chrome_trace(const std::string& path, const std::string& run_dir, int job_pid, int64_t origin,
                         int64_t e2e_end, double ett_pct, const std::map<int, std::vector<RankAttempt>>& per_rank,
                         const std::vector<Segment>& job_timeline, const std::map<int, JobAttempt>& jobs,
                         const std::vector<std::string>& names) {
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

// ---- checkpoint tiers -------------------------------------------------------------------------------------
// A checkpoint record's tier is in its name: "<phase>/memory" (checkpoint_blocking/memory,
// checkpoint_restore/memory, checkpoint_refused/memory) and checkpoint_memory_persist are the memory tier's;
// the phase itself and its other sub-stages are the durable (disk) tier's, as every record was before the
// memory tier existed.
enum class CkptTier : uint8_t { kDisk = 0, kMemory = 1 };
constexpr CkptTier kCkptTiers[] = {CkptTier::kDisk, CkptTier::kMemory};
const char* tier_key(CkptTier t) { return t == CkptTier::kMemory ? "memory" : "disk"; }

std::optional<CkptTier> checkpoint_tier(const std::string& name, std::string_view phase_name) {
  if (name == phase_name) return CkptTier::kDisk;
  if (name.size() <= phase_name.size() || name.compare(0, phase_name.size(), phase_name) != 0 ||
      name[phase_name.size()] != '/') {
    return std::nullopt;
  }
  // The sub-stage the checkpointer writes for the memory tier (phase::kMemoryTierSuffix, without its '/').
  return std::string_view(name).substr(phase_name.size()) == phase::kMemoryTierSuffix ? CkptTier::kMemory
                                                                                       : CkptTier::kDisk;
}

std::optional<CkptTier> persist_tier(const std::string& name) {
  if (name == phase::kCheckpointMemoryPersist) return CkptTier::kMemory;
  return checkpoint_tier(name, phase::kCheckpointPersist);
}

// What the lowest rank's records say about one tier's saves.
struct TierSaves {
  int count = 0;    // saves (blocking records; several of the same step are one save)
  int refused = 0;  // saves the integrity check refused (tensors changed while being copied)
  std::vector<double> between_training;  // training seconds between consecutive saves of the tier
  std::vector<double> durable_latency;   // save call -> committed, per committed save
};

// Per-rank figures come from the lowest rank (every rank runs the same loop in data-parallel jobs).
template <typename Attempts>
TierSaves tier_saves(const Attempts& ref_attempts, const std::vector<std::string>& names, CkptTier tier) {
  TierSaves out;
  for (const auto& ra : ref_attempts) {
    const auto& a = *ra.ledger;
    for (const auto& p : a.background) {
      const std::string& n = names[p.name];
      if (persist_tier(n) == tier) out.durable_latency.push_back(seconds(p.e - p.b));
      if (checkpoint_tier(n, phase::kCheckpointRefused) == tier) ++out.refused;
    }
    std::vector<std::pair<int64_t, int64_t>> blocks;
    // One checkpoint can block more than once (the save call, then the optimizer's wait for its copies):
    // records that carry the same step are one checkpoint.
    std::set<int64_t> blocked_steps;
    int unnumbered = 0;
    for (const auto& p : a.phases) {
      if (checkpoint_tier(names[p.name], phase::kCheckpointBlocking) != tier) continue;
      if (p.step >= 0 && !blocked_steps.insert(p.step).second) continue;  // a later wait of the same save
      if (p.step < 0) ++unnumbered;
      blocks.emplace_back(p.b, p.e);
    }
    std::sort(blocks.begin(), blocks.end());
    out.count += static_cast<int>(blocked_steps.size()) + unnumbered;
    // Training time accumulated since the previous checkpoint (or attempt start), sampled at each one.
    size_t bi = 0;
    int64_t acc = 0;
    for (const auto& seg : ra.segments) {
      while (bi < blocks.size() && blocks[bi].first <= seg.b) {
        if (acc > 0) out.between_training.push_back(seconds(acc));
        acc = 0;
        ++bi;
      }
      if (seg.kind == Kind::kTraining || seg.kind == Kind::kWasted) acc += seg.e - seg.b;
    }
    for (; bi < blocks.size(); ++bi) {
      if (acc > 0) out.between_training.push_back(seconds(acc));
      acc = 0;
    }
  }
  return out;
}

// The interval recommendation (docs/ett.md §7) for saves that block `blocking_mean` seconds each and take
// `durable_median` seconds to commit, against failures every `mtbf` seconds that cost `restart_s` each.
// Null without a positive blocking time or an MTBF.
json recommendation_for(const std::optional<double>& blocking_mean, const std::optional<double>& mtbf,
                        const json& mtbf_source, double restart_s, double durable_median,
                        const std::optional<double>& interval_s, double effective_s, double median_step_s,
                        IntervalMethod method) {
  if (!blocking_mean || *blocking_mean <= 0 || !mtbf) return nullptr;
  json variants = json::object();
  variants["young"] = recommend_interval(*blocking_mean, *mtbf, restart_s, IntervalMethod::kYoung);
  variants["daly"] = recommend_interval(*blocking_mean, *mtbf, restart_s, IntervalMethod::kDaly);
  variants["daly_series"] = recommend_interval(*blocking_mean, *mtbf, restart_s, IntervalMethod::kDalySeries);
  variants["daly_exact"] = recommend_interval(*blocking_mean, *mtbf, restart_s, IntervalMethod::kDalyExact);
  double optimum = recommend_interval(*blocking_mean, *mtbf, restart_s, method);
  double chosen = optimum;
  std::string note;
  if (std::isfinite(durable_median) && durable_median > chosen) {
    chosen = durable_median;
    note = "the optimum is shorter than the time a save takes to become durable; saving as often as "
           "persistence allows (continuous checkpointing)";
  }
  const double t = effective_s;
  const char* method_names[] = {"young", "daly", "daly_series", "daly_exact"};
  json waste_cur = nullptr, saving = nullptr;
  double waste_rec = t * waste_fraction(chosen, *blocking_mean, *mtbf);
  if (interval_s && *interval_s > 0) {
    double wc = t * waste_fraction(*interval_s, *blocking_mean, *mtbf);
    waste_cur = wc;
    saving = wc - waste_rec;
    if (note.empty()) {
      double excess = waste_rec > 0 ? 100.0 * (wc - waste_rec) / waste_rec : 0.0;
      note = "the current interval wastes " + std::to_string(static_cast<int>(std::round(excess))) +
             "% more than the optimum" +
             (excess < 10.0 ? "; the waste curve is flat near the optimum, change only if it is cheap"
                            : "; consider the recommended interval");
    }
  }
  if (mtbf_source == "lower_bound_no_failures") {
    note += note.empty() ? "" : "; ";
    note += "no failure observed: MTBF taken as the observed training time (a lower bound); pass a "
            "fleet MTBF prior for a better estimate";
  }
  json steps_json = nullptr;
  if (std::isfinite(median_step_s) && median_step_s > 0) {
    steps_json = std::max<int64_t>(1, std::llround(chosen / median_step_s));
  }
  return {{"method", method_names[static_cast<int>(method)]},
          {"interval_s", chosen},
          {"interval_steps", steps_json},
          {"optimum_s", optimum},
          {"blocking_s", *blocking_mean},
          {"mtbf_s", *mtbf},
          {"restart_s", restart_s},
          {"current_interval_s", opt(interval_s)},
          {"waste_at_current_s", waste_cur},
          {"waste_at_recommended_s", waste_rec},
          {"expected_saving_s", saving},
          {"variants", variants},
          {"floor_s", num_or_null(durable_median)},
          {"note", note}};
}

double mean(const std::vector<double>& v) {
  if (v.empty()) return 0.0;
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

struct Analysis {
  json doc;
  ReportSummary summary;
};

Analysis analyse(const LedgerSet& set, const std::string& run_dir, const ReportOptions& options) {
  const auto& names = set.names;
  const std::string kScheduling(phase::kScheduling);

  // ---- 1. per-rank attempts and their raw extents -------------------------------------------------------
  std::map<int, std::vector<RankAttempt>> per_rank;  // rank -> attempts in order
  std::map<int, JobAttempt> jobs;                     // attempt number -> job view
  for (const auto& rl : set.ranks) {
    auto& vec = per_rank[rl.rank];
    for (const auto& a : rl.attempts) {
      RankAttempt ra;
      ra.ledger = &a;
      ra.proc_start = a.proc_start;
      if (!vec.empty()) ra.process_start_floor = process_start_floor(a, vec.back().end);
      if (ra.proc_start) ra.proc_start = std::max(*ra.proc_start, ra.process_start_floor);
      int64_t begin = a.ts;
      int64_t alloc = a.ts;
      if (ra.proc_start) {
        begin = std::min(begin, *ra.proc_start);
        alloc = std::min(alloc, *ra.proc_start);
      }
      for (const auto& p : a.phases) {
        const int64_t b = ra.phase_begin(p, names);
        begin = std::min(begin, b);
        if (names[p.name] != kScheduling) alloc = std::min(alloc, b);
      }
      for (const auto& s : a.steps) begin = std::min(begin, s.b);
      ra.begin = begin;
      ra.alloc_begin = alloc;
      ra.end = a.has_end ? std::max(a.end_ts, a.last_ts) : a.last_ts;
      ra.failed = a.has_end ? a.status != "clean" : !a.running;
      ra.failure_point = a.activity_end > 0 ? a.activity_end : ra.begin;
      vec.push_back(std::move(ra));
      JobAttempt& job = jobs[a.attempt];
      job.attempt = a.attempt;
      job.begin = std::min(job.begin, begin);
      job.alloc_begin = std::min(job.alloc_begin, alloc);
      job.end = std::max(job.end, vec.back().end);
      job.ranks.push_back(rl.rank);
      if (!job.restart_count && a.restart_count) job.restart_count = a.restart_count;
    }
  }
  // Job failure status: the first rank to stop making progress names the failure.
  for (auto& [rank, vec] : per_rank) {
    for (auto& ra : vec) {
      JobAttempt& job = jobs[ra.ledger->attempt];
      if (!ra.failed) continue;
      if (!job.failed || ra.failure_point < *job.failure_point) {
        job.failed = true;
        job.failure_point = ra.failure_point;
        const auto& a = *ra.ledger;
        job.status = !a.has_end ? "killed" : a.status;
        job.detail = a.detail;
        job.exception_type = a.status == "exception" ? exception_type_of(a.detail) : "";
      }
    }
  }
  // An attempt still in progress (read_for_report) that no rank has failed yet.
  for (auto& [rank, vec] : per_rank) {
    for (auto& ra : vec) {
      JobAttempt& job = jobs[ra.ledger->attempt];
      if (ra.ledger->running && !job.failed) job.status = "running";
    }
  }
  auto previous_failed = [&](int attempt) {
    auto it = jobs.find(attempt);
    if (it == jobs.begin() || it == jobs.end()) return false;
    return std::prev(it)->second.failed;
  };

  // ---- 2. per-rank flattened timelines --------------------------------------------------------------------
  for (auto& [rank, vec] : per_rank) {
    int64_t high_water = INT64_MIN;  // highest step of the rank's earlier attempts
    for (auto& ra : vec) {
      const auto& a = *ra.ledger;
      std::vector<Labelled> items;
      items.reserve(a.phases.size() + a.steps.size());
      for (const auto& p : a.phases) {
        const std::string& n = names[p.name];
        Kind kind = n == phase::kTraining ? Kind::kTraining
                    : n == phase::kWastedTraining ? Kind::kWasted
                                                  : Kind::kPhase;
        items.push_back({ra.phase_begin(p, names), p.e, n, kind, Layer::kPhase});
      }
      // Time between the launcher's phases (allocation) and this process's exec is the launcher's own
      // start-up (torchrun agent, rendezvous, spawning workers); launcher phases override where they lie.
      if (ra.proc_start && *ra.proc_start > ra.begin) {
        items.push_back({ra.begin, *ra.proc_start, std::string(phase::kWorkerSpawn), Kind::kPhase, Layer::kFiller});
      }
      if (ra.proc_start && *ra.proc_start < a.ts) {
        bool has_bootstrap = false;
        for (const auto& p : a.phases) has_bootstrap = has_bootstrap || names[p.name] == phase::kProcessBootstrap;
        if (!has_bootstrap) {
          items.push_back(
              {*ra.proc_start, a.ts, std::string(phase::kProcessBootstrap), Kind::kPhase, Layer::kFiller});
        }
      }
      int64_t attempt_max = INT64_MIN;
      for (const auto& s : a.steps) {
        bool wasted = s.n <= high_water;
        items.push_back({s.b, s.e, std::string(wasted ? phase::kWastedTraining : phase::kTraining),
                         wasted ? Kind::kWasted : Kind::kTraining, Layer::kStep});
        attempt_max = std::max(attempt_max, s.n);
      }
      auto flat = flatten(std::move(items), ra.begin, ra.end);
      for (auto& seg : flat) {
        seg.attempt = a.attempt;
        seg.rank = rank;
        if (seg.kind == Kind::kUnattributed && ra.failed && seg.b >= ra.failure_point) {
          seg.kind = Kind::kLostInFlight;
          seg.name = std::string(phase::kLostInFlight);
        }
        if ((seg.kind == Kind::kTraining || seg.kind == Kind::kWasted) && !ra.first_training) {
          ra.first_training = seg.b;
        }
      }
      ra.segments = std::move(flat);
      high_water = std::max(high_water, attempt_max);
      JobAttempt& job = jobs[a.attempt];
      if (!ra.first_training) {
        job.all_ranks_trained = false;
      } else if (!job.first_training || *ra.first_training > *job.first_training) {
        job.first_training = ra.first_training;
      }
      for (const auto& s : a.steps) {
        if (!job.first_step || s.n < *job.first_step) job.first_step = s.n;
        if (!job.last_step || s.n > *job.last_step) job.last_step = s.n;
      }
    }
  }
  for (auto& [n, job] : jobs) {
    if (!job.all_ranks_trained) job.first_training.reset();
  }

  // ---- 3. buckets -----------------------------------------------------------------------------------------
  // Once the first rank of a failed attempt stops, whatever the others still do in that attempt is lost
  // (it is re-done after the restore): split their segments at the job's failure point.
  for (auto& [rank, vec] : per_rank) {
    for (auto& ra : vec) {
      const JobAttempt& job = jobs[ra.ledger->attempt];
      if (!job.failed) continue;
      const int64_t f = *job.failure_point;
      std::vector<Segment> split;
      split.reserve(ra.segments.size() + 1);
      for (auto& seg : ra.segments) {
        if (seg.e <= f || seg.kind == Kind::kLostInFlight) {
          split.push_back(std::move(seg));
          continue;
        }
        if (seg.b < f) {
          Segment head = seg;
          head.e = f;
          split.push_back(std::move(head));
          seg.b = f;
        }
        seg.kind = Kind::kLostInFlight;
        seg.name = std::string(phase::kLostInFlight);
        if (!split.empty() && split.back().kind == Kind::kLostInFlight && split.back().e == seg.b) {
          split.back().e = seg.e;
        } else {
          split.push_back(std::move(seg));
        }
      }
      ra.segments = std::move(split);
    }
  }
  for (auto& [rank, vec] : per_rank) {
    for (auto& ra : vec) {
      const JobAttempt& job = jobs[ra.ledger->attempt];
      bool recovery = previous_failed(job.attempt);
      for (auto& seg : ra.segments) {
        bool in_recovery_window = recovery && (!job.first_training || seg.b < *job.first_training);
        switch (seg.kind) {
          case Kind::kTraining: seg.bucket = Bucket::kEffective; break;
          case Kind::kWasted:
          case Kind::kLostInFlight: seg.bucket = Bucket::kFailure; break;
          case Kind::kUnattributed:
            seg.bucket = in_recovery_window ? Bucket::kFailure : Bucket::kUnattributed;
            break;
          case Kind::kPhase:
          case Kind::kBetween: seg.bucket = in_recovery_window ? Bucket::kFailure : Bucket::kIdle; break;
        }
        if (in_recovery_window && seg.kind == Kind::kTraining) seg.bucket = Bucket::kFailure;
      }
    }
  }

  // ---- 4. E2E and the job timeline -----------------------------------------------------------------------
  std::vector<std::string> warnings = set.warnings;
  const int64_t e2e_begin = e2e_begin_of(jobs, options, warnings);
  int64_t e2e_end = INT64_MIN;
  for (const auto& [n, job] : jobs) e2e_end = std::max(e2e_end, job.end);
  e2e_end = std::max(e2e_end, e2e_begin);

  std::vector<const Segment*> all;
  std::vector<int64_t> points{e2e_begin, e2e_end};
  for (const auto& [rank, vec] : per_rank) {
    for (const auto& ra : vec) {
      for (const auto& seg : ra.segments) {
        if (seg.e <= e2e_begin || seg.b >= e2e_end) continue;
        all.push_back(&seg);
        points.push_back(std::clamp(seg.b, e2e_begin, e2e_end));
        points.push_back(std::clamp(seg.e, e2e_begin, e2e_end));
      }
    }
  }
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  std::sort(all.begin(), all.end(), [](const Segment* x, const Segment* y) { return x->b < y->b; });
  // Active segments ordered by severity, then lowest rank (deterministic).
  auto cmp = [](const Segment* x, const Segment* y) {
    if (x->severity() != y->severity()) return x->severity() < y->severity();
    return x->rank > y->rank;
  };
  std::priority_queue<const Segment*, std::vector<const Segment*>, decltype(cmp)> active(cmp);
  std::vector<Segment> job_timeline;
  // For time no rank covers: the highest-numbered attempt that has ended by p. p only grows, so one sweep
  // over the attempts in end order answers every point (a scan of all attempts per point was quadratic).
  std::vector<std::pair<int64_t, int>> ends;  // (end, attempt)
  ends.reserve(jobs.size());
  for (const auto& [n, job] : jobs) ends.emplace_back(job.end, n);
  std::sort(ends.begin(), ends.end());
  size_t ended = 0;
  int prev_attempt = -1;
  size_t next = 0;
  for (size_t i = 0; i + 1 < points.size(); ++i) {
    int64_t p = points[i], q = points[i + 1];
    for (; ended < ends.size() && ends[ended].first <= p; ++ended) {
      prev_attempt = std::max(prev_attempt, ends[ended].second);
    }
    while (next < all.size() && all[next]->b <= p) {
      active.push(all[next++]);
    }
    // Lazy deletion: a segment that ended may sit below the top; pop only ended tops.
    while (!active.empty() && active.top()->e <= p) active.pop();
    // The top may be stale only if a more severe ended segment hides a live one; handled by the loop.
    Segment seg{p, q, "", Kind::kBetween};
    if (!active.empty()) {
      const Segment* top = active.top();
      seg.name = top->name;
      seg.kind = top->kind;
      seg.bucket = top->bucket;
      seg.attempt = top->attempt;
    } else {
      // Between attempts: did the attempt that ended last before p fail?
      bool after_failure = prev_attempt >= 0 && jobs[prev_attempt].failed;
      seg.name = std::string(after_failure ? phase::kDetectAndTeardown : phase::kRestartGap);
      seg.bucket = after_failure ? Bucket::kFailure : Bucket::kIdle;
      seg.attempt = std::max(prev_attempt, 0);
    }
    append_coalesced(job_timeline, std::move(seg));
  }

  // ---- 5. sums --------------------------------------------------------------------------------------------
  int64_t bucket_us[4] = {0, 0, 0, 0};
  std::map<std::string, int64_t> phase_us;
  std::map<std::string, std::set<Bucket>> phase_bucket_set;
  std::map<std::string, int64_t> substage_us;
  for (const auto& seg : job_timeline) {
    int64_t d = seg.e - seg.b;
    bucket_us[static_cast<int>(seg.bucket)] += d;
    std::string top = top_level_phase(seg.name);
    phase_us[top] += d;
    phase_bucket_set[top].insert(seg.bucket);
    if (top != seg.name) substage_us[top + "/" + seg.name.substr(seg.name.find('/') == std::string::npos
                                                                       ? 0
                                                                       : seg.name.find('/') + 1)] += d;
  }
  const int64_t e2e_us = e2e_end - e2e_begin;
  auto pct = [&](int64_t us) { return e2e_us > 0 ? 100.0 * static_cast<double>(us) / static_cast<double>(e2e_us) : 0.0; };
  const int64_t effective_us = bucket_us[static_cast<int>(Bucket::kEffective)];
  const double effective_s = seconds(effective_us);

  // ---- 6. attempts, TTS, failures, TTR -------------------------------------------------------------------
  json attempts = json::array();
  json tts = json::array();
  std::vector<double> tts_values;
  for (const auto& [n, job] : jobs) {
    std::optional<double> t;
    if (job.first_training) t = seconds(*job.first_training - job.alloc_begin);
    if (t) {
      tts.push_back(*t);
      tts_values.push_back(*t);
    }
    attempts.push_back({{"attempt", n},
                        {"begin_us", job.begin},
                        {"end_us", job.end},
                        {"status", job.status},
                        {"exception_type", job.exception_type.empty() ? json(nullptr) : json(job.exception_type)},
                        {"detail", job.detail.empty() ? json(nullptr) : json(job.detail)},
                        {"time_to_start_s", opt(t)},
                        {"first_training_us", opt_i(job.first_training)},
                        {"failure_us", opt_i(job.failure_point)},
                        {"restart_count", opt_i(job.restart_count)},
                        {"ranks", job.ranks},
                        {"first_step", opt_i(job.first_step)},
                        {"last_step", opt_i(job.last_step)}});
  }

  // Which tier each attempt restored from: its lowest rank's checkpoint_restore records (the ranks agree on
  // the step and tier through the Store before loading). A memory-tier record wins over a plain one: a
  // trainer may wrap the checkpointer's load in its own checkpoint_restore phase.
  std::map<int, CkptTier> restored_tier;
  for (const auto& [rank, vec] : per_rank) {
    for (const auto& ra : vec) {
      if (restored_tier.count(ra.ledger->attempt)) continue;
      std::optional<CkptTier> tier;
      for (const auto& p : ra.ledger->phases) {
        auto t = checkpoint_tier(names[p.name], phase::kCheckpointRestore);
        if (t && (!tier || *t == CkptTier::kMemory)) tier = t;
      }
      if (tier) restored_tier[ra.ledger->attempt] = *tier;
    }
  }
  int restores_from[2] = {0, 0};
  for (const auto& [n, t] : restored_tier) ++restores_from[static_cast<int>(t)];
  std::vector<double> recovered_ttr[2];      // Time to Recover of the failures restored from each tier
  std::vector<double> ttr_values_not_memory;  // ... and of those not restored from the memory tier
  double retraining_from[2] = {0, 0};         // re-training after the failures restored from each tier

  json recoveries = json::array();
  json ttr = json::array();
  std::vector<double> ttr_values;
  std::map<std::string, int> failures_by_category;
  int failures = 0;
  std::vector<std::pair<int64_t, int>> failure_points;  // (time, attempt)
  for (const auto& [n, job] : jobs) {
    if (job.failed) failure_points.emplace_back(*job.failure_point, n);
  }
  std::sort(failure_points.begin(), failure_points.end());
  const NextTraining next_training(jobs);
  std::map<int, int64_t> wasted_us_by_attempt;  // job-timeline re-training per attempt
  for (const auto& seg : job_timeline) {
    if (seg.kind == Kind::kWasted) wasted_us_by_attempt[seg.attempt] += seg.e - seg.b;
  }
  for (size_t k = 0; k < failure_points.size(); ++k) {
    auto [f, attempt] = failure_points[k];
    const JobAttempt& job = jobs[attempt];
    ++failures;
    std::string category = job.status == "exception" ? "exception:" + job.exception_type : job.status;
    failures_by_category[category]++;
    std::optional<int64_t> resumed;
    const int resumed_attempt = next_training.after(attempt, f);
    if (resumed_attempt >= 0) resumed = jobs.at(resumed_attempt).first_training;
    int64_t stop = resumed ? *resumed : e2e_end;
    bool recovered = resumed.has_value();
    if (k + 1 < failure_points.size() && failure_points[k + 1].first < stop) {
      stop = failure_points[k + 1].first;
      recovered = false;
    }
    std::map<std::string, int64_t> breakdown_us;
    // The job timeline is sorted and gap-free: start at the segment that contains f.
    auto first = std::upper_bound(job_timeline.begin(), job_timeline.end(), f,
                                  [](int64_t t, const Segment& seg) { return t < seg.e; });
    for (auto it = first; it != job_timeline.end() && it->b < stop; ++it) {
      int64_t b = std::max(it->b, f), e = std::min(it->e, stop);
      if (e > b) breakdown_us[top_level_phase(it->name)] += e - b;
    }
    int64_t retrain_us = 0;
    if (recovered) {
      auto w = wasted_us_by_attempt.find(resumed_attempt);
      if (w != wasted_us_by_attempt.end()) retrain_us = w->second;
    }
    json breakdown = json::object();
    for (const auto& [name, us] : breakdown_us) breakdown[name] = seconds(us);
    double total = seconds(std::max<int64_t>(stop - f, 0));
    ttr.push_back(total);
    json restored_from = nullptr;
    if (recovered) {
      ttr_values.push_back(total);
      auto rt = restored_tier.find(resumed_attempt);
      if (rt != restored_tier.end()) {
        const int i = static_cast<int>(rt->second);
        restored_from = tier_key(rt->second);
        recovered_ttr[i].push_back(total);
        retraining_from[i] += seconds(retrain_us);
      }
      if (rt == restored_tier.end() || rt->second != CkptTier::kMemory) ttr_values_not_memory.push_back(total);
    }
    recoveries.push_back({{"failed_attempt", attempt},
                          {"resumed_attempt", recovered ? json(resumed_attempt) : json(nullptr)},
                          {"failure_us", f},
                          {"resumed_us", recovered ? json(*resumed) : json(nullptr)},
                          {"recovered", recovered},
                          {"total_s", total},
                          {"breakdown", breakdown},
                          {"retraining_s", seconds(retrain_us)},
                          {"restored_from", restored_from},
                          {"category", category}});
  }

  // ---- 7. checkpoints per tier, steps, MTBF, recommendations ---------------------------------------------
  const auto& ref_attempts = per_rank.begin()->second;
  std::optional<double> cfg_interval_s[2], cfg_interval_steps[2];
  for (const auto& ra : ref_attempts) {
    const auto& cfg = ra.ledger->config;
    for (CkptTier t : kCkptTiers) {
      const std::string prefix = t == CkptTier::kMemory ? "checkpoint_memory_interval" : "checkpoint_interval";
      if (auto it = cfg.find(prefix + "_s"); it != cfg.end()) cfg_interval_s[static_cast<int>(t)] = it->second;
      if (auto it = cfg.find(prefix + "_steps"); it != cfg.end()) cfg_interval_steps[static_cast<int>(t)] = it->second;
    }
  }
  std::vector<double> step_seconds;
  int64_t steps_recorded = 0, steps_effective = 0, steps_retrained = 0;
  std::optional<int64_t> max_step;
  {
    int64_t high_water = INT64_MIN;
    for (const auto& ra : ref_attempts) {
      int64_t attempt_max = INT64_MIN;
      for (const auto& s : ra.ledger->steps) {
        ++steps_recorded;
        if (s.n <= high_water) {
          ++steps_retrained;
        } else {
          ++steps_effective;
          step_seconds.push_back(seconds(s.e - s.b));
        }
        attempt_max = std::max(attempt_max, s.n);
        if (!max_step || s.n > *max_step) max_step = s.n;
      }
      high_water = std::max(high_water, attempt_max);
    }
  }
  const double median_step_s = median(step_seconds);
  const double blocking_measured_s = seconds(phase_us.count(std::string(phase::kCheckpointBlocking))
                                                 ? phase_us[std::string(phase::kCheckpointBlocking)]
                                                 : 0);
  const double wasted_s = seconds(phase_us.count(std::string(phase::kWastedTraining))
                                      ? phase_us[std::string(phase::kWastedTraining)]
                                      : 0);
  // Job-level blocking per tier: the job timeline's checkpoint_blocking time, split by record name.
  int64_t tier_blocking_us[2] = {0, 0};
  for (const auto& seg : job_timeline) {
    if (auto t = checkpoint_tier(seg.name, phase::kCheckpointBlocking)) tier_blocking_us[static_cast<int>(*t)] += seg.e - seg.b;
  }

  std::optional<double> mtbf;
  json mtbf_source = nullptr;
  if (failures > 0 && effective_s > 0) {
    mtbf = effective_s / failures;
    mtbf_source = "measured";
  } else if (options.mtbf_prior_s > 0) {
    mtbf = options.mtbf_prior_s;
    mtbf_source = "prior";
  } else if (effective_s > 0) {
    mtbf = effective_s;
    mtbf_source = "lower_bound_no_failures";
  }

  // One entry per tier. The disk tier's is also the top-level `checkpoints` and `recommendation` (the
  // durable tier: a run without a memory tier has only it, with the figures it always had).
  struct TierFigures {
    TierSaves saves;
    double blocking_s = 0;
    std::optional<double> blocking_mean, interval;
    json interval_source = nullptr;
    double durable_median = 0;
    json recommendation = nullptr;
  };
  TierFigures tier[2];
  json tiers = json::object();
  for (CkptTier t : kCkptTiers) {
    const int i = static_cast<int>(t);
    TierFigures& f = tier[i];
    f.saves = tier_saves(ref_attempts, names, t);
    f.durable_median = median(f.saves.durable_latency);
    if (cfg_interval_s[i]) {
      f.interval = cfg_interval_s[i];
      f.interval_source = "configured";
    } else if (cfg_interval_steps[i] && std::isfinite(median_step_s)) {
      f.interval = *cfg_interval_steps[i] * median_step_s;
      f.interval_source = "configured_steps";
    } else if (!f.saves.between_training.empty()) {
      f.interval = median(f.saves.between_training);
      f.interval_source = "inferred";
    }
    f.blocking_s = seconds(tier_blocking_us[i]);
    if (f.saves.count > 0) f.blocking_mean = f.blocking_s / f.saves.count;
    // The restart cost a tier's interval is weighed against: the mean Time to Recover of the failures
    // restored from it. A memory tier with no such failure yet, and the disk tier, also count the recoveries
    // that restored from no tier at all (the disk tier is what a run without a memory tier restores from).
    const std::vector<double>& own_ttr = recovered_ttr[i];
    const double restart_s = t == CkptTier::kMemory && !own_ttr.empty() ? mean(own_ttr)
                             : t == CkptTier::kMemory ? mean(ttr_values)
                                                      : mean(ttr_values_not_memory);
    f.recommendation = recommendation_for(f.blocking_mean, mtbf, mtbf_source, restart_s, f.durable_median,
                                          f.interval, effective_s, median_step_s, options.method);
    if (t == CkptTier::kMemory && f.saves.count == 0 && f.saves.refused == 0 && restores_from[i] == 0) continue;
    tiers[tier_key(t)] = {
        {"count", f.saves.count},
        {"refused", f.saves.refused},
        {"blocking_s", f.blocking_s},
        {"blocking_mean_s", opt(f.blocking_mean)},
        {"interval_s", opt(f.interval)},
        {"interval_source", f.interval_source},
        {"durable_latency_median_s", num_or_null(f.durable_median)},
        {"restores", restores_from[i]},
        {"recovered_failures", static_cast<int>(own_ttr.size())},
        {"retraining_s", retraining_from[i]},
        {"recommended_interval_s", f.recommendation.is_null() ? json(nullptr) : f.recommendation["interval_s"]},
        {"recommendation", f.recommendation}};
  }
  const TierFigures& disk = tier[static_cast<int>(CkptTier::kDisk)];
  // Meta's estimates: blocking summed over the tiers; unsaved work as if every failure went back to the
  // durable tier (the ledger does not say which failures a memory tier could have covered).
  std::optional<double> blocking_est;
  for (const TierFigures& f : tier) {
    if (f.interval && *f.interval > 0 && f.blocking_mean) {
      blocking_est = blocking_est.value_or(0.0) + effective_s / *f.interval * *f.blocking_mean;
    }
  }
  std::optional<double> unsaved_est;
  if (disk.interval) unsaved_est = failures * *disk.interval / 2.0;
  const json& recommendation = disk.recommendation;
  std::optional<double> recommended;
  if (!recommendation.is_null()) recommended = recommendation["interval_s"].get<double>();

  // ---- 8. per-rank skew -------------------------------------------------------------------------------------
  std::map<std::string, std::map<int, double>> rank_phase_s;
  for (const auto& [rank, vec] : per_rank) {
    for (const auto& ra : vec) {
      for (const auto& seg : ra.segments) {
        rank_phase_s[top_level_phase(seg.name)][rank] += seconds(seg.e - seg.b);
      }
    }
  }
  json skew_phases = json::object();
  for (auto& [name, by_rank] : rank_phase_s) {
    std::vector<double> v;
    for (const auto& [rank, s] : per_rank) v.push_back(by_rank.count(rank) ? by_rank[rank] : 0.0);
    auto [mn, mx] = std::minmax_element(v.begin(), v.end());
    skew_phases[name] = {{"min", *mn}, {"median", median(v)}, {"max", *mx}, {"skew_s", *mx - *mn}};
  }
  // Spread of Recorder start times per attempt, in one pass over all rank attempts.
  std::map<int, std::pair<int64_t, int64_t>> start_range;  // attempt -> (earliest ts, latest ts)
  for (const auto& [rank, vec] : per_rank) {
    for (const auto& ra : vec) {
      auto [it, inserted] = start_range.try_emplace(ra.ledger->attempt, ra.ledger->ts, ra.ledger->ts);
      if (!inserted) {
        it->second.first = std::min(it->second.first, ra.ledger->ts);
        it->second.second = std::max(it->second.second, ra.ledger->ts);
      }
    }
  }
  json start_skew = json::array();
  for (const auto& [n, range] : start_range) start_skew.push_back(seconds(range.second - range.first));

  // ---- 9. badput in Google's categories (include/ettkit/ett/badput.h) ----------------------------------------
  // Over the job timeline, so that the categories sum to E2E minus effective time, like the buckets.
  std::map<std::string_view, int64_t> badput_us;
  for (std::string_view c : badput::kAll) badput_us[c] = 0;
  for (const auto& seg : job_timeline) {
    if (seg.bucket == Bucket::kEffective) continue;
    std::string_view c = badput_category(seg.name);
    if (c == badput::kGoodput) c = badput::kOther;  // "training" while the job still recovered
    badput_us[c] += seg.e - seg.b;
  }

  // ---- 10. the document -----------------------------------------------------------------------------------
  json phases = json::object(), phase_buckets = json::object(), substages = json::object();
  for (const auto& [name, us] : phase_us) {
    phases[name] = seconds(us);
    const auto& bs = phase_bucket_set[name];
    phase_buckets[name] = bs.size() == 1 ? bucket_name(*bs.begin()) : "mixed";
  }
  for (const auto& [name, us] : substage_us) substages[name] = seconds(us);
  json fb = json::object();
  for (const auto& [k, v] : failures_by_category) fb[k] = v;
  json ranks = json::array();
  for (const auto& [rank, vec] : per_rank) ranks.push_back(rank);
  uint64_t dropped = 0;
  for (const auto& rl : set.ranks) {
    for (const auto& a : rl.attempts) dropped += a.dropped;
  }

  json doc;
  doc["format_version"] = 1;
  doc["run_dir"] = run_dir;
  doc["world_size"] = std::max<int>(set.world_size, static_cast<int>(per_rank.size()));
  doc["ranks"] = ranks;
  doc["e2e_s"] = seconds(e2e_us);
  doc["e2e_begin_us"] = e2e_begin;
  doc["e2e_end_us"] = e2e_end;
  doc["include_initial_queue"] = options.include_initial_queue;
  doc["effective_s"] = effective_s;
  doc["idle_s"] = seconds(bucket_us[static_cast<int>(Bucket::kIdle)]);
  doc["failure_s"] = seconds(bucket_us[static_cast<int>(Bucket::kFailure)]);
  doc["unattributed_s"] = seconds(bucket_us[static_cast<int>(Bucket::kUnattributed)]);
  doc["ett_pct"] = pct(effective_us);
  doc["idle_pct"] = pct(bucket_us[static_cast<int>(Bucket::kIdle)]);
  doc["failure_pct"] = pct(bucket_us[static_cast<int>(Bucket::kFailure)]);
  doc["unattributed_pct"] = pct(bucket_us[static_cast<int>(Bucket::kUnattributed)]);
  doc["phases"] = phases;
  doc["phase_buckets"] = phase_buckets;
  doc["substages"] = substages;
  doc["attempts"] = attempts;
  doc["time_to_start_s"] = tts;
  doc["time_to_recover_s"] = ttr;
  doc["recoveries"] = recoveries;
  doc["failures"] = failures;
  doc["failures_by_category"] = fb;
  doc["unsaved_training_s"] = {{"measured", wasted_s}, {"estimated", opt(unsaved_est)}};
  doc["checkpoint_blocking_s"] = {{"measured", blocking_measured_s}, {"estimated", opt(blocking_est)}};
  doc["checkpoints"] = {{"count", disk.saves.count},
                        {"refused", disk.saves.refused},
                        {"blocking_mean_s", opt(disk.blocking_mean)},
                        {"interval_s", opt(disk.interval)},
                        {"interval_source", disk.interval_source},
                        {"durable_latency_median_s", num_or_null(disk.durable_median)},
                        {"tiers", tiers}};
  doc["steps"] = {{"recorded", steps_recorded},
                  {"effective", steps_effective},
                  {"retrained", steps_retrained},
                  {"max_step", opt_i(max_step)},
                  {"median_step_s", num_or_null(median_step_s)}};
  doc["mtbf_s"] = opt(mtbf);
  doc["mtbf_source"] = mtbf_source;
  doc["recommended_interval_s"] = opt(recommended);
  doc["recommendation"] = recommendation;
  json badput_s = json::object(), badput_pct = json::object();
  for (std::string_view c : badput::kAll) {
    badput_s[std::string(c)] = seconds(badput_us[c]);
    badput_pct[std::string(c)] = pct(badput_us[c]);
  }
  doc["badput"] = badput_s;
  doc["badput_pct"] = badput_pct;
  doc["rank_skew"] = {{"phases", skew_phases}, {"attempt_start_skew_s", start_skew}};
  doc["ledger"] = {{"files", set.files},
                   {"records", set.records},
                   {"corrupt_lines", set.corrupt_lines},
                   {"torn_lines", set.torn_lines},
                   {"orphan_records", set.orphan_records},
                   {"dropped_events", dropped},
                   {"warnings", warnings}};
  if (!options.chrome_trace_path.empty()) {
    stream_chrome_trace(options.chrome_trace_path, run_dir, doc["world_size"].get<int>(), e2e_begin, e2e_end,
                        doc["ett_pct"].get<double>(), per_rank, job_timeline, jobs, names);
  }
  if (options.include_timeline) {
    json timeline = json::array();
    json background = json::array();
    for (const auto& [rank, vec] : per_rank) {
      for (const auto& ra : vec) {
        for (const auto& seg : ra.segments) {
          timeline.push_back({{"rank", rank},
                              {"attempt", seg.attempt},
                              {"name", seg.name},
                              {"bucket", bucket_name(seg.bucket)},
                              {"begin_us", seg.b},
                              {"end_us", seg.e}});
        }
        for (const auto& p : ra.ledger->background) {
          background.push_back({{"rank", rank},
                                {"attempt", ra.ledger->attempt},
                                {"name", names[p.name]},
                                {"step", p.step >= 0 ? json(p.step) : json(nullptr)},
                                {"begin_us", p.b},
                                {"end_us", p.e}});
        }
      }
    }
    json job = json::array();
    for (const auto& seg : job_timeline) {
      job.push_back({{"attempt", seg.attempt},
                     {"name", seg.name},
                     {"bucket", bucket_name(seg.bucket)},
                     {"begin_us", seg.b},
                     {"end_us", seg.e}});
    }
    doc["timeline"] = std::move(timeline);
    doc["job_timeline"] = std::move(job);
    doc["background"] = std::move(background);
  }

  Analysis out;
  out.summary.e2e_s = seconds(e2e_us);
  out.summary.ett_pct = doc["ett_pct"];
  out.summary.idle_pct = doc["idle_pct"];
  out.summary.failure_pct = doc["failure_pct"];
  out.summary.unattributed_pct = doc["unattributed_pct"];
  out.summary.attempts = static_cast<int>(jobs.size());
  out.summary.failures = failures;
  out.summary.time_to_start_s = tts_values;
  for (const auto& v : ttr) out.summary.time_to_recover_s.push_back(v.get<double>());
  out.summary.recommended_interval_s = recommended;
  out.summary.mtbf_s = mtbf;
  for (std::string_view c : badput::kAll) out.summary.badput_s.emplace_back(std::string(c), seconds(badput_us[c]));
  out.doc = std::move(doc);
  return out;
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

}  // namespace

std::string build_report_json(const std::string& run_dir, const ReportOptions& options) {
  auto set = read_for_report(run_dir);
  return analyse(set, run_dir, options).doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

ReportSummary build_report(const std::string& run_dir, const ReportOptions& options) {
  ReportOptions lean = options;
  lean.include_timeline = false;
  auto set = read_for_report(run_dir);
  return analyse(set, run_dir, lean).summary;
}

}  // namespace ettkit::ett
