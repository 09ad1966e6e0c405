// Shared helpers for the CPU backend tests: batches of requests built, run and
// compared against a reference rounded to each request's dtype. The small
// model configurations they build random checkpoints from are the zoo's
// (tests/support/model_zoo.h).
#pragma once

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "gtest/gtest.h"
#include "server/core/backend.h"
#include "server/model/model.h"
#include "tests/support/model_zoo.h"
#include "tests/support/run_batch.h"
#include "tests/unit/cpu/test_util.h"

namespace layerserve::cpu_test {

using test_support::RunSync;

// ---- models -------------------------------------------------------------

// The configurations come from the test model zoo (tests/support/model_zoo.h).
using test_support::Llama3StyleConfig;
using test_support::MistralStyleConfig;
using test_support::MixtralStyleConfig;
using test_support::Qwen2MoeStyleConfig;
using test_support::Qwen2StyleConfig;
using test_support::Qwen3MoeStyleConfig;
using test_support::Qwen3StyleConfig;

// ---- batches ------------------------------------------------------------

struct RequestShape {
  int64_t batch;
  int64_t seq_len;
  DType dtype;
};

// Activations exactly representable in BF16, FP16 and FP32 (bf16 values of
// magnitude >= 2^-14 or zero), so one reference run serves every dtype.
inline std::vector<float> RepresentableInputs(Rng& rng, size_t n) {
  std::vector<float> v(n);
  for (float& x : v) {
    x = Bf16ToFloat(FloatToBf16(static_cast<float>(rng.Uniform(-2, 2))));
    if (std::abs(x) < 0x1p-14f) x = 0.0f;
  }
  return v;
}

// A Batch over `shapes` whose inputs are consecutive slices of `activations`,
// packed by Batch::Pack, with outputs poisoned.
struct BuiltBatch {
  std::shared_ptr<Batch> batch;
  std::vector<std::unique_ptr<std::string>> inputs;  // owned storage for input views
};

inline BuiltBatch BuildBatch(const std::vector<RequestShape>& shapes,
                             const std::vector<float>& activations, int64_t hidden) {
  BuiltBatch built;
  built.batch = std::make_shared<Batch>();
  size_t offset = 0;
  for (size_t r = 0; r < shapes.size(); ++r) {
    const RequestShape& s = shapes[r];
    auto request = std::make_unique<InferRequest>();
    request->id = "req" + std::to_string(r);
    request->dtype = s.dtype;
    request->batch = s.batch;
    request->seq_len = s.seq_len;
    request->hidden = hidden;
    const size_t n = request->num_elements();
    auto input = std::make_unique<std::string>(n * DTypeSize(s.dtype), '\0');
    ConvertFromFloat(activations.data() + offset, n, s.dtype, input->data());
    offset += n;
    request->input = *input;
    // 0xff bytes are NaN in FP32, FP16 and BF16.
    request->output.assign(input->size(), '\xff');
    built.inputs.push_back(std::move(input));
    built.batch->requests.push_back(std::move(request));
  }
  built.batch->Pack();
  return built;
}

inline double DtypeRelativeUlp(DType t) {
  switch (t) {
    case DType::kF32:
      return 0.0;
    case DType::kF16:
      return 0x1p-10;
    case DType::kBF16:
      return 0x1p-7;
    case DType::kF8E4M3:
      return 0x1p-3;
  }
  return 0;
}

// Compares each request's output with the reference rounded to its dtype:
// |got - round(ref)| <= ulp(dtype) * |ref| + fp32_tol * (|ref| + rms(ref)).
// The dtype term covers results that straddle a rounding boundary.
inline void ExpectOutputsMatch(const Batch& batch, const std::vector<double>& want,
                               double fp32_tol) {
  const double rms = cpu_test::Rms(want);
  size_t offset = 0;
  for (const auto& request : batch.requests) {
    SCOPED_TRACE(std::string("request ") + request->id + " dtype " +
                 std::string(DTypeProtocolName(request->dtype)));
    const size_t n = request->num_elements();
    ASSERT_EQ(request->output.size(), request->input.size());
    std::vector<float> got(n);
    ConvertToFloat(request->dtype, request->output.data(), n, got.data());
    double worst = -1;
    size_t worst_i = 0;
    double worst_rounded = 0;
    for (size_t i = 0; i < n; ++i) {
      const double ref = want[offset + i];
      const float ref_f = static_cast<float>(ref);
      float rounded = ref_f;
      ConvertFromFloat(&ref_f, 1, request->dtype, &rounded);  // round-trip through the dtype
      ConvertToFloat(request->dtype, &rounded, 1, &rounded);
      const double tol = DtypeRelativeUlp(request->dtype) * std::abs(ref) +
                         fp32_tol * (std::abs(ref) + rms) + 0x1p-24;
      const double excess = std::abs(got[i] - rounded) / tol;
      if (!(excess <= worst)) {
        worst = excess;
        worst_i = i;
        worst_rounded = rounded;
        if (std::isnan(excess)) break;
      }
    }
    EXPECT_LE(worst, 1.0) << "worst element " << worst_i << " (token " << worst_i / request->hidden
                          << "): got " << got[worst_i] << ", reference " << want[offset + worst_i]
                          << " rounded " << worst_rounded << "; error / tolerance " << worst;
    offset += n;
  }
}

}  // namespace layerserve::cpu_test
