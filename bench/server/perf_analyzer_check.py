#!/usr/bin/env python3
"""Cross-checks layerctl bench with Triton's perf_analyzer, a client the
project did not write (issue 12: "perf_analyzer -i grpc confirms the 1-token
and 128-token figures within 10%"). On one layerserve, for each request size
T in --tokens: `layerctl bench` over each of --layerctl-connections and
`perf_analyzer -i grpc` (its own threads and channels) at the same
concurrency, interleaved, twice, BF16 [1, T, hidden] requests (perf_analyzer
builds its inputs in the datatype ModelMetadata advertises, BF16, so layerctl
is told to send the same; until 2026-11-27 layerctl sent FP32, twice the bytes,
which made the 128-token rows disagree). One line per
run with tokens/s, latency and the client's CPU time per request answered
(also OUT_DIR/perf_analyzer_check.txt), then
the ratio of perf_analyzer's median to each layerctl setting's.

First, the span's device-bound rate from the same server: one request of
--bound-tokens tokens at a time ([--bound-tokens / 128, 128, hidden], BF16, a
full batch each, never two at once) and the GPU time of the batches the
server samples (its per-op kernel times in /metrics): tokens per batch / GPU
time per batch. Every run's line gives its tokens/s as a share of that bound;
with --max-batch-tokens 8192, a 128-token run at concurrency 64 forms batches
of 64 x 128 tokens, the bound's shape. (The CPU backend exports no kernel
times: no bound.)

The server runs with --kv-cache-memory=0: with sessions on, its ModelConfig
announces sequence_batching and perf_analyzer would run in sequence mode.

  python3 bench/server/perf_analyzer_check.py BIN_DIR OUT_DIR --perf-analyzer=PATH
      [--tokens 1,128] [--concurrency 64] [--duration-s 5] [--layerctl-connections 1,8]
      [--bound-tokens 8192]
      [layerserve args...]
"""

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from layerserve_process import LayerserveProcess  # noqa: E402
from metrics_delta import delta, gpu_ms_per_batch, histogram_mean  # noqa: E402
from thread_cpu import children_cpu_seconds  # noqa: E402


def layerctl_run(bin_dir, server, out, tokens, concurrency, duration_s, connections, name):
    report = out / f"{name}.json"
    # One second of warm-up, as perf_analyzer measures only once its windows
    # are stable: neither counts the connections being set up.
    subprocess.run([bin_dir / "layerctl", "bench", f"--url={server.grpc_url}",
                    f"--model={server.model}", f"--tokens={tokens}",
                    f"--concurrency={concurrency}", f"--duration-s={duration_s}",
                    f"--connections={connections}", "--warmup-s=1",
                    # What perf_analyzer sends: the datatype ModelMetadata
                    # advertises (BF16), since it builds its inputs from it.
                    "--datatype=BF16", f"--json={report}"],
                   stdout=open(out / f"{name}.txt", "w"),
                   stderr=subprocess.STDOUT, check=True)
    r = json.loads(report.read_text())
    return r["tokens_per_second"], r["latency_ms"]["p50"], r["latency_ms"]["p99"]


