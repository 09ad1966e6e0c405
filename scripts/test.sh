#!/usr/bin/env bash
# THE test command: installs dependencies, builds, runs every ctest test (unit,
# fuzz, integration, the 60 s soak, reference, Python/perf_analyzer
# compatibility; GPU tests skip visibly without a GPU), checks the formatting
# of every C++/CUDA source, that docs/performance.md is what
# scripts/perf_report.py generates (pytest on tests/docs), and the deployment
# files (pytest on tests/deploy),
# then builds the core with ThreadSanitizer in
# build-tsan and runs its tests. Exits non-zero on any failure and always ends
# with one summary line.
# Env: LAYERSERVE_SKIP_INSTALL=1 skips install-deps; LAYERSERVE_SKIP_TSAN=1
#      skips the ThreadSanitizer stage; LAYERSERVE_BUILD_DIR (default build) and
#      LAYERSERVE_TSAN_BUILD_DIR (default build-tsan) move the build trees.
# Args: passed to the main cmake configure (e.g. -DLAYERSERVE_CUDA=OFF).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LAYERSERVE_ROOT"

stage="start"
declare -a done_stages=()
started=$SECONDS
summary() {
  local rc=$?
  local took=$((SECONDS - started)) passed="none" s
  for s in "${done_stages[@]}"; do
    if [[ $passed == none ]]; then passed="$s"; else passed="$passed; $s"; fi
  done
  if [[ $rc -eq 0 ]]; then
    printf 'layerserve test.sh: PASS (%s) in %ds\n' "$passed" "$took"
  else
    printf 'layerserve test.sh: FAIL at stage "%s" (exit %d; passed: %s) in %ds\n' \
      "$stage" "$rc" "$passed" "$took"
  fi
}
trap summary EXIT

# ctest's count of tests that ran, from its "N% tests passed, F tests failed out of T" line.
ctest_total() { sed -n 's/.*tests failed out of \([0-9]*\).*/\1/p' "$1" | tail -n1; }
# pytest's count of passed tests, from its "== N passed ... in Ts ==" line.
pytest_passed() { sed -n 's/.* \([0-9]*\) passed.*/\1/p' "$1" | tail -n1; }

run_ctest() {  # run_ctest <build dir> <log file> [launcher...]
  local dir=$1 out=$2
  shift 2
  # --no-tests=error: an empty suite (e.g. a broken discovery) must not pass.
  "$@" ctest --test-dir "$dir" --output-on-failure --no-tests=error --timeout 900 2>&1 | tee "$out"
}

if [[ ${LAYERSERVE_SKIP_INSTALL:-0} != 1 ]]; then
  stage="install-deps"
  bash scripts/install-deps.sh
  done_stages+=("install-deps")
fi

build_dir="${LAYERSERVE_BUILD_DIR:-$LAYERSERVE_ROOT/build}"
tsan_dir="${LAYERSERVE_TSAN_BUILD_DIR:-$LAYERSERVE_ROOT/build-tsan}"

# Every tracked C++/CUDA source as .clang-format says (fix with
# scripts/format.sh). Needs a git checkout to list the sources.
stage="format"
if git -C "$LAYERSERVE_ROOT" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  bash scripts/format.sh --check
  done_stages+=("format")
else
  echo "[test.sh] not a git checkout: format check skipped" >&2
fi

# docs/performance.md against the results it is generated from, and
# scripts/perf_report.py on a fixture (tests/docs); needs no build.
stage="docs-check"
PYTHONDONTWRITEBYTECODE=1 "$PYTHON" -m pytest -q -p no:cacheprovider tests/docs
done_stages+=("docs-check")

stage="build"
# AUTO unless the arguments say otherwise, so that a tree scripts/serve.sh
# configured without CUDA is tested with the kernels wherever nvcc is.
cuda_arg=(-DLAYERSERVE_CUDA=AUTO)
for arg in "$@"; do [[ $arg == -DLAYERSERVE_CUDA=* ]] && cuda_arg=(); done
LAYERSERVE_BUILD_DIR="$build_dir" bash scripts/build.sh "${cuda_arg[@]}" "$@"
done_stages+=("build")

stage="ctest"
run_ctest "$build_dir" "$build_dir/ctest.log"
done_stages+=("ctest: $(ctest_total "$build_dir/ctest.log") tests")

# Deployment files (Dockerfile, compose, Prometheus rules and their tests, the
# Grafana dashboard's queries) against a live server and a real Prometheus: its
# own stage rather than a ctest test, so that the summary line names it.
stage="deploy-check"
LAYERSERVE_BIN="$build_dir/server/layerserve" LAYERCTL_BIN="$build_dir/client/layerctl" \
  PYTHONDONTWRITEBYTECODE=1 "$PYTHON" -m pytest -v -rs -p no:cacheprovider \
  --basetemp="$build_dir/pytest-deploy" tests/deploy 2>&1 | tee "$build_dir/deploy-check.log"
done_stages+=("deploy-check: $(pytest_passed "$build_dir/deploy-check.log") tests")

if [[ ${LAYERSERVE_SKIP_TSAN:-0} != 1 ]]; then
  stage="tsan build"
  LAYERSERVE_BUILD_DIR="$tsan_dir" bash scripts/build.sh -DLAYERSERVE_TSAN=ON -DLAYERSERVE_CUDA=OFF
  stage="tsan ctest"
  # halt_on_error: a race fails its test at once rather than only in the log.
  # tests/tsan.supp: what an uninstrumented library does that TSan misreads.
  export TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp ${TSAN_OPTIONS:-}"
  # GCC 12's TSan cannot map its shadow under high ASLR entropy (newer
  # kernels); running without ASLR avoids that where the sandbox allows it.
  launcher=()
  if setarch "$(uname -m)" -R true 2>/dev/null; then launcher=(setarch "$(uname -m)" -R); fi
  run_ctest "$tsan_dir" "$tsan_dir/ctest.log" "${launcher[@]}"
  done_stages+=("tsan: $(ctest_total "$tsan_dir/ctest.log") tests")
fi
stage="done"
