// Device code of the fused flash-attention forward (FlashAttention-2 style,
// mma.sync m16n8k16 with fp32 accumulation, for sm_80 and later).
//
// One CTA owns kBlockM query rows of one (sequence, head). It keeps its Q tile
// in shared memory (or, with kQInRegs, in registers), streams K/V tiles of
// kBlockN keys through a two-stage cp.async ring, and keeps the running
// softmax max/sum and the output accumulator in registers; the score tile
// never leaves registers. Each warp owns kBlockM / kNWarps query rows.
//
// Shared tiles are row-major [rows][head_dim] with the 16-byte chunks of each
// row XOR-swizzled by (row % 8): the 8 row addresses of every ldmatrix phase
// then fall in 8 different bank groups, so loads are conflict-free.
//
// Attention is causal (the only kind a decoder layer runs), optionally through
// a sliding window (FlashAttentionParams::window): a query tile then starts
// its key loop at the first key tile any of its rows can see (FirstKeyTile)
// and masks the older keys of that boundary tile as the causal mask does the
// newer keys of the diagonal, so a tile reads at most about window + kBlockM
// keys however long the sequence. Two choices of the version ladder stay
// built in (the versions without them were removed once serving could no
// longer pick them; design record 0007):
// - Longest-first schedule: the grid enumerates (query tile, head) pairs so
//   that, within a section of heads that share L2-resident K/V, every head's
//   longest causal tile is dispatched before any shorter one
//   (longest-processing-time order); head by head, the last heads' long tiles
//   would start when the grid is nearly drained, leaving half-idle SMs. A
//   window keeps the order about right: a tile's key count grows with its
//   first query up to the window and then stays at about window + kBlockM
//   (one key tile more or less, by where the window's edge falls), so the
//   tiles dispatched first are still the longest, only no longer by much,
//   and the short ones (queries within the first window) still come last.
// - Lazy rescale: a row's running max is only raised (and the output
//   accumulator rescaled) when a new score exceeds it by more than
//   2^kRescaleSlackLog2 in exp space. Probabilities are then bounded by
//   2^kRescaleSlackLog2 instead of 1, harmless in fp32 and exact after the
//   final division, and most key tiles skip the rescale multiplies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/dtype.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/pdl.cuh"
#include "kernels/common/reduce.cuh"
#include "layerserve/kernels/attention.h"

namespace layerserve::kernels::flash {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kQInRegs_, int kMinBlocksPerSm_>
struct FlashFwdTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr bool kQInRegs = kQInRegs_;
  static constexpr int kMinBlocksPerSm = kMinBlocksPerSm_;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kNWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;   // m16 tiles per warp
  static constexpr int kNTiles = kBlockN / 8;         // n8 tiles of the score tile
  static constexpr int kDTiles = kHeadDim / 8;        // n8 tiles of the output
  static constexpr int kKSteps = kHeadDim / 16;       // k16 steps of Q K^T
  static constexpr int kPSteps = kBlockN / 16;        // k16 steps of P V
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr int kStages = 2;
  static constexpr int kSmemElems = kBlockM * kHeadDim + 2 * kStages * kBlockN * kHeadDim;

  static_assert(kBlockM % kNWarps == 0 && kRowsPerWarp % 16 == 0, "each warp owns whole m16 tiles");
  static_assert(kBlockN % 16 == 0, "P V steps over 16 keys at a time");
  static_assert(kHeadDim % 64 == 0, "the swizzle permutes 8 chunks of 16 bytes per row");
  static_assert((kBlockM * kChunksPerRow) % kThreads == 0, "Q tile loads split evenly");
  static_assert((kBlockN * kChunksPerRow) % kThreads == 0, "K/V tile loads split evenly");
  static_assert(kDTiles % 2 == 0 && kNTiles % 2 == 0, "ldmatrix.x4 feeds two n8 tiles");
};

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled tile.
template <int kHeadDim>
__device__ __forceinline__ int SwizzledOffset(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// Starts the async copy of a kRows x kHeadDim tile. Rows at or past
// `valid_rows` are zero-filled rather than read, so a tile overhanging the
// end of a sequence reads nothing out of bounds and feeds no garbage (NaN
// bytes included) into the matrix products.
template <typename Traits, int kRows, typename T>
__device__ __forceinline__ void LoadTileAsync(T* smem, const T* gmem, int64_t row_stride, int valid_rows, int tid) {
  constexpr int kIters = kRows * Traits::kChunksPerRow / Traits::kThreads;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int idx = i * Traits::kThreads + tid;
    const int row = idx / Traits::kChunksPerRow;
    const int chunk = idx % Traits::kChunksPerRow;
    const bool valid = row < valid_rows;
    const T* src = valid ? gmem + row * row_stride + chunk * 8 : gmem;
    CpAsync16(smem + SwizzledOffset<Traits::kHeadDim>(row, chunk), src, valid);
  }
}

