// The report's figure passes (src/ett/report_passes.h): from the job timeline and the per-rank segments to
// the typed Report's totals, attempts, recoveries, checkpoint statistics, recommendations and skew.

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "ett/report_passes.h"
#include "ettkit/ett/badput.h"

namespace ettkit::ett::report_detail {

namespace {

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

// ---- checkpoint tiers -------------------------------------------------------------------------------------
// A checkpoint record's tier is in its name: "<phase>/memory" (checkpoint_blocking/memory,
// checkpoint_restore/memory, checkpoint_refused/memory) and checkpoint_memory_persist are the memory tier's;
// the phase itself and its other sub-stages are the durable (disk) tier's, as every record was before the
// memory tier existed.
constexpr CheckpointTier kTiers[] = {CheckpointTier::kDisk, CheckpointTier::kMemory};

std::optional<CheckpointTier> checkpoint_tier(const std::string& name, std::string_view phase_name) {
  if (name == phase_name) return CheckpointTier::kDisk;
  if (name.size() <= phase_name.size() || name.compare(0, phase_name.size(), phase_name) != 0 ||
      name[phase_name.size()] != '/') {
    return std::nullopt;
  }
  // The sub-stage the checkpointer writes for the memory tier (phase::kMemoryTierSuffix, without its '/').
  return std::string_view(name).substr(phase_name.size()) == phase::kMemoryTierSuffix ? CheckpointTier::kMemory
                                                                                       : CheckpointTier::kDisk;
}

std::optional<CheckpointTier> persist_tier(const std::string& name) {
  if (name == phase::kCheckpointMemoryPersist) return CheckpointTier::kMemory;
  return checkpoint_tier(name, phase::kCheckpointPersist);
}

// What the lowest rank's records say about one tier's saves.
struct TierSaves {
  int count = 0;    // saves (blocking records; several of the same step are one save)
  int refused = 0;  // saves the integrity check refused (tensors changed while being copied)
  int failed = 0;   // saves that failed otherwise (a write error, a lost peer): nothing committed
  std::vector<double> between_training;  // training seconds between consecutive saves of the tier
  std::vector<double> durable_latency;   // save call -> committed, per committed save
};

// Per-rank figures come from the lowest rank (every rank runs the same loop in data-parallel jobs).
template <typename Attempts>
TierSaves tier_saves(const Attempts& ref_attempts, const std::vector<std::string>& names, CheckpointTier tier) {
  TierSaves out;
  for (const auto& ra : ref_attempts) {
    const auto& a = *ra.ledger;
    for (const auto& p : a.background) {
      const std::string& n = names[p.name];
      if (persist_tier(n) == tier) out.durable_latency.push_back(seconds(p.e - p.b));
      if (checkpoint_tier(n, phase::kCheckpointRefused) == tier) ++out.refused;
      if (checkpoint_tier(n, phase::kCheckpointFailed) == tier) ++out.failed;
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

}  // namespace

// ---- totals -----------------------------------------------------------------------------------------------
void sum_buckets(const Analysis& an, Report& r) {
  std::map<std::string, int64_t> phase_us;
  std::map<std::string, std::set<Bucket>> phase_bucket_set;
  std::map<std::string, int64_t> substage_us;
  // Badput over the job timeline, so that the categories sum to E2E minus effective time, like the buckets.
  std::map<std::string_view, int64_t> badput_us;
  for (std::string_view c : badput::kAll) badput_us[c] = 0;
  for (const auto& seg : an.job_timeline) {
    const int64_t d = seg.e - seg.b;
    switch (seg.bucket) {
      case Bucket::kEffective: r.effective_us += d; break;
      case Bucket::kIdle: r.idle_us += d; break;
      case Bucket::kFailure: r.failure_us += d; break;
      case Bucket::kUnattributed: r.unattributed_us += d; break;
    }
    std::string top = top_level_phase(seg.name);
    phase_us[top] += d;
    phase_bucket_set[top].insert(seg.bucket);
    if (top != seg.name) {
      const auto slash = seg.name.find('/');
      substage_us[top + "/" + seg.name.substr(slash == std::string::npos ? 0 : slash + 1)] += d;
    }
    if (seg.bucket != Bucket::kEffective) {
      std::string_view c = badput_category(seg.name);
      if (c == badput::kGoodput) c = badput::kOther;  // "training" while the job still recovered
      badput_us[c] += d;
    }
  }
  for (const auto& [name, us] : phase_us) {
    const auto& bs = phase_bucket_set[name];
    r.phases[name] = PhaseTotal{seconds(us), bs.size() == 1 ? std::optional<Bucket>(*bs.begin()) : std::nullopt};
  }
  for (const auto& [name, us] : substage_us) r.substages[name] = seconds(us);
  for (std::string_view c : badput::kAll) r.badput_s.emplace_back(std::string(c), seconds(badput_us[c]));
}

// ---- attempts, TTS, failures, TTR -------------------------------------------------------------------------
RecoveryCosts attempts_and_recoveries(const Analysis& an, Report& r) {
  const auto& jobs = an.jobs;
  const auto& names = an.names();
  for (const auto& [n, job] : jobs) {
    AttemptSummary s;
    s.attempt = n;
    s.begin_us = job.begin;
    s.end_us = job.end;
    s.status = job.status;
    s.exception_type = job.exception_type;
    s.detail = job.detail;
    if (job.first_training) s.time_to_start_s = seconds(*job.first_training - job.alloc_begin);
    s.first_training_us = job.first_training;
    s.failure_us = job.failure_point;
    s.restart_count = job.restart_count;
    s.ranks = job.ranks;
    s.first_step = job.first_step;
    s.last_step = job.last_step;
    for (int rank : job.ranks) {  // ranks in ascending order: the lowest rank's value of a key wins
      for (const auto& ra : an.per_rank.at(rank)) {
        if (ra.ledger->attempt != n) continue;
        for (const auto& [key, value] : ra.ledger->notes) s.notes.emplace(key, value);
      }
    }
    r.attempts.push_back(std::move(s));
  }

  // Which tier each attempt restored from: its lowest rank's checkpoint_restore records (the ranks agree on
  // the step and tier through the Store before loading). A memory-tier record wins over a plain one: a
  // trainer may wrap the checkpointer's load in its own checkpoint_restore phase.
  std::map<int, CheckpointTier> restored_tier;
  for (const auto& [rank, vec] : an.per_rank) {
    for (const auto& ra : vec) {
      if (restored_tier.count(ra.ledger->attempt)) continue;
      std::optional<CheckpointTier> tier;
      for (const auto& p : ra.ledger->phases) {
        auto t = checkpoint_tier(names[p.name], phase::kCheckpointRestore);
        if (t && (!tier || *t == CheckpointTier::kMemory)) tier = t;
      }
      if (tier) restored_tier[ra.ledger->attempt] = *tier;
    }
  }
  RecoveryCosts costs;
  for (const auto& [n, t] : restored_tier) ++costs.restores_from[static_cast<int>(t)];

  std::vector<std::pair<int64_t, int>> failure_points;  // (time, attempt)
  for (const auto& [n, job] : jobs) {
    if (job.failed) failure_points.emplace_back(*job.failure_point, n);
  }
  std::sort(failure_points.begin(), failure_points.end());
  const NextTraining next_training(jobs);
  const auto& job_timeline = an.job_timeline;
  std::map<int, int64_t> wasted_us_by_attempt;  // job-timeline re-training per attempt
  for (const auto& seg : job_timeline) {
    if (seg.kind == Kind::kWasted) wasted_us_by_attempt[seg.attempt] += seg.e - seg.b;
  }
  for (size_t k = 0; k < failure_points.size(); ++k) {
    auto [f, attempt] = failure_points[k];
    const JobAttempt& job = jobs.at(attempt);
    ++r.failures;
    std::string category = job.status == "exception" ? "exception:" + job.exception_type : job.status;
    r.failures_by_category[category]++;
    std::optional<int64_t> resumed;
    const int resumed_attempt = next_training.after(attempt, f);
    if (resumed_attempt >= 0) resumed = jobs.at(resumed_attempt).first_training;
    int64_t stop = resumed ? *resumed : an.e2e_end;
    bool recovered = resumed.has_value();
    if (k + 1 < failure_points.size() && failure_points[k + 1].first < stop) {
      stop = failure_points[k + 1].first;
      recovered = false;
    }
    Recovery rec;
    rec.failed_attempt = attempt;
    rec.failure_us = f;
    rec.recovered = recovered;
    rec.category = std::move(category);
    std::map<std::string, int64_t> breakdown_us;
    // The job timeline is sorted and gap-free: start at the segment that contains f.
    auto first = std::upper_bound(job_timeline.begin(), job_timeline.end(), f,
                                  [](int64_t t, const Segment& seg) { return t < seg.e; });
    for (auto it = first; it != job_timeline.end() && it->b < stop; ++it) {
      int64_t b = std::max(it->b, f), e = std::min(it->e, stop);
      if (e > b) breakdown_us[top_level_phase(it->name)] += e - b;
    }
    for (const auto& [name, us] : breakdown_us) rec.breakdown[name] = seconds(us);
    int64_t retrain_us = 0;
    if (recovered) {
      auto w = wasted_us_by_attempt.find(resumed_attempt);
      if (w != wasted_us_by_attempt.end()) retrain_us = w->second;
    }
    rec.retraining_s = seconds(retrain_us);
    rec.total_s = seconds(std::max<int64_t>(stop - f, 0));
    if (recovered) {
      rec.resumed_attempt = resumed_attempt;
      rec.resumed_us = *resumed;
      costs.ttr_recovered.push_back(rec.total_s);
      auto rt = restored_tier.find(resumed_attempt);
      if (rt != restored_tier.end()) {
        const int i = static_cast<int>(rt->second);
        rec.restored_from = rt->second;
        costs.recovered_ttr[i].push_back(rec.total_s);
        costs.retraining_from[i] += rec.retraining_s;
      }
      if (rt == restored_tier.end() || rt->second != CheckpointTier::kMemory) {
        costs.ttr_not_memory.push_back(rec.total_s);
      }
    }
    r.recoveries.push_back(std::move(rec));
  }
  return costs;
}

// ---- checkpoints per tier, steps, MTBF, recommendations -------------------------------------------------
void checkpoint_figures(const Analysis& an, const RecoveryCosts& costs, const ReportOptions& options, Report& r) {
  const auto& names = an.names();
  const auto& ref_attempts = an.per_rank.begin()->second;
  std::optional<double> cfg_interval_s[2], cfg_interval_steps[2];
  for (const auto& ra : ref_attempts) {
    const auto& cfg = ra.ledger->config;
    for (CheckpointTier t : kTiers) {
      const std::string prefix = t == CheckpointTier::kMemory ? "checkpoint_memory_interval" : "checkpoint_interval";
      if (auto it = cfg.find(prefix + "_s"); it != cfg.end()) cfg_interval_s[static_cast<int>(t)] = it->second;
      if (auto it = cfg.find(prefix + "_steps"); it != cfg.end()) cfg_interval_steps[static_cast<int>(t)] = it->second;
    }
  }
  std::vector<double> step_seconds;
  {
    int64_t high_water = INT64_MIN;
    for (const auto& ra : ref_attempts) {
      int64_t attempt_max = INT64_MIN;
      for (const auto& s : ra.ledger->steps) {
        ++r.steps.recorded;
        if (s.n <= high_water) {
          ++r.steps.retrained;
        } else {
          ++r.steps.effective;
          step_seconds.push_back(seconds(s.e - s.b));
        }
        attempt_max = std::max(attempt_max, s.n);
        if (!r.steps.max_step || s.n > *r.steps.max_step) r.steps.max_step = s.n;
      }
      high_water = std::max(high_water, attempt_max);
    }
  }
  const double median_step_s = median(step_seconds);
  if (std::isfinite(median_step_s)) r.steps.median_step_s = median_step_s;
  auto phase_s = [&](std::string_view name) {
    auto it = r.phases.find(std::string(name));
    return it == r.phases.end() ? 0.0 : it->second.seconds;
  };
  r.checkpoint_blocking_s.measured = phase_s(phase::kCheckpointBlocking);
  r.unsaved_training_s.measured = phase_s(phase::kWastedTraining);
  // Job-level blocking per tier: the job timeline's checkpoint_blocking time, split by record name.
  int64_t tier_blocking_us[2] = {0, 0};
  for (const auto& seg : an.job_timeline) {
    if (auto t = checkpoint_tier(seg.name, phase::kCheckpointBlocking)) tier_blocking_us[static_cast<int>(*t)] += seg.e - seg.b;
  }

  const double effective_s = seconds(r.effective_us);
  if (r.failures > 0 && effective_s > 0) {
    r.mtbf_s = effective_s / r.failures;
    r.mtbf_source = "measured";
  } else if (options.mtbf_prior_s > 0) {
    r.mtbf_s = options.mtbf_prior_s;
    r.mtbf_source = "prior";
  } else if (effective_s > 0) {
    r.mtbf_s = effective_s;
    r.mtbf_source = "lower_bound_no_failures";
  }

  // One entry per tier. The disk tier's is also the top-level `checkpoints` and `recommendation` (the
  // durable tier: a run without a memory tier has only it, with the figures it always had).
  TierStatistics tier[2];
  for (CheckpointTier t : kTiers) {
    const int i = static_cast<int>(t);
    TierStatistics& f = tier[i];
    const TierSaves saves = tier_saves(ref_attempts, names, t);
    f.count = saves.count;
    f.refused = saves.refused;
    f.failed = saves.failed;
    const double durable_median = median(saves.durable_latency);
    if (std::isfinite(durable_median)) f.durable_latency_median_s = durable_median;
    if (cfg_interval_s[i]) {
      f.interval_s = cfg_interval_s[i];
      f.interval_source = "configured";
    } else if (cfg_interval_steps[i] && std::isfinite(median_step_s)) {
      f.interval_s = *cfg_interval_steps[i] * median_step_s;
      f.interval_source = "configured_steps";
    } else if (!saves.between_training.empty()) {
      f.interval_s = median(saves.between_training);
      f.interval_source = "inferred";
    }
    f.blocking_s = seconds(tier_blocking_us[i]);
    if (saves.count > 0) f.blocking_mean_s = f.blocking_s / saves.count;
    // The restart cost a tier's interval is weighed against: the mean Time to Recover of the failures
    // restored from it. A memory tier with no such failure yet, and the disk tier, also count the recoveries
    // that restored from no tier at all (the disk tier is what a run without a memory tier restores from).
    const std::vector<double>& own_ttr = costs.recovered_ttr[i];
    const double restart_s = t == CheckpointTier::kMemory && !own_ttr.empty() ? mean(own_ttr)
                             : t == CheckpointTier::kMemory ? mean(costs.ttr_recovered)
                                                            : mean(costs.ttr_not_memory);
    f.recommendation = recommendation_for(f.blocking_mean_s, r.mtbf_s, r.mtbf_source, restart_s, durable_median,
                                          f.interval_s, effective_s, median_step_s, options.method);
    f.restores = costs.restores_from[i];
    f.recovered_failures = static_cast<int>(own_ttr.size());
    f.retraining_s = costs.retraining_from[i];
  }
  r.checkpoints.disk = tier[static_cast<int>(CheckpointTier::kDisk)];
  const TierStatistics& memory = tier[static_cast<int>(CheckpointTier::kMemory)];
  if (memory.count > 0 || memory.refused > 0 || memory.failed > 0 || memory.restores > 0) r.checkpoints.memory = memory;
  // Meta's estimates: blocking summed over the tiers; unsaved work as if every failure went back to the
  // durable tier (the ledger does not say which failures a memory tier could have covered).
  for (const TierStatistics& f : tier) {
    if (f.interval_s && *f.interval_s > 0 && f.blocking_mean_s) {
      r.checkpoint_blocking_s.estimated =
          r.checkpoint_blocking_s.estimated.value_or(0.0) + effective_s / *f.interval_s * *f.blocking_mean_s;
    }
  }
  if (r.checkpoints.disk.interval_s) r.unsaved_training_s.estimated = r.failures * *r.checkpoints.disk.interval_s / 2.0;
}

std::optional<IntervalRecommendation> recommendation_for(const std::optional<double>& blocking_mean,
                                                         const std::optional<double>& mtbf,
                                                         const std::string& mtbf_source, double restart_s,
                                                         double durable_median,
                                                         const std::optional<double>& interval_s,
                                                         double effective_s, double median_step_s,
                                                         IntervalMethod method) {
  if (!blocking_mean || *blocking_mean <= 0 || !mtbf) return std::nullopt;
  IntervalRecommendation rec;
  rec.method = method;
  for (IntervalMethod m : {IntervalMethod::kYoung, IntervalMethod::kDaly, IntervalMethod::kDalySeries,
                           IntervalMethod::kDalyExact}) {
    rec.variants[static_cast<int>(m)] = recommend_interval(*blocking_mean, *mtbf, restart_s, m);
  }
  rec.optimum_s = recommend_interval(*blocking_mean, *mtbf, restart_s, method);
  double chosen = rec.optimum_s;
  std::string note;
  if (std::isfinite(durable_median) && durable_median > chosen) {
    chosen = durable_median;
    note = "the optimum is shorter than the time a save takes to become durable; saving as often as "
           "persistence allows (continuous checkpointing)";
  }
  const double t = effective_s;
  rec.waste_at_recommended_s = t * waste_fraction(chosen, *blocking_mean, *mtbf);
  if (interval_s && *interval_s > 0) {
    const double wc = t * waste_fraction(*interval_s, *blocking_mean, *mtbf);
    rec.waste_at_current_s = wc;
    rec.expected_saving_s = wc - rec.waste_at_recommended_s;
    if (note.empty()) {
      const double waste_rec = rec.waste_at_recommended_s;
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
  if (std::isfinite(median_step_s) && median_step_s > 0) {
    rec.interval_steps = std::max<int64_t>(1, std::llround(chosen / median_step_s));
  }
  rec.interval_s = chosen;
  rec.blocking_s = *blocking_mean;
  rec.mtbf_s = *mtbf;
  rec.restart_s = restart_s;
  rec.current_interval_s = interval_s;
  if (std::isfinite(durable_median)) rec.floor_s = durable_median;
  rec.note = std::move(note);
  return rec;
}

// ---- per-rank skew ----------------------------------------------------------------------------------------
void rank_skew(const Analysis& an, Report& r) {
  std::map<std::string, std::map<int, double>> rank_phase_s;
  for (const auto& [rank, vec] : an.per_rank) {
    for (const auto& ra : vec) {
      for (const auto& seg : ra.segments) rank_phase_s[top_level_phase(seg.name)][rank] += seconds(seg.e - seg.b);
    }
  }
  for (auto& [name, by_rank] : rank_phase_s) {
    std::vector<double> v;
    for (const auto& [rank, s] : an.per_rank) v.push_back(by_rank.count(rank) ? by_rank[rank] : 0.0);
    auto [mn, mx] = std::minmax_element(v.begin(), v.end());
    r.phase_skew[name] = PhaseSkew{*mn, median(v), *mx, *mx - *mn};
  }
  // Spread of Recorder start times per attempt, in one pass over all rank attempts.
  std::map<int, std::pair<int64_t, int64_t>> start_range;  // attempt -> (earliest ts, latest ts)
  for (const auto& [rank, vec] : an.per_rank) {
    for (const auto& ra : vec) {
      auto [it, inserted] = start_range.try_emplace(ra.ledger->attempt, ra.ledger->ts, ra.ledger->ts);
      if (!inserted) {
        it->second.first = std::min(it->second.first, ra.ledger->ts);
        it->second.second = std::max(it->second.second, ra.ledger->ts);
      }
    }
  }
  for (const auto& [n, range] : start_range) r.attempt_start_skew_s.push_back(seconds(range.second - range.first));
}

// ---- the segments themselves ------------------------------------------------------------------------------
void copy_timelines(const Analysis& an, Report& r) {
  const auto& names = an.names();
  r.has_timeline = true;
  for (const auto& [rank, vec] : an.per_rank) {
    for (const auto& ra : vec) {
      for (const auto& seg : ra.segments) {
        r.timeline.push_back(TimelineSegment{rank, seg.attempt, seg.name, seg.bucket, seg.b, seg.e});
      }
      for (const auto& p : ra.ledger->background) {
        r.background.push_back(BackgroundSpan{rank, ra.ledger->attempt, names[p.name],
                                              p.step >= 0 ? std::optional<int64_t>(p.step) : std::nullopt, p.b,
                                              p.e});
      }
    }
  }
  for (const auto& seg : an.job_timeline) {
    r.job_timeline.push_back(TimelineSegment{-1, seg.attempt, seg.name, seg.bucket, seg.b, seg.e});
  }
}

}  // namespace ettkit::ett::report_detail
