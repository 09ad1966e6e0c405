// GEMM tuning at model load: which kernel serves each projection shape.
//
// The kernel library's GemmRouter keeps a table (M bucket, N, K) ->
// configuration and can fill it by timing every candidate against cuBLASLt
// (Autotune). This file creates the backend's router and decides, once at
// start-up, where that table comes from, in this order:
//   1. a cache file (--gemm-tune-cache) written by an earlier start on the
//      same device, driver and layerserve version: no timing at all;
//   2. an autotune pass for the shapes the cache lacks (--gemm-autotune,
//      on by default; about a second per shape on an H100), whose results
//      are then written back to the cache file;
//   3. pins from --gemm-override, which replace any tuned or cached choice;
// and logs the resulting table, one line per shape, in the same spelling the
// override flag takes, so a line can be pasted back to pin a choice.
//
// The cache is JSON (readable, editable: an edited choice is used as is).
// It is keyed by everything that changes the timings: device name, compute
// capability, SM count, driver and runtime versions, and the layerserve
// version; a file for another key is ignored and rewritten. Writes go to a
// temporary file renamed over the old one, so a crash never leaves half a
// cache behind, and servers starting together each leave a whole file.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "layerserve/kernels/gemm.h"
#include "server/cuda/layer_executor.h"

namespace layerserve::cuda {

// One --gemm-override entry: the bucket of `m` for (n, k) runs `config`, for
// bf16 weights or, with `fp8`, for FP8 ones (of either scaling).
struct GemmPin {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  bool fp8 = false;
  kernels::GemmConfig config;
};

// "M:NxK[/fp8]=SPEC[,...]", e.g. "16:6144x4096=v4s2,4096:4096x14336/fp8=v0";
// SPEC as kernels::ParseGemmConfigSpec reads it; "/fp8" pins an FP8 weight's
// route (v0 its cuBLASLt FP8, v6 the project's), and a v6 SPEC implies it.
// Empty text: no pins.
absl::StatusOr<std::vector<GemmPin>> ParseGemmPins(std::string_view text);
std::string FormatGemmPin(const GemmPin& pin);

// What a tuning pass measured on one device.
struct GemmTuneCache {
  std::string device_key;
  std::vector<kernels::GemmTuneResult> results;
};

std::string SerializeGemmTuneCache(const GemmTuneCache& cache);
// INVALID_ARGUMENT for text that is not a cache this version wrote (or an
// edit of one with a bad configuration spelling).
absl::StatusOr<GemmTuneCache> ParseGemmTuneCache(std::string_view json);

// The device key of the current CUDA device; `build` names this binary (the
// layerserve version).
absl::StatusOr<std::string> CurrentDeviceKey(std::string_view build);

struct GemmTuningOptions {
  bool autotune = true;
  std::string cache_path;  // empty: no cache
  std::string build;       // goes into the device key
  std::vector<GemmPin> pins;
};

// One (n, k) projection shape a model runs, as the tuning times it: `gated`
// for the MLP's gate/up projection, which runs with its SiLU gate
// (GemmParams::silu_mul) and is timed so; `fp8` for an FP8 weight of that
// scaling. The router's table is keyed by (n, k) and the precision: a model
// whose gate/up shape equals another of its projections of the same
// precision gets one of the two timings for both (a choice slower for one of
// them, never a wrong result).
struct TunedShape {
  int64_t n = 0;
  int64_t k = 0;
  bool gated = false;
  kernels::Fp8Scaling fp8 = kernels::Fp8Scaling::kNone;
  bool accumulate = false;  // adds onto the residual stream (o, down)
};
// The shapes of `shape`'s layers that the table routes, each at the
// precision `layer`'s linear has (FP8 where its Fp8Linear says so, else
// bf16): none for fp16 (our kernels take bf16), and no MLP shapes for a
// mixture of experts (its grouped GEMMs are not tuned).
std::vector<TunedShape> TunedShapesFor(const LayerShape& shape, const LayerDeviceWeights& layer);
// "bf16", "fp8-row", "fp8-block": a weight's precision as the log and
// /metrics name it.
std::string GemmPrecisionName(kernels::Fp8Scaling fp8);
// "6144x4096", "28672x4096 gated fp8-block": a tuned shape as the log names it
// (a bf16 one without its precision).
std::string TunedShapeName(const TunedShape& shape);

// Fills the auto-mode `router`'s table for the `shapes` a model runs
// at up to `max_m` tokens, as the header comment says, logging to `log`
// (whole lines, no prefix: the CUDA backend passes a LogStream); does
// nothing in the other modes or where our kernels are not enabled. Returns an
// error only for a failed tuning pass or an unwritable cache path; an
// unreadable or stale cache is logged and replaced.
absl::Status TuneGemmRouter(kernels::GemmRouter& router, const std::vector<TunedShape>& shapes,
                            int64_t max_m, const GemmTuningOptions& options, std::ostream& log);

// What `router` runs for each of `shapes` in each M bucket up to `max_m`
// (the table TuneGemmRouter logs, and /metrics exports).
struct GemmRoute {
  TunedShape shape;
  int64_t m_max = 0;   // the bucket's upper bound
  std::string config;  // kernels::GemmConfigSpec of the route
};
std::vector<GemmRoute> GemmRoutes(const kernels::GemmRouter& router,
                                  const std::vector<TunedShape>& shapes, int64_t max_m);

// The router for the current device in `mode`, tuned as TuneGemmRouter says
// (the CUDA backend's and layer_bench's one way to get one). Logs one line
// when `mode` wants our kernels and they cannot run here.
absl::StatusOr<std::unique_ptr<kernels::GemmRouter>> MakeGemmRouter(
    kernels::GemmMode mode, const std::vector<TunedShape>& shapes, int64_t max_m,
    const GemmTuningOptions& options, std::ostream& log);

}  // namespace layerserve::cuda
