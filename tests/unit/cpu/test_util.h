// Shared helpers for the CPU tests: the portable seeded generator (from
// tests/support) and a comparison that reports the worst element.
#pragma once

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/support/random_model.h"

namespace layerserve::cpu_test {

using test_support::Rng;

// float32 values, uniform in [lo, hi).
inline std::vector<float> RandomFloats(Rng& rng, size_t n, double lo = -1, double hi = 1) {
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(rng.Uniform(lo, hi));
  return v;
}

inline std::vector<double> ToDouble(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

inline double Rms(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return v.empty() ? 0 : std::sqrt(s / static_cast<double>(v.size()));
}

// Passes when every |got - want| <= rel_tol * (|want| + rms(want)): relative
// for large elements, scaled by the tensor's magnitude for elements near zero
// (where an fp32 result carries the absolute error of its inputs). NaN fails.
inline ::testing::AssertionResult AllClose(const std::vector<float>& got,
                                           const std::vector<double>& want, double rel_tol) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure()
           << "size " << got.size() << " != reference size " << want.size();
  }
  const double scale = Rms(want);
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]) / (std::abs(want[i]) + scale);
    if (!(err <= worst)) {  // NaN lands here and sticks
      worst = err;
      worst_i = i;
      if (std::isnan(err)) break;
    }
  }
  std::ostringstream worst_text;
  worst_text << "worst element " << worst_i << ": got " << got[worst_i] << ", reference "
             << want[worst_i] << ", scaled error " << worst << " (tolerance " << rel_tol << ", rms "
             << scale << ")";
  if (!(worst <= rel_tol)) return ::testing::AssertionFailure() << worst_text.str();
  return ::testing::AssertionSuccess() << worst_text.str();
}

}  // namespace layerserve::cpu_test
