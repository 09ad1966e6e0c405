// Expected outputs for integration tests: the demo model's weights (built by
// layerserve_core's MakeDemoModel, the same deterministic weights the server
// serves) run through the float64 reference decoder layer in
// tests/reference, and a comparison with a tolerance by datatype that prints
// the worst element.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "client/tensor.h"
#include "tests/support/reference_model.h"

namespace layerserve::integration {

class DemoReference {
 public:
  // Layers [first_layer, end_layer) of the demo model; with kv_cache_fp8,
  // attention reads K and V as --kv-cache-dtype=fp8 stores them.
  DemoReference(int64_t first_layer, int64_t end_layer, bool kv_cache_fp8 = false);

  int64_t hidden() const { return model_.config.hidden; }

  // Runs x ([batch, seq_len, hidden], row-major) through the layers; each of
  // the `batch` rows is an independent sequence at positions 0..seq_len-1, as
  // the server treats them.
  std::vector<double> Run(const std::vector<float>& x, int64_t batch, int64_t seq_len) const;

 private:
  test_support::ReferenceModel model_;
};

// `count` standard-normal values rounded to BF16, so the same input is exact
// in BF16, FP16 and FP32 and one reference output serves all three.
std::vector<float> RandomBf16ExactValues(size_t count, uint64_t seed);

// Largest error of `got` against the reference rounded to got's datatype,
// relative to the largest reference magnitude, allowed per datatype:
// FP32 1e-4, FP16 2e-3 (~2 ulp), BF16 1.6e-2 (~2 ulp); never tighter than
// the tolerance of the backend's compute type, $LAYERSERVE_COMPUTE_DTYPE.
double ToleranceFor(const std::string& datatype);

// Checks datatype, shape and values; the failure message names the worst
// element ([b, t, h], got, reference, rounded reference, relative error).
// `tolerance_factor` scales ToleranceFor's bound, for tests that check which
// request a reply answers rather than how precisely (another request's reply
// is off by tens of percent).
::testing::AssertionResult MatchesReference(const client::Tensor& got,
                                            const std::vector<int64_t>& expected_shape,
                                            const std::string& expected_datatype,
                                            const std::vector<double>& reference,
                                            double tolerance_factor = 1.0);

}  // namespace layerserve::integration
