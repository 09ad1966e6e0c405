#!/usr/bin/env bash
# Hunts tests that fail at random: runs the whole ctest suite of the main
# build and of the ThreadSanitizer build (both already built, as
# scripts/test.sh leaves them) N times, one after the other, two tests at a
# time, while a compiler keeps a core busy beside them (the load a parallel
# build puts on a CI machine; with two tests at a time, harsher than CI's
# serial run), and prints each test that failed with how often. Exits
# non-zero if any run failed. Each run's ctest log is kept under OUT_DIR.
# Rebuilding either tree while it runs fails the tests whose binaries move.
#   usage: scripts/test-loop.sh [N, default 20] [OUT_DIR, default build/test-loop]
# Env: LAYERSERVE_BUILD_DIR, LAYERSERVE_TSAN_BUILD_DIR (as test.sh);
#      LAYERSERVE_LOOP_LOAD=0 runs without the compiler beside;
#      LAYERSERVE_LOOP_JOBS tests at a time (default 2).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LAYERSERVE_ROOT"
runs=${1:-20}
build_dir="${LAYERSERVE_BUILD_DIR:-$LAYERSERVE_ROOT/build}"
tsan_dir="${LAYERSERVE_TSAN_BUILD_DIR:-$LAYERSERVE_ROOT/build-tsan}"
out=${2:-$build_dir/test-loop}
jobs=${LAYERSERVE_LOOP_JOBS:-2}
mkdir -p "$out"
[[ -f $build_dir/CTestTestfile.cmake ]] || die "$build_dir is not built (scripts/build.sh)"
[[ -f $tsan_dir/CTestTestfile.cmake ]] || die "$tsan_dir is not built (scripts/test.sh builds it)"

# The load: the batcher's translation unit compiled again and again into a
# scratch object, one compiler at a time, with the build's own command.
load_pid=
if [[ ${LAYERSERVE_LOOP_LOAD:-1} != 0 ]]; then
  compile=$(ninja -C "$build_dir" -t commands layerserve_core | grep -m1 'batcher\.cc') ||
    die "no compile command for batcher.cc in $build_dir"
  scratch=$(mktemp -d)
  compile=$(sed -E "s# -o [^ ]+# -o $scratch/load.o#; s# -MF [^ ]+# -MF $scratch/load.d#" <<<"$compile")
  (while :; do bash -c "$compile" >/dev/null 2>&1 || true; done) &
  load_pid=$!
  trap 'kill "$load_pid" 2>/dev/null; rm -rf "$scratch"' EXIT
fi

tsan_launcher=()
if setarch "$(uname -m)" -R true 2>/dev/null; then tsan_launcher=(setarch "$(uname -m)" -R); fi
failed_runs=0
: > "$out/failures.txt"
for ((i = 1; i <= runs; i++)); do
  start=$SECONDS
  status=pass
  if ! ctest --test-dir "$build_dir" -j "$jobs" --output-on-failure --no-tests=error --timeout 900 \
    > "$out/run$i.log" 2>&1; then
    status=fail
  fi
  if ! TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/tsan.supp" \
    "${tsan_launcher[@]}" ctest --test-dir "$tsan_dir" -j "$jobs" --output-on-failure --no-tests=error \
    --timeout 900 > "$out/run$i-tsan.log" 2>&1; then
    status=fail
  fi
  # ctest's list after "The following tests FAILED:", "  123 - name (Failed)"
  # (the skipped GPU tests are listed under "did not run" instead).
  for log in "$out/run$i.log" "$out/run$i-tsan.log"; do
    sed -n '/The following tests FAILED:/,$ s/^[[:space:]]*[0-9]* - \([^ ]*\) (.*/\1/p' "$log" \
      | sed "s/^/run $i: /" >> "$out/failures.txt"
  done
  [[ $status == fail ]] && failed_runs=$((failed_runs + 1))
  printf 'run %d/%d: %s in %ds (%s)\n' "$i" "$runs" "$status" "$((SECONDS - start))" \
    "$(grep -h 'tests passed' "$out/run$i.log" "$out/run$i-tsan.log" | tr '\n' ' ')"
done
if [[ -s $out/failures.txt ]]; then
  echo "tests that failed, with how often:"
  sed 's/^run [0-9]*: //' "$out/failures.txt" | sort | uniq -c | sort -rn
fi
printf 'test-loop: %d of %d runs failed\n' "$failed_runs" "$runs"
[[ $failed_runs -eq 0 ]]
