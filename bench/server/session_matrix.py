#!/usr/bin/env python3
"""Decode through sessions against today's stateless 1-token requests, at
equal concurrency: for each N in --sessions, `layerctl bench --sessions N
--prefill P --steps S` (N sessions, a prefill of P tokens each, then S
one-token steps) and `layerctl bench --tokens 1 --concurrency N` (stateless,
every request on its own), on one layerserve. One line per run (also in
OUT_DIR/session_summary.txt) with decode tokens/s (over the whole decode
phase, and while all N sessions still ran, the like-for-like figure beside
a closed loop at concurrency N), step latency and how the
run's batches launched their layers ("graphs direct/captured/replayed", from
/metrics: session batches that keep meeting new CUDA graph keys cost more,
docs/log/serving.md), and the KV cache memory a session holds (from the start-up
line's bytes per token).
A run with failures is followed by one line per error code with its count
and the first message the client kept (bench_errors.py).

--streaming runs each N's sessions a second time, each session over its own
ModelStreamInfer stream (`layerctl bench --streaming`), as the row
`sessions-stream=N` beside the unary `sessions=N`: the two transports on
the same server, one after the other.

  python3 bench/server/session_matrix.py BIN_DIR OUT_DIR [layerserve args...]
      [--sessions 1,16,64,256] [--prefill 512] [--steps 256] [--streaming]

Env LOAD_CLIENT_ARGS adds layerctl bench flags to every run (e.g.
"--connections=8"); LOAD_DURATION_S (5) is the stateless runs' length.
scripts/gpu-run.sh's bench-sessions stage runs it.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from layerserve_process import LayerserveProcess, ServerStartError  # noqa: E402
from bench_errors import error_lines  # noqa: E402
from metrics_delta import launch_split  # noqa: E402
from summary_log import summary_emitter  # noqa: E402


def run_bench(bin_dir, server, out, name, flags):
    """The run's JSON report, or None if layerctl wrote none. A run in which
    every session or request failed exits 1 but still writes its report, so
    that its row shows the errors."""
    report = out / f"{name}.json"
    report.unlink(missing_ok=True)
    with open(out / f"{name}.txt", "w") as log:
        bench = subprocess.run(
            [bin_dir / "layerctl", "bench", f"--url={server.grpc_url}", f"--model={server.model}",
             f"--json={report}", *flags, *os.environ.get("LOAD_CLIENT_ARGS", "").split()],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if bench.returncode != 0:
        print(f"session_matrix.py: {name}: layerctl bench exited with {bench.returncode} "
              f"(see {out / f'{name}.txt'})", file=sys.stderr)
    if not report.exists():
        return None
    return json.loads(report.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--sessions", default="1,16,64,256")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--streaming", action="store_true",
                        help="also run each session row over streams (layerctl bench --streaming)")
    args, server_args = parser.parse_known_args()
    bin_dir, out = Path(args.bin_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    emit = summary_emitter(out / "session_summary.txt")

    try:
        server = LayerserveProcess(bin_dir / "layerserve", server_args, out / "server.log",
                                   ready_timeout_s=180)
    except ServerStartError as e:
        sys.exit(f"session_matrix.py: {e}")
    with server:
        match = re.search(r"\((\d+) bytes per token", server.log_text())
        per_token = int(match.group(1)) if match else 0
        session_tokens = args.prefill + args.steps
        emit(f"KV cache: {per_token} bytes per token; a session of {session_tokens} tokens holds "
             f"{per_token * session_tokens / 2**20:.1f} MiB (plus up to one partly filled block)")
        transports = [("sessions", [])]
        if args.streaming:
            transports.append(("sessions-stream", ["--streaming"]))
        for n in (int(x) for x in args.sessions.split(",")):
            for label, flags in transports:
                before = server.samples()
                r = run_bench(bin_dir, server, out, f"{label.replace('-', '_')}_{n}",
                              [f"--sessions={n}", f"--prefill={args.prefill}",
                               f"--steps={args.steps}", "--no-progress", *flags])
                if r:
                    lat = r["step_latency_ms"]
                    row = f"{label}={n}"
                    emit(f"{row:<19} decode {r['decode_tokens_per_second']:10.1f} tok/s "
                         f"(all {n} running: {r.get('steady_decode_tokens_per_second', 0):8.1f})  "
                         f"step ms p50 {lat['p50']:7.2f} p90 {lat['p90']:7.2f} "
                         f"p99 {lat['p99']:7.2f}  prefill p50 "
                         f"{r['prefill_latency_ms']['p50']:8.2f} ms  graphs "
                         f"{launch_split(before, server.samples())}  failed {r['sessions_failed']}")
                    for line in error_lines(r):
                        emit(line)
            before = server.samples()
            s = run_bench(bin_dir, server, out, f"stateless_{n}",
                          ["--tokens=1", f"--concurrency={n}",
                           f"--duration-s={os.environ.get('LOAD_DURATION_S', '5')}",
                           "--warmup-s=1", "--no-progress"])
            if s:
                lat = s["latency_ms"]
                row = f"stateless={n}"
                emit(f"{row:<19} 1-token {s['tokens_per_second']:10.1f} tok/s  latency ms "
                     f"p50 {lat['p50']:7.2f} p90 {lat['p90']:7.2f} p99 {lat['p99']:7.2f}  graphs "
                     f"{launch_split(before, server.samples())}  failed {s['requests_failed']}")
                for line in error_lines(s):
                    emit(line)
        try:
            (out / "metrics.txt").write_text(server.scrape()[2])
        except OSError as e:
            print(f"session_matrix.py: /metrics: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
