// libFuzzer's entry to the request path (request_fuzz.h): its input bytes
// make the generator's choices (ByteEntropy), so coverage guidance steers
// the same structure-aware generator the seeded gtest runs, and a broken
// property aborts with the case. Built only with -DLAYERSERVE_LIBFUZZER=ON
// (clang; see tests/unit/grpc/CMakeLists.txt), e.g.
//   build/tests/unit/grpc/request_fuzzer -max_total_time=600 corpus/
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>

#include "tests/unit/grpc/request_fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  layerserve::fuzz::ByteEntropy entropy(std::span<const uint8_t>(data, size));
  const layerserve::fuzz::FuzzCase c = layerserve::fuzz::GenerateCase(entropy);
  if (c.unparsable) return 0;
  const layerserve::fuzz::CheckOutcome outcome = layerserve::fuzz::CheckRequestPath(c);
  if (!outcome.violation.empty()) {
    std::fprintf(stderr, "request path property violated: %s\n  request: %s\n",
                 outcome.violation.c_str(), layerserve::fuzz::ShortDescription(c.request).c_str());
    std::abort();
  }
  return 0;
}
