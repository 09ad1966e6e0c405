// GEMM tuning at model load (see gemm_tuning.h): cache file, autotune pass,
// pins, and the log of the resulting table.
#include "server/cuda/gemm_tuning.h"

#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <ostream>
#include <sstream>
#include <system_error>
#include <tuple>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/cuda/cuda_resources.h"
#include "base/status_macros.h"
#include "nlohmann/json.hpp"

namespace layerserve::cuda {
namespace {

using kernels::GemmTuneResult;

// 2: the gate/up shape is timed with its gated epilogue ("gated" entries).
// 3: FP8 weights' shapes are timed as FP8 products ("precision" fp8-row or
// fp8-block).
// 4: o's and down's shapes are timed adding onto their output ("accumulate").
constexpr char kCacheFormat[] = "layerserve-gemm-tune-4";

// A dense call of `shape` at m tokens, as serving makes it, for asking the
// router where such a call goes: Route never dereferences, so an aligned
// placeholder address stands in for the operands and scales. A block-scaled
// FP8 one carries cuBLASLt's scales unless it is gated (an FP8 gate/up's
// 64-row interleave puts gate and up rows in one 128-row block).
kernels::GemmParams RouteProbe(int64_t m, const TunedShape& shape) {
  kernels::GemmParams p;
  void* const placeholder = reinterpret_cast<void*>(uintptr_t{256});
  p.a = p.w = p.d = placeholder;
  p.lda = p.ldw = shape.k;
  p.m = m;
  p.n = shape.n;
  p.k = shape.k;
  p.dtype = kernels::DType::kBF16;
  p.silu_mul = shape.gated;
  p.accumulate = shape.accumulate;
  p.ldd = p.out_cols();
  if (shape.gated) p.scratch = placeholder;
  p.fp8 = shape.fp8;
  if (shape.fp8 != kernels::Fp8Scaling::kNone) {
    p.a_scale = p.w_scale = static_cast<const float*>(placeholder);
    if (shape.fp8 == kernels::Fp8Scaling::kBlock && !shape.gated) p.w_scale_128 = p.w_scale;
  }
  return p;
}

// GemmPrecisionName's inverse.
std::optional<kernels::Fp8Scaling> ParsePrecision(std::string_view name) {
  for (const auto s :
       {kernels::Fp8Scaling::kNone, kernels::Fp8Scaling::kPerRow, kernels::Fp8Scaling::kBlock}) {
    if (name == GemmPrecisionName(s)) return s;
  }
  return std::nullopt;
}

absl::Status PinError(absl::string_view entry, absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--gemm-override entry '", entry, "': ", why,
                   " (expected M:NxK[/fp8]=CONFIG, e.g. 16:6144x4096=v4s2)"));
}

bool ParsePositive(absl::string_view text, int64_t* out) {
  return absl::SimpleAtoi(text, out) && *out > 0;
}

// The cache's results for `shape` if they cover every bucket up to
// `last_bucket`, else nothing.
std::vector<GemmTuneResult> CachedFor(const std::vector<GemmTuneResult>& cached,
                                      const TunedShape& shape, int last_bucket) {
  std::map<int, GemmTuneResult> by_bucket;
  for (const GemmTuneResult& r : cached) {
    if (r.n == shape.n && r.k == shape.k && r.gated == shape.gated && r.fp8 == shape.fp8 &&
        r.accumulate == shape.accumulate && r.bucket <= last_bucket) {
      by_bucket[r.bucket] = r;
    }
  }
  if (static_cast<int>(by_bucket.size()) != last_bucket + 1) return {};
  std::vector<GemmTuneResult> out;
  for (const auto& [bucket, r] : by_bucket) out.push_back(r);
  return out;
}

absl::StatusOr<std::vector<GemmTuneResult>> ReadCache(const std::string& path,
                                                      const std::string& key, std::ostream& log) {
  std::ifstream in(path);
  if (!in) {
    log << "gemm: no tuning cache at " << path << " yet" << std::endl;
    return std::vector<GemmTuneResult>{};
  }
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<GemmTuneCache> cache = ParseGemmTuneCache(text.str());
  if (!cache.ok()) {
    log << "gemm: ignoring tuning cache " << path << ": " << cache.status().message() << std::endl;
    return std::vector<GemmTuneResult>{};
  }
  if (cache->device_key != key) {
    log << "gemm: tuning cache " << path << " is for '" << cache->device_key << "', not '" << key
        << "'; tuning again" << std::endl;
    return std::vector<GemmTuneResult>{};
  }
  return cache->results;
}