// A fragment of Q for m-tile `mt`, k-step `kk` of this warp, from shared memory.
template <typename Traits, typename T>
__device__ __forceinline__ void LoadQFragment(uint32_t (&a)[4], const T* sQ, int warp_row0, int mt, int kk, int lane) {
  const int row = warp_row0 + mt * 16 + (lane & 15);
  const int chunk = kk * 2 + (lane >> 4);
  LdMatrixX4(a, sQ + SwizzledOffset<Traits::kHeadDim>(row, chunk));
}

// Probabilities may reach 2^kRescaleSlackLog2 with the lazy rescale (see top).
inline constexpr float kRescaleSlackLog2 = 8.f;

// The first key tile (of kBlockN keys) that a query tile starting at row `m0`
// reads. Its first row has the oldest window, keys from m0 - window + 1 on;
// every tile wholly below that is invisible to all the tile's rows and is
// skipped. Without a window (0) every tile from the first is read. E.g.
// kBlockN 64, window 100, m0 256: keys 157.. are visible, so tiles from 2
// (keys 128..191) are read, and keys 128..156 of that tile are masked.
template <int kBlockN>
__device__ __forceinline__ int FirstKeyTile(int m0, int window) {
  return window > 0 && m0 >= window ? (m0 - window + 1) / kBlockN : 0;
}

// Whether query `row` must not see `key` of a sequence of `seqlen` tokens:
// past the end, after the query (causal), or `window` or more keys before it.
__device__ __forceinline__ bool KeyMasked(int row, int key, int seqlen, int window) {
  return key >= seqlen || key > row || (window > 0 && row - key >= window);
}

// Whether any score of keys [key0, key0 + kBlockN) for queries [row_first,
// row_last] is masked (KeyMasked): only tiles that overhang the sequence end,
// reach past the first query (the diagonal) or start below the last query's
// window need the per-score mask.
template <int kBlockN>
__device__ __forceinline__ bool TileNeedsMask(int key0, int row_first, int row_last, int seqlen, int window) {
  return key0 + kBlockN > seqlen || key0 + kBlockN - 1 > row_first || (window > 0 && row_last - key0 >= window);
}

