#!/usr/bin/env python3
"""Servers side by side, row by row, with what each row's batches were.

For each setting in --settings, in the order given (repeat a label to
interleave an A/B, and rotate the order between rounds): start a layerserve
from the setting's binary directory with the common layerserve args plus the
setting's own flags, then run every row of --rows, one `layerctl bench` each,
scraping /metrics before and after. One line per (setting, row): the client's
tokens/s (decode tokens/s for a session row), mean and p99 latency (a
session row's steps), and from the scrapes the batches, compute time and
tokens per batch (and "gpu": the GPU time of the batches the server timed
op by op, every 16th; "host in" and "out": the time a batch spent packing
its tensors into the backend's buffers and copying results back), the
server's mean request time and its parts: the queue wait, the compute of
the batches a request ran in, and the rest, the time outside both, of
which the wait for a reply thread (a session row's
means include its prefills: give it a short --prefill to read them as a
step's; servers older than the per-request metrics show "-" for the last
three), and how the batches were launched (direct, captured into a CUDA
graph, replayed). --ops adds a line per row with each op's share of that
GPU time. --threads adds a line per row with the CPU time per request of the
server's threads by role (bench/server/thread_cpu.py: grpc-cq, batcher,
reply, stream, ...) and of the client.
The tables of docs/log/serving.md's "Where a unary session step loses" were taken
with an uncommitted script that did the same, of which this is the kept form.

  python3 bench/server/launch_rows.py OUT_DIR --settings SETTINGS [--rows ROWS]
      [--layerctl PATH] [--ops] [--threads] [layerserve args...]

SETTINGS: 'label=BIN_DIR|server flags;...', e.g.
  'graphs=/tmp/b/bin|;nographs=/tmp/b/bin|--cuda-graph-max-tokens=0;
   old=/tmp/old/bin|;...'
ROWS: 'name=layerctl bench flags;...' (default: DEFAULT_ROWS below).
--layerctl picks the client (default: the first setting's), so that every
setting is driven by the same one. Env LOAD_CLIENT_ARGS adds flags to every
row (e.g. "--connections=8"). scripts/gpu-run.sh's bench-rows stage runs it.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from layerserve_process import LayerserveProcess, ServerStartError  # noqa: E402
from metrics_delta import delta, gpu_ms_per_batch, histogram_mean, launch_split  # noqa: E402
from summary_log import summary_emitter  # noqa: E402
from thread_cpu import (children_cpu_seconds, per_request_line, seconds_by_role,  # noqa: E402
                        snapshot)

DEFAULT_ROWS = ("l1=--tokens=1 --concurrency=1 --duration-s=2;"
                "u64=--sessions=64 --prefill=1 --steps=256;"
                "l64=--tokens=1 --concurrency=64 --duration-s=3;"
                "v256=--sessions=256 --prefill=512 --steps=256")


def parse_pairs(text, sep="="):
    """'a=x;b=y' -> [('a', 'x'), ('b', 'y')], order and repeats kept."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, value = item.partition(sep)
        pairs.append((name.strip(), value.strip()))
    return pairs


def mean_ms(before, after, name, **labels):
    """Mean of histogram `name` between the scrapes, in ms (0 if empty)."""
    return 1e3 * (histogram_mean(before, after, name, **labels) or 0.0)


def op_line(before, after, sampled):
    """'    ops ms per sampled batch: norm 0.048 gemm_qkv 0.121 ...': each op's
    stream time summed over the span's layers, per batch the server timed
    (`sampled` of them, as gpu_ms_per_batch counts them; None if none)."""
    if sampled <= 0:
        return None
    sums = "layerserve_kernel_duration_seconds_sum"
    ops = sorted({dict(series)["op"] for (name, series) in after if name == sums})
    parts = [f"{op} {1e3 * delta(before, after, sums, op=op) / sampled:.3f}" for op in ops]
    return "    ops ms per sampled batch: " + " ".join(parts)


def thread_line(before, after, server_cpu, client_seconds):
    """'    cpu us per request: server 141 (grpc-cq 52 reply 31 ...) client 63':
    the row's CPU over the requests the server answered in it (its warm-up
    and a session row's prefills included, as the CPU time includes them)."""
    requests = delta(before, after, "layerserve_request_duration_seconds_count")
    if requests <= 0:
        return None
    return "    " + per_request_line("server", server_cpu, client_seconds, requests)


