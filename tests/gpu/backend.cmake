# Tests of the CUDA backend (server/cuda), included from tests/gpu/CMakeLists.txt.
# Label gpu: each test skips visibly ("no CUDA device: GPU test skipped") on a
# machine without a GPU. The backend test compares against the CPU backend.
if(TARGET layerserve_cuda AND TARGET layerserve_cpu)
  layerserve_add_gtest(cuda_backend_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_backend_test.cc
    LIBS layerserve_cuda layerserve_cpu layerserve_reference
    LABELS gpu)
  # FP8 checkpoints on the FP8 GEMM against the float64 W8A8 reference.
  layerserve_add_gtest(cuda_fp8_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_fp8_test.cc
    LIBS layerserve_cuda layerserve_cpu layerserve_reference
    LABELS gpu)
  # Sessions: steps against stateless requests and the CPU backend's sessions.
  layerserve_add_gtest(cuda_sessions_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_sessions_test.cc
    LIBS layerserve_cuda layerserve_cpu GTest::gmock
    LABELS gpu)
  # CUDA graphs: replays against direct launches, bit for bit.
  layerserve_add_gtest(cuda_graphs_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_graphs_test.cc
    LIBS layerserve_cuda
    LABELS gpu)
  layerserve_add_gtest(gemm_tuning_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/gemm_tuning_test.cc
    LIBS layerserve_cuda layerserve_gpu_test_util
    LABELS gpu)
  # The GEMM router in each mode, as the backend uses it (its DeviceBuffer).
  layerserve_add_gtest(gemm_router_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/gemm_router_test.cc
    LIBS layerserve_cuda
    LABELS gpu)
endif()
