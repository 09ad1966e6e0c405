#!/usr/bin/env bash
# Checks the deployment and observability files without Docker or a GPU:
#   1. Dockerfile and .dockerignore: instruction-level checks (no Dockerfile
#      linter is packaged for Debian 12);
#   2. deploy/docker-compose.yml: `docker-compose config -q` for every profile;
#   3. Prometheus: `promtool check config`, `check rules`, `test rules`;
#   4. Grafana dashboard: parses, uses the provisioned datasource uid;
#   5. every metric named in a dashboard, rule or HPA/adapter file is exported
#      by a real layerserve (live scrape on loopback; the CUDA-only families are
#      checked against the metrics header instead);
#   6. a real Prometheus scrapes that server every second during a
#      `layerctl bench` run, and each dashboard query, and the p99 latency,
#      come back from its HTTP API;
#   7. deploy/README.md's split-model recipe: two servers with --layers 0:2
#      and 2:4 chained with `layerctl infer` give the full model's output.
# Needs the built binaries (scripts/build.sh). Installs docker-compose and
# prometheus from apt when missing, without leaving prometheus's service up.
# Env: LAYERSERVE_BIN (default build/server/layerserve), LAYERCTL_BIN
#      (default build/client/layerctl), LAYERSERVE_SKIP_INSTALL=1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$LAYERSERVE_ROOT"

server_bin="${LAYERSERVE_BIN:-build/server/layerserve}"
ctl_bin="${LAYERCTL_BIN:-build/client/layerctl}"
deploy="$LAYERSERVE_ROOT/deploy"
started=$SECONDS

work="$(mktemp -d)"
pids=()  # everything started here, killed on exit
cleanup() {
  local rc=$? pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
  done
  rm -rf "$work"
  if [[ $rc -eq 0 ]]; then
    printf 'layerserve check-deploy.sh: PASS in %ds\n' "$((SECONDS - started))"
  else
    printf 'layerserve check-deploy.sh: FAIL (exit %d) in %ds\n' "$rc" "$((SECONDS - started))"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# run_tracked <command...>: runs a command in the background and waits for it,
# so that a signal interrupts the wait and cleanup also stops the command.
run_tracked() {
  "$@" &
  pids+=("$!")
  wait "$!"
}

[[ -x $server_bin ]] || die "no server binary at $server_bin (run scripts/build.sh)"
[[ -x $ctl_bin ]] || die "no layerctl binary at $ctl_bin (run scripts/build.sh)"

# --- tools -------------------------------------------------------------------
if [[ ${LAYERSERVE_SKIP_INSTALL:-0} != 1 ]] && ! debs_installed docker-compose prometheus curl; then
  # Debian's prometheus package starts its daemon on install; policy-rc.d
  # tells invoke-rc.d not to, unless the machine already has a policy.
  added_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' | as_root tee /usr/sbin/policy-rc.d >/dev/null
    as_root chmod 755 /usr/sbin/policy-rc.d
    added_policy=1
  fi
  install_rc=0
  apt_install docker-compose prometheus curl || install_rc=$?
  [[ $added_policy == 1 ]] && as_root rm -f /usr/sbin/policy-rc.d
  [[ $install_rc == 0 ]] || die "apt install failed"
fi
for tool in docker-compose promtool prometheus curl; do
  command -v "$tool" >/dev/null || die "missing $tool"
done

# --- 1. Dockerfile -------------------------------------------------------------
log "Dockerfile: instruction checks"
"$PYTHON" - "$LAYERSERVE_ROOT" <<'PY'
import fnmatch, json, os, re, sys
root = sys.argv[1]
known = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT", "VOLUME",
         "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
# Logical instructions: comments dropped, backslash continuations joined.
instrs, buf = [], ""
for line in open(os.path.join(root, "Dockerfile")):
    s = line.rstrip("\n")
    if not buf and (not s.strip() or s.lstrip().startswith("#")):
        continue
    if buf and s.lstrip().startswith("#"):
        continue
    if s.endswith("\\"):
        buf += s[:-1] + " "
        continue
    instrs.append((buf + s).strip())
    buf = ""
errors = []
if buf:
    errors.append("file ends inside a line continuation")
stages, user_by_stage, last = [], {}, None
for ins in instrs:
    kw, _, rest = ins.partition(" ")
    if kw.upper() not in known:
        errors.append(f"unknown instruction {kw!r}")
    if kw != kw.upper():
        errors.append(f"instruction not upper case: {kw}")
    if kw == "FROM":
        m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest.strip(), re.I)
        if not m:
            errors.append(f"bad FROM: {rest}")
            continue
        image, name = m.groups()
        if not re.search(r":\S", image.replace("${CUDA_VERSION}", "x")):
            errors.append(f"FROM without a tag: {image}")
        stages.append(name)
        last = name
    elif kw == "COPY":
        m = re.search(r"--from=(\S+)", rest)
        if m and m.group(1) not in stages[:-1]:
            errors.append(f"COPY --from={m.group(1)} names no earlier stage")
    elif kw == "USER":
        user_by_stage[last] = rest.strip()
    if kw in ("CMD", "ENTRYPOINT", "HEALTHCHECK") and "[" in rest:
        try:
            json.loads(rest[rest.index("["):])
        except ValueError as e:
            errors.append(f"{kw} exec form is not valid JSON: {e}")
