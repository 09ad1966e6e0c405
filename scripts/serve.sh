#!/usr/bin/env bash
# Installs dependencies, builds the server and layerctl, and runs the server in
# the foreground.
# Usage: scripts/serve.sh [layerserve flags...]   (no flags: the demo model)
# Env: LAYERSERVE_SKIP_INSTALL=1 skips install-deps.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [[ ${LAYERSERVE_SKIP_INSTALL:-0} != 1 ]]; then
  LAYERSERVE_SKIP_PERF_ANALYZER=1 bash "$LAYERSERVE_ROOT/scripts/install-deps.sh"
fi
# layerctl too: the README's next step, from another shell, is `build/client/layerctl health`.
LAYERSERVE_BUILD_TARGETS="layerserve layerctl" bash "$LAYERSERVE_ROOT/scripts/build.sh"
exec "${LAYERSERVE_BUILD_DIR:-$LAYERSERVE_ROOT/build}/server/layerserve" "$@"
