#!/usr/bin/env python3
"""One-shot probe of the server under load at 1 token per request, concurrency 64
(docs/log/serving.md "The server under load": where the ~2.5 ms between the client's
latency and the server's own request time goes, and which knob moves
throughput). Closed-loop `layerctl bench` runs over a small matrix: baseline,
--streams 1 and 4, --max-queue-delay-us 0 and 500, BF16 on the wire, 2x32 and
4x16 client processes, one process over 8 connections, the async (callback
API) client in open loop, and batching off. One summary line per setting on
stdout (also OUT_DIR/summary.txt): client tok/s and latency, and the server's
/metrics deltas over the measured window (scraped when the warm-up ends and
after the clients exit), process CPU per request, and for the baseline the
server's busiest threads (top -H and a /proc sampler).

  python3 bench/server/probe.py BIN_DIR OUT_DIR [layerserve args...]

BIN_DIR holds layerserve and layerctl. Servers listen on loopback, on the
ports their ready line names (tests/support/layerserve_process.py, shared
with the tests and load_matrix.py). Env: PROBE_DURATION_S (4),
PROBE_WARMUP_S (1), PROBE_CONCURRENCY (64), PROBE_TOKENS (1), PROBE_OPEN_RATE
(40000 req/s offered to the async client). PROBE_SETTINGS replaces the matrix
with settings of your own, run in the order given (repeat labels to
interleave an A/B): 'label=server flags;...', e.g. 'jit=;no-jit=--max-device-wait-us=0;
jit=;no-jit=--max-device-wait-us=0', each client with PROBE_CLIENT_ARGS (e.g.
--connections=8; with --rate=R there, an open loop instead of the concurrency).

A setting whose clients had failures gets, under its line, one line per
error code with the first message a client kept (bench_errors.py).

Each setting's directory keeps what its line is computed from (the three
scrapes, the clients' JSON reports, the CPU counts), so summary_line() can
recompute it later by hand.
"""

import argparse
import collections
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from layerserve_process import (LayerserveProcess, ServerStartError,  # noqa: E402
                                parse_samples)
from bench_errors import merged_error_lines  # noqa: E402
from metrics_delta import delta, gpu_ms_per_batch, histogram_mean  # noqa: E402
from summary_log import summary_emitter  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
READY_TIMEOUT_S = 60
STOP_TIMEOUT_S = 10  # the clients have finished: the drain has nothing to wait for


