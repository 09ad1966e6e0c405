#!/usr/bin/env bash
# One-shot probe of the server under load at 1 token per request, concurrency 64
# (docs/perf.md "The server under load": where the ~2.5 ms between the client's
# latency and the server's own request time goes, and which knob moves
# throughput). Closed-loop `layerctl bench` runs over a small matrix: baseline,
# --streams 1 and 4, --max-queue-delay-us 0 and 500, BF16 on the wire, 2x32
# and 4x16 client processes, one process over 8 connections, the async
# (callback API) client in open loop, and batching off. One summary line per setting on stdout (also OUT_DIR/summary.txt):
# client tok/s and latency, and the server's /metrics deltas over the measured
# window (scraped when the warm-up ends and after the clients exit), process CPU
# per request, and for the baseline the server's busiest threads (top -H).
#   bash bench/server/probe.sh BIN_DIR OUT_DIR [layerserve args...]
# Same conventions as load_matrix.sh (loopback, ports from the ready line). Env:
# PROBE_DURATION_S (4), PROBE_WARMUP_S (1), PROBE_CONCURRENCY (64),
# PROBE_TOKENS (1), PROBE_OPEN_RATE (40000 req/s offered to the async client).
set -uo pipefail
bin=$1 out=$2
shift 2
server_args=("$@")
duration_s=${PROBE_DURATION_S:-4}
warmup_s=${PROBE_WARMUP_S:-1}
concurrency=${PROBE_CONCURRENCY:-64}
tokens=${PROBE_TOKENS:-1}
open_rate=${PROBE_OPEN_RATE:-40000}
clk_tck=$(getconf CLK_TCK)
for tool in layerserve layerctl; do
  [[ -x $bin/$tool ]] || { echo "probe.sh: $bin/$tool not found (BIN_DIR must hold layerserve and layerctl)" >&2; exit 2; }
done
command -v top > /dev/null || echo "probe.sh: no top here; the thread listing will be empty" >&2
# Six servers start here. Where the server autotunes its GEMMs at load, one
# cache keeps later starts short and every setting on the same kernel choices.
server_flags=$("$bin/layerserve" --help 2>&1)
if [[ $server_flags == *--gemm-tune-cache* && " ${server_args[*]} " != *gemm?tune?cache* ]]; then
  server_args+=("--gemm-tune-cache=$out/gemm_tune_cache.json")
fi
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
helper="$out/probe_helper.py"
server_pid=""

# Metric parsing and the summary line; kept beside the results so they can be
# re-summarized by hand.
cat > "$helper" <<'PY'
"""Helper of bench/server/probe.sh: scrape, per-thread CPU, one summary line."""
import collections, glob, json, os, re, sys, time, urllib.request

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')

def metrics(path):
    """{(name, labels): value} of a Prometheus text file (empty if missing)."""
    out = {}
    if os.path.exists(path):
        for line in open(path):
            m = LINE.match(line)
            if m and not line.startswith('#'):
                out[(m.group(1), m.group(2) or '')] = float(m.group(3))
    return out

def total(m, name, label_has=''):
    return sum(v for (n, l), v in m.items() if n == name and label_has in l)

def delta(a, b, name, label_has=''):
    return total(b, name, label_has) - total(a, name, label_has)

def sample_threads(pid, seconds, period_s=0.05):
    """Per thread of pid over `seconds`: name, CPU %, and the share of samples
    in each kernel wait channel ("R" when running), busiest first."""
    def read(task):
        stat = open(f'{task}/stat').read()
        fields = stat[stat.rindex(')') + 2:].split()
        wchan = open(f'{task}/wchan').read().strip() if fields[0] != 'R' else 'R'
        return int(fields[11]) + int(fields[12]), wchan or fields[0]
    first, states, names = {}, {}, {}
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for task in glob.glob(f'/proc/{pid}/task/*'):
            tid = os.path.basename(task)
            try:
                ticks, wchan = read(task)
                names.setdefault(tid, open(f'{task}/comm').read().strip())
            except OSError:
                continue
            first.setdefault(tid, ticks)
            states.setdefault(tid, collections.Counter())[wchan] += 1
            last_ticks[tid] = ticks
        time.sleep(period_s)
    elapsed = time.monotonic() - start
    rows = []
    for tid, counter in states.items():
        pct = 100.0 * (last_ticks[tid] - first[tid]) / CLK_TCK / elapsed
        n = sum(counter.values())
        waits = ' '.join(f'{w}:{100 * c / n:.0f}%' for w, c in counter.most_common(3))
        rows.append((pct, tid, names[tid], waits))
    rows.sort(reverse=True)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for pct, _, name, _ in rows:
        by_name[name][0] += 1
        by_name[name][1] += pct
    lines = [f'server threads over {elapsed:.1f} s (CPU %, where they wait):']
    lines += [f'  {tid:>8} {name:<16} {pct:6.1f}%  {waits}' for pct, tid, name, waits in rows[:10]]
    lines.append('  by name: ' + ', '.join(
        f'{name} x{n} {pct:.0f}%' for name, (n, pct) in
        sorted(by_name.items(), key=lambda kv: -kv[1][1]) if pct >= 1))
    return '\n'.join(lines)

