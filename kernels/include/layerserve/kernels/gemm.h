// The projection GEMM of a decoder layer, and the one path every caller takes
// to it: D[m, n] = A[m, k] · W[n, k]ᵀ (+ bias[n]) (+ D when accumulating),
// row-major (W is the nn.Linear weight as stored), bf16 or fp16 in and out,
// fp32 accumulation. M is the number of batched tokens; N, K are model
// dimensions.
//
// Serving, the tests and the benchmarks all go through GemmRouter: Run()
// chooses per call (ChooseGemm: a pure function of the call, the mode, the
// tuned table and the DeviceInfo) between cuBLASLt (version 0) and the
// project's Hopper kernels (versions 3-5), and RunConfig() runs one given
// version on the same launch code, which is how tests and benchmarks compare
// versions. LaunchGemm is the kernels' own launcher underneath.
//
// Numbered versions (design record 0007): only versions serving can choose
// are built; v1 (mma.sync, pre-Hopper GPUs, where serving uses cuBLASLt) and
// v2 (TMA + wgmma without warp specialization, superseded by v3) were
// removed after commit 92d9569.
//
// FP8 (W8A8) products (GemmParams::fp8) take version 6, the project's FP8
// kernel, or cuBLASLt's FP8 (version 0 on an FP8 product: per-row scales as
// its outer-vector scaling, block-128 ones as its 128-element activation and
// 128x128 weight blocks) where the tuned table or the cuBLASLt mode says so
// and cuBLASLt takes the call (CublasLtTakesFp8). The table keys FP8 and
// bf16 entries apart (GemmTableKey).
//
// In-place accumulation (D += A·Wᵀ): our kernels round A·Wᵀ + D once. The
// cuBLASLt path lets C alias D (beta = 1); cuBLASLt 13.0 was seen to round
// A·Wᵀ to the output type before that add at small M (design record 0010),
// i.e. what an unfused `x + linear(a)` computes. Copying D aside on every
// call would cost an extra read and write of D (about a tenth of o_proj's
// time at M = 8192), so the router accepts the double rounding and the tests
// allow it on the cuBLASLt path.
//
// cuBLASLt is column-major. A row-major [m, k] matrix is the same memory as a
// column-major [k, m] one, so the router computes Dᵀ[n, m] = W[n, k] · Aᵀ[k,
// m] with W read as a column-major [k, n] matrix transposed (the "TN" form the
// tensor-core kernels prefer) and A as column-major [k, m]; the bias epilogue
// then adds bias[i] to row i of Dᵀ, i.e. to output feature i.
//
// Plain C++ header: compiles without nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layerserve/kernels/common.h"

