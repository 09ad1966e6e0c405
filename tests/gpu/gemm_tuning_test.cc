// GEMM routing and tuning: the configuration spellings, M buckets, the route
// rule (ChooseGemm, a pure function checked on hand-made devices),
// --gemm-override parsing and the cache file format run anywhere, GPU or not;
// the tuning pass itself (autotune, cache written and read back, stale cache,
// pins over tuned choices) needs the H100 and skips visibly elsewhere.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "layerserve/kernels/gemm.h"
#include "server/cuda/gemm_tuning.h"
#include "tests/gpu/gpu_test_util.h"

namespace layerserve::cuda {
namespace {

using kernels::Fp8Scaling;
using kernels::GemmConfig;
using kernels::GemmMode;
using kernels::GemmParams;
using kernels::GemmRouter;
using kernels::GemmTuneResult;
using kernels::GemmVersion;

TEST(GemmConfigSpecTest, EverySpellingRoundTrips) {
  for (const char* spec : {"v0", "v0a1", "v0a7", "v3", "v3b128", "v3b256", "v4", "v4s1", "v4s2", "v4s4", "v4s8", "v5",
                           "v6", "v6s1", "v6s4"}) {
    const absl::StatusOr<GemmConfig> config = kernels::ParseGemmConfigSpec(spec);
    ASSERT_TRUE(config.ok()) << spec << ": " << config.status();
    EXPECT_EQ(kernels::GemmConfigSpec(*config), spec);
  }
  const absl::StatusOr<GemmConfig> bare = kernels::ParseGemmConfigSpec("4s2");
  ASSERT_TRUE(bare.ok());
  EXPECT_EQ(bare->version, GemmVersion::kSmallMSplitK);
  EXPECT_EQ(bare->split_k, 2);
}

TEST(GemmConfigSpecTest, OthersAreRejected) {
  for (const char* spec :
       {"",     "v",    "v1",     "v2",    "v7",   "v6b128",        "v6s9",   "x3",   "v3b64", "v3b",  "v3s2",
        "v4s0", "v4s9", "v4b128", "v4s2x", "v0s1", "v3b1280000000", "v5b256", "v5s2", "v0a0",  "v0a8", "v3a1"}) {
    EXPECT_EQ(kernels::ParseGemmConfigSpec(spec).status().code(), absl::StatusCode::kInvalidArgument)
        << "'" << spec << "'";
  }
}

TEST(GemmPinsTest, ParsesAListAndFormatsItBack) {
  const absl::StatusOr<std::vector<GemmPin>> pins =
      ParseGemmPins("16:6144x4096=v4s2,4096:4096x14336=v0,300:4096x4096=3b128");
  ASSERT_TRUE(pins.ok()) << pins.status();
  ASSERT_EQ(pins->size(), 3u);
  EXPECT_EQ((*pins)[0].m, 16);
  EXPECT_EQ((*pins)[0].n, 6144);
  EXPECT_EQ((*pins)[0].k, 4096);
  EXPECT_EQ((*pins)[0].config.split_k, 2);
  EXPECT_EQ((*pins)[1].config.version, GemmVersion::kCublasLt);
  EXPECT_EQ(FormatGemmPin((*pins)[2]), "300:4096x4096=v3b128");
  const absl::StatusOr<std::vector<GemmPin>> none = ParseGemmPins("");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

// "/fp8" pins an FP8 weight's route; a v6 spec is FP8 whether it says so or not.
TEST(GemmPinsTest, Fp8PinsNameTheirPrecision) {
  const absl::StatusOr<std::vector<GemmPin>> pins =
      ParseGemmPins("2048:4096x14336/fp8=v0,16:6144x4096=v6s2,16:6144x4096=v0");
  ASSERT_TRUE(pins.ok()) << pins.status();
  ASSERT_EQ(pins->size(), 3u);
  EXPECT_TRUE((*pins)[0].fp8);
  EXPECT_EQ((*pins)[0].config.version, GemmVersion::kCublasLt);
  EXPECT_EQ(FormatGemmPin((*pins)[0]), "2048:4096x14336/fp8=v0");
  EXPECT_TRUE((*pins)[1].fp8);
  EXPECT_EQ(FormatGemmPin((*pins)[1]), "16:6144x4096/fp8=v6s2");
  EXPECT_FALSE((*pins)[2].fp8);
  for (const char* text : {"16:64x64/fp8=v3", "16:64x64/fp8=v4s2", "16:64x64/fp9=v0", "16:64x64/fp8/fp8=v0"}) {
    EXPECT_EQ(ParseGemmPins(text).status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

TEST(GemmPinsTest, BadEntriesNameThemselves) {
  for (const char* text : {"16:6144x4096", "16=v0", "0:64x64=v0", "16:64x0=v0", "a:64x64=v0", "16:64x64x2=v0",
                           "16:64x64=v9", "16:64x64=v0,", "16:64x64=v0=v3"}) {
    const absl::StatusOr<std::vector<GemmPin>> pins = ParseGemmPins(text);
    EXPECT_EQ(pins.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_NE(std::string(pins.status().message()).find("--gemm-override"), std::string::npos) << pins.status();
  }
}

GemmTuneResult Result(int bucket, int64_t n, int64_t k, GemmConfig config, float us, float v0_us) {
  GemmTuneResult r;
  r.bucket = bucket;
  r.m_timed = kernels::GemmMBucketUpperBound(bucket);
  r.n = n;
  r.k = k;
  r.chosen = config;
  r.chosen_us = us;
  r.cublaslt_us = v0_us;
  return r;
}

TEST(GemmTuneCacheTest, RoundTrips) {
  GemmTuneCache cache;
  cache.device_key = "NVIDIA H100 80GB HBM3; sm_90; 132 SMs; driver 13000; runtime 13000; layerserve 0.1";
  cache.results = {Result(0, 6144, 4096, {GemmVersion::kSmallMSplitK, 4, 0}, 11.5f, 12.25f),
                   Result(11, 4096, 14336, {GemmVersion::kWarpSpecialized, 0, 128}, 900.f, 880.f),
                   Result(5, 4096, 4096, {GemmVersion::kCublasLt, 0, 0}, 20.f, 20.f),
                   Result(4, 28672, 4096, {GemmVersion::kWarpSpecialized, 0, 256}, 91.f, 94.f)};
  cache.results.back().gated = true;
  cache.results.push_back(Result(9, 4096, 14336, {GemmVersion::kCublasLt, 0, 0}, 300.f, 300.f));
  cache.results.back().fp8 = Fp8Scaling::kBlock;
  cache.results.push_back(Result(0, 28672, 4096, {GemmVersion::kFp8, 2, 0}, 40.f, 60.f));
  cache.results.back().fp8 = Fp8Scaling::kPerRow;
  cache.results.back().gated = true;
  cache.results.push_back(Result(7, 4096, 4096, {GemmVersion::kClusterMulticast, 0, 0}, 50.f, 52.f));
  cache.results.back().accumulate = true;
  const absl::StatusOr<GemmTuneCache> back = ParseGemmTuneCache(SerializeGemmTuneCache(cache));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->device_key, cache.device_key);
  ASSERT_EQ(back->results.size(), cache.results.size());
  for (size_t i = 0; i < cache.results.size(); ++i) {
    const GemmTuneResult& a = cache.results[i];
    const GemmTuneResult& b = back->results[i];
    EXPECT_EQ(b.bucket, a.bucket);
    EXPECT_EQ(b.m_timed, a.m_timed);
    EXPECT_EQ(b.n, a.n);
    EXPECT_EQ(b.k, a.k);
    EXPECT_EQ(b.gated, a.gated);
    EXPECT_EQ(b.fp8, a.fp8);
    EXPECT_EQ(b.accumulate, a.accumulate);
    EXPECT_EQ(kernels::GemmConfigSpec(b.chosen), kernels::GemmConfigSpec(a.chosen));
    EXPECT_FLOAT_EQ(b.chosen_us, a.chosen_us);
    EXPECT_FLOAT_EQ(b.cublaslt_us, a.cublaslt_us);
  }
}

TEST(GemmTuneCacheTest, RejectsWhatItDidNotWrite) {
  const std::string good_entry = R"({"n":64,"k":64,"m_max":8,"config":"v4s2"})";
  const auto doc = [](const std::string& entry) {
    return R"({"format":"layerserve-gemm-tune-4","device_key":"d","entries":[)" + entry + "]}";
  };
  ASSERT_TRUE(ParseGemmTuneCache(doc(good_entry)).ok());
  for (const std::string& text :
       {std::string("not json"), std::string("[]"), std::string(R"({"format":"other","device_key":"d","entries":[]})"),
        std::string(R"({"format":"layerserve-gemm-tune-4","entries":[]})"),
        // The format before FP8 entries: it timed FP8 weights' shapes as bf16.
        std::string(R"({"format":"layerserve-gemm-tune-2","device_key":"d","entries":[]})"),
        doc(R"({"n":64,"k":64,"m_max":8,"config":"v0","precision":"fp8-tensor"})"),
        doc(R"({"n":64,"k":64,"m_max":8,"config":"v0","precision":1})"),
        // The format before gated entries: its gate/up timings are of the plain product.
        std::string(R"({"format":"layerserve-gemm-tune-1","device_key":"d","entries":[]})"),
        doc(R"({"n":64,"k":64,"m_max":100,"config":"v0"})"),  // 100 bounds no bucket
        doc(R"({"n":64,"k":64,"m_max":8,"config":"v7"})"), doc(R"({"n":0,"k":64,"m_max":8,"config":"v0"})"),
        doc(R"({"n":64,"m_max":8,"config":"v0"})")}) {
    EXPECT_EQ(ParseGemmTuneCache(text).status().code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// A dense bf16 call of shape (m, n, k); the route never dereferences, so an
// aligned placeholder address stands in for the operands.
GemmParams Dense(int64_t m, int64_t n, int64_t k) {
  GemmParams p;
  p.a = p.w = p.d = reinterpret_cast<void*>(uintptr_t{256});
  p.lda = p.ldw = k;
  p.ldd = n;
  p.m = m;
  p.n = n;
  p.k = k;
  return p;
}

kernels::DeviceInfo H100() {
  kernels::DeviceInfo dev;
  dev.cc_major = 9;
  dev.num_sms = 132;
  dev.max_smem_optin = 227 * 1024;
  dev.l2_bytes = 50 << 20;
  return dev;
}

TEST(GemmBucketsTest, CoverAllM) {
  EXPECT_EQ(kernels::GemmMBucket(1), 0);
  EXPECT_EQ(kernels::GemmMBucket(8), 0);
  EXPECT_EQ(kernels::GemmMBucket(9), 1);
  EXPECT_EQ(kernels::GemmMBucket(64), 3);
  EXPECT_EQ(kernels::GemmMBucket(65), 4);
  const int last = kernels::GemmMBucket(int64_t{1} << 40);
  for (int64_t m = 1; m <= 20000; m += 7) {
    const int b = kernels::GemmMBucket(m);
    EXPECT_TRUE(m <= kernels::GemmMBucketUpperBound(b) || b == last) << m;
    if (b > 0) EXPECT_GT(m, kernels::GemmMBucketUpperBound(b - 1)) << m;
  }
}

// The route rule of every mode, worked through on a hand-made H100 and A100.
TEST(ChooseGemmTest, FollowsTheModeTheTableAndWhatOurKernelsTake) {
  const kernels::DeviceInfo h100 = H100();
  kernels::DeviceInfo a100 = h100;
  a100.cc_major = 8;
  const kernels::GemmTable none;
  const auto spec = [](const GemmConfig& c) { return kernels::GemmConfigSpec(c); };
  if (!kernels::GemmBuiltWithSm90a()) {
    // Without sm_90a code every route is cuBLASLt, even on an H100.
    EXPECT_EQ(spec(kernels::ChooseGemm(Dense(1, 4096, 4096), GemmMode::kCustom, none, h100)), "v0");
    return;
  }
  // Auto, untuned: v4 up to M = 16, then cuBLASLt.
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(1, 6144, 4096), GemmMode::kAuto, none, h100)), "v4");
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(16, 6144, 4096), GemmMode::kAuto, none, h100)), "v4");
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(17, 6144, 4096), GemmMode::kAuto, none, h100)), "v0");
  // Auto, tuned: the table's entry for the call's bucket (17..32 here).
  kernels::GemmTable tuned;
  tuned[{kernels::GemmMBucket(20), 6144, 4096, Fp8Scaling::kNone}] = GemmConfig{GemmVersion::kSmallMSplitK, 2, 0};
  tuned[{kernels::GemmMBucket(3000), 6144, 4096, Fp8Scaling::kNone}] = GemmConfig{GemmVersion::kClusterMulticast, 0, 0};
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(30, 6144, 4096), GemmMode::kAuto, tuned, h100)), "v4s2");
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(3000, 6144, 4096), GemmMode::kAuto, tuned, h100)), "v5");
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(3000, 4096, 4096), GemmMode::kAuto, tuned, h100)), "v0");
  // Custom: v4 up to M = 64, v3 above.
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(64, 4096, 4096), GemmMode::kCustom, none, h100)), "v4");
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(65, 4096, 4096), GemmMode::kCustom, none, h100)), "v3");
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(1, 4096, 4096), GemmMode::kCublasLt, none, h100)), "v0");
  // What ours do not take goes to cuBLASLt in every mode: another device,
  // fp16, a bias, strided rows, N or K not a multiple of 8, misaligned
  // operands, and a pinned v4 at M > 64.
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(1, 4096, 4096), GemmMode::kCustom, none, a100)), "v0");
  GemmParams p = Dense(8, 4096, 4096);
  p.dtype = kernels::DType::kF16;
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kCustom, none, h100)), "v0");
  p = Dense(8, 4096, 4096);
  p.bias = p.w;
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kCustom, none, h100)), "v0");
  p = Dense(8, 4096, 4096);
  p.lda = 4104;
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kCustom, none, h100)), "v0");
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(8, 100, 4096), GemmMode::kCustom, none, h100)), "v0");
  p = Dense(8, 4096, 4096);
  p.a = reinterpret_cast<void*>(uintptr_t{264});
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kCustom, none, h100)), "v0");
  kernels::GemmTable bad_pin;
  bad_pin[{kernels::GemmMBucket(100), 4096, 4096, Fp8Scaling::kNone}] = GemmConfig{GemmVersion::kSmallMSplitK, 0, 0};
  EXPECT_EQ(spec(kernels::ChooseGemm(Dense(100, 4096, 4096), GemmMode::kAuto, bad_pin, h100)), "v0");
}

