#pragma once
// The checkpoint-interval advisor: the interval between checkpoints that minimises expected lost time.
//
// All inputs and results are in seconds of *training* time. δ = time training is blocked per checkpoint,
// M = mean time between failures, R = restart cost.
//   young        √(2δM)                                      Young (1974)
//   daly         √(2δ(M+R))                                  Daly (2006), first order with restart
//   daly_series  √(2δM)·[1 + ⅓√(δ/2M) + ⅑(δ/2M)] − δ, M if δ ≥ 2M   Daly (2006), higher order
//   daly_exact   M·(1 + W₀(−e^{−(1+δ/M)}))                    exact optimum of Daly's cost (Lambert W)

#include <string_view>

#include "ettkit/common/export.h"

namespace ettkit::ett {

enum class IntervalMethod { kYoung, kDaly, kDalySeries, kDalyExact };

/// Parses "young" | "daly" | "daly_series" | "daly_exact"; throws InvalidArgument naming `method`.
ETTKIT_API IntervalMethod parse_interval_method(std::string_view method);

/// The optimal checkpoint interval in seconds. Throws InvalidArgument when blocking_s or mtbf_s is not
/// positive and finite, or restart_s is negative or not finite.
ETTKIT_API double recommend_interval(double blocking_s, double mtbf_s, double restart_s = 0.0,
                                     IntervalMethod method = IntervalMethod::kYoung);

/// Expected waste per unit of training time for interval I under Meta's (= Young's) model:
/// I/(2M) from unsaved work plus δ/I from blocking. Used to quote the saving of a recommendation.
ETTKIT_API double waste_fraction(double interval_s, double blocking_s, double mtbf_s);

/// Principal branch of the Lambert W function on [-1/e, ∞).
ETTKIT_API double lambert_w0(double z);

}  // namespace ettkit::ett