namespace layerserve::kernels {

// How an FP8 product's codes are scaled (GemmParams::fp8). kNone: not an FP8
// product (a and w are dtype).
enum class Fp8Scaling {
  kNone,
  // One scale per row of A (per token: dynamic, or a static per-tensor scale
  // repeated) and one per row of W (per channel, or a per-tensor scale
  // repeated): y[m, n] = (sum_k a[m, k] w[n, k]) a_scale[m] w_scale[n].
  kPerRow,
  // Block-128 (transformers' fine-grained FP8): scales change every
  // kFp8BlockK columns of K, so each K block's partial sum is scaled as it is
  // added: y[m, n] = sum_kb (sum_{k in kb} a[m, k] w[n, k])
  //   a_scale[kb m + m] w_scale[(n / kFp8WeightScaleRows) kblocks + kb],
  // kblocks = ceil(k / kFp8BlockK); a_scale is token-contiguous per K block
  // (the layout LaunchQuantizeFp8 writes), and w_scale holds one scale per
  // 64 rows (a checkpoint's 128-row block scale repeated twice, so that q, k
  // and v, or gate and up, can be stacked at 64-row boundaries).
  kBlock,
};
// "bf16" (kNone), "row", "block": as logs, the tuning cache and benchmarks
// name a product's precision.
std::string_view Fp8ScalingName(Fp8Scaling scaling);
inline constexpr int64_t kFp8BlockK = 128;
inline constexpr int64_t kFp8WeightScaleRows = 64;
// Columns of GemmParams::w_scale_128: K blocks padded to a multiple of 4.
constexpr int64_t kFp8CublasLtScaleCols(int64_t k) { return ((k + kFp8BlockK - 1) / kFp8BlockK + 3) / 4 * 4; }
// The FP8 kernel's gate/up interleave (GemmParams::silu_mul on an FP8
// product): blocks of 64 gate rows then the matching 64 up rows, so that one
// 128-row tile holds both halves of 64 outputs and a block-128 scale never
// straddles them. (The bf16 kernels interleave by kGateUpBlock, layer_ops.h.)
inline constexpr int64_t kFp8GateUpBlock = 64;
constexpr int64_t Fp8GateUpRow(int64_t i, bool up) {
  return (i / kFp8GateUpBlock) * 2 * kFp8GateUpBlock + (up ? kFp8GateUpBlock : 0) + i % kFp8GateUpBlock;
}

struct GemmParams {
  const void* a = nullptr;  // activations [m, k], row stride lda (elements)
  int64_t lda = 0;
  const void* w = nullptr;  // weights [n, k], row stride ldw
  int64_t ldw = 0;
  void* d = nullptr;  // output [m, n], row stride ldd
  int64_t ldd = 0;
  const void* bias = nullptr;  // [n] or null
  // D += A · Wᵀ, reading D in place (beta = 1): fuses a residual add.
  bool accumulate = false;
  int64_t m = 0;  // rows of A and D (tokens)
  int64_t n = 0;  // output features
  int64_t k = 0;  // input features
  DType dtype = DType::kBF16;
  // A grouped product (a mixture of experts' projections) when group_offsets
  // is set: group g multiplies A's rows [group_offsets[g], group_offsets[g +
  // 1]) by W_g, rows [g n, (g + 1) n) of w (the groups' weights stacked, [groups,
  // n, k]), into the same rows of D; m counts all of A's rows. The offsets
  // (groups + 1 of them, device memory) are written by a kernel earlier on
  // the stream, the expert routing, so the host knows only m and a bound on
  // any one group's rows, max_group_rows. Only our kernels take grouped
  // products (v4 for max_group_rows <= 64, else v3; v6 for FP8 ones); groups
  // with no rows read none of their weights.
  const int32_t* group_offsets = nullptr;
  int groups = 0;
  int64_t max_group_rows = 0;
  // The MLP's gated activation as the epilogue: w is a gate/up weight whose
  // rows are interleaved as GateUpRow (layer_ops.h) says, n = 2 x the
  // intermediate width, and D receives silu(gate) * up, [m, n / 2] (ldd
  // counts its columns), rounded as LaunchSiluMul rounds. Our kernels (v3, v4)
  // apply it to the fp32 accumulators, so the [m, n] product is never
  // written; v5 gives way to v3. The cuBLASLt route writes that product to
  // `scratch` ([m, n], dense, dtype) and then runs LaunchSiluMul. Takes
  // neither bias nor accumulate; n is a multiple of 16.
  bool silu_mul = false;
  void* scratch = nullptr;
  // An FP8 product (Fp8Scaling): a and w hold float8_e4m3fn codes, one byte
  // each (lda, ldw count them), d is dtype (bf16), and a_scale / w_scale
  // (device fp32) are laid out as the scaling says. A bias (dense, not
  // gated) is added to the scaled fp32 sum before the output's one rounding,
  // by version 6 only (cuBLASLt's FP8 route does not take it);
  // silu_mul interleaves w by kFp8GateUpBlock; n, k multiples of 16. A
  // grouped FP8 product stacks the groups' scales as it stacks W (w_scale
  // holds groups x one group's layout) and indexes a_scale by A's row over
  // all m rows (LaunchQuantizeFp8's layout of the whole A).
  Fp8Scaling fp8 = Fp8Scaling::kNone;
  const float* a_scale = nullptr;
  const float* w_scale = nullptr;
  // cuBLASLt's copy of a kBlock weight's scales (its 128x128 block layout):
  // [ceil(n / 128)][kFp8CublasLtScaleCols(k)], the checkpoint's 128-row
  // blocks with each row of K blocks padded to a multiple of 4. Only the
  // cuBLASLt route reads it, and takes a kBlock call only where it is set:
  // null where two 64-row halves of one 128-row block carry different scales
  // (stacked parts of 64-row multiples, the gate/up interleave).
  const float* w_scale_128 = nullptr;
  int64_t out_cols() const { return silu_mul ? n / 2 : n; }
  bool grouped() const { return group_offsets != nullptr; }
};

// The most groups one grouped product takes (the persistent kernel keeps
// their tile counts in shared memory).
inline constexpr int kMaxGemmGroups = 256;

// Numbered kernel versions; the benchmark, the tests and docs/log/gemm.md
// use the same numbers (design record 0007).
enum class GemmVersion : int {
  kCublasLt = 0,          // cuBLASLt, through the router's plan cache
  kWarpSpecialized = 3,   // producer warpgroup + 2 consumer warpgroups, 128x256 or 128x128 tiles (sm_90a)
  kSmallMSplitK = 4,      // M <= 64: weight streaming, split-K reduced in a cluster, tokens as wgmma N (sm_90a)
  kClusterMulticast = 5,  // v3 in 2-CTA clusters along M sharing each W tile by TMA multicast (sm_90a)
  kFp8 = 6,               // FP8 W8A8: W rows as wgmma M, token tiles of 8-128 as N, split-K in a cluster (sm_90a)
};

struct GemmConfig {
  GemmVersion version = GemmVersion::kWarpSpecialized;
  // Versions 4 and 6 (its M <= 64 kernel): K splits, 1..8 (one thread block
  // cluster per W tile);
  // 0 picks from the shape and the SM count.
  int split_k = 0;
  // Version 3 only: tile width 128 or 256; 0 picks from the shape.
  int block_n = 0;
  // Versions 3 and 6, grouped products only: tile height 64 or 128; 0 picks
  // from the rows per group. (Version 6: 64 runs the decode kernel in token
  // tiles of up to 64, 128 the prefill kernel.) Not part of the spec
  // strings: grouped products are never tuned or pinned.
  int block_m = 0;
  // Version 0 only: which of cuBLASLt's heuristic answers runs, by its rank
  // among the answers for the M bucket's timed size (GemmTuneResult::m_timed;
  // 0: the first answer for the call's own M, cuBLASLt's default). Autotune
  // times the first kCublasLtTunedAnswers (gemm_heuristics.h).
  int cublaslt_answer = 0;
};

std::string GemmConfigName(const GemmConfig& config);

// Short spelling of a configuration, as flags, the benchmark and the autotune
// cache write it: "v0" (cuBLASLt), "v0a1".."v0a7" (its heuristic's answer of
// that rank), "v3", "v3b128", "v3b256", "v4", "v4s1".."v4s8", "v5", "v6",
// "v6s1".."v6s8". ParseGemmConfigSpec is its inverse (INVALID_ARGUMENT for
// anything else); the leading "v" is optional there.
std::string GemmConfigSpec(const GemmConfig& config);
// The loaded cuBLASLt's version (cublasLtGetVersion): a tuned table's
// cuBLASLt answers (GemmConfig::cublaslt_answer) hold for it only.
size_t CublasLtVersion();
absl::StatusOr<GemmConfig> ParseGemmConfigSpec(std::string_view spec);

// Which implementation the calls our kernels can take run on.
enum class GemmMode {
  // Per (M bucket, N, K), the router's table (tuned at load for the model's
  // shapes, read from a cache, or pinned); untuned shapes get the built-in
  // defaults (v4 for M <= 16, cuBLASLt above). The serving default.
  kAuto,
  // cuBLASLt for every call: the reference path, and the way back should one
  // of our kernels misbehave on some device.
  kCublasLt,
  // Ours wherever they run (v4 for M <= 64, v3 above), even where slower: for
  // validating and profiling them inside the real server.
  kCustom,
};

// "auto", "cublaslt", "custom": the names a --gemm flag takes.
std::string_view GemmModeName(GemmMode mode);
// INVALID_ARGUMENT for any other name.
absl::StatusOr<GemmMode> ParseGemmMode(std::string_view name);

// M buckets of the tuned table: 1-8, 9-16, 17-32, 33-64, then powers of two
// up to 8192, then everything larger (upper bound 16384).
inline constexpr std::array<int64_t, 12> kGemmBucketUpper = {8,   16,   32,   64,   128,  256,
                                                             512, 1024, 2048, 4096, 8192, 16384};
int GemmMBucket(int64_t m);
int64_t GemmMBucketUpperBound(int bucket);

// (M bucket, N, K, FP8 scaling) -> configuration: what autotune measured or a
// pin says. The scaling (kNone for a bf16 product) keeps an FP8 weight's
// choice apart from a bf16 one of the same shape.
using GemmTableKey = std::tuple<int, int64_t, int64_t, Fp8Scaling>;
using GemmTable = std::map<GemmTableKey, GemmConfig>;

// True if this library was built with sm_90a device code (wgmma, setmaxnreg).
bool GemmBuiltWithSm90a();

// OK if our version `config` can run `p` on `dev` with this build, else why
// not: UNIMPLEMENTED for a missing architecture or feature (not a CC 9.0
// device, no sm_90a code), INVALID_ARGUMENT for what the version does not
// take (dtype other than bf16, a bias but on v6, strided operands, N or K not a multiple
// of 8, operands not 16-byte aligned, M > 64 for v4, silu_mul on v5, bad options). Pure: reads
// neither the device nor the operands.
absl::Status GemmSupported(const GemmParams& p, const GemmConfig& config, const DeviceInfo& dev);

// Whether cuBLASLt's FP8 takes the FP8 product `p` (pure): not grouped, no
// bias, bf16 out, n and k multiples of 16, a gated product with its scratch, and a
// kBlock one with w_scale_128 and m a multiple of 4 (cuBLASLt 13.1 answers
// NOT_SUPPORTED for its 128-element activation blocks at any other m, even
// with each K block's scales 16-byte aligned; such calls take v6).
bool CublasLtTakesFp8(const GemmParams& p);

// The route of one call; pure, as above. A grouped product always takes ours
// (v4 for max_group_rows <= 64, else v3, v6 for FP8: cuBLASLt has no form for
// it), and fails where they cannot run. An FP8 product takes v6 unless
// cuBLASLt takes it (CublasLtTakesFp8) and `mode` is kCublasLt or kAuto's
// table entry says v0; a table entry of v6 gives its split count. A bf16
// product takes cuBLASLt wherever ours do not take the call or `mode` is
// kCublasLt; kCustom: v4 for M <= 64, else v3; kAuto: `table`'s entry for the
// call's bucket, else v4 for M <= 16 (where it matched or beat cuBLASLt on
// every Llama-3-8B shape on the H100), else cuBLASLt. A silu_mul call routed
// to v5 runs v3 instead (v5 stores its tiles through TMA, with no gated form;
// v3 is the same kernel without the multicast).
GemmConfig ChooseGemm(const GemmParams& p, GemmMode mode, const GemmTable& table, const DeviceInfo& dev);

// Launches our version `config` (3..5) on `stream`, after GemmSupported.
absl::Status LaunchGemm(const GemmParams& p, const GemmConfig& config, const DeviceInfo& dev, cudaStream_t stream);

// One M bucket's autotune outcome for (n, k): the configuration chosen and
// the measured time of it and of cuBLASLt (microseconds per launch, launches
// back to back) at m_timed, the bucket's largest M (capped at 8192).
struct GemmTuneResult {
  int bucket = 0;
  int64_t m_timed = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool gated = false;                  // timed as the gate/up projection (Autotune's `gated`)
  Fp8Scaling fp8 = Fp8Scaling::kNone;  // timed as an FP8 product (Autotune's `fp8`)
  bool accumulate = false;             // timed adding onto its output (Autotune's `accumulate`)
  GemmConfig chosen;
  float chosen_us = 0;
  float cublaslt_us = 0;
};

// Scratch memory a GEMM may use (cuBLASLt's workspace); one per stream, never
// shared by two streams at once.
struct GemmWorkspace {
  void* data = nullptr;
  size_t bytes = 0;
};

// Chooses and runs every GEMM. Threading: Run and RunConfig may be called
// from several threads at once, each with its own stream and workspace
// (cuBLASLt plans are cached per shape under a mutex; a cached plan is
// immutable). The table is filled before serving (Autotune, SetChoice, both
// not thread-safe against Run) and read-only after.
class GemmRouter {
 public:
  // 32 MiB is what cuBLASLt's Hopper kernels ask for at most.
  static constexpr size_t kDefaultWorkspaceBytes = size_t{32} << 20;

