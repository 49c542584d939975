#include "checkpoint/checkpoint_ledger.h"

#include <cstdio>
#include <string>
#include <utility>

#include "ettkit/common/error.h"
#include "ettkit/ett/phases.h"
#include "ettkit/ett/recorder.h"

namespace ettkit::checkpoint::detail {

namespace {
int index_of(Tier t) { return static_cast<int>(t); }
double seconds(int64_t begin_us, int64_t end_us) { return static_cast<double>(end_us - begin_us) * 1e-6; }
double mean(double sum, int64_t n) { return n ? sum / static_cast<double>(n) : 0.0; }
}  // namespace

void record_interval_config(ett::Recorder& recorder, const Every& disk, const Every& memory) {
  for (const auto& [every, prefix] : {std::pair{&disk, "checkpoint"}, std::pair{&memory, "checkpoint_memory"}}) {
    if (every->kind == Every::Kind::kSteps) {
      recorder.set_config(std::string(prefix) + "_interval_steps", every->value);
    } else if (every->kind == Every::Kind::kSeconds) {
      recorder.set_config(std::string(prefix) + "_interval_s", every->value);
    }
  }
}

void CheckpointLedger::attach(ett::Recorder* recorder) {
  recorder_ = recorder;
  if (!recorder_) return;
  ett::Recorder& rec = *recorder_;
  const std::string memory(ett::phase::kMemoryTierSuffix);
  for (Tier t : {Tier::kDisk, Tier::kMemory}) {
    const std::string suffix = t == Tier::kMemory ? memory : std::string();
    PhaseIds& ids = tier_ids_[index_of(t)];
    ids.blocking = rec.phase_id(std::string(ett::phase::kCheckpointBlocking) + suffix);
    ids.refused = rec.phase_id(std::string(ett::phase::kCheckpointRefused) + suffix);
    ids.failed = rec.phase_id(std::string(ett::phase::kCheckpointFailed) + suffix);
    ids.restore = rec.phase_id(std::string(ett::phase::kCheckpointRestore) + suffix);
  }
  persist_id_ = rec.phase_id(ett::phase::kCheckpointPersist);
  memory_id_ = rec.phase_id(ett::phase::kCheckpointMemoryPersist);
  staging_id_ = rec.phase_id("checkpoint_staging");
  drain_id_ = rec.phase_id(std::string(ett::phase::kShutdown) + "/checkpoint_drain");
}

void CheckpointLedger::count_save(Tier tier) {
  std::lock_guard<std::mutex> lk(mu_);
  ++saves_;
  ++tier_[index_of(tier)].saves;
  last_tier_ = tier;
}

void CheckpointLedger::record_blocking(int64_t begin_us, int64_t end_us, int64_t step) {
  Tier tier;
  {
    std::lock_guard<std::mutex> lk(mu_);
    tier = last_tier_;
    blocking_sum_ += seconds(begin_us, end_us);
    tier_[index_of(tier)].blocking_sum += seconds(begin_us, end_us);
  }
  if (recorder_) recorder_->record_phase(tier_ids_[index_of(tier)].blocking, begin_us, end_us, step);
}

void CheckpointLedger::record_staging(int64_t begin_us, int64_t end_us, int64_t step) {
  if (recorder_) recorder_->record_background(staging_id_, begin_us, end_us, step);
}

void CheckpointLedger::record_durable(Tier tier, int64_t call_us, int64_t end_us, int64_t step) {
  if (recorder_) recorder_->record_background(tier == Tier::kMemory ? memory_id_ : persist_id_, call_us, end_us, step);
  std::lock_guard<std::mutex> lk(mu_);
  TierFigures& f = tier_[index_of(tier)];
  ++f.committed;
  f.durable_sum += seconds(call_us, end_us);
}

void CheckpointLedger::record_failure(Tier tier, bool torn, int64_t call_us, int64_t end_us, int64_t step) {
  if (recorder_) {
    const PhaseIds& ids = tier_ids_[index_of(tier)];
    recorder_->record_background(torn ? ids.refused : ids.failed, call_us, end_us, step);
  }
  std::lock_guard<std::mutex> lk(mu_);
  ++failed_;
  if (torn) ++refused_;
}

void CheckpointLedger::record_drain(int64_t begin_us, int64_t end_us) {
  if (recorder_ && !recorder_->closed()) recorder_->record_phase(drain_id_, begin_us, end_us);
}

void CheckpointLedger::record_restore(int64_t step, Tier tier, int64_t begin_us, int64_t end_us) {
  if (recorder_) recorder_->record_phase(tier_ids_[index_of(tier)].restore, begin_us, end_us, step);
}

void CheckpointLedger::note_prefetched_restore(int64_t step, Tier tier, double verify_s, uint64_t reverified_bytes) {
  if (!recorder_) return;
  // Three significant digits: a sub-millisecond verification reads 0.000433 s, not 0.00043313 s.
  char text[32];
  std::snprintf(text, sizeof text, "%.3g", verify_s);
  recorder_->set_note("restore_prefetch",
                      ettkit::detail::concat("step ", step, " (", tier == Tier::kMemory ? "memory" : "disk",
                                             ") verified ahead in ", text, " s; ", reverified_bytes,
                                             " bytes hashed again at load"));
}

double CheckpointLedger::mean_blocking_s() const {
  return locked([&] { return mean(blocking_sum_, saves_); });
}
double CheckpointLedger::mean_blocking_s(Tier tier) const {
  return locked([&] { return mean(tier_[index_of(tier)].blocking_sum, tier_[index_of(tier)].saves); });
}
double CheckpointLedger::mean_time_to_durable_s(Tier tier) const {
  return locked([&] { return mean(tier_[index_of(tier)].durable_sum, tier_[index_of(tier)].committed); });
}
int64_t CheckpointLedger::saves_committed(Tier tier) const {
  return locked([&] { return tier_[index_of(tier)].committed; });
}
int64_t CheckpointLedger::saves_failed() const { return locked([&] { return failed_; }); }
int64_t CheckpointLedger::saves_refused() const { return locked([&] { return refused_; }); }

}  // namespace ettkit::checkpoint::detail
