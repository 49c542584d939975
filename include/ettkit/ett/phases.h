#pragma once
// The phase taxonomy (Meta's ETT phases) shared by the recorder and the report.
//
// A phase name is either a top-level phase ("compile"), a known sub-stage that rolls up into its parent
// ("process_group_init" -> "launcher_init"), an explicit "parent/child" path, or a user-named phase
// ("eval"), which the report counts as idle time (a phase outside training that consumes no new data).

#include <string>
#include <string_view>

#include "ettkit/common/export.h"

namespace ettkit::ett {

namespace phase {
// Before the process exists (recorded from launcher-provided timestamps).
inline constexpr std::string_view kScheduling = "scheduling";
inline constexpr std::string_view kHardwareSetup = "hardware_setup";
// In-process start-up.
inline constexpr std::string_view kLauncherInit = "launcher_init";
inline constexpr std::string_view kCompile = "compile";
inline constexpr std::string_view kCheckpointRestore = "checkpoint_restore";
// The training loop.
inline constexpr std::string_view kTraining = "training";
inline constexpr std::string_view kWastedTraining = "wasted_training";
inline constexpr std::string_view kCheckpointBlocking = "checkpoint_blocking";
inline constexpr std::string_view kShutdown = "shutdown";
// Sub-stage the report derives for a clean attempt's process teardown: from its end record to the process's
// process_exit record (interpreter finalization, process-group and library teardown after the recorder closed).
inline constexpr std::string_view kProcessTeardown = "shutdown/process_teardown";
// Background track (does not block training; drawn on its own trace track).
inline constexpr std::string_view kCheckpointPersist = "checkpoint_persist";
inline constexpr std::string_view kCheckpointMemoryPersist = "checkpoint_memory_persist";
// A save the integrity check refused (a saved tensor changed while it was copied).
inline constexpr std::string_view kCheckpointRefused = "checkpoint_refused";
// A save that failed for another reason (a write error such as a full disk, a lost peer, a commit timeout):
// nothing was committed; the checkpointer's log names the error.
inline constexpr std::string_view kCheckpointFailed = "checkpoint_failed";
// The memory tier's records are the sub-stage "memory" of the disk tier's names: checkpoint_blocking/memory,
// checkpoint_restore/memory, checkpoint_refused/memory, checkpoint_failed/memory (their time rolls up into the
// parent phase).
inline constexpr std::string_view kMemoryTierSuffix = "/memory";
// Sub-stage the recorder writes for [process start, recorder start): interpreter start, imports.
inline constexpr std::string_view kProcessBootstrap = "process_bootstrap";
// Sub-stage the report derives for [allocation, process start): the launcher's own start-up (torchrun
// agent, rendezvous, spawning the workers).
inline constexpr std::string_view kWorkerSpawn = "worker_spawn";
// Report-only names for time no record covers.
inline constexpr std::string_view kLostInFlight = "lost_in_flight";          // alive after its last record, then killed
// After another rank stopped first: what no record covers on this rank (waiting in its next collective, torn
// down by the launcher). Failure time like lost_in_flight, but no work: a survivor's teardown.
inline constexpr std::string_view kPeerTeardown = "peer_teardown";
inline constexpr std::string_view kDetectAndTeardown = "detect_and_teardown";  // between a failed attempt and the next
inline constexpr std::string_view kRestartGap = "restart_gap";                // between a clean attempt and the next
inline constexpr std::string_view kUnattributed = "unattributed";
}  // namespace phase

/// The top-level phase a name rolls up into: "process_group_init" -> "launcher_init",
/// "launcher_init/foo" -> "launcher_init", "compile" -> "compile", "eval" -> "eval".
ETTKIT_API std::string top_level_phase(std::string_view name);

/// Whether a name is one of the built-in top-level phases or sub-stages (not user-named).
ETTKIT_API bool is_known_phase(std::string_view name);

/// Validates a phase name (non-empty, at most 128 bytes, [A-Za-z0-9_./-] only) or throws InvalidArgument.
ETTKIT_API void validate_phase_name(std::string_view name);

}  // namespace ettkit::ett
