#!/usr/bin/env python3
"""The request path's floor: layerctl bench rows against grpc_echo.

grpc_echo (bench/grpc/grpc_echo.cc) answers ModelInfer with the request's own
input, on the thread that received it, over layerserve's completion-queue
plumbing, with nothing behind it. So a row here is what gRPC and the client
cost on this machine for the same requests, and the same row against
layerserve (bench/server/launch_rows.py) adds the batcher, the backend and
the replies. One line per row: tokens/s, the client's mean and p99 latency,
and the CPU per request of the echo's threads by role and of the client.

  python3 bench/server/echo_rows.py OUT_DIR --echo PATH --layerctl PATH
      [--rows ROWS] [--hidden H] [--threads N] [--delay-us D]

ROWS: 'name=layerctl bench flags;...' as launch_rows.py takes them (default
below); --hidden is the tensor width the rows send (Llama-3-8B's 4096);
--delay-us makes the echo answer each request that long after it arrived,
from a thread of its own (as a server answers after its batch computed).
Env LOAD_CLIENT_ARGS adds flags to every row. scripts/gpu-run.sh's
bench-echo stage runs it.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from launch_rows import parse_pairs
from summary_log import summary_emitter
from thread_cpu import children_cpu_seconds, per_request_line, seconds_by_role, snapshot

DEFAULT_ROWS = ("c1=--tokens=1 --concurrency=1 --duration-s=2;"
                "c64=--tokens=1 --concurrency=64 --connections=8 --duration-s=3;"
                "c64x1=--tokens=1 --concurrency=64 --connections=1 --duration-s=3")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--echo", required=True, help="the grpc_echo binary")
    parser.add_argument("--layerctl", required=True)
    parser.add_argument("--rows", default=DEFAULT_ROWS)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=0,
                        help="the echo's completion queues (0: its default, as layerserve's)")
    parser.add_argument("--delay-us", type=int, default=0,
                        help="answer each request this long after it arrived (0: at once)")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    emit = summary_emitter(out / "summary.txt")
    emit("# echo row: client tok/s, client mean (p99) ms; CPU us per request: the echo's threads "
         "by role, the client")
    argv = [args.echo] + ([f"--threads={args.threads}"] if args.threads > 0 else []) + (
        [f"--delay-us={args.delay_us}"] if args.delay_us > 0 else [])
    label = f"echo+{args.delay_us}us" if args.delay_us > 0 else "echo"
    with open(out / "echo.log", "w") as log:
        echo = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            line = echo.stdout.readline().split()
            if len(line) != 2 or line[0] != "port":
                sys.exit(f"echo_rows.py: grpc_echo did not start (see {out / 'echo.log'})")
            url = f"127.0.0.1:{line[1]}"
            for row, row_flags in parse_pairs(args.rows):
                report_path = out / f"{row}.json"
                threads_before, client_before = snapshot(echo.pid), children_cpu_seconds()
                with open(out / f"{row}.txt", "w") as row_log:
                    subprocess.run(
                        [args.layerctl, "bench", f"--url={url}", "--model=echo",
                         f"--hidden={args.hidden}", "--no-progress", f"--json={report_path}",
                         *row_flags.split(), *os.environ.get("LOAD_CLIENT_ARGS", "").split()],
                        stdout=row_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                threads_after, client_after = snapshot(echo.pid), children_cpu_seconds()
                report = json.loads(report_path.read_text()) if report_path.exists() else {}
                latency = report.get("latency_ms", {})
                # Every request the client sent, its warm-up included, as the
                # CPU time includes it (requests_ok counts the measured ones).
                requests = max(report.get("requests_ok", 0), 1) * (
                    1 + report.get("warmup_s", 0) / max(report.get("measured_s", 1), 1e-9))
                cpu = per_request_line("echo", seconds_by_role(threads_before, threads_after),
                                       client_after - client_before, requests)
                emit(f"{label} {row:8s} {report.get('tokens_per_second', 0):10.0f} tok/s  client "
                     f"{latency.get('mean', 0):6.3f} (p99 {latency.get('p99', 0):6.2f}) ms  "
                     f"{cpu}  failed {report.get('requests_failed', 0)}")
        finally:
            echo.terminate()
            echo.wait(timeout=30)


if __name__ == "__main__":
    main()