// `heads_per_section` divides p.num_heads; the grid is (query tiles x heads,
// sequences).
template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    FlashFwdKernel(const FlashAttentionParams p, const int heads_per_section) {
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kMTiles = Traits::kMTiles;
  constexpr int kNTiles = Traits::kNTiles;
  constexpr int kDTiles = Traits::kDTiles;
  constexpr int kKSteps = Traits::kKSteps;
  constexpr int kPSteps = Traits::kPSteps;
  AllowDependentLaunch();  // o_proj may start streaming its weights

  // Sections of heads run one after another; inside one, rank r covers query
  // tile (last - r) of every head in the section, so the longest causal tiles
  // of all its heads start first and the grid ends on short ones. Adjacent
  // blocks are adjacent heads: GQA heads sharing K/V run together.
  const int m_blocks = (p.max_seqlen + kBlockM - 1) / kBlockM;
  const int section_blocks = m_blocks * heads_per_section;
  const int section = blockIdx.x / section_blocks;
  const int in_section = blockIdx.x - section * section_blocks;
  const int rank = in_section / heads_per_section;
  const int m_block = m_blocks - 1 - rank;
  const int head = section * heads_per_section + (in_section - rank * heads_per_section);
  const int seq = blockIdx.y;
  const int seq_start = p.cu_seqlens[seq];
  const int seqlen = p.cu_seqlens[seq + 1] - seq_start;
  const int m0 = m_block * kBlockM;
  if (m0 >= seqlen) return;

  // Keys [n_start, n_end) in n_tiles tiles: causal ends them at the tile's
  // last query, a window starts them at FirstKeyTile. k and v point at key
  // n_start, the first one read; kv_rows of the sequence's keys lie from there.
  const int n_end = min(seqlen, m0 + kBlockM);
  const int n_start = FirstKeyTile<kBlockN>(m0, p.window) * kBlockN;
  const int n_tiles = (n_end - n_start + kBlockN - 1) / kBlockN;
  const int kv_rows = seqlen - n_start;

  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const T* q = static_cast<const T*>(p.q) + (seq_start + m0) * p.q_row_stride + head * kHeadDim;
  const T* k = static_cast<const T*>(p.k) + (seq_start + n_start) * p.k_row_stride + kv_head * kHeadDim;
  const T* v = static_cast<const T*>(p.v) + (seq_start + n_start) * p.v_row_stride + kv_head * kHeadDim;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + kBlockM * kHeadDim;                    // [kStages][kBlockN][kHeadDim]
  T* sV = sK + Traits::kStages * kBlockN * kHeadDim;  // [kStages][kBlockN][kHeadDim]

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int warp_row0 = warp * Traits::kRowsPerWarp;
  const int quad_row = lane >> 2;       // g in the fragment layouts
  const int quad_col = (lane & 3) * 2;  // 2t

  LoadTileAsync<Traits, kBlockM>(sQ, q, p.q_row_stride, seqlen - m0, tid);
  LoadTileAsync<Traits, kBlockN>(sK, k, p.k_row_stride, kv_rows, tid);
  LoadTileAsync<Traits, kBlockN>(sV, v, p.v_row_stride, kv_rows, tid);
  CpAsyncCommit();

  float acc_o[kMTiles][kDTiles][4];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mt][dt][e] = 0.f;
  // Per query row this thread touches (rows g and g+8 of each m-tile): the
  // running max of raw scores and this thread's partial sum of exponentials
  // (the quad's partial sums are added once, at the end).
  float row_max[kMTiles][2];
  float row_sum[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  // exp(x * scale) = 2^(x * scale * log2(e)): one FFMA and one EX2 per score.
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;

  uint32_t q_regs[Traits::kQInRegs ? kMTiles : 1][Traits::kQInRegs ? kKSteps : 1][4];

  // Tile t holds keys n_start + t * kBlockN on.
  for (int t = 0; t < n_tiles; ++t) {
    const int stage = t & 1;
    if (t + 1 < n_tiles) {
      // The next tile goes into the other stage, which every warp finished
      // reading before the barrier that ended the previous iteration.
      const int n_next = (t + 1) * kBlockN;  // from key n_start
      LoadTileAsync<Traits, kBlockN>(sK + (stage ^ 1) * kBlockN * kHeadDim, k + n_next * p.k_row_stride, p.k_row_stride,
                                     kv_rows - n_next, tid);
      LoadTileAsync<Traits, kBlockN>(sV + (stage ^ 1) * kBlockN * kHeadDim, v + n_next * p.v_row_stride, p.v_row_stride,
                                     kv_rows - n_next, tid);
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();

    if constexpr (Traits::kQInRegs) {
      if (t == 0) {
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
          for (int kk = 0; kk < kKSteps; ++kk) LoadQFragment<Traits>(q_regs[mt][kk], sQ, warp_row0, mt, kk, lane);
      }
    }

    const T* sKs = sK + stage * kBlockN * kHeadDim;
    const T* sVs = sV + stage * kBlockN * kHeadDim;

    // S = Q K^T for this warp's rows and the tile's kBlockN keys.
    float acc_s[kMTiles][kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[mt][nt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        if constexpr (Traits::kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[mt][r] = q_regs[mt][kk][r];
        } else {
          LoadQFragment<Traits>(a[mt], sQ, warp_row0, mt, kk, lane);
        }
      }
#pragma unroll
      for (int np = 0; np < kNTiles / 2; ++np) {
        // Keys np*16 .. np*16+15: registers 0,1 are B for n-tile 2np (k low,
        // k high), registers 2,3 for n-tile 2np+1.
        uint32_t b[4];
        const int row = np * 16 + (lane & 7) + ((lane >> 4) << 3);
        const int chunk = kk * 2 + ((lane >> 3) & 1);
        LdMatrixX4(b, sKs + SwizzledOffset<kHeadDim>(row, chunk));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          MmaM16N8K16<T>(acc_s[mt][2 * np], a[mt], b[0], b[1]);
          MmaM16N8K16<T>(acc_s[mt][2 * np + 1], a[mt], b[2], b[3]);
        }
      }
    }

    // Mask keys past the sequence end, after the query or below its window.
    // Only the tiles on the diagonal, the sequence boundary or the window's
    // edge need it. A row may see no key of a tile (below its window, or
    // after it), even of the first tile it reads: its scores are all -inf,
    // which the online softmax below carries through as "nothing seen yet".
    const int n0 = n_start + t * kBlockN;
    if (TileNeedsMask<kBlockN>(n0, m0, m0 + kBlockM - 1, seqlen, p.window)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = m0 + warp_row0 + mt * 16 + quad_row + ((e >> 1) << 3);
            const int key = n0 + nt * 8 + quad_col + (e & 1);
            if (KeyMasked(row, key, seqlen, p.window)) acc_s[mt][nt][e] = -INFINITY;
          }
    }

    // Online softmax: rescale what was accumulated by 2^(old max - new max)
    // and turn the scores into unnormalized probabilities.
    float tile_max[kMTiles][2];
    bool raise = false;
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max[mt][h];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) mx = fmaxf(mx, fmaxf(acc_s[mt][nt][2 * h], acc_s[mt][nt][2 * h + 1]));
        tile_max[mt][h] = QuadReduceMax(mx);
        // The first finite score always raises (-inf to finite is +inf);
        // a row still fully masked compares NaN and does not.
        raise |= (tile_max[mt][h] - row_max[mt][h]) * scale_log2 > kRescaleSlackLog2;
      }
    // Warp-uniform, so the rescale is skipped as one branch; when any row
    // needs it every row of the warp moves to its exact max.
    if (__any_sync(0xffffffffu, raise)) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float mx = tile_max[mt][h];
          const float max_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
          const float correction = FastExp2(row_max[mt][h] * scale_log2 - max_scaled);
          row_max[mt][h] = mx;
          row_sum[mt][h] *= correction;