absl::Status WriteCache(const std::string& path, const GemmTuneCache& cache) {
  // Per process, so two servers starting together never share a temp file.
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(temp, std::ios::trunc);
    out << SerializeGemmTuneCache(cache);
    if (!out.flush()) {
      return absl::FailedPreconditionError(
          absl::StrCat("gemm: cannot write the tuning cache '", temp, "'"));
    }
  }
  std::error_code error;
  std::filesystem::rename(temp, path, error);
  if (error) {
    return absl::FailedPreconditionError(
        absl::StrCat("gemm: cannot rename '", temp, "' to '", path, "': ", error.message()));
  }
  return absl::OkStatus();
}

// "m<=8 v4s4 1.06x": the bucket, its choice, and cuBLASLt's time over the
// choice's (how much faster the choice measured; 1.00x when it is cuBLASLt).
std::string DescribeResult(const GemmTuneResult& r) {
  std::string text = absl::StrCat("m<=", kernels::GemmMBucketUpperBound(r.bucket), " ",
                                  kernels::GemmConfigSpec(r.chosen));
  if (r.chosen_us > 0 && r.cublaslt_us > 0) {
    absl::StrAppend(&text, absl::StrFormat(" %.2fx", r.cublaslt_us / r.chosen_us));
  }
  return text;
}

}  // namespace

absl::StatusOr<std::vector<GemmPin>> ParseGemmPins(std::string_view text) {
  std::vector<GemmPin> pins;
  if (text.empty()) return pins;
  for (const absl::string_view entry : absl::StrSplit(ToAbsl(text), ',')) {
    const std::vector<absl::string_view> lhs_rhs = absl::StrSplit(entry, '=');
    if (lhs_rhs.size() != 2) return PinError(entry, "no single '='");
    const std::vector<absl::string_view> m_shape = absl::StrSplit(lhs_rhs[0], ':');
    if (m_shape.size() != 2) return PinError(entry, "no single ':'");
    absl::string_view dims = m_shape[1];
    GemmPin pin;
    pin.fp8 = absl::ConsumeSuffix(&dims, "/fp8");
    const std::vector<absl::string_view> n_k = absl::StrSplit(dims, 'x');
    if (n_k.size() != 2 || !ParsePositive(m_shape[0], &pin.m) || !ParsePositive(n_k[0], &pin.n) ||
        !ParsePositive(n_k[1], &pin.k)) {
      return PinError(entry, "M, N and K must be positive integers");
    }
    absl::StatusOr<kernels::GemmConfig> config =
        kernels::ParseGemmConfigSpec(std::string_view(lhs_rhs[1].data(), lhs_rhs[1].size()));
    if (!config.ok()) return PinError(entry, config.status().message());
    pin.config = *config;
    if (pin.config.version == kernels::GemmVersion::kFp8) pin.fp8 = true;
    if (pin.fp8 && pin.config.version != kernels::GemmVersion::kFp8 &&
        pin.config.version != kernels::GemmVersion::kCublasLt) {
      return PinError(entry, "an FP8 weight runs v0 (cuBLASLt's FP8) or v6");
    }
    pins.push_back(pin);
  }
  return pins;
}

std::string FormatGemmPin(const GemmPin& pin) {
  return absl::StrCat(pin.m, ":", pin.n, "x", pin.k, pin.fp8 ? "/fp8" : "", "=",
                      kernels::GemmConfigSpec(pin.config));
}

