// The report's timeline passes (src/ett/report_passes.h): ledger records -> per-rank timelines -> buckets
// -> one job timeline.
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

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <queue>
#include <string>
#include <vector>

#include "common/logging.h"
#include "ett/report_passes.h"

namespace ettkit::ett::report_detail {

namespace {

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


// "Type: message" -> "Type". Split at ": " (not ':') so that C++ names keep their namespace
// ("std::runtime_error: boom" -> "std::runtime_error").
std::string exception_type_of(const std::string& detail) {
  auto sep = detail.find(": ");
  return sep == std::string::npos ? detail : detail.substr(0, sep);
}


// A rank of a failed attempt, as cause_of_failure() weighs it.
struct FailedRank {
  const AttemptLedger* ledger;
  int64_t failure_point;  // its last activity (RankAttempt::failure_point)
  int rank;
};

// A death without an end record (killed) or by a signal is a cause from outside the job; an exception on
// another rank at about the same time is usually its consequence (gloo's "Connection reset by peer", NCCL's
// "remote process exited"). An exception counts as raised after the death unless it was recorded more than
// this long before the dead rank's last sign of life: ranks on one host share a clock, and NTP keeps hosts'
// clocks within a few milliseconds of each other.
constexpr int64_t kPeerClockSkewUs = 5000;

bool died_from_outside(const AttemptLedger& a) { return !a.has_end || a.status == "signal"; }

// The last instant the rank is known to have been alive: its end record (it recorded its own end), else its
// latest record of any kind (heartbeats included: a killed rank died after it).
int64_t last_alive(const AttemptLedger& a) { return a.has_end ? a.end_ts : a.last_ts; }

// Which failed rank names the failure of an attempt (docs/ett.md §7, "failure category"). Within each
// group (deaths from outside; exceptions and other statuses) the rank that stopped making progress first,
// lowest rank on a tie. Then the death from outside wins over the exception unless the exception was
// recorded while the dead rank was demonstrably still alive (by more than kPeerClockSkewUs). The choice
// depends only on the records, never on which file or rank is read first.
const AttemptLedger* cause_of_failure(const std::vector<FailedRank>& ranks) {
  const FailedRank* outside = nullptr;
  const FailedRank* other = nullptr;
  auto earlier = [](const FailedRank& x, const FailedRank* y) {
    return y == nullptr || x.failure_point < y->failure_point ||
           (x.failure_point == y->failure_point && x.rank < y->rank);
  };
  for (const auto& r : ranks) {
    const FailedRank*& slot = died_from_outside(*r.ledger) ? outside : other;
    if (earlier(r, slot)) slot = &r;
  }
  if (outside == nullptr) return other->ledger;
  if (other == nullptr) return outside->ledger;
  const bool raised_while_alive = last_alive(*other->ledger) + kPeerClockSkewUs < last_alive(*outside->ledger);
  return raised_while_alive ? other->ledger : outside->ledger;
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

}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double mean(const std::vector<double>& v) {
  if (v.empty()) return 0.0;
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

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

void collect_attempts(Analysis& an) {
  auto& per_rank = an.per_rank;
  auto& jobs = an.jobs;
  const auto& names = an.names();
  const std::string kScheduling(phase::kScheduling);
  for (const auto& rl : an.set->ranks) {
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
      // A clean attempt's process lives on after its recorder closed (interpreter and process-group
      // teardown): its process_exit record extends the attempt to the process's end, as shutdown.
      if (a.has_end && a.status == "clean" && a.process_exit_ts && *a.process_exit_ts > ra.end) {
        ra.teardown_begin = ra.end;
        ra.end = *a.process_exit_ts;
      }
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
  // Job failure status: the failure point is the first rank to stop making progress; the cause is chosen
  // by cause_of_failure(), independent of which rank's last record happened to come first.
  std::map<int, std::vector<FailedRank>> failed_ranks;  // attempt -> its failed ranks, in rank order
  for (auto& [rank, vec] : per_rank) {
    for (auto& ra : vec) {
      if (!ra.failed) continue;
      JobAttempt& job = jobs[ra.ledger->attempt];
      if (!job.failed || ra.failure_point < *job.failure_point) job.failure_point = ra.failure_point;
      job.failed = true;
      failed_ranks[ra.ledger->attempt].push_back({ra.ledger, ra.failure_point, rank});
    }
  }
  for (auto& [attempt, ranks] : failed_ranks) {
    JobAttempt& job = jobs[attempt];
    const AttemptLedger& a = *cause_of_failure(ranks);
    for (const auto& r : ranks) {
      if (r.ledger == &a) job.cause_rank = r.rank;
    }
    job.status = !a.has_end ? "killed" : a.status;
    job.detail = a.detail;
    job.exception_type = a.status == "exception" ? exception_type_of(a.detail) : "";
  }
  // An attempt still in progress (read_for_report) that no rank has failed yet.
  for (auto& [rank, vec] : per_rank) {
    for (auto& ra : vec) {
      JobAttempt& job = jobs[ra.ledger->attempt];
      if (ra.ledger->running && !job.failed) job.status = "running";
    }
  }
}

void flatten_rank_timelines(Analysis& an) {
  auto& per_rank = an.per_rank;
  auto& jobs = an.jobs;
  const auto& names = an.names();
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
      if (ra.teardown_begin) {
        items.push_back({*ra.teardown_begin, ra.end, std::string(phase::kProcessTeardown), Kind::kPhase,
                         Layer::kPhase});
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
}

void assign_buckets(Analysis& an) {
  auto& per_rank = an.per_rank;
  auto& jobs = an.jobs;
  auto previous_failed = [&](int attempt) {
    auto it = jobs.find(attempt);
    if (it == jobs.begin() || it == jobs.end()) return false;
    return std::prev(it)->second.failed;
  };
  // Once the first rank of a failed attempt stops, whatever the others still do in that attempt is lost
  // (it is re-done after the restore): split their segments at the job's failure point.
  for (auto& [rank, vec] : per_rank) {
    for (auto& ra : vec) {
      const JobAttempt& job = jobs[ra.ledger->attempt];
      if (!job.failed) continue;
      const int64_t f = *job.failure_point;
      // Every rank but the one that names the failure (a survivor): what no record covers on it from the
      // job's failure point on is it waiting for the dead peer and being torn down, not work in flight. The
      // cause, not the first rank to stop, decides: which rank's last record came first is a race (§7).
      const bool survivor = rank != job.cause_rank;
      std::vector<Segment> split;
      split.reserve(ra.segments.size() + 1);
      for (auto& seg : ra.segments) {
        if (seg.e <= f) {
          split.push_back(std::move(seg));
          continue;
        }
        if (seg.b < f) {
          Segment head = seg;
          head.e = f;
          split.push_back(std::move(head));
          seg.b = f;
        }
        const bool uncovered = seg.kind == Kind::kUnattributed || seg.kind == Kind::kLostInFlight;
        seg.kind = Kind::kLostInFlight;
        seg.name = std::string(uncovered && survivor ? phase::kPeerTeardown : phase::kLostInFlight);
        if (!split.empty() && split.back().kind == Kind::kLostInFlight && split.back().name == seg.name &&
            split.back().e == seg.b) {
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
}

void build_job_timeline(Analysis& an, const ReportOptions& options) {
  const auto& per_rank = an.per_rank;
  auto& jobs = an.jobs;
  an.warnings = an.set->warnings;
  const int64_t e2e_begin = e2e_begin_of(jobs, options, an.warnings);
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
  std::vector<Segment>& job_timeline = an.job_timeline;
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
  an.e2e_begin = e2e_begin;
  an.e2e_end = e2e_end;
}

}  // namespace ettkit::ett::report_detail
