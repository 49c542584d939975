// The interval policy (include/ettkit/checkpoint/schedule.h): parsing an interval, the failure history from
// the ETT report, and the per-tier due test.
#include "ettkit/checkpoint/schedule.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "checkpoint/checkpoint_ledger.h"
#include "common/logging.h"
#include "ettkit/common/error.h"
#include "ettkit/ett/interval.h"
#include "ettkit/ett/report.h"

namespace ettkit::checkpoint {
namespace {

constexpr const char* kValid = "give steps (e.g. 500), a duration (e.g. '90s', '10min', '1h'), 'auto' or 'never'";

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

/// "12", "1.5", ".5": digits with at most one point, at least one digit after it. nullopt otherwise.
std::optional<double> decimal(std::string_view s) {
  size_t point = s.find('.');
  if (s.empty() || (point != std::string_view::npos && (point + 1 == s.size() || s.find('.', point + 1) != std::string_view::npos))) {
    return std::nullopt;
  }
  for (char c : s) {
    if (c != '.' && (c < '0' || c > '9')) return std::nullopt;
  }
  if (s.size() > 30) return std::nullopt;
  return std::stod(std::string(s));
}

}  // namespace

Every Every::parse(std::string_view text, std::string_view field) {
  std::string_view t = trim(text);
  if (t.empty() || t == "never") return {};
  if (t == "auto") return automatic();
  // Steps: digits only.
  if (std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    ETTKIT_CHECK(t.size() <= 18, InvalidArgument, field, "='", text, "' is not valid: ", kValid);
    return steps(std::stoll(std::string(t)), field);
  }
  // A duration: a number, optional blanks, a unit.
  size_t unit = t.size();
  while (unit > 0 && t[unit - 1] >= 'a' && t[unit - 1] <= 'z') --unit;
  std::string_view u = t.substr(unit);
  double scale = u == "s" || u == "sec" ? 1.0 : u == "m" || u == "min" ? 60.0 : u == "h" ? 3600.0 : 0.0;
  std::optional<double> n = decimal(trim(t.substr(0, unit)));
  ETTKIT_CHECK(scale > 0 && n && *n > 0, InvalidArgument, field, "='", text, "' is not valid: ", kValid);
  return seconds(*n * scale, field);
}

Every Every::steps(int64_t n, std::string_view field) {
  ETTKIT_CHECK(n > 0, InvalidArgument, field, "=", n, " must be a positive number of steps");
  return {Kind::kSteps, static_cast<double>(n)};
}

Every Every::seconds(double s, std::string_view field) {
  ETTKIT_CHECK(s > 0 && std::isfinite(s), InvalidArgument, field, "=", s, " s must be a positive, finite duration");
  return {Kind::kSeconds, s};
}

const char* Every::kind_name() const {
  switch (kind) {
    case Kind::kSteps: return "steps";
    case Kind::kSeconds: return "seconds";
    case Kind::kAuto: return "auto";
    case Kind::kNever: break;
  }
  return "never";
}

FailureHistory FailureHistory::from_run(const std::string& run_dir, double prior_mtbf_s) {
  ETTKIT_CHECK(prior_mtbf_s > 0 && std::isfinite(prior_mtbf_s), InvalidArgument, "mtbf_prior_s=", prior_mtbf_s,
               " must be positive and finite");
  FailureHistory h;
  h.mtbf_s = prior_mtbf_s;
  if (run_dir.empty()) return h;
  ett::ReportOptions opt;
  opt.mtbf_prior_s = prior_mtbf_s;
  opt.include_timeline = false;
  ett::ReportSummary s;
  try {
    s = ett::build_report(run_dir, opt);
  } catch (const InvalidArgument&) {
    return h;  // no ledger yet: the first attempt of a job
  } catch (const std::exception& e) {
    ETTKIT_LOG_WARN("checkpoint interval: the ETT ledger of '", run_dir, "' could not be read (", e.what(),
                    "); 'auto' assumes an MTBF of ", prior_mtbf_s, " s and no restart cost");
    return h;
  }
  if (s.mtbf_s && *s.mtbf_s > 0 && std::isfinite(*s.mtbf_s)) h.mtbf_s = *s.mtbf_s;
  double sum = 0;
  int n = 0;
  for (double v : s.time_to_recover_s) {
    if (std::isfinite(v) && v >= 0) {
      sum += v;
      ++n;
    }
  }
  if (n > 0) h.restart_s = sum / n;
  return h;
}

TierCosts TierCosts::of(const AsyncCheckpointer& ck, Tier tier) {
  return {tier == Tier::kMemory ? ck.memory_saves_committed() : ck.saves_committed(), ck.mean_blocking_s(tier),
          ck.mean_time_to_durable_s(tier)};
}

CheckpointSchedule::CheckpointSchedule(Every disk, Every memory, FailureHistory history, double start_s)
    : history_(history) {
  ETTKIT_CHECK(history.mtbf_s > 0 && std::isfinite(history.mtbf_s), InvalidArgument, "the failure history's mtbf_s=",
               history.mtbf_s, " must be positive and finite");
  ETTKIT_CHECK(history.restart_s >= 0 && std::isfinite(history.restart_s), InvalidArgument,
               "the failure history's restart_s=", history.restart_s, " must be >= 0 and finite");
  disk_.every = disk;
  memory_.every = memory;
  disk_.last_time = memory_.last_time = start_s;
}

double CheckpointSchedule::now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double CheckpointSchedule::auto_interval_s(const TierCosts& costs) const {
  if (costs.committed == 0) return kAutoUnmeasuredIntervalS;
  // A save measured as free still costs something: Daly's interval needs a positive blocking time.
  double interval = ett::recommend_interval(std::max(costs.blocking_s, 1e-4), history_.mtbf_s, history_.restart_s,
                                            ett::IntervalMethod::kDaly);
  return std::max(interval, costs.durable_s);
}

bool CheckpointSchedule::tier_due(const TierState& s, int64_t step, double now, const TierCosts& costs) const {
  switch (s.every.kind) {
    case Every::Kind::kNever:
      return false;
    case Every::Kind::kSteps:
      return step > 0 && step % static_cast<int64_t>(s.every.value) == 0 && step != s.last_step &&
             step != disk_.last_step;
    case Every::Kind::kSeconds:
      return now - s.last_time >= s.every.value;
    case Every::Kind::kAuto:
      // The first save of the tier measures what a save costs.
      return s.made == 0 || now - s.last_time >= auto_interval_s(costs);
  }
  return false;
}

std::optional<Tier> CheckpointSchedule::due(int64_t step, double now, const TierCosts& disk,
                                            const TierCosts& memory) const {
  if (tier_due(disk_, step, now, disk)) return Tier::kDisk;
  if (tier_due(memory_, step, now, memory)) return Tier::kMemory;
  return std::nullopt;
}

std::optional<Tier> CheckpointSchedule::due(int64_t step, double now, const AsyncCheckpointer& ck) const {
  return due(step, now, TierCosts::of(ck, Tier::kDisk), TierCosts::of(ck, Tier::kMemory));
}

std::optional<Tier> CheckpointSchedule::due(int64_t step, const AsyncCheckpointer& ck) const {
  return due(step, now_s(), ck);
}

double CheckpointSchedule::auto_interval_s(const AsyncCheckpointer& ck, Tier tier) const {
  return auto_interval_s(TierCosts::of(ck, tier));
}

void CheckpointSchedule::saved(int64_t step, Tier tier, double now) {
  TierState& s = tier == Tier::kMemory ? memory_ : disk_;
  s.last_step = step;
  s.last_time = now;
  ++s.made;
}

void CheckpointSchedule::restored(int64_t step) { disk_.last_step = memory_.last_step = step; }

void CheckpointSchedule::record_intervals(ett::Recorder& recorder) const {
  detail::record_interval_config(recorder, disk_.every, memory_.every);
}

}  // namespace ettkit::checkpoint