std::string SerializeGemmTuneCache(const GemmTuneCache& cache) {
  nlohmann::json entries = nlohmann::json::array();
  for (const GemmTuneResult& r : cache.results) {
    entries.push_back({{"n", r.n},
                       {"k", r.k},
                       {"m_max", kernels::GemmMBucketUpperBound(r.bucket)},
                       {"m_timed", r.m_timed},
                       {"gated", r.gated},
                       {"accumulate", r.accumulate},
                       {"precision", GemmPrecisionName(r.fp8)},
                       {"config", kernels::GemmConfigSpec(r.chosen)},
                       {"us", r.chosen_us},
                       {"cublaslt_us", r.cublaslt_us}});
  }
  const nlohmann::json doc = {
      {"format", kCacheFormat}, {"device_key", cache.device_key}, {"entries", entries}};
  return doc.dump(1) + "\n";
}

absl::StatusOr<GemmTuneCache> ParseGemmTuneCache(std::string_view json) {
  const nlohmann::json doc = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return absl::InvalidArgumentError("gemm tuning cache: not a JSON object");
  }
  if (doc.value("format", "") != kCacheFormat) {
    return absl::InvalidArgumentError(
        absl::StrCat("gemm tuning cache: format is not '", kCacheFormat, "'"));
  }
  const auto key = doc.find("device_key");
  const auto entries = doc.find("entries");
  if (key == doc.end() || !key->is_string() || entries == doc.end() || !entries->is_array()) {
    return absl::InvalidArgumentError("gemm tuning cache: needs device_key and entries");
  }
  GemmTuneCache cache;
  cache.device_key = key->get<std::string>();
  for (const nlohmann::json& e : *entries) {
    const auto number = [&e](const char* name) -> const nlohmann::json* {
      const auto it = e.find(name);
      return it != e.end() && it->is_number() ? &*it : nullptr;
    };
    const nlohmann::json* n = number("n");
    const nlohmann::json* k = number("k");
    const nlohmann::json* m_max = number("m_max");
    const auto config = e.find("config");
    if (n == nullptr || k == nullptr || m_max == nullptr || config == e.end() ||
        !config->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat("gemm tuning cache: bad entry ", e.dump()));
    }
    GemmTuneResult r;
    r.n = n->get<int64_t>();
    r.k = k->get<int64_t>();
    r.bucket = kernels::GemmMBucket(m_max->get<int64_t>());
    if (r.n <= 0 || r.k <= 0 || kernels::GemmMBucketUpperBound(r.bucket) != m_max->get<int64_t>()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemm tuning cache: entry ", e.dump(), " is not an M bucket of this build"));
    }
    absl::StatusOr<kernels::GemmConfig> chosen =
        kernels::ParseGemmConfigSpec(config->get<std::string>());
    if (!chosen.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("gemm tuning cache: ", chosen.status().message()));
    }
    r.chosen = *chosen;
    if (const auto gated = e.find("gated"); gated != e.end() && gated->is_boolean()) {
      r.gated = gated->get<bool>();
    }
    if (const auto accumulate = e.find("accumulate");
        accumulate != e.end() && accumulate->is_boolean()) {
      r.accumulate = accumulate->get<bool>();
    }
    if (const auto precision = e.find("precision"); precision != e.end()) {
      const std::optional<kernels::Fp8Scaling> scaling =
          precision->is_string() ? ParsePrecision(precision->get<std::string>()) : std::nullopt;
      if (!scaling) {
        return absl::InvalidArgumentError(
            absl::StrCat("gemm tuning cache: bad precision in ", e.dump()));
      }
      r.fp8 = *scaling;
    }
    if (const nlohmann::json* v = number("m_timed")) r.m_timed = v->get<int64_t>();
    if (const nlohmann::json* v = number("us")) r.chosen_us = v->get<float>();
    if (const nlohmann::json* v = number("cublaslt_us")) r.cublaslt_us = v->get<float>();
    cache.results.push_back(r);
  }
  return cache;
}

absl::StatusOr<std::string> CurrentDeviceKey(std::string_view build) {
  int device = 0, driver = 0, runtime = 0;
  LS_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  cudaDeviceProp props{};
  LS_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&props, device));
  LS_CUDA_RETURN_IF_ERROR(cudaDriverGetVersion(&driver));
  LS_CUDA_RETURN_IF_ERROR(cudaRuntimeGetVersion(&runtime));
  return absl::StrCat(props.name, "; sm_", props.major, props.minor, "; ",
                      props.multiProcessorCount, " SMs; driver ", driver, "; runtime ", runtime,
                      "; cublasLt ", kernels::CublasLtVersion(), "; layerserve ", ToAbsl(build));
}

