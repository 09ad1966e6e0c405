// DemoReference and MatchesReference (see reference_check.h).
#include "tests/integration/reference_check.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "server/model/model.h"

namespace layerserve::integration {
namespace {

// The reference's output value as the server would return it in `datatype`.
double RoundTo(double value, const std::string& datatype) {
  const float f = static_cast<float>(value);
  if (datatype == "FP16") return client::HalfBitsToFloat(client::FloatToHalfBits(f));
  if (datatype == "BF16") return client::Bf16BitsToFloat(client::FloatToBf16Bits(f));
  return f;
}

}  // namespace

DemoReference::DemoReference(int64_t first_layer, int64_t end_layer, bool kv_cache_fp8) {
  LayerRange range;
  range.begin = first_layer;
  range.end = end_layer;
  model_ = test_support::ToReference(MakeDemoModel(range));
  model_.config.kv_cache_fp8 = kv_cache_fp8;
}

std::vector<double> DemoReference::Run(const std::vector<float>& x, int64_t batch,
                                       int64_t seq_len) const {
  std::vector<int32_t> cu_seqlens;
  for (int64_t b = 0; b <= batch; ++b) cu_seqlens.push_back(static_cast<int32_t>(b * seq_len));
  return test_support::ReferenceForward(model_, std::vector<double>(x.begin(), x.end()),
                                        cu_seqlens);
}

std::vector<float> RandomBf16ExactValues(size_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& v : values) v = client::Bf16BitsToFloat(client::FloatToBf16Bits(normal(rng)));
  return values;
}

namespace {

double DatatypeTolerance(const std::string& datatype) {
  if (datatype == "FP16") return 2e-3;
  if (datatype == "BF16") return 1.6e-2;
  return 1e-4;
}

}  // namespace

double ToleranceFor(const std::string& datatype) {
  // A backend that computes in a narrower type than the wire's (the CUDA
  // backend computes in BF16) cannot be held to the wire type's tolerance;
  // LAYERSERVE_COMPUTE_DTYPE names that type (unset: FP32, the CPU backend).
  const char* compute = std::getenv("LAYERSERVE_COMPUTE_DTYPE");
  return std::max(DatatypeTolerance(datatype),
                  DatatypeTolerance(compute != nullptr ? compute : "FP32"));
}

::testing::AssertionResult MatchesReference(const client::Tensor& got,
                                            const std::vector<int64_t>& expected_shape,
                                            const std::string& expected_datatype,
                                            const std::vector<double>& reference,
                                            double tolerance_factor) {
  const double tolerance = tolerance_factor * ToleranceFor(got.datatype);
  if (got.datatype != expected_datatype) {
    return ::testing::AssertionFailure()
           << "datatype " << got.datatype << ", expected " << expected_datatype;
  }
  if (got.shape != expected_shape) {
    return ::testing::AssertionFailure()
           << "shape [" << absl::StrJoin(got.shape, ",") << "], expected ["
           << absl::StrJoin(expected_shape, ",") << "]";
  }
  absl::StatusOr<std::vector<float>> values = client::TensorToFloats(got);
  if (!values.ok()) return ::testing::AssertionFailure() << values.status();
  if (values->size() != reference.size()) {
    return ::testing::AssertionFailure()
           << values->size() << " values, reference has " << reference.size();
  }
  double scale = 0;
  for (double r : reference) scale = std::max(scale, std::fabs(r));
  if (!(scale > 0)) return ::testing::AssertionFailure() << "reference is all zero or NaN";
  size_t worst = 0;
  double worst_error = -1;
  for (size_t i = 0; i < reference.size(); ++i) {
    const double error = std::fabs((*values)[i] - RoundTo(reference[i], got.datatype));
    // NaN compares false: treat it as the worst possible element.
    if (!(error <= worst_error) || std::isnan(error)) {
      worst_error = std::isnan(error) ? INFINITY : error;
      worst = i;
    }
  }
  const double relative = worst_error / scale;
  const int64_t hidden = expected_shape.back();
  const int64_t seq_len = expected_shape[1];
  const std::string where = absl::StrFormat(
      "worst element [%d, %d, %d]: got %.8g, reference %.8g (rounded to %s: %.8g), error %.3g = "
      "%.3g of the reference scale %.4g (tolerance %.3g)",
      static_cast<int64_t>(worst) / hidden / seq_len,
      static_cast<int64_t>(worst) / hidden % seq_len, static_cast<int64_t>(worst) % hidden,
      (*values)[worst], reference[worst], got.datatype, RoundTo(reference[worst], got.datatype),
      worst_error, relative, scale, tolerance);
  if (relative > tolerance) return ::testing::AssertionFailure() << where;
  return ::testing::AssertionSuccess() << where;
}

}  // namespace layerserve::integration