def device_bound(bin_dir, server, out, tokens):
    """Tokens/s of the span on the device alone, for batches of `tokens`: one
    BF16 request of [tokens / 128, 128, hidden] at a time, so batches never
    overlap, and the GPU time of the server's sampled batches (the per-op
    kernel times it exports for one batch in 16, summed)."""
    sequences = max(1, tokens // 128)
    before = server.samples()
    subprocess.run([bin_dir / "layerctl", "bench", f"--url={server.grpc_url}",
                    f"--model={server.model}", f"--batch={sequences}",
                    f"--tokens={tokens // sequences}", "--datatype=BF16", "--concurrency=1",
                    "--duration-s=6"], stdout=open(out / "bound.txt", "w"),
                   stderr=subprocess.STDOUT, check=True)
    after = server.samples()
    gpu_ms, _ = gpu_ms_per_batch(before, after, server.layers[1] - server.layers[0])
    if gpu_ms is None:
        return None
    return sequences * (tokens // sequences) / (gpu_ms / 1e3)


def server_view_of(before, after):
    """The server's side of a run (its whole length, warm-up included): mean
    request time, queue time and compute per batch in ms, mean batch tokens."""
    def mean(name):
        return histogram_mean(before, after, name) or 0.0
    return (f"server: req {1e3 * mean('layerserve_request_duration_seconds'):.2f} "
            f"queue {1e3 * mean('layerserve_queue_duration_seconds'):.2f} "
            f"compute {1e3 * mean('layerserve_compute_duration_seconds'):.2f} ms, "
            f"batch {mean('layerserve_batch_tokens'):.0f} tok")


def perf_analyzer_run(pa, server, out, hidden, tokens, concurrency, duration_s, name):
    report = out / f"{name}.csv"
    subprocess.run([pa, "-m", server.model, "-u", server.grpc_url, "-i", "grpc",
                    "--shape", f"hidden_states:1,{tokens},{hidden}",
                    "--concurrency-range", str(concurrency),
                    "--measurement-interval", str(int(duration_s * 1000)),
                    # It reports once three windows agree; bounded on a noisy machine.
                    "--stability-percentage", "25", "--max-trials", "6",
                    "--percentile", "50", "-f", str(report)],
                   stdout=open(out / f"{name}.txt", "w"), stderr=subprocess.STDOUT, check=True)
    with open(report, newline="") as f:
        row = list(csv.DictReader(f))[-1]
    # perf_analyzer's CSV latencies are in microseconds.
    return (float(row["Inferences/Second"]) * tokens, float(row["p50 latency"]) / 1000,
            float(row["p99 latency"]) / 1000)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--perf-analyzer", required=True)
    parser.add_argument("--tokens", default="1,128")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=5)
    parser.add_argument("--layerctl-connections", default="1,8")
    parser.add_argument("--bound-tokens", type=int, default=8192)
    args, server_args = parser.parse_known_args()
    bin_dir, out = Path(args.bin_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = []

    def emit(text):
        print(text, flush=True)
        lines.append(text)

    server = LayerserveProcess(bin_dir / "layerserve", [*server_args, "--kv-cache-memory=0"],
                               out / "server.log", ready_timeout_s=120)
    with server:
        hidden = int(server.log_text().split(" hidden ")[1].split(",")[0])
        bound = device_bound(bin_dir, server, out, args.bound_tokens)
        emit(f"device-bound rate, batches of {args.bound_tokens} tokens: "
             + (f"{bound:.0f} tok/s" if bound else "not measured (no kernel times)"))
        connections = [int(c) for c in args.layerctl_connections.split(",")]
        for tokens in (int(t) for t in args.tokens.split(",")):
            results = {f"layerctl-x{c}": [] for c in connections}
            results["perf_analyzer"] = []
            for i in range(2):
                for client in results:
                    name = f"{client}-t{tokens}-{i}"
                    before = server.samples()
                    cpu_before = children_cpu_seconds()
                    if client == "perf_analyzer":
                        r = perf_analyzer_run(args.perf_analyzer, server, out, hidden, tokens,
                                              args.concurrency, args.duration_s, name)
                    else:
                        r = layerctl_run(bin_dir, server, out, tokens, args.concurrency,
                                         args.duration_s, int(client.split("-x")[1]), name)
                    after = server.samples()
                    server_view = server_view_of(before, after)
                    # Client CPU per request the server answered during the
                    # client's whole run (its warm-up and windows included).
                    answered = delta(before, after, "layerserve_requests_total")
                    client_us = (1e6 * (children_cpu_seconds() - cpu_before) / answered
                                 if answered else 0.0)
                    results[client].append(r[0])
                    share = f" ({r[0] / bound:5.1%} of bound)" if bound else ""
                    emit(f"{name:26s} {r[0]:10.0f} tok/s{share}  "
                         f"p50 {r[1]:7.2f} ms  p99 {r[2]:7.2f} ms | client CPU "
                         f"{client_us:5.0f} us/req | {server_view}")
            pa = statistics.median(results["perf_analyzer"])
            for client, rates in results.items():
                if client != "perf_analyzer":
                    emit(f"T={tokens}: perf_analyzer / {client} tokens/s = "
                         f"{pa / statistics.median(rates):.3f}")
    (out / "perf_analyzer_check.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