std::vector<TunedShape> TunedShapesFor(const LayerShape& shape, const LayerDeviceWeights& layer) {
  if (shape.dtype != kernels::DType::kBF16) return {};  // our GEMM kernels take bf16 only
  // o and down add onto the residual stream (a shared expert's down too).
  std::vector<TunedShape> shapes = {
      {shape.qkv_width(), shape.hidden, false, layer.qkv_fp8.scaling},
      {shape.hidden, shape.q_width(), false, layer.o_fp8.scaling, /*accumulate=*/true}};
  // Experts run grouped GEMMs, which the table does not route; their
  // router's logits are a plain bf16 product.
  if (shape.experts > 0) shapes.push_back({shape.router_rows(), shape.hidden});
  if (shape.experts == 0) {
    shapes.push_back({2 * shape.intermediate, shape.hidden, true, layer.gate_up_fp8.scaling});
    shapes.push_back(
        {shape.hidden, shape.intermediate, false, layer.down_fp8.scaling, /*accumulate=*/true});
  }
  // A shared expert is a dense MLP of its own width.
  if (shape.shared_intermediate > 0) {
    shapes.push_back(
        {2 * shape.shared_intermediate, shape.hidden, true, layer.shared_gate_up_fp8.scaling});
    shapes.push_back({shape.hidden, shape.shared_intermediate, false, layer.shared_down_fp8.scaling,
                      /*accumulate=*/true});
  }
  return shapes;
}

std::string GemmPrecisionName(kernels::Fp8Scaling fp8) {
  return fp8 == kernels::Fp8Scaling::kNone
             ? "bf16"
             : absl::StrCat("fp8-", ToAbsl(kernels::Fp8ScalingName(fp8)));
}

std::string TunedShapeName(const TunedShape& shape) {
  return absl::StrCat(
      shape.n, "x", shape.k, shape.gated ? " gated" : "", shape.accumulate ? " accumulating" : "",
      shape.fp8 != kernels::Fp8Scaling::kNone ? " " + GemmPrecisionName(shape.fp8) : "");
}

std::vector<GemmRoute> GemmRoutes(const kernels::GemmRouter& router,
                                  const std::vector<TunedShape>& shapes, int64_t max_m) {
  std::vector<GemmRoute> routes;
  std::vector<std::tuple<int64_t, int64_t, bool, kernels::Fp8Scaling, bool>> seen;
  for (const TunedShape& shape : shapes) {
    const auto key = std::make_tuple(shape.n, shape.k, shape.gated, shape.fp8, shape.accumulate);
    if (std::find(seen.begin(), seen.end(), key) != seen.end()) continue;  // one entry routes both
    seen.push_back(key);
    for (int b = 0; b <= kernels::GemmMBucket(max_m); ++b) {
      const int64_t m = kernels::GemmMBucketUpperBound(b);
      routes.push_back({shape, m, kernels::GemmConfigSpec(router.Route(RouteProbe(m, shape)))});
    }
  }
  return routes;
}

