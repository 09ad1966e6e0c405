#!/usr/bin/env bash
# Formats every tracked C++/CUDA source with clang-format as .clang-format
# (and the 120-column overrides in kernels/, tests/gpu/, bench/) say.
#   scripts/format.sh           rewrite the files in place
#   scripts/format.sh --check   change nothing; exit 1 and name the files
#                               that differ (what scripts/test.sh runs)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LAYERSERVE_ROOT"
command -v clang-format >/dev/null || die "clang-format is not installed (scripts/install-deps.sh installs it)"
mapfile -d '' files < <(git ls-files -z '*.cc' '*.h' '*.cu' '*.cuh')
if [[ ${1:-} == --check ]]; then
  if ! clang-format --dry-run --Werror "${files[@]}" 2>/tmp/layerserve-format.$$; then
    grep -o '^[^:]*:[0-9]*:[0-9]*: error' /tmp/layerserve-format.$$ | cut -d: -f1 | sort -u |
      sed 's/^/  not formatted: /' >&2
    rm -f /tmp/layerserve-format.$$
    die "run scripts/format.sh to format them"
  fi
  rm -f /tmp/layerserve-format.$$
  log "format: ${#files[@]} files as .clang-format says"
else
  clang-format -i "${files[@]}"
  log "formatted ${#files[@]} files"
fi
