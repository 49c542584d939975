#include "ett/process_info.h"

#include <time.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace ettkit::ett::detail {

namespace {

int64_t clock_ns(clockid_t clock) {
  timespec t{};
  clock_gettime(clock, &t);
  return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

// `state`, when given, receives field 3 (R, S, D, Z for a zombie, ...).
std::optional<int64_t> start_epoch_us_from(const std::string& path, char* state = nullptr) {
  // Field 22 of /proc/<pid>/stat is the start time in clock ticks after boot (on CLOCK_BOOTTIME). The
  // command name (field 2) may contain spaces, so parse after its ')'.
  std::ifstream stat(path);
  std::string line;
  if (!stat || !std::getline(stat, line)) return std::nullopt;
  auto close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream fields(line.substr(close + 2));
  std::string field;
  // Fields after ')' start at field 3 (state); starttime is field 22.
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return std::nullopt;
    if (i == 3 && state != nullptr) *state = field.empty() ? '?' : field[0];
  }
  long long start_ticks = std::strtoll(field.c_str(), nullptr, 10);
  long ticks_per_s = sysconf(_SC_CLK_TCK);
  if (ticks_per_s <= 0) return std::nullopt;
  // The boot time in epoch nanoseconds, from two clocks read now. /proc/stat's btime is whole seconds, which
  // put every process start up to 1 s early: before the end of the previous attempt it followed.
  const int64_t boot_epoch_ns = clock_ns(CLOCK_REALTIME) - clock_ns(CLOCK_BOOTTIME);
  return boot_epoch_ns / 1000 + static_cast<int64_t>(start_ticks) * 1000000 / ticks_per_s;
}

}  // namespace

std::optional<int64_t> process_start_epoch_us() { return start_epoch_us_from("/proc/self/stat"); }

bool process_is_running(int64_t pid, int64_t start_epoch_us) {
  if (pid <= 0) return false;
  char state = '?';
  auto start = start_epoch_us_from("/proc/" + std::to_string(pid) + "/stat", &state);
  if (!start || state == 'Z' || state == 'X') return false;
  // The same process, not a later one that reuses the pid: the start agrees to within two clock ticks (the
  // boot time is read anew each time, and both values are rounded down to a tick).
  const long ticks_per_s = sysconf(_SC_CLK_TCK);
  const int64_t tolerance_us = 2 * 1000000 / (ticks_per_s > 0 ? ticks_per_s : 100);
  return std::llabs(*start - start_epoch_us) <= tolerance_us;
}

std::string host_name() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return {};
  return buf;
}

std::optional<int64_t> env_int(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  char* end = nullptr;
  long long v = std::strtoll(value, &end, 10);
  if (end == value || *end != '\0') return std::nullopt;
  return v;
}

}  // namespace ettkit::ett::detail