absl::Status TuneGemmRouter(kernels::GemmRouter& router, const std::vector<TunedShape>& shapes,
                            int64_t max_m, const GemmTuningOptions& options, std::ostream& log) {
  if (!router.custom_kernels_enabled() || router.mode() != kernels::GemmMode::kAuto) {
    return absl::OkStatus();
  }
  LS_ASSIGN_OR_RETURN(const std::string key, CurrentDeviceKey(options.build));
  std::vector<GemmTuneResult> cached;
  if (!options.cache_path.empty()) {
    LS_ASSIGN_OR_RETURN(cached, ReadCache(options.cache_path, key, log));
  }
  const int last_bucket = kernels::GemmMBucket(max_m);
  CudaStream stream;       // created on the first shape that needs timing
  DeviceBuffer workspace;  // likewise: cuBLASLt's, for its timed runs
  bool tuned_any = false;
  // Entries for the cache file: everything read (other models' shapes
  // included) with this pass's results replacing those of their shape.
  using MergeKey = std::tuple<int64_t, int64_t, bool, kernels::Fp8Scaling, bool, int>;
  std::map<MergeKey, GemmTuneResult> merged;
  const auto merge_key = [](const GemmTuneResult& r) {
    return MergeKey{r.n, r.k, r.gated, r.fp8, r.accumulate, r.bucket};
  };
  for (const GemmTuneResult& r : cached) merged[merge_key(r)] = r;

  for (const TunedShape& tuned : shapes) {
    const int64_t n = tuned.n, k = tuned.k;
    std::vector<GemmTuneResult> results = CachedFor(cached, tuned, last_bucket);
    std::string source = "from the cache";
    if (results.empty() && options.autotune) {
      if (stream.get() == nullptr) {
        LS_ASSIGN_OR_RETURN(stream, CreateStream());
        LS_ASSIGN_OR_RETURN(workspace, DeviceBuffer::Allocate(router.workspace_bytes()));
      }
      const auto start = std::chrono::steady_clock::now();
      LS_ASSIGN_OR_RETURN(
          results, router.Autotune(n, k, max_m, {workspace.data(), workspace.bytes()}, stream.get(),
                                   tuned.gated, tuned.fp8, tuned.accumulate));
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      source = absl::StrFormat("autotuned in %.1f s", seconds);
      tuned_any = true;
      for (const GemmTuneResult& r : results) merged[merge_key(r)] = r;
    } else if (results.empty()) {
      source = "defaults, autotune off";
    } else {
      for (const GemmTuneResult& r : results) {
        router.SetChoice(kernels::GemmMBucketUpperBound(r.bucket), n, k, r.chosen, tuned.fp8);
      }
    }
    std::string line = absl::StrCat("gemm ", TunedShapeName(tuned), " (", source, "):");
    for (const GemmTuneResult& r : results) absl::StrAppend(&line, " ", DescribeResult(r));
    if (results.empty()) {
      for (const GemmRoute& route : GemmRoutes(router, {tuned}, max_m)) {
        absl::StrAppend(&line, " m<=", route.m_max, " ", route.config);
      }
    }
    log << line << std::endl;
  }
  if (tuned_any && !options.cache_path.empty()) {
    GemmTuneCache cache{key, {}};
    for (const auto& [where, r] : merged) cache.results.push_back(r);
    LS_RETURN_IF_ERROR(WriteCache(options.cache_path, cache));
    log << "gemm: tuning written to " << options.cache_path << std::endl;
  }
  for (const GemmPin& pin : options.pins) {
    if (pin.fp8) {
      for (const auto scaling : {kernels::Fp8Scaling::kPerRow, kernels::Fp8Scaling::kBlock}) {
        router.SetChoice(pin.m, pin.n, pin.k, pin.config, scaling);
      }
    } else {
      router.SetChoice(pin.m, pin.n, pin.k, pin.config);
    }
    log << "gemm: pinned " << FormatGemmPin(pin) << std::endl;
  }
  if (!shapes.empty()) {
    log << "gemm: (the figure after each choice is cuBLASLt's time over the "
           "choice's; pin a bucket with --gemm-override=M:NxK=CONFIG)"
        << std::endl;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<kernels::GemmRouter>> MakeGemmRouter(
    kernels::GemmMode mode, const std::vector<TunedShape>& shapes, int64_t max_m,
    const GemmTuningOptions& options, std::ostream& log) {
  LS_ASSIGN_OR_RETURN(
      std::unique_ptr<kernels::GemmRouter> router,
      kernels::GemmRouter::Create(mode, kernels::GemmRouter::kDefaultWorkspaceBytes));
  if (mode != kernels::GemmMode::kCublasLt && !router->custom_kernels_enabled()) {
    const kernels::DeviceInfo& dev = router->device();
    log << "gemm: mode " << kernels::GemmModeName(mode)
        << ": our GEMM kernels are unavailable (they need a compute capability 9.0 device and an "
           "sm_90a build; this is "
        << dev.cc_major << "." << dev.cc_minor << ", "
        << (kernels::GemmBuiltWithSm90a() ? "with" : "without")
        << " sm_90a); every GEMM runs on cuBLASLt" << std::endl;
  }
  LS_RETURN_IF_ERROR(TuneGemmRouter(*router, shapes, max_m, options, log));
  return router;
}

}  // namespace layerserve::cuda
