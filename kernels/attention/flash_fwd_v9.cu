// Flash-attention forward, version 9: short sequences on CUDA cores, one warp
// per query row and head.
//
// Why: the tiled versions give every sequence at least one query tile per
// head (v8: 128 rows, two warpgroups and a TMA pipeline), however short the
// sequence. A batch of stateless one-token requests, the server's commonest
// small batch, is num_seqs x heads such tiles with one valid row each, a
// fifth to a third of a whole 4-layer batch's time (design record 0006).
// Here the work is what the
// rows need: a warp holds its query row in registers (head_dim / 32 elements
// a lane), walks its sequence's visible keys (causal, through the window),
// and keeps an online softmax in fp32. With one key the output is exactly V
// (weight 2^0 = 1, sum 1). It is a kernel of short sequences only: a warp's
// keys go one after another, so at 8 x 32 tokens it already took 2.8x v7's
// time, and the default takes it up to kFlashV9DefaultMaxSeqlen.
//
// Launch: a CTA of kWarps warps per (row slot, group of kWarps query heads),
// row slots = num_seqs x max_seqlen (a slot past its sequence's end exits).
// Consecutive query heads share a KV head under GQA, so a CTA's warps read
// the same K/V rows (from L1 after the first). Launched as a programmatic
// dependent of RoPE: it lets o_proj be scheduled at entry and waits for its
// inputs before reading them.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "base/cuda/cuda_status.h"
#include "kernels/attention/flash_attention_versions.h"
#include "kernels/common/dtype.cuh"
#include "kernels/common/mma_sm80.cuh"
#include "kernels/common/pdl.cuh"

namespace layerserve::kernels::flash {
namespace {

constexpr int kWarps = 4;

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kWarps * 32) ShortSeqAttentionKernel(const FlashAttentionParams p) {
  constexpr int kPerLane = kHeadDim / 32;  // 2 or 4 elements
  using V = Vec<T, kPerLane>;
  AllowDependentLaunch();  // o_proj may start streaming its weights
  WaitForPrerequisiteGrids();
  const int s = static_cast<int>(blockIdx.x) / p.max_seqlen;
  const int row = static_cast<int>(blockIdx.x) % p.max_seqlen;
  const int begin = p.cu_seqlens[s];
  if (begin + row >= p.cu_seqlens[s + 1]) return;
  const int head = static_cast<int>(blockIdx.y) * kWarps + static_cast<int>(threadIdx.x) / 32;
  if (head >= p.num_heads) return;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int kv_head = head / (p.num_heads / p.num_kv_heads);
  const int64_t token = begin + row;

  const V qv = *reinterpret_cast<const V*>(static_cast<const T*>(p.q) + token * p.q_row_stride +
                                           int64_t{head} * kHeadDim + lane * kPerLane);
  float q[kPerLane];
  for (int e = 0; e < kPerLane; ++e) q[e] = ToFloat(qv.v[e]);
  // Rounded where the tiled versions and the paged attention round, so that
  // a sequence gives the same output whichever kernel its batch takes (a
  // session's steps are checked against one stateless request): scores in
  // fp32, exponentials in base 2 of the scaled scores, each probability
  // rounded to T for its product with V (the tensor cores' operand there),
  // the sum of the unrounded ones.
  const float scale_log2 = p.softmax_scale * 1.4426950408889634f;

  // Keys row - window + 1 .. row of the sequence (all of 0..row without a
  // window), oldest first.
  const int first = p.window > 0 && row - p.window + 1 > 0 ? row - p.window + 1 : 0;
  float m = -INFINITY, l = 0.f, acc[kPerLane] = {};
  const T* k_head = static_cast<const T*>(p.k) + int64_t{kv_head} * kHeadDim + lane * kPerLane;
  const T* v_head = static_cast<const T*>(p.v) + int64_t{kv_head} * kHeadDim + lane * kPerLane;
  for (int j = first; j <= row; ++j) {
    const V kv = *reinterpret_cast<const V*>(k_head + (begin + j) * p.k_row_stride);
    const V vv = *reinterpret_cast<const V*>(v_head + (begin + j) * p.v_row_stride);
    float score = 0.f;
    for (int e = 0; e < kPerLane; ++e) score += q[e] * ToFloat(kv.v[e]);
    for (int offset = 16; offset > 0; offset /= 2) score += __shfl_xor_sync(0xffffffffu, score, offset);
    const float m_new = fmaxf(m, score);
    const float base = m_new * scale_log2;
    const float rescale = FastExp2(m * scale_log2 - base);  // 0 for the first key (m = -inf)
    const float weight = FastExp2(score * scale_log2 - base);
    l = l * rescale + weight;
    const float rounded = RoundTo<T>(weight);
    for (int e = 0; e < kPerLane; ++e) acc[e] = acc[e] * rescale + rounded * ToFloat(vv.v[e]);
    m = m_new;
  }
  V out;
  const float inv_l = 1.f / l;
  for (int e = 0; e < kPerLane; ++e) out.v[e] = FromFloat<T>(acc[e] * inv_l);
  *reinterpret_cast<V*>(static_cast<T*>(p.out) + token * p.out_row_stride + int64_t{head} * kHeadDim +
                        lane * kPerLane) = out;
}

template <typename T, int kHeadDim>
absl::Status Launch(const FlashAttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(int64_t{p.num_seqs} * p.max_seqlen),
                  static_cast<unsigned>((p.num_heads + kWarps - 1) / kWarps));
  LS_CUDA_RETURN_IF_ERROR(LaunchDependent(ShortSeqAttentionKernel<T, kHeadDim>, grid, dim3(kWarps * 32), 0, stream, p));
  return absl::OkStatus();
}

}  // namespace

absl::Status FlashFwdV9Available(const FlashAttentionParams& p) {
  if (p.max_seqlen > kFlashV9MaxSeqlen) {
    return absl::UnimplementedError(absl::StrCat("flash attention v9: sequences of at most ", kFlashV9MaxSeqlen,
                                                 " tokens (max_seqlen ", p.max_seqlen, ")"));
  }
  return absl::OkStatus();
}

absl::Status RunFlashFwdV9(const FlashAttentionParams& p, cudaStream_t stream) {
  if (absl::Status s = FlashFwdV9Available(p); !s.ok()) return s;
  const bool bf16 = p.dtype == DType::kBF16;
  if (p.head_dim == 128) return bf16 ? Launch<__nv_bfloat16, 128>(p, stream) : Launch<__half, 128>(p, stream);
  return bf16 ? Launch<__nv_bfloat16, 64>(p, stream) : Launch<__half, 64>(p, stream);
}

}  // namespace layerserve::kernels::flash