// An FP8 product (Fp8Scaling): v6, or cuBLASLt's FP8 where the mode or the
// table's FP8 entry says so and cuBLASLt takes the call.
TEST(ChooseGemmTest, Fp8TakesVersion6OrCublasLtsFp8) {
  if (!kernels::GemmBuiltWithSm90a()) GTEST_SKIP() << "no sm_90a code: FP8 does not run in this build";
  const kernels::DeviceInfo h100 = H100();
  const auto spec = [](const GemmConfig& c) { return kernels::GemmConfigSpec(c); };
  const auto fp8 = [](int64_t m, int64_t n, int64_t k, Fp8Scaling scaling) {
    GemmParams p = Dense(m, n, k);
    p.fp8 = scaling;
    p.a_scale = p.w_scale = static_cast<const float*>(p.w);
    if (scaling == Fp8Scaling::kBlock) p.w_scale_128 = p.w_scale;
    return p;
  };
  const kernels::GemmTable none;
  for (const Fp8Scaling s : {Fp8Scaling::kPerRow, Fp8Scaling::kBlock}) {
    EXPECT_EQ(spec(kernels::ChooseGemm(fp8(1, 6144, 4096, s), GemmMode::kAuto, none, h100)), "v6");
    EXPECT_EQ(spec(kernels::ChooseGemm(fp8(4096, 6144, 4096, s), GemmMode::kAuto, none, h100)), "v6");
    EXPECT_EQ(spec(kernels::ChooseGemm(fp8(4096, 6144, 4096, s), GemmMode::kCustom, none, h100)), "v6");
    EXPECT_EQ(spec(kernels::ChooseGemm(fp8(4096, 6144, 4096, s), GemmMode::kCublasLt, none, h100)), "v0");
  }
  kernels::GemmTable tuned;
  const int big = kernels::GemmMBucket(4096);
  tuned[{big, 6144, 4096, Fp8Scaling::kBlock}] = GemmConfig{GemmVersion::kCublasLt};
  tuned[{kernels::GemmMBucket(16), 6144, 4096, Fp8Scaling::kBlock}] = GemmConfig{GemmVersion::kFp8, 2, 0};
  tuned[{big, 4096, 4096, Fp8Scaling::kNone}] = GemmConfig{GemmVersion::kCublasLt};
  EXPECT_EQ(spec(kernels::ChooseGemm(fp8(4000, 6144, 4096, Fp8Scaling::kBlock), GemmMode::kAuto, tuned, h100)), "v0");
  EXPECT_EQ(spec(kernels::ChooseGemm(fp8(16, 6144, 4096, Fp8Scaling::kBlock), GemmMode::kAuto, tuned, h100)), "v6s2");
  // Entries are per precision: the per-row product and a bf16 entry of the
  // same shape say nothing to it.
  EXPECT_EQ(spec(kernels::ChooseGemm(fp8(4000, 6144, 4096, Fp8Scaling::kPerRow), GemmMode::kAuto, tuned, h100)), "v6");
  EXPECT_EQ(spec(kernels::ChooseGemm(fp8(4000, 4096, 4096, Fp8Scaling::kBlock), GemmMode::kAuto, tuned, h100)), "v6");
  // What cuBLASLt's FP8 does not take stays on v6, whatever the table or the
  // mode: a block-scaled weight without its scales, a gated call without
  // scratch, a grouped product.
  GemmParams p = fp8(4000, 6144, 4096, Fp8Scaling::kBlock);
  p.w_scale_128 = nullptr;
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kAuto, tuned, h100)), "v6");
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kCublasLt, none, h100)), "v6");
  // A block-scaled product of m not a multiple of 4, which cuBLASLt 13.1
  // does not take.
  EXPECT_EQ(spec(kernels::ChooseGemm(fp8(4001, 6144, 4096, Fp8Scaling::kBlock), GemmMode::kAuto, tuned, h100)), "v6");
  EXPECT_EQ(spec(kernels::ChooseGemm(fp8(4001, 6144, 4096, Fp8Scaling::kPerRow), GemmMode::kCublasLt, none, h100)),
            "v0");
  p = fp8(4000, 6144, 4096, Fp8Scaling::kPerRow);
  p.silu_mul = true;
  p.ldd = p.n / 2;
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kCublasLt, none, h100)), "v6");
  p.scratch = p.d;
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kCublasLt, none, h100)), "v0");
  p = fp8(4000, 6144, 4096, Fp8Scaling::kBlock);
  const int32_t* offsets = reinterpret_cast<const int32_t*>(uintptr_t{256});
  p.group_offsets = offsets;
  p.groups = 8;
  p.max_group_rows = 1000;
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kAuto, tuned, h100)), "v6");
  EXPECT_EQ(spec(kernels::ChooseGemm(p, GemmMode::kCublasLt, none, h100)), "v6");
}

