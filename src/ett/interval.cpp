#include "ettkit/ett/interval.h"

#include <cmath>
#include <limits>

#include "ettkit/common/error.h"

namespace ettkit::ett {

IntervalMethod parse_interval_method(std::string_view method) {
  if (method == "young") return IntervalMethod::kYoung;
  if (method == "daly") return IntervalMethod::kDaly;
  if (method == "daly_series") return IntervalMethod::kDalySeries;
  if (method == "daly_exact") return IntervalMethod::kDalyExact;
  ETTKIT_THROW(InvalidArgument, "method='", method,
               "' is not a checkpoint-interval method; use 'young', 'daly', 'daly_series' or 'daly_exact'");
}

double lambert_w0(double z) {
  constexpr double kMinusInvE = -0.36787944117144233;
  ETTKIT_EXPECTS(std::isfinite(z) && z >= kMinusInvE - 1e-15, "lambert_w0: z=", z,
                 " is outside the principal branch's domain [-1/e, inf)");
  if (z <= kMinusInvE) return -1.0;
  // Initial guess: series around the branch point near -1/e, log-based far away; then Halley steps,
  // which converge cubically.
  double w;
  if (z < -0.3) {
    double p = std::sqrt(2.0 * (M_E * z + 1.0));
    w = -1.0 + p - p * p / 3.0 + 11.0 * p * p * p / 72.0;
  } else if (z < 3.0) {
    w = std::log1p(z);
  } else {
    double lz = std::log(z);
    w = lz - std::log(lz);
  }
  for (int i = 0; i < 64; ++i) {
    double ew = std::exp(w);
    double f = w * ew - z;
    double denom = ew * (w + 1.0) - (w + 2.0) * f / (2.0 * w + 2.0);
    if (denom == 0.0 || !std::isfinite(denom)) break;
    double next = w - f / denom;
    if (std::fabs(next - w) <= 1e-15 * (1.0 + std::fabs(next))) return next;
    w = next;
  }
  return w;
}

double recommend_interval(double blocking_s, double mtbf_s, double restart_s, IntervalMethod method) {
  ETTKIT_EXPECTS(std::isfinite(blocking_s) && blocking_s > 0, "blocking_s=", blocking_s,
                 " must be a positive, finite number of seconds (time training is blocked per checkpoint)");
  ETTKIT_EXPECTS(std::isfinite(mtbf_s) && mtbf_s > 0, "mtbf_s=", mtbf_s,
                 " must be a positive, finite number of seconds (mean time between failures)");
  ETTKIT_EXPECTS(std::isfinite(restart_s) && restart_s >= 0, "restart_s=", restart_s,
                 " must be a non-negative, finite number of seconds (time to restart after a failure)");
  const double d = blocking_s;
  const double m = mtbf_s;
  switch (method) {
    case IntervalMethod::kYoung:
      return std::sqrt(2.0 * d * m);
    case IntervalMethod::kDaly:
      return std::sqrt(2.0 * d * (m + restart_s));
    case IntervalMethod::kDalySeries: {
      if (d >= 2.0 * m) return m;
      double x = d / (2.0 * m);
      return std::sqrt(2.0 * d * m) * (1.0 + std::sqrt(x) / 3.0 + x / 9.0) - d;
    }
    case IntervalMethod::kDalyExact: {
      // dT_w/dτ = 0 for T_w(τ) = M e^{R/M} (e^{(τ+δ)/M} − 1) Ts/τ gives τ* = M (1 + W₀(−e^{−(1+δ/M)})).
      return m * (1.0 + lambert_w0(-std::exp(-(1.0 + d / m))));
    }
  }
  ETTKIT_THROW(InvalidArgument, "unknown interval method");
}

double waste_fraction(double interval_s, double blocking_s, double mtbf_s) {
  ETTKIT_EXPECTS(interval_s > 0 && mtbf_s > 0 && blocking_s >= 0, "waste_fraction: interval_s=", interval_s,
                 ", blocking_s=", blocking_s, ", mtbf_s=", mtbf_s, " must be positive");
  return interval_s / (2.0 * mtbf_s) + blocking_s / interval_s;
}

}  // namespace ettkit::ett
