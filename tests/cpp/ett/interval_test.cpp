#include "ettkit/ett/interval.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ettkit/common/error.h"

namespace ettkit::ett {
namespace {

// Daly (2006), Figs. 3-5: delta = 5 min, R = 10 min (values in minutes).
struct DalyRow {
  double mtbf_min, young, daly1, series, exact;
};
constexpr DalyRow kDaly[] = {
    {1440, 120.000, 120.416, 116.690, 116.690},
    {360, 60.000, 60.828, 56.713, 56.714},
    {15, 12.247, 15.811, 9.141, 9.167},
};

TEST(RecommendInterval, ReproducesDalysPublishedTable) {
  for (const auto& row : kDaly) {
    EXPECT_NEAR(recommend_interval(5, row.mtbf_min, 10, IntervalMethod::kYoung), row.young, 1e-3);
    EXPECT_NEAR(recommend_interval(5, row.mtbf_min, 10, IntervalMethod::kDaly), row.daly1, 1e-3);
    EXPECT_NEAR(recommend_interval(5, row.mtbf_min, 10, IntervalMethod::kDalySeries), row.series, 1e-3);
    EXPECT_NEAR(recommend_interval(5, row.mtbf_min, 10, IntervalMethod::kDalyExact), row.exact, 1e-3);
  }
  // The paper rounds: 117, 57, 9.1 minutes.
  EXPECT_NEAR(recommend_interval(5, 1440, 10, IntervalMethod::kDalySeries), 117, 0.5);
  EXPECT_NEAR(recommend_interval(5, 15, 10, IntervalMethod::kDalySeries), 9.1, 0.05);
}

TEST(RecommendInterval, BlogExampleInSeconds) {
  // delta = 10 s, M = 6000 s, R = 600 s.
  EXPECT_NEAR(recommend_interval(10, 6000, 600, IntervalMethod::kYoung), 346.410, 1e-3);
  EXPECT_NEAR(recommend_interval(10, 6000, 600, IntervalMethod::kDaly), 363.318, 1e-3);
  EXPECT_NEAR(recommend_interval(10, 6000, 600, IntervalMethod::kDalyExact), 339.776, 1e-3);
}

TEST(RecommendInterval, ExactOptimumMinimisesDalysCost) {
  // T_w(tau) ∝ (e^{(tau+d)/M} - 1)/tau: the exact optimum beats its neighbours.
  const double d = 60, m = 55200;
  auto cost = [&](double tau) { return (std::exp((tau + d) / m) - 1) / tau; };
  double opt = recommend_interval(d, m, 0, IntervalMethod::kDalyExact);
  EXPECT_LT(cost(opt), cost(opt * 0.99));
  EXPECT_LT(cost(opt), cost(opt * 1.01));
}

TEST(RecommendInterval, SeriesFallsBackToMtbfWhenBlockingDominates) {
  EXPECT_DOUBLE_EQ(recommend_interval(300, 100, 0, IntervalMethod::kDalySeries), 100);
}

TEST(RecommendInterval, RejectsBadInputsNamingTheField) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  EXPECT_THROW(recommend_interval(0, 100), InvalidArgument);
  EXPECT_THROW(recommend_interval(-1, 100), InvalidArgument);
  EXPECT_THROW(recommend_interval(nan, 100), InvalidArgument);
  EXPECT_THROW(recommend_interval(1, inf), InvalidArgument);
  EXPECT_THROW(recommend_interval(1, 0), InvalidArgument);
  EXPECT_THROW(recommend_interval(1, 10, -1), InvalidArgument);
  try {
    recommend_interval(1, -5);
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("mtbf_s=-5"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_interval_method("optimal"), InvalidArgument);
  EXPECT_EQ(parse_interval_method("daly_exact"), IntervalMethod::kDalyExact);
}

TEST(LambertW, SatisfiesItsDefinition) {
  for (double z : {-0.367879, -0.3, -0.1, 0.0, 0.5, 1.0, 10.0, 1e6}) {
    double w = lambert_w0(z);
    EXPECT_NEAR(w * std::exp(w), z, 1e-9 * (1 + std::fabs(z))) << z;
  }
  EXPECT_NEAR(lambert_w0(1.0), 0.5671432904097838, 1e-14);  // the omega constant
  EXPECT_THROW(lambert_w0(-1.0), InvalidArgument);
}

TEST(WasteFraction, IsFlatNearTheOptimum) {
  // W(k I*)/W(I*) = (k + 1/k)/2: +25 % at k = 2 and 0.5, +8.3 % at 1.5.
  const double d = 60, m = 55200;
  double opt = recommend_interval(d, m);
  double w = waste_fraction(opt, d, m);
  EXPECT_NEAR(waste_fraction(2 * opt, d, m) / w, 1.25, 1e-12);
  EXPECT_NEAR(waste_fraction(0.5 * opt, d, m) / w, 1.25, 1e-12);
  EXPECT_NEAR(waste_fraction(1.5 * opt, d, m) / w, (1.5 + 1 / 1.5) / 2, 1e-12);
}

}  // namespace
}  // namespace ettkit::ett
