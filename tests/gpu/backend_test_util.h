// Shared helpers of the CUDA backend tests (cuda_backend_test.cc,
// cuda_sessions_test.cc): the visible skip without a GPU, a small qwen2-style
// model and a Mixtral-style configuration on its shapes, and the comparison
// at the backend's precision (running a batch to completion is
// tests/support/run_batch.h's, shared with the CPU tests).
//
// The CUDA backend computes in bf16 (fp16 for fp16 checkpoints) with fp32
// accumulation, so elements are compared relative to the output's scale:
// |got - want| <= kTol * (rms(want) + |want|), and ||got - want|| / ||want|| <=
// kNormTol.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "gtest/gtest.h"
#include "server/core/backend.h"
#include "server/cuda/cuda_backend.h"
#include "server/model/model.h"
#include "tests/support/model_zoo.h"
#include "tests/support/random_model.h"
#include "tests/support/run_batch.h"

namespace layerserve::cuda_test {

inline constexpr double kTol = 3e-2;
inline constexpr double kNormTol = 1e-2;

#define SKIP_WITHOUT_GPU()                                                          \
  do {                                                                              \
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)

// A qwen2-shaped span (q/k/v biases, GQA 2:1, head_dim 64) with random weights
// stored in `dtype`.
inline ModelSpan MakeQwenModel(DType dtype, uint64_t seed) {
  const LlamaConfig c = test_support::Qwen2Gqa2Config();
  ModelSpan m = test_support::RandomModel(c, /*first_layer=*/0, c.num_hidden_layers, dtype, seed);
  m.name = "qwen-test";
  return m;
}

// A Mixtral-style span's configuration on MakeQwenModel's attention shapes
// (without its biases): 8 experts of intermediate 384, 2 per token.
inline LlamaConfig MixtralTestConfig() { return test_support::MixtralGqa2Config(); }

using test_support::RunSync;
using test_support::Start;
using test_support::Wait;

// Compares `got` with `want`, rows of `hidden` values, at the backend's
// precision (kTol, kNormTol); names the worst element in `what`'s terms.
inline void ExpectCloseValues(const std::vector<float>& got, const std::vector<float>& want, int64_t hidden,
                              const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const size_t n = want.size();
  double sum_sq = 0, diff_sq = 0;
  for (size_t j = 0; j < n; ++j) sum_sq += double(want[j]) * want[j];
  const double rms = std::sqrt(sum_sq / double(std::max<size_t>(n, 1)));
  double worst = -1;
  size_t worst_j = 0;
  for (size_t j = 0; j < n; ++j) {
    const double d = std::abs(double(got[j]) - double(want[j]));
    diff_sq += std::isfinite(d) ? d * d : 1e30;
    const double score = std::isfinite(d) ? d / (rms + std::abs(double(want[j]))) : 1e30;
    if (score > worst) {
      worst = score;
      worst_j = j;
    }
  }
  if (n == 0) return;
  const double norm_err = std::sqrt(diff_sq / (sum_sq + 1e-30));
  const std::string where = what + ": worst element token " + std::to_string(worst_j / hidden) + " feature " +
                            std::to_string(worst_j % hidden) + ": got " + std::to_string(got[worst_j]) + " want " +
                            std::to_string(want[worst_j]) + " (score " + std::to_string(worst) + ", rms " +
                            std::to_string(rms) + "); normwise error " + std::to_string(norm_err);
  EXPECT_LE(worst, kTol) << where;
  EXPECT_LE(norm_err, kNormTol) << where;
}

// A request's output as floats; NaN where it has the wrong size.
inline std::vector<float> OutputFloats(const InferRequest& r) {
  std::vector<float> v(r.num_elements(), NAN);
  if (r.output.size() == r.input.size()) ConvertToFloat(r.dtype, r.output.data(), v.size(), v.data());
  return v;
}

}  // namespace layerserve::cuda_test
