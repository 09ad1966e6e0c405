#!/usr/bin/env python3
"""Does a long prefill arriving among decoding sessions raise their p99 step
latency by more than one chunk's compute time? (issue 11, item 4: chunked
prefill, --prefill-chunk-tokens, puts one piece of a long session request in
each batch beside the other sessions' decode steps.)

For each value of --chunks, one layerserve, warmed up (one long prefill and
a short decode load, unmeasured, so that no phase counts a first batch's
cuBLASLt planning and kernel loading), and in it three phases:
  (a) chunk time: long prefills alone for --chunk-seconds (on CUDA, until 2
      batches were sampled, at most 12x that); /metrics before and after give
      the batches' mean tokens (one piece each: the chunk, or the whole prompt
      up to --max-batch-tokens under 0), their compute time
      (layerserve_compute_duration_seconds) and, on CUDA, their GPU time
      (metrics_delta.gpu_ms_per_batch, as probe.py computes it);
  (b) baseline: the decode load alone, `layerctl bench --sessions N --prefill
      P --steps S`: step latency p50/p90/p99/max and decode tokens/s;
  (c) mixed: the same decode load while long prefills arrive back to back.
(b) and (c) alternate --rounds times (b, c, b, c), so the spread of the
baselines shows the noise. A long prefill is one `layerctl bench --sessions 1
--prefill L --steps 0` process (random input, no files), one after the other
from one thread: at most one long prefill is in the server at a time (each
process starts, draws its input in milliseconds and connects before it sends,
so "back to back" leaves gaps of that much). The mixed line says
how many long prefills overlapped the decode window, and estimates the share
of decode steps that ran beside a piece: each piece delays the decode round
it shares a batch with, or the rounds that run while it computes, whichever
is more (pieces x max(1, chunk time / baseline step p50) rounds of --steps).

The verdict per setting: p99(mixed) - p99(baseline), means over the rounds,
against one chunk's compute time (GPU time where the backend samples it, else
compute time per batch): "within" or "over"; "inconclusive" when under 2% of
the steps ran beside a piece (a p99 sees only what touches over 1% of them).
That share grows with the long prefills' rate, not with --steps (which puts
more of them in the window); --long-clients 2 doubles the rate, at the risk
of two pieces in one batch. The chunk time is a mean over the pieces: a late
piece reads more cached keys than an early one. The long clients' CPU
(drawing inputs) is spent in (c) only.

  python3 bench/server/prefill_interference.py BIN_DIR OUT_DIR [layerserve args...]
      [--chunks 0,512,2048] [--sessions 64] [--prefill 512] [--steps 300]
      [--long-tokens 8192] [--rounds 2] [--chunk-seconds 5] [--datatype BF16]
      [--connections 8] [--long-clients 1]

BIN_DIR holds layerserve and layerctl; the other args go to layerserve (model,
backend, --kv-cache-memory, ...). OUT_DIR gets summary.txt (the printed
lines), each server's log, the decode reports (chunk<C>_baseline<R>.json,
chunk<C>_mixed<R>.json), the long prefills' reports, one JSON line each
(chunk<C>_alone_long.jsonl, chunk<C>_mixed<R>_<client>_long.jsonl), and the
metrics around phase (a).
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from layerserve_process import LayerserveProcess, ServerStartError, parse_samples  # noqa: E402
from bench_errors import error_lines  # noqa: E402
from metrics_delta import delta, gpu_ms_per_batch  # noqa: E402
from summary_log import summary_emitter  # noqa: E402

READY_TIMEOUT_S = 180       # model load and GEMM autotuning on a cold cache
MIN_SAMPLED_BATCHES = 2     # CUDA samples one batch in 16 (timing_sample_every)
INCONCLUSIVE_SHARE = 0.02   # a p99 sees only what touches over 1% of the steps


class LongPrefills:
    """Long prefills back to back from one thread, each a `layerctl bench
    --sessions 1 --prefill L --steps 0` process, until stop(). `done` holds
    (monotonic end time, request latency s) per completed one."""

    def __init__(self, layerctl, server, args, out, label, delay_s=0.0):
        self.report, self.jsonl = out / f"{label}_long.json", out / f"{label}_long.jsonl"
        self.argv = [str(layerctl), "bench", f"--url={server.grpc_url}", f"--model={server.model}",
                     "--sessions=1", f"--prefill={args.long_tokens}", "--steps=0",
                     f"--datatype={args.datatype}", "--timeout-s=300", "--no-progress",
                     f"--json={self.report}"]
        self.jsonl.write_text("")
        self.done, self.error = [], None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(delay_s,))
        self._thread.start()

    def _loop(self, delay_s):
        self._stop.wait(delay_s)
        while not self._stop.is_set():
            self.report.unlink(missing_ok=True)
            run = subprocess.run(self.argv, capture_output=True, text=True,
                                 stdin=subprocess.DEVNULL)
            end = time.monotonic()
            r = json.loads(self.report.read_text()) if self.report.exists() else {}
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"end_monotonic": end, "rc": run.returncode, "report": r}))
                f.write("\n")
            if run.returncode != 0 or r.get("sessions_completed") != 1:
                lines = error_lines(r, indent="") or [(run.stdout + run.stderr).strip()[-500:]]
                self.error = f"long prefill failed (rc {run.returncode}): {'; '.join(lines)}"
                return
            self.done.append((end, r["prefill_latency_ms"]["max"] / 1e3))

    def stop(self):
        """Lets the prefill in flight finish, then returns."""
        self._stop.set()
        self._thread.join()


def decode_bench(layerctl, server, args, out, label):
    """The decode load once; (its report, its monotonic end time)."""
    report = out / f"{label}.json"
    with open(out / f"{label}.txt", "w") as log:
        rc = subprocess.run(
            [str(layerctl), "bench", f"--url={server.grpc_url}", f"--model={server.model}",
             f"--sessions={args.sessions}", f"--prefill={args.prefill}", f"--steps={args.steps}",
             f"--datatype={args.datatype}", f"--connections={args.connections}", "--no-progress",
             f"--json={report}"], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL).returncode
    end = time.monotonic()
    if not report.exists():
        sys.exit(f"decode bench {label} failed (rc {rc}): {(out / f'{label}.txt').read_text()}")
    return json.loads(report.read_text()), end


def warm_up(server, layerctl, args, out, name):
    """One long prefill, then a short decode load, unmeasured: the first batch
    of each new size plans its cuBLASLt GEMMs and loads their kernels (up to
    ~100 ms on the H100, seen as an 8 ms mean "gemm_qkv" over a phase (a)
    without this), which no later phase should count."""
    longs = LongPrefills(layerctl, server, args, out, f"{name}_warmup")
    while not longs.done and not longs.error:
        time.sleep(0.2)
    longs.stop()
    if longs.error:
        sys.exit(f"warm-up: {longs.error}")
    decode_bench(layerctl, server, argparse.Namespace(**{**vars(args), "steps": 20}), out,
                 f"{name}_warmup")


def chunk_time(server, layerctl, args, out, name):
    """Phase (a): long prefills alone; their batches from /metrics."""
    def scrape(when):
        text = server.scrape(timeout_s=5)[2]
        (out / f"{name}_metrics_{when}.txt").write_text(text)
        return parse_samples(text)

    layers = server.layers[1] - server.layers[0]
    cuda = server.ready["backend"] == "cuda"
    before, started = scrape("before"), time.monotonic()
    longs = LongPrefills(layerctl, server, args, out, f"{name}_alone")
    while not longs.error:
        time.sleep(1)
        elapsed = time.monotonic() - started
        if elapsed >= args.chunk_seconds and (
                not cuda or elapsed > 12 * args.chunk_seconds or
                gpu_ms_per_batch(before, server.samples(), layers)[1] >= MIN_SAMPLED_BATCHES):
            break
    longs.stop()
    seconds, after = time.monotonic() - started, scrape("after")
    batches = delta(before, after, "layerserve_batch_tokens_count")
    gpu_ms, sampled = gpu_ms_per_batch(before, after, layers)

    def per_batch(metric, scale=1):
        return scale * delta(before, after, metric) / batches if batches else None

    a = {"prefills": len(longs.done), "seconds": seconds, "batches": batches, "sampled": sampled,
         "error": longs.error, "gpu_ms": gpu_ms,
         "tokens": per_batch("layerserve_batch_tokens_sum"),
         "compute_ms": per_batch("layerserve_compute_duration_seconds_sum", 1e3),
         "latency_ms": [1e3 * lat for _, lat in longs.done]}
    a["chunk_ms"] = a["gpu_ms"] if a["gpu_ms"] is not None else a["compute_ms"]
    return a


def fmt(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def median(xs):
    return statistics.median(xs) if xs else None


def decode_text(r):
    lat = r["step_latency_ms"]
    failed = f"  sessions failed {r['sessions_failed']}" if r["sessions_failed"] else ""
    return (f"decode {r['decode_tokens_per_second']:9.1f} tok/s  step ms p50 {lat['p50']:7.2f} "
            f"p90 {lat['p90']:7.2f} p99 {lat['p99']:7.2f} max {lat['max']:7.2f}{failed}")


def in_window(done, r, end):
    """The long prefills whose request overlapped the decode phase, which
    ended (about) when the bench process did: [(overlap s, latency s)]."""
    start = end - r["decode_s"]
    return [(min(t, end) - max(t - lat, start), lat) for t, lat in done
            if t > start and t - lat < end]


def run_setting(server, layerctl, args, out, chunk, emit):
    """Phases (a), then (b, c) x rounds, and the verdict, on one server."""
    name, tag = f"chunk{chunk}", f"chunk={chunk:<5}"
    warm_up(server, layerctl, args, out, name)
    a = chunk_time(server, layerctl, args, out, name)
    emit(f"{tag} (a) long alone  {a['prefills']} prefills in {a['seconds']:.1f} s (latency p50 "
         f"{fmt(median(a['latency_ms']), '.1f')} ms), {a['batches']:.0f} batches of "
         f"{fmt(a['tokens'], '.1f')} tokens: compute {fmt(a['compute_ms'])} ms/batch, "
         f"gpu {fmt(a['gpu_ms'])} ms/batch ({a['sampled']:.0f} sampled)")
    if a["error"] or not a["batches"]:
        return emit(f"{tag} no chunk time: {a['error'] or 'no batch ran'}")
    pieces = a["batches"] / max(a["prefills"], 1)  # per long prefill
    p99 = {"baseline": [], "mixed": []}
    shares = []  # of each mixed run's decode steps, those that ran beside a piece (estimated)
    for rnd in range(1, args.rounds + 1):
        r, _ = decode_bench(layerctl, server, args, out, f"{name}_baseline{rnd}")
        p99["baseline"].append(r["step_latency_ms"]["p99"])
        step_ms = r["step_latency_ms"]["p50"]
        emit(f"{tag} (b) baseline #{rnd} {decode_text(r)}")
        for line in error_lines(r):
            emit(line)
        # --long-clients > 1 staggers its clients over about one prefill's client time.
        pace_s = a["seconds"] / max(a["prefills"], 1)
        longs = [LongPrefills(layerctl, server, args, out, f"{name}_mixed{rnd}_{k}",
                              delay_s=k * pace_s / args.long_clients)
                 for k in range(args.long_clients)]
        r, end = decode_bench(layerctl, server, args, out, f"{name}_mixed{rnd}")
        for lp in longs:
            lp.stop()
        done = sorted(d for lp in longs for d in lp.done)
        p99["mixed"].append(r["step_latency_ms"]["p99"])
        hits = in_window(done, r, end)
        # A piece delays the decode round it shares a batch with, or, longer
        # than a step, the rounds that run while it computes.
        rounds = sum(min(1.0, o / lat) for o, lat in hits) * pieces * max(
            1.0, a["chunk_ms"] / step_ms if step_ms > 0 else 1.0)
        shares.append(min(1.0, rounds / args.steps))
        lat = [1e3 * lat for _, lat in hits]
        emit(f"{tag} (c) mixed #{rnd}    {decode_text(r)} | long prefills in the "
             f"{r['decode_s']:.2f} s decode window: {len(hits)} (of {len(done)}; latency "
             f"p50 {fmt(median(lat), '.1f')} max {fmt(max(lat, default=None), '.1f')} ms), "
             f"~{100 * shares[-1]:.0f}% of the steps beside a piece")
        for line in error_lines(r) + [f"    {lp.error}" for lp in longs if lp.error]:
            emit(line)
    rise = statistics.mean(p99["mixed"]) - statistics.mean(p99["baseline"])
    share = statistics.mean(shares)
    if share < INCONCLUSIVE_SHARE:
        verdict = (f"inconclusive: only ~{100 * share:.1f}% of the steps ran beside a piece "
                   "(too few long prefills a second: try --long-clients 2)")
    else:
        verdict = "within" if rise <= a["chunk_ms"] else "over"
    emit(f"{tag} verdict: p99 mixed - baseline = {rise:+.2f} ms (means of {args.rounds} round(s); "
         f"baselines spread {max(p99['baseline']) - min(p99['baseline']):.2f} ms) against one "
         f"chunk ({'gpu' if a['gpu_ms'] is not None else 'compute'}, {pieces:.1f} a prefill) "
         f"{a['chunk_ms']:.2f} ms: {verdict}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--chunks", default="0,512,2048",
                        help="--prefill-chunk-tokens values (0: --max-batch-tokens)")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--long-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=2, help="(b, c) pairs per setting")
    parser.add_argument("--chunk-seconds", type=float, default=5, help="phase (a), at least")
    parser.add_argument("--datatype", default="BF16", help="on the wire, for every client")
    parser.add_argument("--connections", type=int, default=8, help="of the decode bench")
    parser.add_argument("--long-clients", type=int, default=1,
                        help="long-prefill clients in (c); above 1, pieces of two long "
                        "prefills may share a batch")
    args, server_args = parser.parse_known_args()
    bin_dir, out = Path(args.bin_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # One autotune cache keeps later servers' starts short and their kernels alike.
    if not re.search(r"gemm.tune.cache", " ".join(server_args)):
        server_args.append(f"--gemm-tune-cache={out / 'gemm_tune_cache.json'}")
    emit = summary_emitter(out / "summary.txt")

    emit(f"# {args.sessions} sessions x ({args.prefill}-token prefill, {args.steps} steps) "
         f"beside {args.long_tokens}-token prefills, {args.datatype}, {args.rounds} round(s); "
         f"server args: {' '.join(server_args)}")
    for chunk in (int(c) for c in args.chunks.split(",")):
        try:
            server = LayerserveProcess(bin_dir / "layerserve",
                                       [*server_args, f"--prefill-chunk-tokens={chunk}"],
                                       out / f"server_chunk{chunk}.log",
                                       ready_timeout_s=READY_TIMEOUT_S)
        except ServerStartError as e:
            sys.exit(f"prefill_interference.py: {e}")
        with server:
            run_setting(server, bin_dir / "layerctl", args, out, chunk, emit)
    emit(f"# details under {out}")


if __name__ == "__main__":
    main()
