#pragma once
// Facts about the current process that the attempt record carries.

#include <cstdint>
#include <optional>
#include <string>

namespace ettkit::ett::detail {

/// When this process started (was forked), in UTC epoch microseconds: the boot time (CLOCK_REALTIME minus
/// CLOCK_BOOTTIME) plus the start ticks from /proc; one clock tick (10 ms) resolution, never later than the
/// actual start. std::nullopt where /proc is unavailable.
std::optional<int64_t> process_start_epoch_us();
/// Whether process `pid` of this machine is running (not a zombie) and is the process that started at
/// `start_epoch_us` (as process_start_epoch_us() reported it), not a later one that reuses the pid.
bool process_is_running(int64_t pid, int64_t start_epoch_us);

/// The host name (empty on failure).
std::string host_name();

/// An integer environment variable, or std::nullopt when unset or not an integer.
std::optional<int64_t> env_int(const char* name);

}  // namespace ettkit::ett::detail
