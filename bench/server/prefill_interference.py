#!/usr/bin/env python3
"""What a long prefill does to other sessions' decode steps, with and
without chunked prefill (--prefill-chunk-tokens).

For each chunk setting, one layerserve runs `layerctl bench --sessions N
--prefill P --steps S` (the decode load) while a second client sends long
prefills back to back (`layerctl infer`, one session of --long-tokens tokens
each, started and ended in one request). A prefill that fills a whole batch
holds every decode step behind it for that batch's time; in pieces, each
batch carries one piece and the waiting decode steps. Prints one line per
setting: decode tokens/s, step latency p50/p90/p99 and max, and how many long
prefills ran meanwhile; the bench JSON and server logs go to OUT_DIR.

  python3 bench/server/prefill_interference.py BIN_DIR OUT_DIR [layerserve args...]
      [--chunks 0,256] [--sessions 8] [--prefill 32] [--steps 200] [--long-tokens 4096]

BIN_DIR holds layerserve and layerctl; the remaining args choose the model
and backend. Chunk 0 means --max-batch-tokens (no chunking below it).
"""

import argparse
import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from layerserve_process import LayerserveProcess, ServerStartError  # noqa: E402
from bench_errors import error_lines  # noqa: E402


def long_prefills(layerctl, url, model, npy, out_npy, stop, counter):
    """Sends one-request sessions of the long input until `stop` is set."""
    i = 0
    while not stop.is_set():
        i += 1
        result = subprocess.run(
            [str(layerctl), "infer", "--url", url, "--model", model, "--input", str(npy),
             "--output", str(out_npy), "--sequence-id", f"long-{i}", "--sequence-start",
             "--sequence-end"], capture_output=True, text=True)
        if result.returncode != 0:
            print(f"long prefill failed: {result.stderr.strip()}", file=sys.stderr)
            return
        counter[0] += 1


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--chunks", default="0,256",
                        help="--prefill-chunk-tokens values to compare")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--prefill", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--long-tokens", type=int, default=4096)
    args, server_args = parser.parse_known_args()
    bin_dir, out = Path(args.bin_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layerctl = bin_dir / "layerctl"

    for chunk in (int(c) for c in args.chunks.split(",")):
        name = f"chunk{chunk}"
        try:
            server = LayerserveProcess(bin_dir / "layerserve",
                                       [*server_args, f"--prefill-chunk-tokens={chunk}"],
                                       out / f"server_{name}.log", ready_timeout_s=120)
        except ServerStartError as e:
            sys.exit(f"prefill_interference.py: {e}")
        with server:
            hidden = _hidden_from_log(server.log_text())
            npy = out / f"long_{args.long_tokens}.npy"
            np.save(npy, np.random.default_rng(0).standard_normal(
                (1, args.long_tokens, hidden), dtype=np.float32))
            stop, counter = threading.Event(), [0]
            loader = threading.Thread(target=long_prefills, args=(
                layerctl, server.grpc_url, server.model, npy, out / "long_out.npy", stop, counter))
            loader.start()
            report = out / f"decode_{name}.json"
            bench = subprocess.run(
                [str(layerctl), "bench", "--url", server.grpc_url, "--model", server.model,
                 "--sessions", str(args.sessions), "--prefill", str(args.prefill),
                 "--steps", str(args.steps), "--json", str(report)],
                capture_output=True, text=True)
            stop.set()
            loader.join()
            if bench.returncode != 0:
                sys.exit(f"bench failed: {bench.stdout}{bench.stderr}")
            r = json.loads(report.read_text())
            lat = r["step_latency_ms"]
            failed = f"  failed {r['sessions_failed']}" if r["sessions_failed"] else ""
            print(f"chunk={chunk:<5} decode {r['decode_tokens_per_second']:9.1f} tok/s  step ms "
                  f"p50 {lat['p50']:7.2f} p90 {lat['p90']:7.2f} p99 {lat['p99']:7.2f} "
                  f"max {lat['max']:7.2f}  long prefills meanwhile: {counter[0]}{failed}",
                  flush=True)
            for line in error_lines(r):
                print(line, flush=True)


def _hidden_from_log(text):
    """The hidden size from the start-up line `model ... (llama, hidden 512, ...`."""
    marker = "hidden "
    at = text.index(marker) + len(marker)
    return int(text[at:].split(",", 1)[0].split()[0])


if __name__ == "__main__":
    main()