def cpu_ticks(pid):
    """utime + stime of a process, in clock ticks (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def sample_threads(pid, seconds, period_s=0.05):
    """Per thread of pid over `seconds`: name, CPU %, and the share of samples
    in each kernel wait channel ("R" when running), busiest first."""
    def read(task):
        stat = open(f"{task}/stat").read()
        fields = stat[stat.rindex(")") + 2:].split()
        wchan = open(f"{task}/wchan").read().strip() if fields[0] != "R" else "R"
        return int(fields[11]) + int(fields[12]), wchan or fields[0]
    first, last, states, names = {}, {}, {}, {}
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for task in glob.glob(f"/proc/{pid}/task/*"):
            tid = os.path.basename(task)
            try:
                ticks, wchan = read(task)
                names.setdefault(tid, open(f"{task}/comm").read().strip())
            except OSError:
                continue
            first.setdefault(tid, ticks)
            states.setdefault(tid, collections.Counter())[wchan] += 1
            last[tid] = ticks
        time.sleep(period_s)
    elapsed = time.monotonic() - start
    rows = []
    for tid, counter in states.items():
        pct = 100.0 * (last[tid] - first[tid]) / CLK_TCK / elapsed
        n = sum(counter.values())
        waits = " ".join(f"{w}:{100 * c / n:.0f}%" for w, c in counter.most_common(3))
        rows.append((pct, tid, names[tid], waits))
    rows.sort(reverse=True)
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for pct, _, name, _ in rows:
        by_name[name][0] += 1
        by_name[name][1] += pct
    lines = [f"server threads over {elapsed:.1f} s (CPU %, where they wait):"]
    lines += [f"  {tid:>8} {name:<16} {pct:6.1f}%  {waits}" for pct, tid, name, waits in rows[:10]]
    lines.append("  by name: " + ", ".join(
        f"{name} x{n} {pct:.0f}%" for name, (n, pct) in
        sorted(by_name.items(), key=lambda kv: -kv[1][1]) if pct >= 1))
    return "\n".join(lines)


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def summary_line(label, d, layers):
    """The summary line of one setting, from the files under its directory d."""
    def scraped(when):
        path = Path(d) / f"metrics_{when}.txt"
        return parse_samples(path.read_text()) if path.exists() else {}
    pre, before, after = scraped("pre"), scraped("before"), scraped("after")

    runs = [json.load(open(p)) for p in sorted(glob.glob(f"{d}/client[0-9]*.json"))]
    expected = len(glob.glob(f"{d}/client[0-9]*.txt"))
    if not runs or len(runs) != expected:
        return f"{label:<16} FAILED: {len(runs)} of {expected} clients wrote a report (see {d})"
    tok_s = sum(r["tokens_per_second"] for r in runs)
    p50 = sum(r["latency_ms"]["p50"] for r in runs) / len(runs)
    p99 = max(r["latency_ms"]["p99"] for r in runs)
    mean = sum(r["latency_ms"]["mean"] for r in runs) / len(runs)
    failed = sum(r["requests_failed"] for r in runs)
    skipped = sum(r.get("skipped_arrivals", 0) for r in runs)

    def mean_of(name):
        return histogram_mean(before, after, name)

    def ms(x):
        return None if x is None else 1e3 * x

    req_s = ms(mean_of("layerserve_request_duration_seconds"))
    queue_s = ms(mean_of("layerserve_queue_duration_seconds"))
    compute_s = ms(mean_of("layerserve_compute_duration_seconds"))
    other = None if None in (req_s, queue_s, compute_s) else req_s - queue_s - compute_s
    gap = None if req_s is None else mean - req_s
    batch_req = mean_of("layerserve_batch_size")
    batch_tok = mean_of("layerserve_batch_tokens")
    served_ok = delta(before, after, "layerserve_requests_total", code="OK")
    served_all = delta(before, after, "layerserve_requests_total")
    # GPU time per sampled batch (metrics_delta.py). CPU backend: no kernel series, "-".
    gpu = gpu_ms_per_batch(before, after, layers)[0]
    # Server CPU over the measured window; client CPU over its whole run
    # (warm-up included), per request the server answered in that span.
    cpu = open(f"{d}/server_cpu.txt").read().split()
    server_us = (1e6 * (int(cpu[1]) - int(cpu[0])) / CLK_TCK / served_all) if served_all > 0 else None
    client_all = delta(pre, after, "layerserve_requests_total")
    client_us = None
    try:
        real, user, sys_ = (float(x) for x in open(f"{d}/client_time.txt").read().split()[-3:])
        client_us = 1e6 * (user + sys_) / client_all if client_all > 0 else None
    except (OSError, ValueError):
        pass
    extra = f" fail={failed}" if failed else ""
    extra += f" skipped={skipped}" if skipped else ""
    return (f"{label:<16} tok/s={tok_s:8.0f} p50={p50:6.2f} p99={p99:6.2f} mean={mean:6.2f} | "
            f"srv req={fmt(req_s)} queue={fmt(queue_s)} compute={fmt(compute_s)} "
            f"other={fmt(other)} gap={fmt(gap)} ms | batch={fmt(batch_req, '.1f')} req "
            f"{fmt(batch_tok, '.1f')} tok gpu={fmt(gpu)} ms | served={served_ok:.0f}"
            f"/{served_all:.0f} | cpu us/req srv={fmt(server_us, '.0f')} "
            f"cli={fmt(client_us, '.0f')}{extra}"
            + "".join(f"\n{line}" for line in merged_error_lines(runs)))


class Probe:
    def __init__(self, bin_dir, out, server_args):
        self.bin = Path(bin_dir)
        self.out = Path(out)
        self.server_args = server_args
        self.duration = os.environ.get("PROBE_DURATION_S", "4")
        self.warmup = os.environ.get("PROBE_WARMUP_S", "1")
        self.concurrency = int(os.environ.get("PROBE_CONCURRENCY", "64"))
        self.tokens = int(os.environ.get("PROBE_TOKENS", "1"))
        self.open_rate = os.environ.get("PROBE_OPEN_RATE", "40000")
        self.emit = summary_emitter(self.out / "summary.txt")
        self.server = None

    def scrape(self, path):
        try:
            text = self.server.scrape(timeout_s=5)[2]
        except OSError as e:
            text = f"# scrape failed: {e}\n"
        path.write_text(text)

    def start_server(self, label, *flags):
        log = self.out / f"server_{label}.log"
        try:
            self.server = LayerserveProcess(self.bin / "layerserve", [*self.server_args, *flags],
                                            log, ready_timeout_s=READY_TIMEOUT_S)
            return True
        except ServerStartError as e:
            print("\n".join(str(e).splitlines()[-5:]), file=sys.stderr)
            self.emit(f"{label}: server did not start (see {log})")
            return False

    def stop_server(self):
        self.server.stop(timeout_s=STOP_TIMEOUT_S)
        self.server = None

    def run_setting(self, label, procs, *bench_args):
        """procs client processes at once against the running server; prints
        and records one summary line."""
        d = self.out / label
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        self.scrape(d / "metrics_pre.txt")
        started = time.monotonic()
        clients = []
        for i in range(procs):
            with open(d / f"client{i}.txt", "w") as log:
                clients.append(subprocess.Popen(
                    [self.bin / "layerctl", "bench", f"--url={self.server.grpc_url}",
                     f"--model={self.server.model}", f"--tokens={self.tokens}",
                     f"--duration-s={self.duration}", f"--warmup-s={self.warmup}", "--no-progress",
                     f"--json={d / f'client{i}.json'}", *bench_args],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        time.sleep(float(self.warmup))
        self.scrape(d / "metrics_before.txt")
        ticks_before = cpu_ticks(self.server.pid)
        sampler = None
        if label == "baseline":
            sampler = threading.Thread(target=self.sample_threads, daemon=True)
            sampler.start()
            time.sleep(1)
            # Two frames: top's first one does not cover a fresh interval.
            with open(self.out / "top_server_threads.txt", "w") as f:
                if shutil.which("top"):
                    subprocess.run(["top", "-b", "-H", "-n", "2", "-d", "1", "-p",
                                    str(self.server.pid)], stdout=f, stderr=subprocess.STDOUT)
        # wait4 gives each client's own CPU time, as `time` did around them.
        user = sys_ = 0.0
        for client in clients:
            _, status, usage = os.wait4(client.pid, 0)
            client.returncode = os.waitstatus_to_exitcode(status)
            user += usage.ru_utime
            sys_ += usage.ru_stime
        (d / "client_time.txt").write_text(f"{time.monotonic() - started:.3f} {user:.3f} {sys_:.3f}\n")
        ticks_after = cpu_ticks(self.server.pid)
        self.scrape(d / "metrics_after.txt")
        (d / "server_cpu.txt").write_text(f"{ticks_before} {ticks_after}\n")
        layers = self.server.layers[1] - self.server.layers[0]
        self.emit(summary_line(label, d, layers))
        if sampler:
            sampler.join()
            top = self.out / "top_server_threads.txt"
            print(f"10 busiest server threads (top -H, a 1 s frame mid-run, in {top}; "
                  "the row whose PID is the server's may show the whole process):")
            lines = top.read_text(errors="replace").splitlines()
            header = [i for i, x in enumerate(lines) if re.match(r"^ *PID +USER", x)]
            if header:
                print("\n".join(lines[header[-1]:header[-1] + 11]))
            self.emit((self.out / "server_threads.txt").read_text().rstrip("\n"))

    def sample_threads(self):
        try:
            text = sample_threads(self.server.pid, float(self.duration) - 0.5)
        except Exception as e:  # the line says what went wrong instead of a thread traceback
            text = f"thread sampler failed: {e!r}"
        (self.out / "server_threads.txt").write_text(text + "\n")

    def run_custom(self, spec):
        """PROBE_SETTINGS: 'label=server flags;label=server flags;...', run in
        that order, each on its own server (a label may repeat, to interleave
        A/B runs), every client with PROBE_CLIENT_ARGS."""
        client_args = os.environ.get("PROBE_CLIENT_ARGS", "").split()
        # An open loop (--rate in the client args) sets its own load.
        load = ([] if any(a.startswith("--rate") for a in client_args)
                else [f"--concurrency={self.concurrency}"])
        for i, entry in enumerate(e for e in spec.split(";") if e.strip()):
            label, _, flags = entry.partition("=")
            label = f"{i + 1:02d}-{label.strip()}"
            if self.start_server(label, *flags.split()):
                self.run_setting(label, 1, *load, *client_args)
                self.stop_server()

    def run(self):
        c = self.concurrency
        spec = os.environ.get("PROBE_SETTINGS", "")
        if spec:
            self.emit(f"# probe: {self.tokens}-token requests, concurrency {c}, {self.duration} s "
                      f"after {self.warmup} s warm-up; server args: {' '.join(self.server_args)}; "
                      f"client args: {os.environ.get('PROBE_CLIENT_ARGS', '')}")
            return self.run_custom(spec)
        self.emit(f"# probe: {self.tokens}-token requests, concurrency {c}, {self.duration} s after "
                  f"{self.warmup} s warm-up; server args: {' '.join(self.server_args)}")
        self.emit("# ms: client p50/p99/mean; srv req/queue/compute = server means over the window "
                  "(compute per batch); other = req - queue - compute (handler + reply loop); "
                  "gap = client mean - srv req; gpu = device time per sampled batch; "
                  "served = OK/all in the window")
        # One server for the settings that change only the client.
        if self.start_server("baseline"):
            self.run_setting("baseline", 1, f"--concurrency={c}")
            self.run_setting("bf16", 1, f"--concurrency={c}", "--datatype=BF16")
            self.run_setting(f"clients-2x{c // 2}", 2, f"--concurrency={c // 2}")
            self.run_setting(f"clients-4x{c // 4}", 4, f"--concurrency={c // 4}")
            self.run_setting("connections-8", 1, f"--concurrency={c}", "--connections=8")
            # The callback-API client: one thread issues, gRPC threads complete;
            # at most c outstanding, arrivals beyond that are skipped (a closed
            # loop in effect).
            self.run_setting("async-open", 1, f"--rate={self.open_rate}", "--arrivals=uniform",
                             f"--max-in-flight={c}")
            self.stop_server()
        # Later flags win over the server args (absl flags: the last value counts).
        for label, flag in [("streams-1", "--streams=1"), ("streams-4", "--streams=4"),
                            ("delay-0us", "--max-queue-delay-us=0"),
                            ("delay-500us", "--max-queue-delay-us=500"),
                            ("batching-off", f"--max-batch-tokens={self.tokens}")]:
            if self.start_server(label, flag):
                self.run_setting(label, 1, f"--concurrency={c}")
                self.stop_server()


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin_dir", help="holds layerserve and layerctl")
    parser.add_argument("out_dir", help="logs, scrapes, client reports and summary.txt")
    parser.add_argument("server_args", nargs=argparse.REMAINDER,
                        help="layerserve flags (model, backend, ...)")
    args = parser.parse_args()
    started = time.monotonic()
    for tool in ("layerserve", "layerctl"):
        if not os.access(Path(args.bin_dir) / tool, os.X_OK):
            print(f"probe.py: {args.bin_dir}/{tool} not found "
                  "(BIN_DIR must hold layerserve and layerctl)", file=sys.stderr)
            sys.exit(2)
    if not shutil.which("top"):
        print("probe.py: no top here; the thread listing will be empty", file=sys.stderr)
    server_args = list(args.server_args)
    # Six servers start here. Where the server autotunes its GEMMs at load (a
    # CUDA build; every build accepts the flag), one cache keeps later starts
    # short and every setting on the same kernel choices.
    if not re.search(r"gemm.tune.cache", " ".join(server_args)):
        server_args.append(f"--gemm-tune-cache={Path(args.out_dir) / 'gemm_tune_cache.json'}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    probe = Probe(args.bin_dir, out, server_args)
    try:
        probe.run()
    finally:
        if probe.server:
            probe.stop_server()
    probe.emit(f"# probe done in {time.monotonic() - started:.0f} s; details under {out}")


if __name__ == "__main__":
    main()
