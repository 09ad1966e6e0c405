#!/usr/bin/env bash
# Builds the Dockerfile's CPU image without a Docker engine, as a check that
# its stages work: each of the stages `cpu-build` and `cpu` runs in a fresh
# Debian 12 root made by debootstrap (what debian:12-slim is), its RUN lines
# through `chroot ... sh -c` as written in the Dockerfile, its COPY lines as
# copies (the build context is `git archive HEAD`); then the image's
# entrypoint and healthcheck run in the `cpu` root as its USER: the server
# must reach its ready line on the demo model and `layerctl health` must
# answer SERVING. Only the instructions those two stages use are understood
# (FROM, ENV, WORKDIR, COPY [--from], RUN, USER, EXPOSE, HEALTHCHECK,
# ENTRYPOINT, CMD); anything else stops the check.
#
# Usage (root, network to a Debian mirror): scripts/check-cpu-image.sh [WORK_DIR]
# WORK_DIR (default /tmp/layerserve-cpu-image) holds the two roots (about
# 2.5 GB; reused by a later run after debootstrap). Takes ~30 min on 2 cores,
# most of it the server's build.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LAYERSERVE_ROOT"
work=${1:-/tmp/layerserve-cpu-image}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
[[ ${EUID:-$(id -u)} -eq 0 ]] || die "needs root (debootstrap, chroot)"
apt_install debootstrap

# The Dockerfile's instructions of one stage, one per line (continuations
# joined), without comments.
stage_lines() {
  "$PYTHON" - "$1" << 'PY'
import re, sys
text = open("Dockerfile").read()
lines, cur = [], ""
for raw in text.splitlines():
    if not cur and (raw.lstrip().startswith("#") or not raw.strip()):
        continue
    if cur and raw.lstrip().startswith("#"):
        continue
    cur += raw.rstrip()
    if cur.endswith("\\"):
        cur = cur[:-1] + " "
        continue
    lines.append(cur.strip())
    cur = ""
out, inside = [], False
for line in lines:
    m = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
    if m:
        inside = m.group(1) == sys.argv[1]
        continue
    if inside:
        out.append(line)
print("\n".join(out))
PY
}

# A fresh Debian 12 root at $1 (debootstrap once, kept as a pristine copy).
fresh_root() {
  local pristine=$work/bookworm
  if [[ ! -f $pristine/.done ]]; then
    rm -rf "$pristine"
    log "debootstrap bookworm into $pristine"
    debootstrap --variant=minbase bookworm "$pristine" "$mirror" > "$work/debootstrap.log" 2>&1 ||
      die "debootstrap failed: $work/debootstrap.log"
    touch "$pristine/.done"
  fi
  rm -rf "$1" && cp -a "$pristine" "$1"
  cp /etc/resolv.conf "$1/etc/resolv.conf"
}

mounts() {  # mounts ROOT: /proc, /dev and /sys for apt and the build
  mount -t proc proc "$1/proc"
  mount --rbind /dev "$1/dev"
  mount -t sysfs sys "$1/sys"
}
unmounts() {
  umount -l "$1/proc" "$1/sys" 2>/dev/null || true
  umount -R -l "$1/dev" 2>/dev/null || true
}

# Runs stage $1 in root $2.
run_stage() {
  local stage=$1 root=$2 workdir=/ envs=() user=root line args
  log "stage $stage in $root"
  fresh_root "$root"
  mounts "$root"
  trap 'unmounts "$root"' RETURN
  while IFS= read -r line; do
    args=${line#* }
    case ${line%% *} in
      ENV) envs+=("$args") ;;
      WORKDIR) workdir=$args; mkdir -p "$root$workdir" ;;
      COPY)
        if [[ $args == "--from="* ]]; then
          local from=${args%% *} rest=${args#* }
          from=${from#--from=}
          local srcs=(${rest% *}) dest=${rest##* } src
          for src in "${srcs[@]}"; do cp -a "$work/$from$src" "$root$dest"; done
        elif [[ $args == ". ." ]]; then
          git archive HEAD | tar -x -C "$root$workdir"
        else
          die "COPY $args: only '. .' and --from= copies are understood"
        fi
        ;;
      RUN) log "RUN ${args:0:100}"
           chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
             HOME=/root "${envs[@]}" sh -c "cd $workdir && $args" ;;
      USER) user=$args ;;
      EXPOSE | HEALTHCHECK | ENTRYPOINT | CMD | ARG) ;;
      *) die "unknown instruction: $line" ;;
    esac
  done < <(stage_lines "$stage")
  printf '%s\n' "$user" > "$root/.image-user"
}

mkdir -p "$work"
start=$SECONDS
run_stage cpu-build "$work/cpu-build"
run_stage cpu "$work/cpu"
log "stages built in $((SECONDS - start)) s; image root $(du -sh "$work/cpu" | cut -f1)"

# The image's entrypoint (layerserve with the CMD's flags) as its user, and
# its healthcheck.
root=$work/cpu
mounts "$root"
trap 'unmounts "$root"' EXIT
# The image's USER as uid:gid from the root's own passwd (chroot resolves a
# name through the host's).
user=$(awk -F: -v u="$(cat "$root/.image-user")" '$1 == u {print $3 ":" $4}' "$root/etc/passwd")
[[ -n $user ]] || die "the image's user $(cat "$root/.image-user") is not in its /etc/passwd"
chroot --userspec="$user" "$root" layerserve --host 127.0.0.1 --grpc-port 18001 --metrics-port 18002 \
  > "$work/serve.log" 2>&1 &
server=$!
for _ in $(seq 1 120); do
  grep -q "layerserve ready" "$work/serve.log" && break
  kill -0 "$server" 2>/dev/null || die "layerserve exited in the image root: $(tail -5 "$work/serve.log")"
  sleep 1
done
grep -q "layerserve ready" "$work/serve.log" || die "no ready line in 120 s: $(tail -5 "$work/serve.log")"
health=$(chroot --userspec="$user" "$root" layerctl health --url 127.0.0.1:18001)
kill -TERM "$server" && wait "$server" || true
log "layerctl health in the image: $health"
[[ $health == *SERVING* ]] || die "the healthcheck did not answer SERVING"
log "the CPU image's stages work; $(grep -m1 "layerserve ready" "$work/serve.log")"
