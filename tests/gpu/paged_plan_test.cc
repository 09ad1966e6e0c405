// Tests of the paged attention's plan (PlanPagedAttention,
// layerserve/kernels/paged_attention.h): host code, so these run without a
// GPU. The kernels that execute a plan are tested under three plans each in
// paged_attention_test.cc.
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "layerserve/kernels/paged_attention.h"

namespace layerserve::kernels {
namespace {

constexpr int kH100Sms = 132;

std::vector<PagedSequence> Decoders(int count, int context) {
  return std::vector<PagedSequence>(static_cast<size_t>(count), PagedSequence{1, context});
}

PagedAttentionPlan MustPlan(const std::vector<PagedSequence>& seqs, int heads, int kv_heads, int sms) {
  int64_t tokens = 0;
  for (const PagedSequence& s : seqs) tokens += s.new_tokens;
  const absl::StatusOr<PagedAttentionPlan> plan = PlanPagedAttention(
      seqs, heads, kv_heads, sms, PagedPlanCapacity(tokens, static_cast<int64_t>(seqs.size()), heads, kv_heads, sms));
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.ok() ? *plan : PagedAttentionPlan{};
}

// The header's worked examples: Llama-3-8B heads on an H100.
TEST(PagedPlanTest, WorkedExamples) {
  const PagedAttentionPlan one = MustPlan(Decoders(1, 1024), 32, 8, kH100Sms);
  ASSERT_EQ(one.items.size(), 17u);
  ASSERT_EQ(one.combines.size(), 1u);
  EXPECT_EQ(one.combines[0].splits, 17);
  EXPECT_EQ(one.combines[0].rows, 4);
  EXPECT_EQ(one.partial_rows, 17 * 4);
  for (int i = 0; i < 17; ++i) {
    EXPECT_EQ(one.items[i].kv_begin, 64 * i);
    EXPECT_EQ(one.items[i].kv_end, std::min(64 * (i + 1), 1025));
    EXPECT_EQ(one.items[i].partial_row0, 4 * i);
  }

  const PagedAttentionPlan sixteen = MustPlan(Decoders(16, 4096), 32, 8, kH100Sms);
  ASSERT_EQ(sixteen.items.size(), 32u);
  ASSERT_EQ(sixteen.combines.size(), 16u);
  EXPECT_EQ(sixteen.items[0].kv_end, 33 * 64);
  EXPECT_EQ(sixteen.items[1].kv_begin, 33 * 64);
  EXPECT_EQ(sixteen.items[1].kv_end, 4097);
  EXPECT_EQ(sixteen.items[2].seq, 1);

  const PagedAttentionPlan sixty_four = MustPlan(Decoders(64, 1024), 32, 8, kH100Sms);
  EXPECT_EQ(sixty_four.items.size(), 64u);
  EXPECT_TRUE(sixty_four.combines.empty());
  EXPECT_EQ(sixty_four.partial_rows, 0);
}

// Whatever the batch, every (sequence, query tile) is covered, its keys
// 0 .. its last query's position exactly once and in order, by one direct
// item or by the splits of one combine task whose workspace rows are its own.
// A sequence of kPagedWideMinTokens new tokens or more has wide tiles of
// kPagedWideRows rows, each one direct item; the others 16-row tiles.
TEST(PagedPlanTest, CoversEveryTileAndKeyOnce) {
  std::mt19937 rng(11);
  for (int round = 0; round < 200; ++round) {
    const int heads_choice[][2] = {{32, 8}, {8, 8}, {32, 1}, {6, 2}, {40, 8}};
    const auto& hc = heads_choice[round % 5];
    const int group = hc[0] / hc[1];
    std::vector<PagedSequence> seqs(1 + rng() % 40);
    for (PagedSequence& s : seqs) {
      s.new_tokens = static_cast<int32_t>(rng() % 4 == 0 ? rng() % 300 : 1 + rng() % 3);
      if (rng() % 10 == 0) s.new_tokens = kPagedWideMinTokens - 1 + static_cast<int32_t>(rng() % 2);
      s.start = static_cast<int32_t>(rng() % 3 == 0 ? 0 : rng() % 9000);
    }
    const int sms = 1 + static_cast<int>(rng() % 200);
    const PagedAttentionPlan plan = MustPlan(seqs, hc[0], hc[1], sms);
    SCOPED_TRACE("round " + std::to_string(round));
    std::vector<int> partial_owner(static_cast<size_t>(plan.partial_rows), -1);
    size_t item = 0, combine = 0;
    for (size_t s = 0; s < seqs.size(); ++s) {
      const int rows = seqs[s].new_tokens * group;
      const bool wide = seqs[s].new_tokens >= kPagedWideMinTokens;
      const int step = wide ? kPagedWideRows : kPagedQueryRows;
      for (int row0 = 0; row0 < rows; row0 += step) {
        const int tile_rows = std::min(step, rows - row0);
        const int key_end = seqs[s].start + (row0 + tile_rows - 1) / group + 1;
        ASSERT_LT(item, plan.items.size());
        const PagedWorkItem& first = plan.items[item];
        ASSERT_EQ(first.seq, static_cast<int32_t>(s));
        ASSERT_EQ(first.q_row0, row0);
        ASSERT_EQ(first.rows, step);
        if (wide) EXPECT_LT(first.partial_row0, 0) << "a wide item is never split";
        if (first.partial_row0 < 0) {
          EXPECT_EQ(first.kv_begin, 0);
          EXPECT_EQ(first.kv_end, key_end);
          ++item;
          continue;
        }
        ASSERT_LT(combine, plan.combines.size());
        const PagedCombineTask& task = plan.combines[combine++];
        EXPECT_EQ(task.seq, static_cast<int32_t>(s));
        EXPECT_EQ(task.q_row0, row0);
        EXPECT_EQ(task.rows, tile_rows);
        EXPECT_GE(task.splits, 2);
        int next_key = 0;
        for (int split = 0; split < task.splits; ++split, ++item) {
          ASSERT_LT(item, plan.items.size());
          const PagedWorkItem& it = plan.items[item];
          EXPECT_EQ(it.seq, static_cast<int32_t>(s));
          EXPECT_EQ(it.q_row0, row0);
          EXPECT_EQ(it.kv_begin, next_key);
          EXPECT_EQ(it.kv_begin % kPagedKeyTile, 0);
          EXPECT_GT(it.kv_end, it.kv_begin);
          next_key = it.kv_end;
          EXPECT_EQ(it.partial_row0, task.partial_row0 + split * task.rows);
          for (int r = 0; r < task.rows; ++r) {
            const size_t slot = static_cast<size_t>(it.partial_row0 + r);
            ASSERT_LT(slot, partial_owner.size());
            EXPECT_EQ(partial_owner[slot], -1) << "workspace row " << slot << " written twice";
            partial_owner[slot] = static_cast<int>(item);
          }
        }
        EXPECT_EQ(next_key, key_end);
      }
    }
    EXPECT_EQ(item, plan.items.size());
    EXPECT_EQ(combine, plan.combines.size());
    EXPECT_TRUE(std::find(partial_owner.begin(), partial_owner.end(), -1) == partial_owner.end())
        << "a workspace row nobody writes";
  }
}

// Tighter limits mean fewer splits, never a failure while the unsplit
// tiles fit; fewer items than tiles is RESOURCE_EXHAUSTED.
TEST(PagedPlanTest, LimitsBoundTheSplits) {
  const std::vector<PagedSequence> seqs = Decoders(1, 8191);
  const absl::StatusOr<PagedAttentionPlan> free_plan =
      PlanPagedAttention(seqs, 32, 8, kH100Sms, PagedPlanLimits{INT32_MAX, INT32_MAX});
  ASSERT_TRUE(free_plan.ok());
  // 128 key tiles: 32 splits of 4 are 256 CTAs, one wave.
  EXPECT_EQ(free_plan->combines.at(0).splits, 32);
  const absl::StatusOr<PagedAttentionPlan> tight = PlanPagedAttention(seqs, 32, 8, kH100Sms, PagedPlanLimits{5, 16});
  ASSERT_TRUE(tight.ok()) << tight.status();
  EXPECT_LE(tight->items.size(), 5u);
  EXPECT_LE(tight->partial_rows, 16);
  const absl::StatusOr<PagedAttentionPlan> none = PlanPagedAttention(seqs, 32, 8, kH100Sms, PagedPlanLimits{1, 0});
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->items.size(), 1u);
  EXPECT_TRUE(none->combines.empty());
  EXPECT_EQ(PlanPagedAttention(Decoders(2, 10), 32, 8, kH100Sms, PagedPlanLimits{1, 0}).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// Padding appends idle items and tasks (0 rows) and keeps the plan's own.
TEST(PagedPlanTest, PaddingAppendsIdleWork) {
  PagedAttentionPlan plan = MustPlan(Decoders(1, 1024), 32, 8, kH100Sms);
  const PagedAttentionPlan original = plan;
  ASSERT_TRUE(PadPagedPlan(20, 2, &plan).ok());
  ASSERT_EQ(plan.items.size(), 20u);
  ASSERT_EQ(plan.combines.size(), 2u);
  EXPECT_EQ(plan.partial_rows, original.partial_rows);
  for (size_t i = 0; i < original.items.size(); ++i) {
    EXPECT_EQ(plan.items[i].kv_begin, original.items[i].kv_begin);
    EXPECT_EQ(plan.items[i].rows, original.items[i].rows);
  }
  for (size_t i = original.items.size(); i < 20; ++i) EXPECT_EQ(plan.items[i].rows, 0);
  EXPECT_EQ(plan.combines[0].splits, 17);
  EXPECT_EQ(plan.combines[1].rows, 0);
  EXPECT_EQ(PadPagedPlan(19, 2, &plan).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PadPagedPlan(20, 1, &plan).code(), absl::StatusCode::kInvalidArgument);
}

TEST(PagedPlanTest, RejectsBadShapes) {
  const PagedPlanLimits limits{100, 100};
  EXPECT_EQ(PlanPagedAttention(Decoders(1, 5), 6, 4, kH100Sms, limits).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPagedAttention(Decoders(1, 5), 8, 0, kH100Sms, limits).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPagedAttention({{-1, 3}}, 8, 8, kH100Sms, limits).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanPagedAttention({{1, -3}}, 8, 8, kH100Sms, limits).status().code(), absl::StatusCode::kInvalidArgument);
  const absl::StatusOr<PagedAttentionPlan> empty = PlanPagedAttention({}, 8, 8, kH100Sms, limits);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->items.empty());
}

}  // namespace
}  // namespace layerserve::kernels
