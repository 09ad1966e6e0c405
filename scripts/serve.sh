#!/usr/bin/env bash
# Installs what serving needs, builds the server and layerctl, and runs the
# server in the foreground.
# Usage: scripts/serve.sh [layerserve flags...]   (no flags: the demo model)
# Env: LAYERSERVE_SKIP_INSTALL=1 skips installing packages; LAYERSERVE_CUDA=ON
#      or OFF forces the CUDA backend in or out of the build (default: in
#      where nvidia-smi lists a GPU, cuda_choice in common.sh).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

cuda=$(cuda_choice)
log "CUDA backend: $cuda (LAYERSERVE_CUDA=ON or OFF forces it; OFF serves on the CPU backend)"
if [[ ${LAYERSERVE_SKIP_INSTALL:-0} != 1 ]]; then
  # The build's packages only: not the test, deployment or benchmark tools.
  LAYERSERVE_DEPS=serve bash "$LAYERSERVE_ROOT/scripts/install-deps.sh"
fi
# layerctl too: the README's next step, from another shell, is `build/client/layerctl health`.
LAYERSERVE_BUILD_TARGETS="layerserve layerctl" bash "$LAYERSERVE_ROOT/scripts/build.sh" \
  -DLAYERSERVE_CUDA="$cuda"
exec "${LAYERSERVE_BUILD_DIR:-$LAYERSERVE_ROOT/build}/server/layerserve" "$@"