TEST(GemmModeTest, NamesRoundTripAndOthersAreRejected) {
  for (const GemmMode mode : {GemmMode::kAuto, GemmMode::kCublasLt, GemmMode::kCustom}) {
    const absl::StatusOr<GemmMode> parsed = kernels::ParseGemmMode(kernels::GemmModeName(mode));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, mode);
  }
  EXPECT_EQ(kernels::ParseGemmMode("cuBLASLt").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kernels::ParseGemmMode("").status().code(), absl::StatusCode::kInvalidArgument);
}

// One tuning pass as the server runs it at load: a fresh router, the model's
// shapes, and what it logged.
struct Pass {
  std::unique_ptr<GemmRouter> router;
  std::string log;
};

std::string Choice(const Pass& pass, int64_t m, int64_t n, int64_t k) {
  return kernels::GemmConfigSpec(pass.router->Route(Dense(m, n, k)));
}

Pass RunPass(const std::vector<TunedShape>& shapes, int64_t max_m, const GemmTuningOptions& options) {
  Pass pass;
  absl::StatusOr<std::unique_ptr<GemmRouter>> router = GemmRouter::Create(GemmMode::kAuto);
  EXPECT_TRUE(router.ok()) << router.status();
  if (!router.ok()) return pass;
  pass.router = *std::move(router);
  std::ostringstream log;
  const absl::Status status = TuneGemmRouter(*pass.router, shapes, max_m, options, log);
  EXPECT_TRUE(status.ok()) << status;
  pass.log = log.str();
  std::printf("%s", pass.log.c_str());
  return pass;
}

