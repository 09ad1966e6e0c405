#!/usr/bin/env bash
# Prints, one per line, the Debian/Ubuntu packages that own the shared
# libraries the given executables load (as ldd resolves them), leaving out
# those under /usr/local/cuda (the CUDA base image brings them). The
# Dockerfile's build stages run it so that each runtime stage installs exactly
# these, under whatever names that release gives them (noble's t64 renames,
# bookworm's), with no list written by hand.
# Usage: scripts/runtime-debs.sh BINARY...
set -euo pipefail
(($# > 0)) || { echo "usage: $0 BINARY..." >&2; exit 2; }
ldd "$@" | awk '/=> \// {print $3}' | grep -v '^/usr/local/cuda' | xargs -n1 basename | sort -u |
  while read -r so; do
    # dpkg -S's pattern matches across directories, so a library reached
    # through an alternatives link (libopenblas.so.0) finds its real owner.
    owner=$(dpkg -S "*-linux-gnu*/${so}" 2>/dev/null | head -n1 | cut -d: -f1)
    [[ -n $owner ]] || { echo "runtime-debs: no package owns ${so}" >&2; exit 1; }
    printf '%s\n' "$owner"
  done | sort -u
