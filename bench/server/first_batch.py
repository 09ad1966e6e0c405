#!/usr/bin/env python3
"""The first request of each size against the ones after it, per server
setting: what a request pays when its batch is the first of its size. On the
CUDA backend that first batch loads kernel modules and has cuBLASLt plan its
shapes, up to ~100 ms on the H100, unless the server warmed up at start
(--cuda-warmup, the default). Each setting starts its own server (timing the
start, where the warm-up is paid), then for each size sends three single
requests one after another (`layerctl bench --requests=1`), and prints one
line per size: the three latencies and first / third.

  python3 bench/server/first_batch.py BIN_DIR OUT_DIR [--tokens 1,8,...]
      [--setting LABEL=FLAGS ...] [layerserve args...]

BIN_DIR holds layerserve and layerctl. Without --setting: warm= (the
defaults) and cold=--cuda-warmup=false. The summary also goes to
OUT_DIR/first_batch.txt.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from layerserve_process import LayerserveProcess, ServerStartError  # noqa: E402
from summary_log import summary_emitter  # noqa: E402

DEFAULT_TOKENS = "1,8,16,32,64,128,256,512,1024,2048"
REPEATS = 3


def one_request_ms(layerctl, server, tokens, out_json):
    """Latency of one FP32 request of `tokens` tokens, in ms."""
    subprocess.run([str(layerctl), "bench", f"--url=127.0.0.1:{server.grpc_port}",
                    f"--model={server.model}", f"--tokens={tokens}", "--concurrency=1",
                    "--requests=1", "--duration-s=600", "--no-progress", f"--json={out_json}"],
                   check=True, stdout=subprocess.DEVNULL, timeout=120)
    report = json.loads(Path(out_json).read_text())
    if report["requests_ok"] < 1:
        raise RuntimeError(f"{tokens} tokens: {report.get('first_error_by_code')}")
    return report["latency_ms"]["max"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bin_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--tokens", default=DEFAULT_TOKENS)
    parser.add_argument("--setting", action="append", default=[],
                        help="LABEL=server flags, repeatable")
    args, server_args = parser.parse_known_args()
    bin_dir, out = Path(args.bin_dir), Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = args.setting or ["warm=", "cold=--cuda-warmup=false"]
    sizes = [int(t) for t in args.tokens.split(",")]
    emit = summary_emitter(out / "first_batch.txt")
    for setting in settings:
        label, _, flags = setting.partition("=")
        start = time.monotonic()
        try:
            server = LayerserveProcess(bin_dir / "layerserve", server_args + flags.split(),
                                       out / f"server-{label}.log")
        except ServerStartError as e:
            emit(f"{label}: the server did not start: {e}")
            continue
        with server:
            emit(f"{label}: ready in {time.monotonic() - start:.1f} s "
                 f"(flags: {' '.join(server_args + flags.split())})")
            for tokens in sizes:
                ms = [one_request_ms(bin_dir / "layerctl", server, tokens,
                                     out / f"{label}-{tokens}-{i}.json") for i in range(REPEATS)]
                emit(f"{label:8s} {'tokens=' + str(tokens):12s} ms: "
                     + " ".join(f"{m:8.2f}" for m in ms) + f"  first/third {ms[0] / ms[-1]:6.2f}")


if __name__ == "__main__":
    main()
