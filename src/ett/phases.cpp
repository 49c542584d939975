#include "ettkit/ett/phases.h"

#include <array>
#include <utility>

#include "ettkit/common/error.h"

namespace ettkit::ett {

namespace {
// Meta's launcher_init sub-stages (and ours): recorded under their own names, rolled up into
// launcher_init in the report's top-level phases.
constexpr std::array<std::string_view, 9> kLauncherInitSubstages = {
    "device_init",          "process_group_init",      "preproc_creation",   "train_module_creation",
    "init_plugins",         "pre_train",               "get_first_batch_data", phase::kProcessBootstrap,
    phase::kWorkerSpawn};

constexpr std::array<std::string_view, 10> kTopLevel = {
    phase::kScheduling,         phase::kHardwareSetup, phase::kLauncherInit,       phase::kCompile,
    phase::kCheckpointRestore,  phase::kTraining,      phase::kWastedTraining,     phase::kCheckpointBlocking,
    phase::kShutdown,           phase::kCheckpointPersist};
}  // namespace

std::string top_level_phase(std::string_view name) {
  if (auto slash = name.find('/'); slash != std::string_view::npos) {
    return std::string(name.substr(0, slash));
  }
  for (auto sub : kLauncherInitSubstages) {
    if (name == sub) return std::string(phase::kLauncherInit);
  }
  return std::string(name);
}

bool is_known_phase(std::string_view name) {
  for (auto top : kTopLevel) {
    if (name == top) return true;
  }
  for (auto sub : kLauncherInitSubstages) {
    if (name == sub) return true;
  }
  return false;
}

void validate_phase_name(std::string_view name) {
  ETTKIT_EXPECTS(!name.empty(), "phase name is empty; use a name such as 'compile' or 'eval'");
  ETTKIT_EXPECTS(name.size() <= 128, "phase name '", name.substr(0, 32), "...' is ", name.size(),
                 " bytes; at most 128 are allowed");
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '.' || c == '-' || c == '/';
    ETTKIT_EXPECTS(ok, "phase name '", name, "' contains '", c,
                   "'; only letters, digits and _ . - / are allowed");
  }
  ETTKIT_EXPECTS(name.front() != '/' && name.back() != '/', "phase name '", name,
                 "' must not start or end with '/'; use 'parent/child'");
}

}  // namespace ettkit::ett