#pragma unroll
          for (int dt = 0; dt < kDTiles; ++dt) {
            acc_o[mt][dt][2 * h] *= correction;
            acc_o[mt][dt][2 * h + 1] *= correction;
          }
        }
    }
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float max_scaled = row_max[mt][h] == -INFINITY ? 0.f : row_max[mt][h] * scale_log2;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            const float prob = FastExp2(acc_s[mt][nt][e] * scale_log2 - max_scaled);
            acc_s[mt][nt][e] = prob;
            row_sum[mt][h] += prob;
          }
      }

      // O += P V, with P rounded to T straight from the score accumulators
      // (the C layout of two adjacent n8 tiles is the A layout of one k16 step).
#pragma unroll
    for (int ks = 0; ks < kPSteps; ++ks) {
      uint32_t a[kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        a[mt][0] = PackPair<T>(acc_s[mt][2 * ks][0], acc_s[mt][2 * ks][1]);
        a[mt][1] = PackPair<T>(acc_s[mt][2 * ks][2], acc_s[mt][2 * ks][3]);
        a[mt][2] = PackPair<T>(acc_s[mt][2 * ks + 1][0], acc_s[mt][2 * ks + 1][1]);
        a[mt][3] = PackPair<T>(acc_s[mt][2 * ks + 1][2], acc_s[mt][2 * ks + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDTiles / 2; ++dp) {
        // Keys ks*16 .. +15, dims dp*16 .. +15, transposed into B fragments:
        // registers 0,1 for d-tile 2dp (keys low, keys high), 2,3 for 2dp+1.
        uint32_t b[4];
        const int row = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
        const int chunk = dp * 2 + (lane >> 4);
        LdMatrixX4Trans(b, sVs + SwizzledOffset<kHeadDim>(row, chunk));
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
          MmaM16N8K16<T>(acc_o[mt][2 * dp], a[mt], b[0], b[1]);
          MmaM16N8K16<T>(acc_o[mt][2 * dp + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }

  // Normalize and store this warp's rows; rows past the sequence end belong to
  // the next sequence (or past the buffer) and are not written.
  T* out = static_cast<T*>(p.out) + (seq_start + m0) * p.out_row_stride + head * kHeadDim;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = QuadReduceSum(row_sum[mt][h]);
      const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
      const int row = warp_row0 + mt * 16 + quad_row + 8 * h;
      if (m0 + row < seqlen) {
        T* out_row = out + row * p.out_row_stride;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          *reinterpret_cast<uint32_t*>(out_row + dt * 8 + quad_col) =
              PackPair<T>(acc_o[mt][dt][2 * h] * inv_sum, acc_o[mt][dt][2 * h + 1] * inv_sum);
        }
      }
    }
}

}  // namespace layerserve::kernels::flash
