# syntax=docker/dockerfile:1
# Container images of layerserve, two from this file:
#
#   cpu       Debian 12 slim with the CPU build (no CUDA in it): the compose
#             cpu and demo profiles run it.
#   runtime   NVIDIA's CUDA 13 runtime image with the CUDA build for the H100
#             (sm_90a): the compose gpu profile and deploy/k8s run it. The last
#             stage, so a build without --target makes it.
#
# Each comes from a build stage on its own base (cpu-build: Debian 12 slim and
# Debian's packages; build: NVIDIA's CUDA 13 devel image) that compiles the
# server and layerctl; the image carries only the two binaries and the shared
# libraries they load. The runtime package list is not written by hand: the
# build stage asks dpkg which packages own the libraries `ldd` reports
# (scripts/runtime-debs.sh), so the names follow each release's (noble's t64
# renames, bookworm's) without guesswork. libcudart and libcublasLt come with
# the CUDA runtime base image. With BuildKit (Docker's default builder) a
# --target builds only the stages it needs.
#
# Ubuntu 24.04 (noble) libraries the CUDA stages rely on, the same major
# versions as the Debian 12 the project is tested on and the cpu stages use:
#   gRPC 1.51.1 (libgrpc++1.51t64, libgrpc29t64), protobuf 3.21.12
#   (libprotobuf32t64), Abseil 20220623 (libabsl20220623t64), prometheus-cpp
#   1.0.2 (libprometheus-cpp-core1.0), OpenBLAS 0.3.26, cpp-httplib (0.14 in
#   noble, 0.11 in Debian 12), nlohmann-json 3.11, CLI11 (header-only; 2.4 in
#   noble, 2.1 in Debian 12). The gRPC health proto is
#   part of the repository (proto/grpc/health/v1), so no grpc-proto package.
#
# Checked statically (tests/deploy/test_deploy.py). The project's machines
# have no Docker engine: scripts/check-cpu-image.sh builds the cpu stages in
# debootstrap roots and runs the result; the CUDA image has never been built
# (UNVERIFIED). Build on a machine with Docker, from the repository root:
#   docker build -t localhost/layerserve:0.1.0 .                  (the CUDA image)
#   docker build --target cpu -t localhost/layerserve-cpu:0.1.0 . (the CPU image)
# (the names deploy/docker-compose.yml runs).
# 13.0.2: NVIDIA publishes ubuntu24.04 images of it (nvcr.io/nvidia/cuda:13.0.2-cudnn-devel-ubuntu24.04
# is in public use); the tag itself was not pulled here.
ARG CUDA_VERSION=13.0.2

# --- the CPU image ------------------------------------------------------------------
# What scripts/install-deps.sh installs to build the server, less the tests'.
FROM docker.io/library/debian:12-slim AS cpu-build
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      g++ cmake ninja-build pkg-config \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      libabsl-dev prometheus-cpp-dev libopenblas-dev nlohmann-json3-dev libcpp-httplib-dev \
      libcli11-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cmake -S . -B build -G Ninja \
      -DCMAKE_BUILD_TYPE=Release \
      -DLAYERSERVE_BUILD_TESTS=OFF \
      -DLAYERSERVE_CUDA=OFF \
 && cmake --build build --target layerserve layerctl \
 && scripts/runtime-debs.sh build/server/layerserve build/client/layerctl > /runtime-debs.txt \
 && cat /runtime-debs.txt

FROM docker.io/library/debian:12-slim AS cpu
ENV DEBIAN_FRONTEND=noninteractive
COPY --from=cpu-build /runtime-debs.txt /tmp/runtime-debs.txt
RUN apt-get update \
 && xargs -a /tmp/runtime-debs.txt apt-get install -y --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-debs.txt \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin layerserve
COPY --from=cpu-build /src/build/server/layerserve /src/build/client/layerctl /usr/local/bin/
USER layerserve
EXPOSE 8001 8002
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["layerctl", "health", "--url", "127.0.0.1:8001"]
ENTRYPOINT ["layerserve"]
CMD ["--host", "0.0.0.0", "--grpc-port", "8001", "--metrics-port", "8002"]

# --- the CUDA image -----------------------------------------------------------------
FROM docker.io/nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      g++ cmake ninja-build pkg-config \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      libabsl-dev prometheus-cpp-dev libopenblas-dev nlohmann-json3-dev libcpp-httplib-dev \
      libcli11-dev libssl-dev \
 && rm -rf /var/lib/apt/lists/*
# 90a: the H100's sm_90a, which the persistent GEMM kernels need.
ARG CUDA_ARCHITECTURES=90a
WORKDIR /src
COPY . .
RUN cmake -S . -B build -G Ninja \
      -DCMAKE_BUILD_TYPE=Release \
      -DLAYERSERVE_BUILD_TESTS=OFF \
      -DLAYERSERVE_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES} \
 && cmake --build build --target layerserve layerctl
# The runtime stage installs exactly the packages owning the non-CUDA shared
# libraries of the two binaries.
RUN scripts/runtime-debs.sh build/server/layerserve build/client/layerctl > /runtime-debs.txt \
 && cat /runtime-debs.txt

FROM docker.io/nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04 AS runtime
ENV DEBIAN_FRONTEND=noninteractive
COPY --from=build /runtime-debs.txt /tmp/runtime-debs.txt
RUN apt-get update \
 && xargs -a /tmp/runtime-debs.txt apt-get install -y --no-install-recommends \
 && rm -rf /var/lib/apt/lists/* /tmp/runtime-debs.txt \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin layerserve
COPY --from=build /src/build/server/layerserve /src/build/client/layerctl /usr/local/bin/
USER layerserve
EXPOSE 8001 8002
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["layerctl", "health", "--url", "127.0.0.1:8001"]
ENTRYPOINT ["layerserve"]
CMD ["--host", "0.0.0.0", "--grpc-port", "8001", "--metrics-port", "8002"]
