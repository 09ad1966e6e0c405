// Batch packing and the checks every backend runs before computing.
#include "server/core/backend.h"

#include <gtest/gtest.h>

#include <string>

namespace layerserve {
namespace {

std::unique_ptr<InferRequest> Request(int64_t batch, int64_t seq_len, const std::string& bytes,
                                      int64_t hidden = 2) {
  auto r = std::make_unique<InferRequest>();
  r->id = "r";
  r->dtype = DType::kBF16;
  r->batch = batch;
  r->seq_len = seq_len;
  r->hidden = hidden;
  r->input = bytes;
  return r;
}

TEST(BatchTest, PackGivesEachSequenceItsRows) {
  const std::string two_by_three(2 * 3 * 2 * 2, 'x'), one_by_one(1 * 1 * 2 * 2, 'y');
  Batch batch;
  batch.requests.push_back(Request(2, 3, two_by_three));
  batch.requests.push_back(Request(1, 1, one_by_one));
  batch.Pack();
  EXPECT_EQ(batch.cu_seqlens, (std::vector<int32_t>{0, 3, 6, 7}));
  EXPECT_EQ(batch.total_tokens, 7);
  EXPECT_TRUE(batch.Validate(/*hidden_size=*/2, /*max_tokens=*/7).ok());
}

TEST(BatchTest, ValidateRejectsWhatNoBackendMayCompute) {
  const std::string bytes(1 * 4 * 2 * 2, 'x');
  struct Case {
    const char* label;
    int64_t hidden_size, max_tokens;
    std::unique_ptr<InferRequest> request;
    absl::StatusCode code;
  };
  Case cases[] = {
      {"hidden mismatch", 4, 100, Request(1, 4, bytes), absl::StatusCode::kInvalidArgument},
      {"byte count", 2, 100, Request(1, 3, bytes), absl::StatusCode::kInvalidArgument},
      {"negative shape", 2, 100, Request(-1, 4, bytes), absl::StatusCode::kInvalidArgument},
      {"over max tokens", 2, 3, Request(1, 4, bytes), absl::StatusCode::kInvalidArgument},
  };
  for (Case& c : cases) {
    Batch batch;
    batch.requests.push_back(std::move(c.request));
    batch.Pack();
    EXPECT_EQ(batch.Validate(c.hidden_size, c.max_tokens).code(), c.code) << c.label;
  }
  Batch stale;  // packed, then changed: the offsets no longer match
  stale.requests.push_back(Request(1, 4, bytes));
  stale.Pack();
  stale.cu_seqlens.back() = 3;
  EXPECT_EQ(stale.Validate(2, 100).code(), absl::StatusCode::kInternal);
}

// A session step of `request`: B tables of consecutive block ids from `first`.
void SetStep(InferRequest& request, int64_t position, int64_t block_tokens, KvBlockId first) {
  request.session = SessionParams{.id = SessionId(int64_t{1})};
  request.step.position = position;
  request.step.tokens = request.seq_len;
  request.step.block_tokens = block_tokens;
  request.step.block_tables.clear();
  const int64_t blocks = BlocksForTokens(position + request.seq_len, block_tokens);
  for (int64_t b = 0; b < request.batch; ++b) {
    auto& table = request.step.block_tables.emplace_back();
    for (int64_t i = 0; i < blocks; ++i) table.push_back(first++);
  }
}

TEST(BatchTest, PackGivesSessionSequencesTheirPositionsAndTables) {
  const std::string stateless(1 * 2 * 2 * 2, 'x'), session(2 * 3 * 2 * 2, 'y');
  Batch batch;
  batch.requests.push_back(Request(1, 2, stateless));
  batch.requests.push_back(Request(2, 3, session));
  SetStep(*batch.requests[1], /*position=*/5, /*block_tokens=*/4, /*first=*/10);
  batch.Pack();
  EXPECT_TRUE(batch.has_sessions);
  ASSERT_EQ(batch.kv.size(), 3u);
  EXPECT_EQ(batch.kv[0].position, 0);
  EXPECT_EQ(batch.kv[0].block_table, nullptr);
  EXPECT_EQ(batch.kv[1].position, 5);
  EXPECT_EQ(*batch.kv[1].block_table, (std::vector<KvBlockId>{10, 11}));
  EXPECT_EQ(*batch.kv[2].block_table, (std::vector<KvBlockId>{12, 13}));
  EXPECT_TRUE(batch.Validate(2, 100, KvCacheShape{.num_blocks = 14, .block_tokens = 4}).ok());
}

TEST(BatchTest, ValidateChecksSessionStepsAgainstThePool) {
  const std::string bytes(1 * 3 * 2 * 2, 'y');
  const KvCacheShape pool{.num_blocks = 8, .block_tokens = 4};
  auto check = [&](auto mutate, const KvCacheShape& shape) {
    Batch batch;
    batch.requests.push_back(Request(1, 3, bytes));
    SetStep(*batch.requests[0], 2, 4, 0);
    mutate(*batch.requests[0]);
    batch.Pack();
    return batch.Validate(2, 100, shape).code();
  };
  EXPECT_EQ(check([](InferRequest&) {}, pool), absl::StatusCode::kOk);
  EXPECT_EQ(check([](InferRequest&) {}, KvCacheShape{}), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(check([](InferRequest& r) { r.step.block_tables[0].pop_back(); }, pool),
            absl::StatusCode::kInternal);
  EXPECT_EQ(check([](InferRequest& r) { r.step.block_tables[0][0] = 8; }, pool),
            absl::StatusCode::kInternal);
  EXPECT_EQ(check([](InferRequest& r) { r.step.block_tables.clear(); }, pool),
            absl::StatusCode::kInternal);
  EXPECT_EQ(check([](InferRequest& r) { r.step.block_tokens = 16; }, pool),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace layerserve
