// The plan of a PagedAttention launch (paged_attention.h): which CTA computes
// which query rows over which keys. Host code only, a pure function of the
// batch's shape, so the heuristic is unit-tested without a GPU.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "layerserve/kernels/paged_attention.h"

namespace layerserve::kernels {
namespace {

// The kernel keeps two CTAs resident per SM (about 100 KB of shared memory
// each): a wave of the grid is two CTAs per SM.
constexpr int64_t kCtasPerSm = 2;
// What a CTA costs besides its key tiles, in key tiles: a guess (about 2 us
// against ~1.4 us per tile per SM when K/V streams at 3 TB/s), to refine
// with the decode benchmark.
constexpr int64_t kCtaOverheadTiles = 2;

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// One query tile before splitting: its sequence, first row, valid rows, the
// number of key tiles up to its last query's position, and whether it is a
// wide one (kPagedWideRows rows, never split).
struct Tile {
  int32_t seq;
  int32_t q_row0;
  int32_t rows;
  int32_t key_end;
  int64_t key_tiles;
  bool wide;
};

}  // namespace

PagedPlanLimits PagedPlanCapacity(int64_t max_tokens, int64_t max_seqs, int num_heads, int num_kv_heads, int num_sms) {
  const int64_t group = num_kv_heads > 0 ? std::max(1, num_heads / num_kv_heads) : 1;
  const int64_t target_items = CeilDiv(kCtasPerSm * std::max(1, num_sms), std::max(1, num_kv_heads));
  PagedPlanLimits limits;
  // Unsplit: a tile per 16 rows of every sequence, plus one partial tile
  // each. Splits happen only when those are fewer than target_items, and
  // then come to at most twice target_items (see PlanPagedAttention).
  limits.items = CeilDiv(max_tokens * group, kPagedQueryRows) + max_seqs + 2 * target_items;
  limits.partial_rows = 2 * target_items * kPagedQueryRows;
  return limits;
}

absl::StatusOr<PagedAttentionPlan> PlanPagedAttention(const std::vector<PagedSequence>& seqs, int num_heads,
                                                      int num_kv_heads, int num_sms, const PagedPlanLimits& limits) {
  if (num_kv_heads <= 0 || num_heads <= 0 || num_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("paged attention plan: num_heads (", num_heads,
                                                   ") must be a positive multiple of num_kv_heads (", num_kv_heads,
                                                   ")"));
  }
  const int64_t group = num_heads / num_kv_heads;
  std::vector<Tile> tiles;
  bool has_wide = false;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const PagedSequence& seq = seqs[s];
    if (seq.new_tokens < 0 || seq.start < 0) {
      return absl::InvalidArgumentError(absl::StrCat("paged attention plan: sequence ", s, " has ", seq.new_tokens,
                                                     " new tokens at start ", seq.start));
    }
    const int64_t rows = int64_t{seq.new_tokens} * group;
    if (rows > INT32_MAX || int64_t{seq.start} + seq.new_tokens > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat("paged attention plan: sequence ", s, " is too long"));
    }
    const bool wide = seq.new_tokens >= kPagedWideMinTokens;
    const int64_t step = wide ? kPagedWideRows : kPagedQueryRows;
    has_wide = has_wide || wide;
    for (int64_t row0 = 0; row0 < rows; row0 += step) {
      const int64_t tile_rows = std::min<int64_t>(step, rows - row0);
      // Keys 0 .. the tile's last query's position.
      const int64_t key_end = seq.start + (row0 + tile_rows - 1) / group + 1;
      const int64_t key_tiles = CeilDiv(key_end, kPagedKeyTile);
      tiles.push_back({static_cast<int32_t>(s), static_cast<int32_t>(row0), static_cast<int32_t>(tile_rows),
                       static_cast<int32_t>(key_end), key_tiles, wide});
    }
  }
  if (static_cast<int64_t>(tiles.size()) > limits.items) {
    return absl::ResourceExhaustedError(absl::StrCat("paged attention plan: ", tiles.size(),
                                                     " query tiles, more than the ", limits.items,
                                                     " work items planned for"));
  }

  // Key tiles per split (chunk): none while the unsplit items fill the
  // GPU's CTA slots (or a prefill piece's wide tiles are there to fill
  // them); else the chunk that finishes soonest, modelled as
  // waves x (chunk + kCtaOverheadTiles): every CTA of a wave reads `chunk`
  // tiles after a fixed cost (its query load, the pipeline's first latency,
  // the merge and the partial write; the combine), the smaller grid winning
  // a tie. Candidates are ceil(max_key_tiles / s) for s splits
  // of the longest tile, up to one CTA slot each. If the plan outgrows its
  // limits the chunk doubles until it fits (at max_key_tiles nothing splits).
  const int64_t slots = kCtasPerSm * std::max(1, num_sms);
  int64_t max_key_tiles = 1;
  for (const Tile& t : tiles) max_key_tiles = std::max(max_key_tiles, t.key_tiles);
  int64_t chunk = max_key_tiles;
  if (!has_wide && static_cast<int64_t>(tiles.size()) * num_kv_heads < slots) {
    int64_t best_cost = INT64_MAX, best_ctas = INT64_MAX;
    const int64_t max_splits = std::min(max_key_tiles, slots);
    for (int64_t splits = 1; splits <= max_splits; ++splits) {
      const int64_t candidate = CeilDiv(max_key_tiles, splits);
      int64_t ctas = 0;
      for (const Tile& t : tiles) ctas += CeilDiv(t.key_tiles, candidate) * num_kv_heads;
      const int64_t cost = CeilDiv(ctas, slots) * (candidate + kCtaOverheadTiles);
      if (cost < best_cost || (cost == best_cost && ctas < best_ctas)) {
        best_cost = cost;
        best_ctas = ctas;
        chunk = candidate;
      }
    }
  }
  for (;; chunk = std::min(max_key_tiles, 2 * chunk)) {
    PagedAttentionPlan plan;
    for (const Tile& t : tiles) {
      const int64_t splits = CeilDiv(t.key_tiles, chunk);
      if (splits <= 1 || t.wide) {
        plan.items.push_back({t.seq, t.q_row0, 0, t.key_end, -1, t.wide ? kPagedWideRows : kPagedQueryRows});
        continue;
      }
      // Evened out: splits of per_split key tiles, the last one shorter.
      const int64_t per_split = CeilDiv(t.key_tiles, splits);
      const int64_t used_splits = CeilDiv(t.key_tiles, per_split);
      const int64_t row0 = plan.partial_rows;
      for (int64_t i = 0; i < used_splits; ++i) {
        const int64_t begin = i * per_split * kPagedKeyTile;
        const int64_t end = std::min<int64_t>(t.key_end, (i + 1) * per_split * kPagedKeyTile);
        plan.items.push_back({t.seq, t.q_row0, static_cast<int32_t>(begin), static_cast<int32_t>(end),
                              static_cast<int32_t>(row0 + i * t.rows), kPagedQueryRows});
      }
      plan.combines.push_back({t.seq, t.q_row0, t.rows, static_cast<int32_t>(row0), static_cast<int32_t>(used_splits)});
      plan.partial_rows += used_splits * t.rows;
    }
    if ((static_cast<int64_t>(plan.items.size()) <= limits.items && plan.partial_rows <= limits.partial_rows) ||
        chunk >= max_key_tiles) {
      return plan;
    }
  }
}

absl::Status PadPagedPlan(int64_t items, int64_t combines, PagedAttentionPlan* plan) {
  if (static_cast<int64_t>(plan->items.size()) > items || static_cast<int64_t>(plan->combines.size()) > combines) {
    return absl::InvalidArgumentError(absl::StrCat("paged attention plan: ", plan->items.size(), " items and ",
                                                   plan->combines.size(), " combine tasks do not pad to ", items,
                                                   " and ", combines));
  }
  plan->items.resize(static_cast<size_t>(items), PagedWorkItem{.rows = 0});
  plan->combines.resize(static_cast<size_t>(combines), PagedCombineTask{});
  return absl::OkStatus();
}

}  // namespace layerserve::kernels
