#!/usr/bin/env bash
# Installs Triton's perf_analyzer into $LAYERSERVE_TOOLS_DIR (default
# ~/.cache/layerserve/tools) as a wrapper script `perf_analyzer`.
#
# The PyPI package `perf-analyzer` is only a placeholder; a working binary
# (manylinux1) ships inside the tritonclient 2.40.0 wheel as
# tritonclient-2.40.0.data/data/bin/perf_analyzer. It needs libb64.so.0d
# (Debian libb64-0d) and libcudart.so.12 (PyPI nvidia-cuda-runtime-cu12, no GPU
# needed to load it); the wrapper points LD_LIBRARY_PATH at the latter.
#
# On failure the reason is written to $LAYERSERVE_TOOLS_DIR/perf_analyzer.install-error,
# which the compatibility test shows when it skips.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

readonly PA_VERSION=2.40.0
readonly WHEEL_MEMBER="tritonclient-${PA_VERSION}.data/data/bin/perf_analyzer"
readonly HOME_DIR="$LAYERSERVE_TOOLS_DIR/perf_analyzer-$PA_VERSION"
readonly WRAPPER="$LAYERSERVE_TOOLS_DIR/perf_analyzer"
readonly ERROR_FILE="$LAYERSERVE_TOOLS_DIR/perf_analyzer.install-error"

mkdir -p "$LAYERSERVE_TOOLS_DIR"
record_failure() {
  local rc=$?
  [[ $rc -eq 0 ]] && return
  printf 'scripts/install-perf-analyzer.sh failed (exit %d) at: %s\n' "$rc" "$BASH_COMMAND" >"$ERROR_FILE"
  log "failed; reason recorded in $ERROR_FILE"
}
trap record_failure EXIT

# `--help` is not an option of this perf_analyzer (it prints usage and exits
# 99); --version exits 0 once every library resolves, and prints to stderr.
works() {
  local out
  out="$("$WRAPPER" --version 2>&1)" && [[ $out == *"Perf Analyzer Version $PA_VERSION"* ]]
}

if [[ -x $WRAPPER ]] && works; then
  log "perf_analyzer $PA_VERSION already installed: $WRAPPER"
  rm -f "$ERROR_FILE"
  exit 0
fi

# libb64: from apt when root/sudo can install it, else unpacked from the .deb
# into the tools dir (apt-get download needs no root).
libb64_dir=""
if ! debs_installed libb64-0d; then
  if [[ ${EUID:-$(id -u)} -eq 0 ]] || command -v sudo >/dev/null 2>&1; then
    apt_install libb64-0d
  else
    log "no root: unpacking libb64-0d into $HOME_DIR/deb"
    tmp_deb="$(mktemp -d)"
    (cd "$tmp_deb" && apt-get download libb64-0d)
    dpkg-deb -x "$tmp_deb"/libb64-0d_*.deb "$HOME_DIR/deb"
    rm -rf "$tmp_deb"
    libb64_dir="$(dirname "$(find "$HOME_DIR/deb" -name 'libb64.so.0d' | head -n1)")"
  fi
fi

mkdir -p "$HOME_DIR/bin"
if [[ ! -x $HOME_DIR/bin/perf_analyzer ]]; then
  dl="$(mktemp -d)"
  log "pip download tritonclient==$PA_VERSION (for its perf_analyzer binary)"
  "$PYTHON" -m pip download --disable-pip-version-check --no-deps \
    "tritonclient==$PA_VERSION" -d "$dl" >/dev/null
  wheel="$(ls "$dl"/tritonclient-"$PA_VERSION"-*.whl)"
  "$PYTHON" - "$wheel" "$WHEEL_MEMBER" "$HOME_DIR/bin/perf_analyzer" <<'PY'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest + ".part", "wb") as out:
    shutil.copyfileobj(src, out)
PY
  chmod 755 "$HOME_DIR/bin/perf_analyzer.part"
  mv "$HOME_DIR/bin/perf_analyzer.part" "$HOME_DIR/bin/perf_analyzer"
  rm -rf "$dl"
fi

# libcudart.so.12 goes into a private --target dir: it stays out of the system
# Python (no PEP 668 question) and cannot clash with a CUDA toolkit's cudart.
cudart_dir="$HOME_DIR/python/nvidia/cuda_runtime/lib"
if [[ ! -e $cudart_dir/libcudart.so.12 ]]; then
  log "pip install --target nvidia-cuda-runtime-cu12 (libcudart.so.12)"
  rm -rf "$HOME_DIR/python"
  "$PYTHON" -m pip install --disable-pip-version-check --root-user-action=ignore --no-deps --quiet \
    --target "$HOME_DIR/python" 'nvidia-cuda-runtime-cu12>=12.2,<13'
  [[ -e $cudart_dir/libcudart.so.12 ]] || die "nvidia-cuda-runtime-cu12 has no libcudart.so.12"
fi

lib_path="$cudart_dir${libb64_dir:+:$libb64_dir}"
cat >"$WRAPPER.part" <<WRAP
#!/usr/bin/env bash
# perf_analyzer $PA_VERSION from the tritonclient wheel; written by scripts/install-perf-analyzer.sh.
export LD_LIBRARY_PATH="$lib_path\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$HOME_DIR/bin/perf_analyzer" "\$@"
WRAP
chmod 755 "$WRAPPER.part"
mv "$WRAPPER.part" "$WRAPPER"

if ! works; then
  "$WRAPPER" --version || true
  ldd "$HOME_DIR/bin/perf_analyzer" | grep 'not found' >&2 || true
  die "perf_analyzer does not run"
fi
help="$("$WRAPPER" --help 2>&1 || true)"
[[ $help == *"Usage:"* ]] || die "perf_analyzer --help prints no usage"
rm -f "$ERROR_FILE"
log "perf_analyzer $PA_VERSION installed: $WRAPPER"