  // For the current device; `workspace_bytes`: the size of the workspace every
  // call will pass. Where `mode` wants our kernels but they cannot run here
  // (not a CC 9.0 device, no sm_90a code), every call goes to cuBLASLt and
  // custom_kernels_enabled() is false: that is not an error.
  static absl::StatusOr<std::unique_ptr<GemmRouter>> Create(GemmMode mode = GemmMode::kAuto,
                                                            size_t workspace_bytes = kDefaultWorkspaceBytes);
  ~GemmRouter();
  GemmRouter(const GemmRouter&) = delete;
  GemmRouter& operator=(const GemmRouter&) = delete;

  // Enqueues the product on `stream` on the route Route() names; nothing
  // synchronizes. INVALID_ARGUMENT for bad shapes, null pointers or a
  // too-small workspace; INTERNAL when cuBLASLt or a launch fails.
  absl::Status Run(const GemmParams& p, const GemmWorkspace& workspace, cudaStream_t stream);
  // Runs `config` (version 0: cuBLASLt) whatever the route says; for tests,
  // benchmarks and autotune. Our versions must be GemmSupported.
  absl::Status RunConfig(const GemmParams& p, const GemmConfig& config, const GemmWorkspace& workspace,
                         cudaStream_t stream);
  // What Run runs for a valid `p`.
  GemmConfig Route(const GemmParams& p) const;