TEST(GemmTuningTest, TunesWritesTheCacheAndReadsItBack) {
  if (!kernels::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  {
    absl::StatusOr<std::unique_ptr<GemmRouter>> probe = GemmRouter::Create(GemmMode::kAuto);
    ASSERT_TRUE(probe.ok()) << probe.status();
    if (!(*probe)->custom_kernels_enabled()) {
      GTEST_SKIP() << "not an sm_90a device/binary: every GEMM is cuBLASLt, nothing to tune";
    }
  }
  const std::string path = (std::filesystem::path(::testing::TempDir()) / "layerserve_gemm_tune_test.json").string();
  std::filesystem::remove(path);
  // The second as a gate/up projection (timed gated), the third as a down
  // projection (timed adding onto its output), each keyed apart in the cache.
  const std::vector<TunedShape> shapes = {{1024, 1024}, {2048, 512, true}, {512, 1024, false, Fp8Scaling::kNone, true}};
  const int64_t max_m = 100;  // buckets up to 128
  const int last_bucket = kernels::GemmMBucket(max_m);
  GemmTuningOptions options;
  options.cache_path = path;
  options.build = "test";

  const Pass tuned = RunPass(shapes, max_m, options);
  EXPECT_NE(tuned.log.find("1024x1024 (autotuned"), std::string::npos) << tuned.log;
  EXPECT_NE(tuned.log.find("2048x512 gated (autotuned"), std::string::npos) << tuned.log;
  EXPECT_NE(tuned.log.find("512x1024 accumulating (autotuned"), std::string::npos) << tuned.log;
  const absl::StatusOr<GemmTuneCache> written = ParseGemmTuneCache(ReadFile(path));
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->results.size(), shapes.size() * (last_bucket + 1));
  for (const GemmTuneResult& r : written->results) {
    EXPECT_EQ(r.gated, r.n == 2048) << r.n << "x" << r.k;
    EXPECT_EQ(r.accumulate, r.n == 512) << r.n << "x" << r.k;
    EXPECT_GT(r.chosen_us, 0.f);
    EXPECT_GT(r.cublaslt_us, 0.f);
    EXPECT_LE(r.chosen_us, r.cublaslt_us) << "the choice is the fastest candidate, cuBLASLt included";
  }

  const Pass cached = RunPass(shapes, max_m, options);
  EXPECT_NE(cached.log.find("1024x1024 (from the cache)"), std::string::npos) << cached.log;
  EXPECT_EQ(cached.log.find("autotuned"), std::string::npos) << cached.log;
  for (const TunedShape& s : shapes) {
    for (int b = 0; b <= last_bucket; ++b) {
      const int64_t m = kernels::GemmMBucketUpperBound(b);
      EXPECT_EQ(Choice(cached, m, s.n, s.k), Choice(tuned, m, s.n, s.k)) << s.n << "x" << s.k << " m<=" << m;
    }
  }
  // The same shape timed plain is not in the cache: it is tuned.
  const Pass plain = RunPass({{2048, 512}}, max_m, options);
  EXPECT_NE(plain.log.find("2048x512 (autotuned"), std::string::npos) << plain.log;

  // A larger max_m than the cache covers re-tunes; so does another device key.
  const Pass wider = RunPass({{1024, 1024}}, 1000, options);
  EXPECT_NE(wider.log.find("1024x1024 (autotuned"), std::string::npos) << wider.log;
  options.build = "another build";
  const Pass stale = RunPass({{1024, 1024}}, max_m, options);
  EXPECT_NE(stale.log.find("tuning again"), std::string::npos) << stale.log;

  // Pins win over the cache; autotune off without a cache keeps the defaults.
  options.pins = {GemmPin{5, 1024, 1024, false, GemmConfig{GemmVersion::kWarpSpecialized, 0, 128}}};
  const Pass pinned = RunPass({{1024, 1024}}, max_m, options);
  EXPECT_EQ(Choice(pinned, 8, 1024, 1024), "v3b128");
  EXPECT_NE(pinned.log.find("pinned 5:1024x1024=v3b128"), std::string::npos) << pinned.log;
  GemmTuningOptions off;
  off.autotune = false;
  const Pass defaults = RunPass({{1024, 1024}}, max_m, off);
  EXPECT_NE(defaults.log.find("defaults, autotune off"), std::string::npos) << defaults.log;
  std::filesystem::remove(path);
}

