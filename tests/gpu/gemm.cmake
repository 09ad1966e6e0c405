# GEMM GPU tests; include()d from tests/gpu/CMakeLists.txt when the CUDA
# language is enabled and the layerserve_gemm target exists.
find_package(CUDAToolkit REQUIRED)
add_library(layerserve_gemm_reference STATIC ${CMAKE_CURRENT_LIST_DIR}/gemm_reference.cu)
target_include_directories(layerserve_gemm_reference PUBLIC ${CMAKE_CURRENT_LIST_DIR}/../..)
target_link_libraries(layerserve_gemm_reference PUBLIC CUDA::cudart)
set_target_properties(layerserve_gemm_reference PROPERTIES CUDA_STANDARD 17 CUDA_STANDARD_REQUIRED ON)

# The sizing rules of every version (kernels/gemm/gemm_heuristics.h) through
# their worked examples; pure functions, no GPU.
layerserve_add_gtest(gemm_heuristics_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/gemm_heuristics_test.cc
  LIBS layerserve_gemm)

layerserve_add_gtest(gemm_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/gemm_test.cc
  LIBS layerserve_gemm layerserve_gemm_reference layerserve_gpu_test_util
  LABELS gpu)

# Chains of v4 launches under programmatic dependent launch, each reading the
# previous one's output, against the same chain run one launch at a time.
layerserve_add_gtest(gemm_pdl_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/gemm_pdl_test.cc
  LIBS layerserve_gemm layerserve_gemm_reference layerserve_gpu_test_util
  LABELS gpu)

# The mixture-of-experts pieces: the grouped GEMM (v3, v4, the router's route)
# per group against the fp32 reference, and the routing, gather and
# combine kernels against float64.
layerserve_add_gtest(moe_gpu_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/moe_test.cc
  LIBS layerserve_gemm layerserve_kernels layerserve_base layerserve_gemm_reference layerserve_gpu_test_util
  LABELS gpu)

# The gated epilogue (GemmParams::silu_mul): fused against the plain product
# plus the SiLU kernel, bit for bit, and against the fp32 reference.
layerserve_add_gtest(gemm_silu_gpu_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/gemm_silu_test.cc
  LIBS layerserve_gemm layerserve_kernels layerserve_gemm_reference layerserve_gpu_test_util
  LABELS gpu)

# The FP8 path: activation quantization bit for bit against the host, and
# version 6 (per-row and block-128 scales) against a float64 reference over
# the same codes and scales.
layerserve_add_gtest(gemm_fp8_gpu_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/gemm_fp8_test.cc
  LIBS layerserve_gemm layerserve_kernels layerserve_base layerserve_gpu_test_util
  LABELS gpu)