  // Times every candidate (cuBLASLt, v3 at both tile widths, v4 at 1/2/4/8
  // splits for M <= 64, v5 for M > 64) for each M bucket up to max_m on
  // synthetic random bf16 data of shape (bucket's largest M capped at 8192,
  // n, k), launches back to back in a CUDA graph with W rotating through
  // enough copies to miss in L2, and keeps the fastest in the table. Call at
  // start-up: it allocates, and synchronizes `stream`. Where our kernels are
  // not enabled, nothing is timed and the result is empty. `gated` times the
  // calls as the MLP's gate/up projection runs them (silu_mul: the gate in
  // our epilogues, a second kernel after cuBLASLt), which is what that
  // shape's table entries then route. `fp8` times the shape as an FP8
  // product of that scaling instead (e4m3 codes of random data, quantized
  // as serving quantizes them): cuBLASLt's FP8 where it takes the call, and
  // v6 with its own split count and, for M <= 64, 1/2/4/8 splits.
  // `accumulate` times the calls adding onto their output, as a layer's o
  // and down projections add onto the residual stream: the residual's read
  // costs our epilogues more than cuBLASLt's (10-20% of v3's and v5's time
  // at 8192 tokens on the H200), so a choice timed without it can be wrong.
  absl::StatusOr<std::vector<GemmTuneResult>> Autotune(int64_t n, int64_t k, int64_t max_m,
                                                       const GemmWorkspace& workspace, cudaStream_t stream,
                                                       bool gated = false, Fp8Scaling fp8 = Fp8Scaling::kNone,
                                                       bool accumulate = false);
  // Pins the configuration of m's bucket for (n, k) and the precision `fp8`
  // (kNone: bf16), replacing any tuned one.
  void SetChoice(int64_t m, int64_t n, int64_t k, const GemmConfig& config, Fp8Scaling fp8 = Fp8Scaling::kNone);
  const GemmTable& table() const { return table_; }
  // The row tile of every grouped product versions 3 and 6 run (GemmConfig::
  // block_m; 0, the default, picks per call). For benchmarks' A/B; like
  // SetChoice, not thread-safe against Run.
  void SetGroupedBlockM(int block_m) { grouped_block_m_ = block_m; }

