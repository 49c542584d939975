// The one serializer of the typed report (include/ettkit/ett/report_model.h) into the JSON document of
// docs/ett.md §8. The keys are a stable contract (format_version); the model's fields carry their names.

#include <nlohmann/json.hpp>

#include "ettkit/ett/report_model.h"

using nlohmann::json;

namespace ettkit::ett {

namespace {

double seconds(int64_t us) { return static_cast<double>(us) / 1e6; }

template <typename T>
json opt(const std::optional<T>& v) {
  return v ? json(*v) : json(nullptr);
}

json text_or_null(const std::string& s) { return s.empty() ? json(nullptr) : json(s); }

const char* method_name(IntervalMethod m) {
  switch (m) {
    case IntervalMethod::kYoung: return "young";
    case IntervalMethod::kDaly: return "daly";
    case IntervalMethod::kDalySeries: return "daly_series";
    case IntervalMethod::kDalyExact: return "daly_exact";
  }
  return "?";
}

json to_json(const std::optional<IntervalRecommendation>& r) {
  if (!r) return nullptr;
  json variants = json::object();
  for (IntervalMethod m : {IntervalMethod::kYoung, IntervalMethod::kDaly, IntervalMethod::kDalySeries,
                           IntervalMethod::kDalyExact}) {
    variants[method_name(m)] = r->variants[static_cast<int>(m)];
  }
  return {{"method", method_name(r->method)},
          {"interval_s", r->interval_s},
          {"interval_steps", opt(r->interval_steps)},
          {"optimum_s", r->optimum_s},
          {"blocking_s", r->blocking_s},
          {"mtbf_s", r->mtbf_s},
          {"restart_s", r->restart_s},
          {"current_interval_s", opt(r->current_interval_s)},
          {"waste_at_current_s", opt(r->waste_at_current_s)},
          {"waste_at_recommended_s", r->waste_at_recommended_s},
          {"expected_saving_s", opt(r->expected_saving_s)},
          {"variants", variants},
          {"floor_s", opt(r->floor_s)},
          {"note", r->note}};
}

json to_json(const TierStatistics& t) {
  return {{"count", t.count},
          {"refused", t.refused},
          {"failed", t.failed},
          {"blocking_s", t.blocking_s},
          {"blocking_mean_s", opt(t.blocking_mean_s)},
          {"interval_s", opt(t.interval_s)},
          {"interval_source", text_or_null(t.interval_source)},
          {"durable_latency_median_s", opt(t.durable_latency_median_s)},
          {"restores", t.restores},
          {"recovered_failures", t.recovered_failures},
          {"retraining_s", t.retraining_s},
          {"recommended_interval_s", t.recommendation ? json(t.recommendation->interval_s) : json(nullptr)},
          {"recommendation", to_json(t.recommendation)}};
}

json to_json(const TimelineSegment& s) {
  json j = {{"attempt", s.attempt},
            {"name", s.name},
            {"bucket", bucket_name(s.bucket)},
            {"begin_us", s.begin_us},
            {"end_us", s.end_us}};
  if (s.rank >= 0) j["rank"] = s.rank;
  return j;
}

}  // namespace

const char* bucket_name(Bucket b) {
  switch (b) {
    case Bucket::kEffective: return "effective";
    case Bucket::kUnattributed: return "unattributed";
    case Bucket::kIdle: return "idle";
    case Bucket::kFailure: return "failure";
  }
  return "?";
}

const char* tier_name(CheckpointTier t) { return t == CheckpointTier::kMemory ? "memory" : "disk"; }

std::vector<double> Report::time_to_start_s() const {
  std::vector<double> out;
  for (const auto& a : attempts) {
    if (a.time_to_start_s) out.push_back(*a.time_to_start_s);
  }
  return out;
}

std::vector<double> Report::time_to_recover_s() const {
  std::vector<double> out;
  out.reserve(recoveries.size());
  for (const auto& r : recoveries) out.push_back(r.total_s);
  return out;
}

std::string to_json(const Report& r) {
  json doc;
  doc["format_version"] = r.format_version;
  doc["run_dir"] = r.run_dir;
  doc["world_size"] = r.world_size;
  doc["ranks"] = r.ranks;
  doc["e2e_s"] = r.e2e_s();
  doc["e2e_begin_us"] = r.e2e_begin_us;
  doc["e2e_end_us"] = r.e2e_end_us;
  doc["include_initial_queue"] = r.include_initial_queue;
  doc["effective_s"] = seconds(r.effective_us);
  doc["idle_s"] = seconds(r.idle_us);
  doc["failure_s"] = seconds(r.failure_us);
  doc["unattributed_s"] = seconds(r.unattributed_us);
  doc["ett_pct"] = r.pct(r.effective_us);
  doc["idle_pct"] = r.pct(r.idle_us);
  doc["failure_pct"] = r.pct(r.failure_us);
  doc["unattributed_pct"] = r.pct(r.unattributed_us);

  json phases = json::object(), phase_buckets = json::object(), substages = json::object();
  for (const auto& [name, p] : r.phases) {
    phases[name] = p.seconds;
    phase_buckets[name] = p.bucket ? bucket_name(*p.bucket) : "mixed";
  }
  for (const auto& [name, s] : r.substages) substages[name] = s;
  doc["phases"] = phases;
  doc["phase_buckets"] = phase_buckets;
  doc["substages"] = substages;
  json badput = json::object(), badput_pct = json::object();
  for (const auto& [category, s] : r.badput_s) {
    badput[category] = s;
    badput_pct[category] = r.pct(static_cast<int64_t>(std::llround(s * 1e6)));
  }
  doc["badput"] = badput;
  doc["badput_pct"] = badput_pct;

  json attempts = json::array();
  for (const auto& a : r.attempts) {
    attempts.push_back({{"attempt", a.attempt},
                        {"begin_us", a.begin_us},
                        {"end_us", a.end_us},
                        {"status", a.status},
                        {"exception_type", text_or_null(a.exception_type)},
                        {"detail", text_or_null(a.detail)},
                        {"time_to_start_s", opt(a.time_to_start_s)},
                        {"first_training_us", opt(a.first_training_us)},
                        {"failure_us", opt(a.failure_us)},
                        {"restart_count", opt(a.restart_count)},
                        {"ranks", a.ranks},
                        {"first_step", opt(a.first_step)},
                        {"last_step", opt(a.last_step)},
                        {"notes", a.notes}});
  }
  doc["attempts"] = attempts;
  doc["time_to_start_s"] = r.time_to_start_s();
  doc["time_to_recover_s"] = r.time_to_recover_s();
  json recoveries = json::array();
  for (const auto& rec : r.recoveries) {
    json breakdown = json::object();
    for (const auto& [name, s] : rec.breakdown) breakdown[name] = s;
    recoveries.push_back({{"failed_attempt", rec.failed_attempt},
                          {"resumed_attempt", opt(rec.resumed_attempt)},
                          {"failure_us", rec.failure_us},
                          {"resumed_us", opt(rec.resumed_us)},
                          {"recovered", rec.recovered},
                          {"total_s", rec.total_s},
                          {"breakdown", breakdown},
                          {"retraining_s", rec.retraining_s},
                          {"restored_from", rec.restored_from ? json(tier_name(*rec.restored_from)) : json(nullptr)},
                          {"category", rec.category}});
  }
  doc["recoveries"] = recoveries;
  doc["failures"] = r.failures;
  json fb = json::object();
  for (const auto& [k, v] : r.failures_by_category) fb[k] = v;
  doc["failures_by_category"] = fb;
  doc["unsaved_training_s"] = {{"measured", r.unsaved_training_s.measured},
                               {"estimated", opt(r.unsaved_training_s.estimated)}};
  doc["checkpoint_blocking_s"] = {{"measured", r.checkpoint_blocking_s.measured},
                                  {"estimated", opt(r.checkpoint_blocking_s.estimated)}};
  const TierStatistics& disk = r.checkpoints.disk;
  json tiers = json::object();
  tiers["disk"] = to_json(disk);
  if (r.checkpoints.memory) tiers["memory"] = to_json(*r.checkpoints.memory);
  doc["checkpoints"] = {{"count", disk.count},
                        {"refused", disk.refused},
                        {"failed", disk.failed},
                        {"blocking_mean_s", opt(disk.blocking_mean_s)},
                        {"interval_s", opt(disk.interval_s)},
                        {"interval_source", text_or_null(disk.interval_source)},
                        {"durable_latency_median_s", opt(disk.durable_latency_median_s)},
                        {"tiers", tiers}};
  doc["steps"] = {{"recorded", r.steps.recorded},
                  {"effective", r.steps.effective},
                  {"retrained", r.steps.retrained},
                  {"max_step", opt(r.steps.max_step)},
                  {"median_step_s", opt(r.steps.median_step_s)}};
  doc["mtbf_s"] = opt(r.mtbf_s);
  doc["mtbf_source"] = text_or_null(r.mtbf_source);
  doc["recommended_interval_s"] = r.recommendation() ? json(r.recommendation()->interval_s) : json(nullptr);
  doc["recommendation"] = to_json(r.recommendation());
  json skew_phases = json::object();
  for (const auto& [name, k] : r.phase_skew) {
    skew_phases[name] = {{"min", k.min}, {"median", k.median}, {"max", k.max}, {"skew_s", k.skew_s}};
  }
  doc["rank_skew"] = {{"phases", skew_phases}, {"attempt_start_skew_s", r.attempt_start_skew_s}};
  doc["ledger"] = {{"files", r.ledger.files},
                   {"records", r.ledger.records},
                   {"corrupt_lines", r.ledger.corrupt_lines},
                   {"torn_lines", r.ledger.torn_lines},
                   {"orphan_records", r.ledger.orphan_records},
                   {"dropped_events", r.ledger.dropped_events},
                   {"warnings", r.ledger.warnings}};
  if (r.has_timeline) {
    json timeline = json::array(), job = json::array(), background = json::array();
    for (const auto& s : r.timeline) timeline.push_back(to_json(s));
    for (const auto& s : r.job_timeline) job.push_back(to_json(s));
    for (const auto& b : r.background) {
      background.push_back({{"rank", b.rank},
                            {"attempt", b.attempt},
                            {"name", b.name},
                            {"step", opt(b.step)},
                            {"begin_us", b.begin_us},
                            {"end_us", b.end_us}});
    }
    doc["timeline"] = std::move(timeline);
    doc["job_timeline"] = std::move(job);
    doc["background"] = std::move(background);
  }
  return doc.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace ettkit::ett