def row_line(label, row, report, before, after, gpu_ms):
    batches = delta(before, after, "layerserve_compute_duration_seconds_count")
    per_batch = max(batches, 1)
    rate = report.get("decode_tokens_per_second", report.get("tokens_per_second", 0.0))
    failed = report.get("requests_failed", 0) + report.get("sessions_failed", 0)
    compute_ms = 1e3 * delta(before, after, "layerserve_compute_duration_seconds_sum") / per_batch
    tokens = delta(before, after, "layerserve_batch_tokens_sum") / per_batch
    # The client's mean latency (a session row's steps) against the server's
    # own request time: what the row's requests spent outside the server.
    latency = report.get("step_latency_ms", report.get("latency_ms", {}))
    client_ms = latency.get("mean", 0.0)
    client_p99 = latency.get("p99", 0.0)
    request_ms = mean_ms(before, after, "layerserve_request_duration_seconds")
    queue_ms = mean_ms(before, after, "layerserve_queue_duration_seconds")
    # Per request, so a batch of 100 weighs 100 times what a batch of 1 does
    # (compute per batch above weighs them alike).
    if delta(before, after, "layerserve_request_compute_seconds_count") > 0:
        batches_ms = mean_ms(before, after, "layerserve_request_compute_seconds")
        reply_ms = mean_ms(before, after, "layerserve_reply_wait_seconds")
        parts = (f"batches {batches_ms:6.3f}  outside {request_ms - queue_ms - batches_ms:6.3f}  "
                 f"reply-wait {reply_ms:6.3f}")
    else:
        parts = "batches      -  outside      -  reply-wait      -"
    gpu = f"{gpu_ms:6.3f}" if gpu_ms is not None else "     -"
    # The host's part of a batch's compute: the tensors packed into the
    # backend's buffers, and the results copied back into the requests.
    stage = "layerserve_batch_stage_seconds"
    host_in = mean_ms(before, after, stage, stage="input")
    host_out = mean_ms(before, after, stage, stage="output")
    return (f"{label:10s} {row:6s} {rate:10.0f} tok/s  batches {batches:6.0f}  compute "
            f"{compute_ms:6.3f} ms (gpu {gpu}  host in {host_in:5.3f} out {host_out:5.3f})  "
            f"{tokens:6.1f} tok/batch  "
            f"client {client_ms:6.3f} (p99 {client_p99:6.2f}) ms  "
            f"server {request_ms:6.3f} (queue {queue_ms:6.3f}  {parts}) ms  direct/captured/replayed "
            f"{launch_split(before, after)}"
            f"  failed {failed}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--settings", required=True)
    parser.add_argument("--rows", default=DEFAULT_ROWS)
    parser.add_argument("--layerctl", default="")
    parser.add_argument("--threads", action="store_true",
                        help="per row, CPU time per request by server thread role and client")
    parser.add_argument("--ops", action="store_true",
                        help="under each row, each op's GPU time per sampled batch")
    args, server_args = parser.parse_known_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = [(label, *value.partition("|")[::2]) for label, value in parse_pairs(args.settings)]
    rows = parse_pairs(args.rows)
    if not settings or not rows:
        sys.exit("launch_rows.py: --settings and --rows must each name at least one entry")
    layerctl = args.layerctl or str(Path(settings[0][1]) / "layerctl")
    emit = summary_emitter(out / "summary.txt")
    emit("# setting row: client tok/s; from /metrics: batches, compute ms (gpu ms) and tokens per "
         "batch; client mean (p99) ms; server request (queue, batches, outside, reply wait) ms; "
         "launches")
    for index, (label, bin_dir, flags) in enumerate(settings):
        run_dir = out / f"{index:02d}-{label}"
        run_dir.mkdir(exist_ok=True)
        try:
            server = LayerserveProcess(Path(bin_dir) / "layerserve", [*server_args, *flags.split()],
                                       run_dir / "server.log", ready_timeout_s=180)
        except ServerStartError as e:
            sys.exit(f"launch_rows.py: {label}: {e}")
        with server:
            before = server.samples()
            for row, row_flags in rows:
                report_path = run_dir / f"{row}.json"
                threads_before, client_before = snapshot(server.pid), children_cpu_seconds()
                with open(run_dir / f"{row}.txt", "w") as log:
                    subprocess.run(
                        [layerctl, "bench", f"--url={server.grpc_url}", f"--model={server.model}",
                         "--no-progress", f"--json={report_path}", *row_flags.split(),
                         *os.environ.get("LOAD_CLIENT_ARGS", "").split()],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                threads_after, client_after = snapshot(server.pid), children_cpu_seconds()
                after = server.samples()
                report = json.loads(report_path.read_text()) if report_path.exists() else {}
                layers = server.layers[1] - server.layers[0]
                gpu_ms, sampled = gpu_ms_per_batch(before, after, layers)
                emit(row_line(label, row, report, before, after, gpu_ms))
                ops = op_line(before, after, sampled) if args.ops else None
                if ops:
                    emit(ops)
                cpu = (thread_line(before, after, seconds_by_role(threads_before, threads_after),
                                   client_after - client_before) if args.threads else None)
                if cpu:
                    emit(cpu)
                before = after


if __name__ == "__main__":
    main()