// FP8 weights' shapes are timed as FP8 products of their scaling (cuBLASLt's
// FP8 against v6 and its split counts), cached and routed apart from the
// bf16 shape of the same (n, k).
TEST(GemmTuningTest, TunesFp8ShapesApartFromBf16Ones) {
  if (!kernels::testing::HaveCudaDevice()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  {
    absl::StatusOr<std::unique_ptr<GemmRouter>> probe = GemmRouter::Create(GemmMode::kAuto);
    ASSERT_TRUE(probe.ok()) << probe.status();
    if (!(*probe)->custom_kernels_enabled()) GTEST_SKIP() << "not an sm_90a device/binary: no FP8 GEMM";
  }
  const std::string path = (std::filesystem::path(::testing::TempDir()) / "layerserve_gemm_tune_fp8.json").string();
  std::filesystem::remove(path);
  const std::vector<TunedShape> shapes = {{1024, 1024},
                                          {1024, 1024, false, Fp8Scaling::kPerRow},
                                          {1024, 1024, false, Fp8Scaling::kBlock},
                                          {2048, 512, true, Fp8Scaling::kPerRow},
                                          {2048, 512, true, Fp8Scaling::kBlock}};
  const int64_t max_m = 3000;  // buckets up to 4096
  GemmTuningOptions options;
  options.cache_path = path;
  options.build = "test";
  const Pass tuned = RunPass(shapes, max_m, options);
  for (const char* line : {"1024x1024 (autotuned", "1024x1024 fp8-row (autotuned", "1024x1024 fp8-block (autotuned",
                           "2048x512 gated fp8-row (autotuned", "2048x512 gated fp8-block (autotuned"}) {
    EXPECT_NE(tuned.log.find(line), std::string::npos) << line << " in\n" << tuned.log;
  }
  const absl::StatusOr<GemmTuneCache> written = ParseGemmTuneCache(ReadFile(path));
  ASSERT_TRUE(written.ok()) << written.status();
  const int buckets = kernels::GemmMBucket(max_m) + 1;
  EXPECT_EQ(written->results.size(), shapes.size() * buckets);
  int cublaslt_timed = 0;
  for (const GemmTuneResult& r : written->results) {
    if (r.fp8 == Fp8Scaling::kNone) continue;
    const std::string where = absl::StrCat(r.n, "x", r.k, " ", std::string(kernels::Fp8ScalingName(r.fp8)),
                                           " m<=", kernels::GemmMBucketUpperBound(r.bucket));
    EXPECT_TRUE(r.chosen.version == GemmVersion::kFp8 || r.chosen.version == GemmVersion::kCublasLt) << where;
    EXPECT_GT(r.chosen_us, 0.f) << where;
    // cuBLASLt never takes a block-scaled gate/up (no 128-row scale blocks
    // of its own); everywhere else it is timed.
    if (r.gated && r.fp8 == Fp8Scaling::kBlock) {
      EXPECT_EQ(r.chosen.version, GemmVersion::kFp8) << where;
      EXPECT_LT(r.cublaslt_us, 0.f) << where;
    } else if (r.cublaslt_us > 0.f) {
      ++cublaslt_timed;
      EXPECT_LE(r.chosen_us, r.cublaslt_us) << where;
    }
  }
  EXPECT_GT(cublaslt_timed, 0) << "cuBLASLt's FP8 was never a candidate";
  // The router follows the FP8 entries for FP8 calls.
  for (const GemmTuneResult& r : written->results) {
    if (r.fp8 == Fp8Scaling::kNone || r.gated) continue;
    GemmParams p = Dense(kernels::GemmMBucketUpperBound(r.bucket), r.n, r.k);
    p.fp8 = r.fp8;
    p.a_scale = p.w_scale = p.w_scale_128 = static_cast<const float*>(p.w);
    EXPECT_EQ(kernels::GemmConfigSpec(tuned.router->Route(p)), kernels::GemmConfigSpec(r.chosen));
  }
  const Pass cached = RunPass(shapes, max_m, options);
  EXPECT_EQ(cached.log.find("autotuned"), std::string::npos) << cached.log;
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace layerserve::cuda
