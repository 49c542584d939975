#pragma once
// ettkit's phases in the badput categories of Google's ml-goodput-measurement (goodput_utils.BadputType),
// so that a job's waste measured by ettkit reads in the categories other tools report (docs/ett.md §11).
//
// The mapping is by name only: a sub-stage with a category of its own ("get_first_batch_data") takes it,
// any other name takes its top-level phase's ("checkpoint_blocking/memory" -> checkpoint_blocking's), and a
// user-named phase ("eval") is CUSTOM_BADPUT_EVENTS. The report applies it to the job timeline, where time
// that is not effective training but carries the name "training" (a rank trained while the job was still
// recovering) is OTHER: the report's badput then sums to E2E minus effective time, exactly.

#include <array>
#include <string_view>

#include "ettkit/common/export.h"

namespace ettkit::ett {

namespace badput {
// Google's names (BadputType, without the elastic ones), so that dashboards can join on them.
inline constexpr std::string_view kTpuInitialization = "TPU_INITIALIZATION";  // accelerator set-up
inline constexpr std::string_view kTrainingPrep = "TRAINING_PREP";
inline constexpr std::string_view kProgramStartup = "PROGRAM_STARTUP";
inline constexpr std::string_view kDataLoadingSync = "DATA_LOADING_SYNC";
inline constexpr std::string_view kCheckpointSave = "UNPRODUCTIVE_CHECKPOINT_SAVE_TIME";
inline constexpr std::string_view kCheckpointRestore = "UNPRODUCTIVE_CHECKPOINT_RESTORE_TIME";
inline constexpr std::string_view kWastedProgress = "WASTED_PROGRESS_FROM_DISRUPTION";
inline constexpr std::string_view kInfrastructureRecovery = "INFRASTRUCTURE_RECOVERY_FROM_DISRUPTION";
inline constexpr std::string_view kCustom = "CUSTOM_BADPUT_EVENTS";
inline constexpr std::string_view kOther = "OTHER";
/// Not a badput category: the name of effective training (Google's goodput).
inline constexpr std::string_view kGoodput = "GOODPUT";

/// Every badput category, in Google's enum order (the report lists them in this order).
inline constexpr std::array<std::string_view, 10> kAll = {
    kTpuInitialization, kTrainingPrep,     kProgramStartup, kDataLoadingSync,        kCheckpointSave,
    kCheckpointRestore, kWastedProgress,   kInfrastructureRecovery, kCustom,         kOther};
}  // namespace badput

/// The category that time spent in phase `name` counts as: one of badput::kAll, or badput::kGoodput for
/// "training". Never throws; any name has a category.
ETTKIT_API std::string_view badput_category(std::string_view name);

}  // namespace ettkit::ett
