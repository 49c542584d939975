// The badput mapping (include/ettkit/ett/badput.h): every name the recorder or the report can produce has a
// category, and the ones Google's tool distinguishes land in Google's.
#include "ettkit/ett/badput.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "ettkit/ett/phases.h"

namespace ettkit::ett {
namespace {

bool is_category(std::string_view c) {
  return std::find(badput::kAll.begin(), badput::kAll.end(), c) != badput::kAll.end();
}

TEST(Badput, EveryBuiltInPhaseAndReportNameHasACategory) {
  // Every name of phases.h and every launcher_init sub-stage (phases.cpp): a category that is not the
  // user-named fallback, so that adding a built-in phase without a category fails here.
  const std::string_view names[] = {
      phase::kScheduling,     phase::kHardwareSetup,    phase::kLauncherInit,      phase::kCompile,
      phase::kCheckpointRestore, phase::kWastedTraining, phase::kCheckpointBlocking, phase::kShutdown,
      phase::kCheckpointPersist, phase::kCheckpointMemoryPersist, phase::kCheckpointRefused,
      phase::kProcessBootstrap, phase::kWorkerSpawn,     phase::kLostInFlight,      phase::kDetectAndTeardown,
      phase::kRestartGap,     phase::kUnattributed,     "device_init",             "process_group_init",
      "preproc_creation",     "train_module_creation",  "init_plugins",            "pre_train",
      "get_first_batch_data"};
  for (std::string_view n : names) {
    SCOPED_TRACE(std::string(n));
    EXPECT_TRUE(is_known_phase(n) || n == phase::kCheckpointRefused || n == phase::kCheckpointMemoryPersist ||
                n == phase::kLostInFlight || n == phase::kDetectAndTeardown || n == phase::kRestartGap ||
                n == phase::kUnattributed);
    EXPECT_TRUE(is_category(badput_category(n)));
    EXPECT_NE(badput_category(n), badput::kCustom);
  }
  EXPECT_EQ(badput_category(phase::kTraining), badput::kGoodput);
}

TEST(Badput, TheCategoriesGoogleDistinguishes) {
  EXPECT_EQ(badput_category("compile"), badput::kProgramStartup);
  EXPECT_EQ(badput_category("process_group_init"), badput::kTrainingPrep);
  EXPECT_EQ(badput_category("get_first_batch_data"), badput::kDataLoadingSync);
  EXPECT_EQ(badput_category("device_init"), badput::kTpuInitialization);
  EXPECT_EQ(badput_category("checkpoint_blocking"), badput::kCheckpointSave);
  EXPECT_EQ(badput_category("checkpoint_restore"), badput::kCheckpointRestore);
  EXPECT_EQ(badput_category("wasted_training"), badput::kWastedProgress);
  EXPECT_EQ(badput_category("detect_and_teardown"), badput::kInfrastructureRecovery);
}

TEST(Badput, SubStagesTakeTheirParentsCategoryAndUserPhasesAreCustom) {
  EXPECT_EQ(badput_category("checkpoint_blocking/memory"), badput::kCheckpointSave);
  EXPECT_EQ(badput_category("checkpoint_restore/memory"), badput::kCheckpointRestore);
  EXPECT_EQ(badput_category("launcher_init/build_model"), badput::kTrainingPrep);
  EXPECT_EQ(badput_category("compile/aot_load"), badput::kProgramStartup);
  EXPECT_EQ(badput_category("eval"), badput::kCustom);
  EXPECT_EQ(badput_category("eval/metrics"), badput::kCustom);
  EXPECT_EQ(badput_category(""), badput::kCustom);
}

}  // namespace
}  // namespace ettkit::ett
