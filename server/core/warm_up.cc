// Warm-up batches (see warm_up.h).
#include "server/core/warm_up.h"

#include <algorithm>
#include <future>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"

namespace layerserve {
namespace {

// One FP32 sequence of `tokens` rows of `zeros` (which outlives the batch).
std::unique_ptr<InferRequest> ZerosRequest(std::string_view zeros, int64_t tokens, int64_t hidden) {
  auto request = std::make_unique<InferRequest>();
  request->id = "warm-up";
  request->dtype = DType::kF32;
  request->batch = 1;
  request->seq_len = tokens;
  request->hidden = hidden;
  request->input = zeros.substr(0, static_cast<size_t>(tokens * hidden) * sizeof(float));
  return request;
}

// Executes a batch of `request` and waits for it.
absl::Status RunOne(Backend& backend, std::unique_ptr<InferRequest> request) {
  const int64_t tokens = request->seq_len;
  auto batch = std::make_shared<Batch>();
  batch->requests.push_back(std::move(request));
  batch->Pack();
  std::promise<absl::Status> done;
  std::future<absl::Status> status = done.get_future();
  backend.Execute(std::move(batch), [&done](absl::Status s) { done.set_value(std::move(s)); });
  const absl::Status result = status.get();
  if (result.ok()) return result;
  return absl::Status(result.code(),
                      absl::StrCat("warm-up batch of ", tokens, " tokens: ", result.message()));
}

}  // namespace

std::vector<int64_t> WarmUpSizes(int64_t max_batch_tokens, int64_t every_up_to,
                                 std::span<const int64_t> bucket_uppers) {
  std::vector<int64_t> sizes;
  const int64_t every = std::min(every_up_to, max_batch_tokens);
  for (int64_t n = 1; n <= every; ++n) sizes.push_back(n);
  for (const int64_t upper : bucket_uppers) {
    const int64_t n = std::min(upper, max_batch_tokens);
    if (sizes.empty() || n > sizes.back()) sizes.push_back(n);
  }
  return sizes;
}

absl::Status WarmUpStateless(Backend& backend, int64_t hidden, std::span<const int64_t> tokens) {
  const int64_t most = tokens.empty() ? 0 : *std::max_element(tokens.begin(), tokens.end());
  const std::string zeros(static_cast<size_t>(std::max<int64_t>(most, 0) * hidden) * sizeof(float),
                          '\0');
  for (const int64_t n : tokens) {
    if (absl::Status s = RunOne(backend, ZerosRequest(zeros, n, hidden)); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status WarmUpSessionStep(Backend& backend, int64_t hidden, const KvCacheShape& cache) {
  const int64_t position =
      std::min<int64_t>(128, int64_t{cache.num_blocks} * cache.block_tokens - 1);
  if (position < 1) return absl::OkStatus();
  const std::string zeros(static_cast<size_t>(hidden) * sizeof(float), '\0');
  std::unique_ptr<InferRequest> request = ZerosRequest(zeros, 1, hidden);
  request->session = SessionParams{SessionId(std::string("layerserve-warm-up"))};
  request->step.position = position;
  request->step.tokens = 1;
  request->step.block_tokens = cache.block_tokens;
  std::vector<KvBlockId>& table = request->step.block_tables.emplace_back();
  for (int64_t b = 0; b * cache.block_tokens <= position; ++b) {
    table.push_back(static_cast<KvBlockId>(b));
  }
  return RunOne(backend, std::move(request));
}

}  // namespace layerserve