last_ticks = {}
CLK_TCK = os.sysconf('SC_CLK_TCK')

def fmt(x, spec='.2f'):
    return '-' if x is None else format(x, spec)

def summary(label, d, layers, clk_tck):
    pre, before, after = (metrics(f'{d}/metrics_{w}.txt') for w in ('pre', 'before', 'after'))
    runs = [json.load(open(p)) for p in sorted(glob.glob(f'{d}/client[0-9]*.json'))]
    expected = len(glob.glob(f'{d}/client[0-9]*.txt'))
    if not runs or len(runs) != expected:
        return f'{label:<16} FAILED: {len(runs)} of {expected} clients wrote a report (see {d})'
    tok_s = sum(r['tokens_per_second'] for r in runs)
    p50 = sum(r['latency_ms']['p50'] for r in runs) / len(runs)
    p99 = max(r['latency_ms']['p99'] for r in runs)
    mean = sum(r['latency_ms']['mean'] for r in runs) / len(runs)
    failed = sum(r['requests_failed'] for r in runs)
    skipped = sum(r.get('skipped_arrivals', 0) for r in runs)

    def mean_of(name):
        n = delta(before, after, name + '_count')
        return delta(before, after, name + '_sum') / n if n > 0 else None

    ms = lambda x: None if x is None else 1e3 * x
    req_s = ms(mean_of('layerserve_request_duration_seconds'))
    queue_s = ms(mean_of('layerserve_queue_duration_seconds'))
    compute_s = ms(mean_of('layerserve_compute_duration_seconds'))
    other = None if None in (req_s, queue_s, compute_s) else req_s - queue_s - compute_s
    gap = None if req_s is None else mean - req_s
    batch_req = mean_of('layerserve_batch_size')
    batch_tok = mean_of('layerserve_batch_tokens')
    served_ok = delta(before, after, 'layerserve_requests_total', 'code="OK"')
    served_all = delta(before, after, 'layerserve_requests_total')
    # Sampled batches report gemm_down once per layer; their per-op device
    # times summed give the GPU time of one batch (with any overlap of the
    # other streams' kernels). CPU backend: no kernel series, "-".
    sampled = delta(before, after, 'layerserve_kernel_duration_seconds_count', 'op="gemm_down"')
    gpu = None
    if sampled > 0 and layers > 0:
        gpu = 1e3 * delta(before, after, 'layerserve_kernel_duration_seconds_sum') / (sampled / layers)
    # Server CPU over the measured window; client CPU over its whole run
    # (warm-up included), per request the server answered in that span.
    cpu = open(f'{d}/server_cpu.txt').read().split()
    server_us = (1e6 * (int(cpu[1]) - int(cpu[0])) / clk_tck / served_all) if served_all > 0 else None
    client_all = delta(pre, after, 'layerserve_requests_total')
    client_us = None
    try:
        real, user, sys_ = (float(x) for x in open(f'{d}/client_time.txt').read().split()[-3:])
        client_us = 1e6 * (user + sys_) / client_all if client_all > 0 else None
    except (OSError, ValueError):
        pass
    extra = f' fail={failed}' if failed else ''
    extra += f' skipped={skipped}' if skipped else ''
    return (f'{label:<16} tok/s={tok_s:8.0f} p50={p50:6.2f} p99={p99:6.2f} mean={mean:6.2f} | '
            f'srv req={fmt(req_s)} queue={fmt(queue_s)} compute={fmt(compute_s)} '
            f'other={fmt(other)} gap={fmt(gap)} ms | batch={fmt(batch_req, ".1f")} req '
            f'{fmt(batch_tok, ".1f")} tok gpu={fmt(gpu)} ms | served={served_ok:.0f}'
            f'/{served_all:.0f} | cpu us/req srv={fmt(server_us, ".0f")} '
            f'cli={fmt(client_us, ".0f")}{extra}')

cmd = sys.argv[1]
if cmd == 'scrape':
    try:
        text = urllib.request.urlopen(sys.argv[2], timeout=5).read().decode()
    except OSError as e:
        text = f'# scrape failed: {e}\n'
    open(sys.argv[3], 'w').write(text)
elif cmd == 'threads':
    print(sample_threads(sys.argv[2], float(sys.argv[3])))
elif cmd == 'summary':
    print(summary(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))
PY