  GemmMode mode() const { return mode_; }
  const DeviceInfo& device() const { return device_; }
  // False where every call goes to cuBLASLt (mode kCublasLt, or our kernels
  // unavailable on this device or build).
  bool custom_kernels_enabled() const { return custom_kernels_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  // Distinct shapes cuBLASLt planned so far (for tests and logs).
  size_t CachedPlans() const;

 private:
  struct CublasLt;
  GemmRouter(GemmMode mode, DeviceInfo device, bool custom_kernels, size_t workspace_bytes,
             std::unique_ptr<CublasLt> cublaslt);
  // The number of cuBLASLt heuristic answers for `p` that Autotune times
  // (kCublasLtTunedAnswers at most; 0 where cuBLASLt does not take it).
  absl::StatusOr<int> CublasLtAnswers(const GemmParams& p);
  // `answer`: GemmConfig::cublaslt_answer.
  absl::Status RunCublasLt(const GemmParams& p, int answer, const GemmWorkspace& workspace, cudaStream_t stream);
  absl::Status RunCublasLtFp8(const GemmParams& p, int answer, const GemmWorkspace& workspace,
                              cudaStream_t stream);  // not gated

  const GemmMode mode_;
  const DeviceInfo device_;
  const bool custom_kernels_;
  const size_t workspace_bytes_;
  const std::unique_ptr<CublasLt> cublaslt_;
  GemmTable table_;
  int grouped_block_m_ = 0;
};

}  // namespace layerserve::kernels
