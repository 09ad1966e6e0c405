// Warm-up batches (server/core/warm_up.h) through a real backend, the CPU
// one: stateless batches of zeros for a dense and a mixture-of-experts span
// (whose router then sees all-equal logits), the session step against pools
// large and small, and a failure that names the warm-up.
#include "server/core/warm_up.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "server/cpu/cpu_backend.h"
#include "tests/support/random_model.h"
#include "tests/unit/cpu/backend_test_util.h"

namespace layerserve {
namespace {

std::unique_ptr<Backend> MakeBackend(const LlamaConfig& config) {
  auto backend = MakeCpuBackend(test_support::RandomModel(config, 0, 2, DType::kF32, 41),
                                CpuBackendOptions{2});
  EXPECT_TRUE(backend.ok()) << backend.status();
  return backend.ok() ? *std::move(backend) : nullptr;
}

TEST(WarmUpTest, StatelessBatchesOfZerosRunOnDenseAndExpertSpans) {
  for (const LlamaConfig& config : {cpu_test::Qwen2StyleConfig(), cpu_test::MixtralStyleConfig()}) {
    std::unique_ptr<Backend> backend = MakeBackend(config);
    ASSERT_NE(backend, nullptr);
    const std::vector<int64_t> sizes = {1, 8, 33};
    const absl::Status status = WarmUpStateless(*backend, config.hidden_size, sizes);
    EXPECT_TRUE(status.ok()) << config.model_type << ": " << status;
  }
}

TEST(WarmUpTest, SizesAreEveryCountThenTheBucketsAboveIt) {
  const std::vector<int64_t> buckets = {8, 16, 32, 64, 128, 256, 512, 1024};
  EXPECT_EQ(WarmUpSizes(8192, 4, buckets),
            (std::vector<int64_t>{1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 1024}));
  // Counts past a bucket's bound skip it; the cap ends both parts.
  EXPECT_EQ(WarmUpSizes(300, 20, buckets),
            (std::vector<int64_t>{1,  2,  3,  4,  5,  6,  7,  8,  9,  10,  11,  12, 13,
                                  14, 15, 16, 17, 18, 19, 20, 32, 64, 128, 256, 300}));
  EXPECT_EQ(WarmUpSizes(3, 256, buckets), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(WarmUpSizes(1, 0, buckets), (std::vector<int64_t>{1}));
  EXPECT_EQ(WarmUpSizes(100, 0, {}), (std::vector<int64_t>{}));
}

TEST(WarmUpTest, TheSessionStepFitsPoolsLargeAndSmall) {
  const LlamaConfig config = cpu_test::Qwen2StyleConfig();
  // 128 cached tokens over 9 blocks of 16; over 3 blocks of 1 (position 2);
  // a pool of one token has no room for a step with cached keys: nothing.
  for (const KvCacheShape& cache :
       {KvCacheShape{16, 16}, KvCacheShape{9, 16}, KvCacheShape{3, 1}, KvCacheShape{1, 1}}) {
    std::unique_ptr<Backend> backend = MakeBackend(config);
    ASSERT_NE(backend, nullptr);
    ASSERT_TRUE(backend->AllocateKvCache(cache).ok());
    const absl::Status status = WarmUpSessionStep(*backend, config.hidden_size, cache);
    EXPECT_TRUE(status.ok()) << cache.num_blocks << " blocks of " << cache.block_tokens << ": "
                             << status;
  }
}

TEST(WarmUpTest, AFailedBatchIsNamed) {
  const LlamaConfig config = cpu_test::Qwen2StyleConfig();
  std::unique_ptr<Backend> backend = MakeBackend(config);
  ASSERT_NE(backend, nullptr);
  // A session step on a backend without a KV cache.
  const absl::Status status = WarmUpSessionStep(*backend, config.hidden_size, {16, 16});
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_TRUE(absl::StartsWith(status.message(), "warm-up batch of 1 tokens: ")) << status;
}

}  // namespace
}  // namespace layerserve
