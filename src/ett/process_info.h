#pragma once
// Facts about the current process that the attempt record carries.

#include <cstdint>
#include <optional>
#include <string>

namespace ettkit::ett::detail {

/// When this process started, in UTC epoch microseconds (from /proc: boot time + start ticks; 10 ms
/// resolution). std::nullopt where /proc is unavailable.
std::optional<int64_t> process_start_epoch_us();

/// The host name (empty on failure).
std::string host_name();

/// An integer environment variable, or std::nullopt when unset or not an integer.
std::optional<int64_t> env_int(const char* name);

}  // namespace ettkit::ett::detail