final_stage = stages[-1] if stages else None
tail = instrs[max(i for i, x in enumerate(instrs) if x.startswith("FROM ")):]
def has(prefix):
    return any(x.startswith(prefix) for x in tail)
if len(stages) < 2:
    errors.append("expected a multi-stage build")
if user_by_stage.get(final_stage, "root") in ("root", "0"):
    errors.append("final stage runs as root")
expose = " ".join(x[len("EXPOSE "):] for x in tail if x.startswith("EXPOSE "))
for port in ("8001", "8002"):
    if port not in expose.split():
        errors.append(f"final stage does not EXPOSE {port}")
if not has("HEALTHCHECK") or "health" not in next(x for x in tail if x.startswith("HEALTHCHECK")):
    errors.append("final stage has no layerctl health HEALTHCHECK")
if not any(x.startswith("ENTRYPOINT") and "layerserve" in x for x in tail):
    errors.append("final stage ENTRYPOINT is not layerserve")
if not any("LAYERSERVE_BUILD_TESTS=OFF" in x for x in instrs):
    errors.append("build does not turn tests off")
# Nothing the CMake build reads may be excluded by .dockerignore.
patterns = [p.strip().rstrip("/") for p in open(os.path.join(root, ".dockerignore"))
            if p.strip() and not p.startswith("#")]
needed = {"CMakeLists.txt"} | set(
    re.findall(r"add_subdirectory\((\S+?)\)", open(os.path.join(root, "CMakeLists.txt")).read()))
for path in sorted(needed):
    for pat in patterns:
        if fnmatch.fnmatch(path, pat) or path.startswith(pat + "/"):
            errors.append(f".dockerignore pattern {pat!r} excludes {path}, which the build needs")
for e in errors:
    print("Dockerfile:", e, file=sys.stderr)
sys.exit(1 if errors else 0)
PY

# --- 2. compose ----------------------------------------------------------------
compose=(docker-compose -f "$deploy/docker-compose.yml")
for profile in "" gpu cpu; do
  args=()
  [[ -n $profile ]] && args=(--profile "$profile")
  log "docker-compose config -q ${args[*]:-(no profile)}"
  "${compose[@]}" "${args[@]}" config -q
done
services="$("${compose[@]}" config --services | sort | tr '\n' ' ')"
[[ $services == "grafana layerserve-cpu layerserve-gpu prometheus " ]] ||
  die "unexpected compose services: $services"
gpu_config="$("${compose[@]}" --profile gpu config)"
grep -q 'driver: nvidia' <<<"$gpu_config" || die "the gpu profile lost its device reservation"