cpu_ticks() {  # utime + stime of a process, in clock ticks
  local stat
  stat=$(< "/proc/$1/stat") || { echo 0; return; }
  stat=${stat##*) }
  local -a f
  read -ra f <<< "$stat"
  echo $((f[11] + f[12]))
}

# shellcheck source=bench/server/server_process.sh
source "$(dirname "${BASH_SOURCE[0]}")/server_process.sh"
trap stop_server EXIT

scrape() { python3 "$helper" scrape "http://127.0.0.1:$metrics_port/metrics" "$1"; }

# run_setting LABEL PROCS [layerctl bench args...]: PROCS client processes at
# once against the running server; prints and records one summary line.
run_setting() {
  local label=$1 procs=$2
  shift 2
  local d="$out/$label"
  rm -rf "$d" && mkdir -p "$d"
  scrape "$d/metrics_pre.txt"
  (
    TIMEFORMAT='%R %U %S'
    time {
      for ((i = 0; i < procs; i++)); do
        "$bin/layerctl" bench --url="127.0.0.1:$grpc_port" --model="$model" --tokens="$tokens" \
          --duration-s="$duration_s" --warmup-s="$warmup_s" --no-progress --json="$d/client$i.json" \
          "$@" > "$d/client$i.txt" 2>&1 &
      done
      wait
    }
  ) 2> "$d/client_time.txt" &
  local clients=$!
  sleep "$warmup_s"
  scrape "$d/metrics_before.txt"
  local ticks_before
  ticks_before=$(cpu_ticks "$server_pid")
  local sampler=""
  if [[ $label == baseline ]]; then
    python3 "$helper" threads "$server_pid" "$(awk -v d="$duration_s" 'BEGIN {print d - 0.5}')" \
      > "$out/server_threads.txt" 2>&1 &
    sampler=$!
    sleep 1
    # Two frames: top's first one does not cover a fresh interval.
    top -b -H -n 2 -d 1 -p "$server_pid" > "$out/top_server_threads.txt" 2>&1
  fi
  wait "$clients"
  local ticks_after
  ticks_after=$(cpu_ticks "$server_pid")
  scrape "$d/metrics_after.txt"
  echo "$ticks_before $ticks_after" > "$d/server_cpu.txt"
  python3 "$helper" summary "$label" "$d" "$layers" "$clk_tck" | tee -a "$summary"
  if [[ -n $sampler ]]; then
    wait "$sampler"
    echo "10 busiest server threads (top -H, a 1 s frame mid-run, in $out/top_server_threads.txt;" \
      "the row whose PID is the server's may show the whole process):"
    awk '/^ *PID +USER/ {n = NR} {line[NR] = $0} END {if (n) for (i = n; i <= n + 10 && i <= NR; i++) print line[i]}' \
      "$out/top_server_threads.txt"
    tee -a "$summary" < "$out/server_threads.txt"
  fi
}

c=$concurrency
echo "# probe: ${tokens}-token requests, concurrency $c, ${duration_s} s after ${warmup_s} s warm-up; server args: ${server_args[*]}" | tee -a "$summary"
echo "# ms: client p50/p99/mean; srv req/queue/compute = server means over the window (compute per batch); other = req - queue - compute (handler + reply loop); gap = client mean - srv req; gpu = device time per sampled batch; served = OK/all in the window" | tee -a "$summary"

# One server for the settings that change only the client.
if start_server "$out/server_baseline.log" "${server_args[@]}"; then
  run_setting baseline 1 --concurrency="$c"
  run_setting bf16 1 --concurrency="$c" --datatype=BF16
  run_setting clients-2x$((c / 2)) 2 --concurrency=$((c / 2))
  run_setting clients-4x$((c / 4)) 4 --concurrency=$((c / 4))
  run_setting connections-8 1 --concurrency="$c" --connections=8
  # The callback-API client: one thread issues, gRPC threads complete; at most
  # c outstanding, arrivals beyond that are skipped (a closed loop in effect).
  run_setting async-open 1 --rate="$open_rate" --arrivals=uniform --max-in-flight="$c"
  stop_server
else
  echo "baseline: server did not start (see $out/server_baseline.log)" | tee -a "$summary"
fi

# Later flags win over SERVER_ARGS (absl flags: the last value counts).
for setting in "streams-1 --streams=1" "streams-4 --streams=4" "delay-0us --max-queue-delay-us=0" \
               "delay-500us --max-queue-delay-us=500" "batching-off --max-batch-tokens=$tokens"; do
  read -r label flag <<< "$setting"
  if start_server "$out/server_$label.log" "${server_args[@]}" "$flag"; then
    run_setting "$label" 1 --concurrency="$c"
    stop_server
  else
    echo "$label: server did not start (see $out/server_$label.log)" | tee -a "$summary"
  fi
done
echo "# probe done in ${SECONDS} s; details under $out" | tee -a "$summary"
