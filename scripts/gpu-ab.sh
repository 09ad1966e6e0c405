#!/usr/bin/env bash
# Runs on the GPU machine: layer_bench from several bundles (made by
# scripts/gpu-bundle.sh at different commits, e.g. .gpubundle/base.tar.xz
# beside the new .gpubundle/layerserve-gpu.tar.xz), one after the other for
# ROUNDS rounds, then prints each case's median over the rounds per bundle
# and its ratio to the first bundle's. Logs go to $OUT (default ./gpu-out).
#   usage: scripts/gpu-ab.sh ROUNDS BUNDLE.tar.xz... [-- layer_bench args]
set -uo pipefail
rounds=$1
shift
bundles=()
while [[ $# -gt 0 && $1 != -- ]]; do bundles+=("$1"); shift; done
[[ ${1:-} == -- ]] && shift
out=${OUT:-gpu-out}
mkdir -p "$out"
for i in "${!bundles[@]}"; do
  rm -rf "/tmp/gpu-ab-$i" && mkdir -p "/tmp/gpu-ab-$i" && tar -C "/tmp/gpu-ab-$i" -xJf "${bundles[$i]}" || exit 1
done
for r in $(seq 1 "$rounds"); do
  for i in "${!bundles[@]}"; do
    LD_LIBRARY_PATH="/tmp/gpu-ab-$i/lib" "/tmp/gpu-ab-$i/bin/layer_bench" "$@" > "$out/ab_${i}_$r.txt" 2>&1 ||
      { echo "layer_bench of ${bundles[$i]} failed (round $r):"; tail -5 "$out/ab_${i}_$r.txt"; exit 1; }
  done
done
# A case row of layer_bench: label ("1 1", "16 16 L=1024"), median, min, floor, ...
python3 - "$out" "$rounds" "${bundles[@]}" <<'PY'
import re, statistics, sys
out, rounds, bundles = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
row = re.compile(r"^\s*(\d+ \d+(?: L=\d+)?)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s")
cases, floor = {}, {}
for i in range(len(bundles)):
    for r in range(1, rounds + 1):
        for line in open(f"{out}/ab_{i}_{r}.txt"):
            m = row.match(line)
            if m:
                cases.setdefault(m.group(1), [[] for _ in bundles])[i].append(float(m.group(2)))
                floor[m.group(1)] = float(m.group(3))
names = [b.rsplit("/", 1)[-1].removesuffix(".tar.xz") for b in bundles]
print(f"medians of {rounds} rounds, ms (ratio to {names[0]})")
print(f"{'case':>14} {'floor':>8}" + "".join(f" {n[:22]:>22}" for n in names))
for case, runs in cases.items():
    med = [statistics.median(x) for x in runs]
    cells = [f"{med[0]:.4f}"] + [f"{m:.4f} ({m / med[0]:.3f})" for m in med[1:]]
    print(f"{case:>14} {floor[case]:8.4f}" + "".join(f" {c:>22}" for c in cells))
PY
