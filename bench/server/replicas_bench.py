#!/usr/bin/env python3
"""Sessions behind the shipped proxy (deploy/nginx/nginx.conf): what the
proxy costs a session's step, and what a second replica adds.

Starts --replicas layerserve processes of one span, replica i on CUDA device
i modulo --gpus (with one GPU, the replicas share it), and for each N in
--sessions runs `layerctl bench --sessions N --prefill P --steps S` (which
sends x-session-id, so nginx's consistent hash keeps each session on one
replica) three ways, one after the other:
  alone    straight to replica 0;
  proxy-1  through nginx with replica 0 as its only upstream (the proxy's
           own cost per step);
  proxy-R  through nginx over all R replicas (the sessions spread by hash).
One line per run (also OUT_DIR/replicas_summary.txt): decode tokens/s
(over the whole decode, and while all N sessions ran), step latency, failed
sessions; then each proxy row over the alone row.

  python3 bench/server/replicas_bench.py BIN_DIR OUT_DIR [layerserve args...]
      [--replicas 2] [--gpus 2] [--sessions 1,16,64,256] [--prefill 512]
      [--steps 256] [--nginx PATH]

scripts/gpu-run.sh's bench-replicas stage runs it (NGINX names a carried
binary where the machine has none; docs/gpu.md).
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_errors import error_lines  # noqa: E402
from layerserve_process import LayerserveProcess, ServerStartError  # noqa: E402
from nginx_proxy import NginxProxy, ProxyError  # noqa: E402
from summary_log import summary_emitter  # noqa: E402
from session_matrix import run_bench  # noqa: E402


class Target:
    """What layerctl bench points at: a grpc_url and a model name."""

    def __init__(self, url, model):
        self.grpc_url = url
        self.model = model


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--sessions", default="1,16,64,256")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--nginx", default=os.environ.get("NGINX"))
    args, server_args = parser.parse_known_args()
    bin_dir, out = Path(args.bin_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    emit = summary_emitter(out / "replicas_summary.txt")

    replicas = []
    try:
        for i in range(args.replicas):
            replicas.append(LayerserveProcess(
                bin_dir / "layerserve", [*server_args, f"--cuda-device={i % args.gpus}"],
                out / f"replica{i}.log", ready_timeout_s=180))
    except ServerStartError as e:
        for r in replicas:
            r.stop()
        sys.exit(f"replicas_bench.py: {e}")
    model = replicas[0].model
    emit(f"{args.replicas} replicas of {model} on {min(args.gpus, args.replicas)} GPU(s); "
         f"sessions of {args.prefill} + {args.steps} tokens")
    try:
        rows = {}
        for n in (int(x) for x in args.sessions.split(",")):
            for label, upstreams in (("alone", None), ("proxy-1", replicas[:1]),
                                     (f"proxy-{args.replicas}", replicas)):
                proxy = None
                try:
                    if upstreams is None:
                        target = Target(replicas[0].grpc_url, model)
                    else:
                        proxy = NginxProxy([r.grpc_url for r in upstreams], out / f"nginx-{label}",
                                           nginx=args.nginx)
                        target = Target(proxy.url, model)
                    r = run_bench(bin_dir, target, out, f"{label.replace('-', '_')}_{n}",
                                  [f"--sessions={n}", f"--prefill={args.prefill}",
                                   f"--steps={args.steps}", "--no-progress"])
                except ProxyError as e:
                    emit(f"{label}: {e}")
                    continue
                finally:
                    if proxy is not None:
                        proxy.stop()
                if not r:
                    continue
                rows[(label, n)] = r
                lat = r["step_latency_ms"]
                row = f"{label} sessions={n}"
                emit(f"{row:<22} decode {r['decode_tokens_per_second']:10.1f} tok/s "
                     f"(all {n} running: {r.get('steady_decode_tokens_per_second', 0):8.1f})  "
                     f"step ms p50 {lat['p50']:7.2f} p90 {lat['p90']:7.2f} p99 {lat['p99']:7.2f}  "
                     f"failed {r['sessions_failed']}")
                for line in error_lines(r):
                    emit(line)
            alone = rows.get(("alone", n))
            if alone and alone["decode_tokens_per_second"] > 0:
                ratios = []
                for label in ("proxy-1", f"proxy-{args.replicas}"):
                    if (label, n) in rows:
                        ratio = rows[(label, n)]["decode_tokens_per_second"] / \
                            alone["decode_tokens_per_second"]
                        step = rows[(label, n)]["step_latency_ms"]["p50"] - \
                            alone["step_latency_ms"]["p50"]
                        ratios.append(f"{label} {ratio:.2f}x tok/s, step p50 {step:+.2f} ms")
                emit(f"  sessions={n} over alone: " + "; ".join(ratios))
    finally:
        for r in replicas:
            r.stop()


if __name__ == "__main__":
    main()
