#pragma once
// Time conventions: steady_clock for durations (immune to NTP steps), UTC epoch microseconds for records
// that must line up across processes, attempts and ranks.

#include <chrono>
#include <cstdint>

namespace ettkit {

using SteadyClock = std::chrono::steady_clock;

/// Microseconds since the Unix epoch (UTC), from the system clock.
inline int64_t epoch_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

/// Nanoseconds on the steady clock; only differences are meaningful.
inline int64_t steady_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count();
}

/// Maps steady-clock readings onto the UTC axis through one anchor taken at construction, so a process's
/// records are monotonic even if the wall clock is stepped while it runs.
class ClockAnchor {
 public:
  ClockAnchor() : epoch_us_(epoch_us()), steady_ns_(steady_ns()) {}
  int64_t to_epoch_us(int64_t steady) const { return epoch_us_ + (steady - steady_ns_) / 1000; }
  int64_t epoch_us_at_anchor() const { return epoch_us_; }

 private:
  int64_t epoch_us_;
  int64_t steady_ns_;
};

}  // namespace ettkit
