#include "ettkit/ett/badput.h"

#include <string>
#include <utility>

#include "ettkit/ett/phases.h"

namespace ettkit::ett {

namespace {
// Names whose category is not their top-level phase's. Google's PROGRAM_STARTUP is the start-up before
// the first step that is not training preparation (their compile time, inferred from the first step);
// ours holds compile and the process's own start (worker spawn, interpreter and imports).
constexpr std::pair<std::string_view, std::string_view> kByName[] = {
    {"device_init", badput::kTpuInitialization},
    {"get_first_batch_data", badput::kDataLoadingSync},
    {phase::kProcessBootstrap, badput::kProgramStartup},
    {phase::kWorkerSpawn, badput::kProgramStartup},
};

constexpr std::pair<std::string_view, std::string_view> kByTopLevel[] = {
    {phase::kTraining, badput::kGoodput},
    // Waiting for an allocation: the restart's queue (attempt 0's counts only with include_initial_queue).
    {phase::kScheduling, badput::kInfrastructureRecovery},
    {phase::kHardwareSetup, badput::kTpuInitialization},
    {phase::kLauncherInit, badput::kTrainingPrep},
    {phase::kCompile, badput::kProgramStartup},
    {phase::kCheckpointRestore, badput::kCheckpointRestore},
    {phase::kCheckpointBlocking, badput::kCheckpointSave},
    {phase::kCheckpointRefused, badput::kCheckpointSave},
    {phase::kCheckpointFailed, badput::kCheckpointSave},
    // Background records never take job time; named for completeness.
    {phase::kCheckpointPersist, badput::kCheckpointSave},
    {phase::kCheckpointMemoryPersist, badput::kCheckpointSave},
    {phase::kWastedTraining, badput::kWastedProgress},
    {phase::kLostInFlight, badput::kWastedProgress},
    {phase::kPeerTeardown, badput::kInfrastructureRecovery},
    {phase::kDetectAndTeardown, badput::kInfrastructureRecovery},
    {phase::kRestartGap, badput::kOther},
    {phase::kShutdown, badput::kOther},
    {phase::kUnattributed, badput::kOther},
};
}  // namespace

std::string_view badput_category(std::string_view name) {
  for (const auto& [n, category] : kByName) {
    if (name == n) return category;
  }
  const std::string top = top_level_phase(name);
  for (const auto& [n, category] : kByTopLevel) {
    if (top == n) return category;
  }
  return badput::kCustom;
}

}  // namespace ettkit::ett
