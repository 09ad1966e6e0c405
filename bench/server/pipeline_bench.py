#!/usr/bin/env python3
"""Steps/s of examples/pipeline_generate.py with sessions and stateless, on
one model split over two layerserve processes (the issue's "pipeline a user
can run", measured). The checkpoint (config.json with num_hidden_layers n,
and the model's ends: embed_tokens, norm, lm_head) is split at n/2; both
servers run on this machine with the same flags. A random prompt of
--prompt-tokens ids is generated from greedily for --new-tokens steps, once
with sessions and once stateless (the whole prefix every step); in FP32 the
two must produce the same tokens. In BF16 they may part where a random
model's top two logits are closer than the rounding of the two paths'
kernels (a decode step's against a whole prefix's, each server's tuned GEMM
routes): the line says where. One line per mode (also OUT_DIR/pipeline.txt).
--devices 0,1 puts the two servers on those CUDA devices (a two-stage
pipeline over two GPUs); --whole then also runs the sessions mode on one
server holding every layer (on the first device), beside the split one.

  python3 bench/server/pipeline_bench.py BIN_DIR OUT_DIR --model-dir=DIR
      [--prompt-tokens 512] [--new-tokens 32] [--datatype BF16]
      [--devices 0,1] [--whole] [layerserve args...]

Needs tritonclient[grpc] and numpy (scripts/gpu-run.sh's bench-pipeline stage
carries them as wheels where they are missing). The client computes the
embedding, final norm and LM head itself with numpy, so its steps/s include
that host work in both modes; the log has the per-mode prefill time too.
"""

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
from layerserve_process import LayerserveProcess  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--datatype", choices=["FP32", "BF16"], default="BF16")
    parser.add_argument("--devices", default="",
                        help="CUDA devices of the two servers, e.g. 0,1 (default: the flags')")
    parser.add_argument("--whole", action="store_true",
                        help="also run sessions on one server holding every layer")
    args, server_args = parser.parse_known_args()
    devices = [f"--cuda-device={d}" for d in args.devices.split(",")] if args.devices else []
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(args.model_dir) / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    split = layers // 2
    rng = random.Random(0)
    prompt = ",".join(str(rng.randrange(config["vocab_size"])) for _ in range(args.prompt_tokens))

    def start(spans):
        """One server per (span, device flags)."""
        started = []
        try:
            for i, (span, device) in enumerate(spans):
                started.append(LayerserveProcess(
                    Path(args.bin_dir) / "layerserve",
                    [f"--model-dir={args.model_dir}", f"--layers={span}", "--model-name=pipe",
                     *server_args, *device], out / f"server{len(spans)}-{i}.log"))
        except Exception:
            for s in started:
                s.stop()
            raise
        return started

    def generate(mode, servers, label):
        """pipeline_generate.py's report over `servers`, or None."""
        report = out / f"{label}.json"
        cmd = [sys.executable, str(ROOT / "examples" / "pipeline_generate.py"),
               f"--model-dir={args.model_dir}",
               f"--servers={','.join(s.grpc_url for s in servers)}", "--model=pipe",
               f"--prompt-ids={prompt}", f"--max-new-tokens={args.new_tokens}",
               f"--datatype={args.datatype}", "--ignore-eos", f"--json={report}"]
        if mode == "stateless":
            cmd.append("--stateless")
        with open(out / f"{label}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            lines.append(f"{label}: pipeline_generate.py failed (rc {rc}, see {label}.log)")
            return None
        r = json.loads(report.read_text())
        lines.append(f"{label:9s} prompt {args.prompt_tokens}, {r['decode_steps']} steps, "
                     f"{args.datatype}: prefill {r['prefill_s'] * 1e3:.1f} ms, decode "
                     f"{r['decode_s']:.3f} s = {r['steps_per_s']:.1f} steps/s")
        return r

    def same_tokens(a, b):
        """'yes', or where the two generations part."""
        a, b = a["generated_ids"], b["generated_ids"]
        if a == b:
            return "yes"
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return f"no, from step {first} of {max(len(a), len(b))}"

    results = {}
    lines = []
    servers = start([(f"0:{split}", devices[:1]), (f"{split}:{layers}", devices[1:2])])
    try:
        for mode in ("sessions", "stateless"):
            r = generate(mode, servers, mode)
            if r:
                results[mode] = r
    finally:
        for s in servers:
            s.stop()
    same = False
    if len(results) == 2:
        same = results["sessions"]["generated_ids"] == results["stateless"]["generated_ids"]
        ratio = results["sessions"]["steps_per_s"] / results["stateless"]["steps_per_s"]
        lines.append(f"sessions / stateless: {ratio:.2f}x steps/s; same tokens: "
                     f"{same_tokens(results['sessions'], results['stateless'])}")
    if args.whole:
        whole = start([(f"0:{layers}", devices[:1])])
        try:
            r = generate("sessions", whole, "whole")
        finally:
            for s in whole:
                s.stop()
        if r and "sessions" in results:
            same = same and r["generated_ids"] == results["sessions"]["generated_ids"]
            lines.append(f"two servers / one server holding both spans: "
                         f"{results['sessions']['steps_per_s'] / r['steps_per_s']:.2f}x steps/s; "
                         f"same tokens: {same_tokens(results['sessions'], r)}")
    text = "\n".join(lines)
    print(text, flush=True)
    (out / "pipeline.txt").write_text(text + "\n")
    return 0 if len(results) == 2 and (same or args.datatype != "FP32") else 1


if __name__ == "__main__":
    sys.exit(main())