# --- 3. Prometheus rules and config --------------------------------------------
log "promtool check config / check rules / test rules"
promtool check config --syntax-only "$deploy/prometheus/prometheus.yml" >/dev/null
promtool check rules "$deploy/prometheus/rules/"*.yml
(cd "$deploy/prometheus/tests" && promtool test rules ./*.yml)

# --- 4. dashboard --------------------------------------------------------------
log "Grafana dashboard and provisioning"
"$PYTHON" - "$deploy" <<'PY'
import json, os, sys
deploy = sys.argv[1]
dash = json.load(open(os.path.join(deploy, "grafana/dashboards/layerserve.json")))
ds = open(os.path.join(deploy, "grafana/provisioning/datasources/prometheus.yml")).read()
assert "uid: layerserve-prom" in ds, "datasource uid is not layerserve-prom"
bad = [p["title"] for p in dash["panels"] if p["type"] != "row"
       and (p["datasource"]["uid"] != "layerserve-prom"
            or any(t["datasource"]["uid"] != "layerserve-prom" for t in p["targets"]))]
assert not bad, f"panels not on the layerserve-prom datasource: {bad}"
ids = [p["id"] for p in dash["panels"]]
assert len(ids) == len(set(ids)), "duplicate panel ids"
print(f"dashboard: {sum(len(p.get('targets', [])) for p in dash['panels'])} queries in "
      f"{len(dash['panels'])} panels")
PY

# --- 5. live server: metric names ----------------------------------------------
# start_server <name> [flags...]: starts layerserve on loopback ports picked
# by the kernel and sets grpc_port and metrics_port from its ready line.
start_server() {
  local name=$1 ready="" pid
  shift
  "$server_bin" --host 127.0.0.1 --grpc-port 0 --metrics-port 0 --backend cpu --cpu-threads 2 \
    "$@" >"$work/$name.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 1 120); do  # 60 s
    ready="$(grep -m1 '^layerserve ready:' "$work/$name.log" || true)"
    [[ -n $ready ]] && break
    kill -0 "$pid" 2>/dev/null || { cat "$work/$name.log" >&2; die "server $name exited"; }
    sleep 0.5
  done
  [[ -n $ready ]] || { cat "$work/$name.log" >&2; die "server $name: no ready line within 60 s"; }
  grpc_port="$(sed -n 's/.* grpc_port=\([0-9]*\).*/\1/p' <<<"$ready")"
  metrics_port="$(sed -n 's/.* metrics_port=\([0-9]*\).*/\1/p' <<<"$ready")"
  [[ -n $grpc_port && -n $metrics_port ]] || die "cannot parse ready line: $ready"
}

log "starting $server_bin on loopback"
start_server full
log "server ready: grpc $grpc_port, metrics $metrics_port"
"$ctl_bin" health --url "127.0.0.1:$grpc_port" >/dev/null || die "layerctl health is not SERVING"
# One request, so that every labelled family has a series in the scrape.
run_tracked "$ctl_bin" bench --url "127.0.0.1:$grpc_port" --model demo --tokens 4 --concurrency 1 \
  --duration-s 1 --warmup-s 0 --no-progress >/dev/null
curl -fsS --max-time 10 "http://127.0.0.1:$metrics_port/metrics" >"$work/scrape.txt"

# Every PromQL expression of the dashboard, the rules, the HPA and the adapter.
"$PYTHON" - "$deploy" "$work/scrape.txt" "$LAYERSERVE_ROOT/server/metrics/prometheus_metrics.h" \
  "$work/queries.json" <<'PY'
import glob, json, os, re, sys, yaml
deploy, scrape, header, out = sys.argv[1:]
exprs = []  # (where, expr)
dash = json.load(open(os.path.join(deploy, "grafana/dashboards/layerserve.json")))
for p in dash["panels"]:
    for t in p.get("targets", []):
        exprs.append(("dashboard: " + p["title"], t["expr"]))
for v in dash["templating"]["list"]:
    exprs.append(("dashboard variable " + v["name"], v["definition"]))
