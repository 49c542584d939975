#pragma once
// Byte-level mutations for the seeded fuzz loops (tests/cpp/*/*_fuzz_test.cpp): flip a bit, overwrite,
// insert, erase, truncate, splice a run from another corpus entry, or repeat a run. Deterministic for a
// given generator state, so a failing case is reproduced by its seed and iteration number.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "test_scale.h"

namespace ettkit::testing {

inline void mutate(std::string& b, const std::vector<std::string>& corpus, std::mt19937_64& rng) {
  const int mutations = 1 + static_cast<int>(rng() % 4);
  for (int m = 0; m < mutations; ++m) {
    const size_t at = b.empty() ? 0 : rng() % b.size();
    switch (rng() % 7) {
      case 0:
        if (at < b.size()) b[at] = static_cast<char>(b[at] ^ (1 << (rng() % 8)));
        break;
      case 1:
        if (at < b.size()) b[at] = static_cast<char>(rng());
        break;
      case 2:
        b.insert(b.begin() + static_cast<long>(at), static_cast<char>(rng()));
        break;
      case 3:
        if (at < b.size()) b.erase(b.begin() + static_cast<long>(at));
        break;
      case 4:
        b.resize(at);
        break;
      case 5: {  // splice a run of another entry
        const std::string& other = corpus[rng() % corpus.size()];
        if (other.empty()) break;
        const size_t from = rng() % other.size(), len = 1 + rng() % 24;
        for (size_t k = 0; k < len && from + k < other.size() && at + k < b.size(); ++k) b[at + k] = other[from + k];
        break;
      }
      default: {  // repeat a run (deep nesting, long arrays)
        const size_t len = 1 + rng() % 8;
        if (at + len <= b.size()) b.insert(at, b.substr(at, len) + b.substr(at, len));
        break;
      }
    }
  }
}

/// Iterations of a fuzz loop: `fixed` (scaled by ETTKIT_TEST_SCALE, as the sanitizer runs set it) in CI, or
/// as many as fit in ETTKIT_FUZZ_SECONDS when it is set.
class FuzzBudget {
 public:
  explicit FuzzBudget(long fixed) : fixed_(scaled_trials(static_cast<int>(fixed), 100)) {
    if (const char* env = std::getenv("ETTKIT_FUZZ_SECONDS")) seconds_ = std::atof(env);
    deadline_ = std::chrono::steady_clock::now() +
                std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds_));
  }
  bool more(long n) const { return seconds_ > 0 ? std::chrono::steady_clock::now() < deadline_ : n < fixed_; }

 private:
  long fixed_;
  double seconds_ = 0;
  std::chrono::steady_clock::time_point deadline_;
};

}  // namespace ettkit::testing
