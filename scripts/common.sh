# Shared helpers for the scripts in this folder (sourced, not run).
#
# Every script runs with `set -euo pipefail`, from any working directory, and
# may be re-run: each step checks whether its work is already done.

LAYERSERVE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export LAYERSERVE_ROOT
: "${LAYERSERVE_TOOLS_DIR:=${HOME:-/root}/.cache/layerserve/tools}"
export LAYERSERVE_TOOLS_DIR
: "${PYTHON:=python3}"

log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Runs a command as root: directly when already root, else through sudo.
as_root() {
  if [[ ${EUID:-$(id -u)} -eq 0 ]]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    die "need root (or sudo) to run: $*"
  fi
}

# True if every named Debian package is installed.
debs_installed() {
  local pkg status
  for pkg in "$@"; do
    status="$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)"
    [[ $status == "install ok installed" ]] || return 1
  done
}

# Installs the named Debian packages that are missing (apt-get update once).
apt_install() {
  debs_installed "$@" && return 0
  local missing=() pkg
  for pkg in "$@"; do debs_installed "$pkg" || missing+=("$pkg"); done
  log "apt-get install ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${missing[@]}"
}

# The CUDA backend's build setting for this machine: LAYERSERVE_CUDA if set
# (ON, OFF or AUTO), else ON where nvidia-smi lists a GPU and OFF elsewhere
# (the CPU backend serves; the CUDA kernels take minutes to compile on a
# small machine and could not run there).
cuda_choice() {
  if [[ -n ${LAYERSERVE_CUDA:-} ]]; then
    printf '%s\n' "$LAYERSERVE_CUDA"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    printf 'ON\n'
  else
    printf 'OFF\n'
  fi
}

# `pip install` that copes with a PEP 668 externally-managed Python: it only
# adds --break-system-packages when pip refuses without it.
pip_install() {
  local out
  if out="$("$PYTHON" -m pip install --disable-pip-version-check --root-user-action=ignore "$@" 2>&1)"; then
    return 0
  fi
  if grep -q externally-managed-environment <<<"$out"; then
    log "externally managed Python: retrying with --break-system-packages"
    "$PYTHON" -m pip install --disable-pip-version-check --root-user-action=ignore --break-system-packages "$@"
  else
    printf '%s\n' "$out" >&2
    return 1
  fi
}
