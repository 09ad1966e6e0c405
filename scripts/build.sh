#!/usr/bin/env bash
# Configures (Ninja, RelWithDebInfo) and builds layerserve with every core.
# Usage: scripts/build.sh [extra cmake args...]
# Env: LAYERSERVE_BUILD_DIR (default <repo>/build), LAYERSERVE_JOBS (default nproc),
#      LAYERSERVE_BUILD_TARGETS (space-separated; default: everything).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

build_dir="${LAYERSERVE_BUILD_DIR:-$LAYERSERVE_ROOT/build}"
jobs="${LAYERSERVE_JOBS:-$(nproc)}"

log "configure $build_dir $*"
cmake -S "$LAYERSERVE_ROOT" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
targets=()
for t in ${LAYERSERVE_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
log "build with $jobs jobs ${LAYERSERVE_BUILD_TARGETS:-(all targets)}"
cmake --build "$build_dir" --parallel "$jobs" "${targets[@]}"
