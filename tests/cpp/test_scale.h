#pragma once
// Trial counts of stress and randomized tests, scaled by ETTKIT_TEST_SCALE (a factor, default 1). The
// sanitizer runs (make tsan, make asan-python) set it below 1: an instrumented run is 5-20x slower, and the
// same kinds of interleaving are exercised by fewer rounds of them.
#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace ettkit::testing {

inline double test_scale() {
  const char* s = std::getenv("ETTKIT_TEST_SCALE");
  if (s == nullptr || *s == '\0') return 1.0;
  char* end = nullptr;
  double v = std::strtod(s, &end);
  return (end != s && std::isfinite(v) && v > 0) ? v : 1.0;
}

/// `n` trials scaled by ETTKIT_TEST_SCALE, never below `at_least`.
inline int scaled_trials(int n, int at_least = 1) {
  return std::max(at_least, static_cast<int>(std::lround(n * test_scale())));
}

}  // namespace ettkit::testing