for f in glob.glob(os.path.join(deploy, "prometheus/rules/*.yml")):
    for g in yaml.safe_load(open(f))["groups"]:
        for r in g["rules"]:
            exprs.append((f"rule {r.get('record') or r.get('alert')}", str(r["expr"])))
adapter = yaml.safe_load(open(os.path.join(deploy, "k8s/prometheus-adapter-values.yaml")))
for r in adapter["rules"]["custom"]:
    exprs.append(("adapter seriesQuery", r["seriesQuery"]))
hpa = yaml.safe_load(open(os.path.join(deploy, "k8s/hpa.yaml")))
for m in hpa["spec"]["metrics"]:
    exprs.append(("hpa metric", m["pods"]["metric"]["name"]))

exported = set(re.findall(r"^# TYPE (layerserve_\w+) ", open(scrape).read(), re.M))
declared = set(re.findall(r"(layerserve_\w+)\{", open(header).read()))
cuda_only = {"layerserve_kernel_duration_seconds", "layerserve_gpu_memory_used_bytes"}
assert cuda_only <= declared, "CUDA-only families missing from prometheus_metrics.h"
missing = []
for where, e in exprs:
    # A metric name: not part of a recorded name (level:metric:ops).
    for name in re.findall(r"(?<![\w:])(layerserve_[a-z0-9_]+)", e):
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        ok = family in exported or (family in cuda_only and family in declared)
        if not ok:
            missing.append(f"{where}: {name}")
for m in missing:
    print("unknown metric:", m, file=sys.stderr)
if missing:
    sys.exit(1)
# Queries for the live Prometheus: the dashboard's, with Grafana's variables
# filled in, and whether they must return a series on the CPU backend.
live = []
for where, e in exprs:
    if where.startswith("dashboard: "):
        q = e.replace("$__rate_interval", "30s").replace("$model", ".*")
        live.append({"where": where, "query": q,
                     "needs_data": not any(c in q for c in cuda_only)})
json.dump(live, open(out, "w"))
print(f"metric names: {len(exprs)} expressions, all names exported "
      f"({len(exported)} families live; CPU backend: {sorted(cuda_only)} checked in the header)")
PY

# --- 6. live Prometheus ----------------------------------------------------------
prom_port="$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$PYTHON" - "$deploy" "$work/prometheus.yml" "$metrics_port" <<'PY'
import os, sys, yaml
deploy, out, port = sys.argv[1:]
cfg = yaml.safe_load(open(os.path.join(deploy, "prometheus/prometheus.yml")))
cfg["global"]["scrape_interval"] = "1s"
cfg["global"]["evaluation_interval"] = "1s"
cfg["rule_files"] = [os.path.join(deploy, "prometheus/rules/*.yml")]
(job,) = cfg["scrape_configs"]
job["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
yaml.safe_dump(cfg, open(out, "w"))
PY
promtool check config "$work/prometheus.yml"
log "starting prometheus on 127.0.0.1:$prom_port"
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/tsdb" \
  --web.listen-address="127.0.0.1:$prom_port" >"$work/prometheus.log" 2>&1 &
pids+=("$!")
prom="http://127.0.0.1:$prom_port"
for _ in $(seq 1 60); do  # 30 s
  curl -fsS --max-time 2 "$prom/-/ready" >/dev/null 2>&1 && break
  kill -0 "${pids[-1]}" 2>/dev/null || { cat "$work/prometheus.log" >&2; die "prometheus exited"; }
  sleep 0.5
done
curl -fsS --max-time 2 "$prom/-/ready" >/dev/null || die "prometheus not ready within 30 s"
# Ready is not scraped: wait for the first successful scrape of the server.
up_query="$prom/api/v1/query?query=up%7Bjob%3D%22layerserve%22%7D%3D%3D1"
for _ in $(seq 1 60); do  # 30 s
  curl -fsS --max-time 2 "$up_query" 2>/dev/null | grep -q '"value"' && break
  sleep 0.5
done
curl -fsS --max-time 2 "$up_query" | grep -q '"value"' ||
  { tail -n 20 "$work/prometheus.log" >&2; die "prometheus has not scraped the server within 30 s"; }

log "layerctl bench for 5 s while prometheus scrapes every second"
run_tracked "$ctl_bin" bench --url "127.0.0.1:$grpc_port" --model demo --tokens 8 --concurrency 4 \
  --duration-s 5 --no-progress >"$work/bench.txt"
sleep 3  # a few scrapes after the last request

"$PYTHON" - "$prom" "$work/queries.json" <<'PY'
import json, math, sys, time, urllib.parse, urllib.request
prom, queries = sys.argv[1], json.load(open(sys.argv[2]))
def query(q):
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body["status"] != "success":
        raise RuntimeError(f"{q}: {body}")
    return body["data"]["result"]
p99_q = ("histogram_quantile(0.99, sum by (le) "
         "(rate(layerserve_request_duration_seconds_bucket[30s])))")
p99 = None
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    res = query(p99_q)
    if res and math.isfinite(float(res[0]["value"][1])) and float(res[0]["value"][1]) > 0:
        p99 = float(res[0]["value"][1])
        break
    time.sleep(1)
if p99 is None:
    counts = query("layerserve_request_duration_seconds_count[60s]")
    sys.exit(f"no finite p99 from prometheus within 20 s: {p99_q}\n"
             f"last result: {res}\nrequest counts scraped: {counts}")
print(f"prometheus: p99 request latency over the bench = {p99 * 1e3:.2f} ms")
up = query('up{job="layerserve"}')
assert up and up[0]["value"][1] == "1", f"scrape target not up: {up}"
empty = []
for q in queries:
    res = query(q["query"])
    if q["needs_data"] and not res:
        empty.append(q["where"])
if empty:
    sys.exit("dashboard queries with no data after the bench: " + "; ".join(empty))
rules = json.load(urllib.request.urlopen(f"{prom}/api/v1/rules", timeout=10))["data"]["groups"]
bad = [r["name"] for g in rules for r in g["rules"] if r.get("health") == "err"]
assert rules and not bad, f"rules not loaded or failing: {bad or 'no groups'}"
print(f"prometheus: {len(queries)} dashboard queries answered, "
      f"{sum(len(g['rules']) for g in rules)} rules loaded")
PY
log "bench: $(grep -m1 -i 'requests/s\|req/s' "$work/bench.txt" || head -n1 "$work/bench.txt")"

# --- 7. split-model recipe -------------------------------------------------------
log "split-model recipe: layers 0:2 then 2:4, chained with layerctl infer"
full_port=$grpc_port
start_server first --layers 0:2
first_port=$grpc_port
start_server second --layers 2:4
second_port=$grpc_port
"$PYTHON" -c 'import numpy as np, sys
np.save(sys.argv[1], np.random.default_rng(0).standard_normal((2, 16, 512)).astype("<f4"))' "$work/x.npy"
"$ctl_bin" infer --url "127.0.0.1:$first_port" --model demo --input "$work/x.npy" --output "$work/h.npy" >/dev/null
"$ctl_bin" infer --url "127.0.0.1:$second_port" --model demo --input "$work/h.npy" --output "$work/y.npy" >/dev/null
"$ctl_bin" infer --url "127.0.0.1:$full_port" --model demo --input "$work/x.npy" --output "$work/ref.npy" >/dev/null
"$PYTHON" - "$work/y.npy" "$work/ref.npy" <<'PY'
import sys
import numpy as np
y, ref = np.load(sys.argv[1]), np.load(sys.argv[2])
assert y.shape == ref.shape, f"shape {y.shape} != {ref.shape}"
err = np.abs(y.astype(np.float64) - ref)
worst = np.unravel_index(np.argmax(err), err.shape)
if err[worst] > 1e-5 * max(1.0, float(np.abs(ref).max())):
    sys.exit(f"chained 0:2 -> 2:4 differs from 0:4: worst at {worst}: {y[worst]} vs {ref[worst]}")
print(f"split-model recipe: chained output equals the full model's (max abs diff {err[worst]:.3g})")
PY
