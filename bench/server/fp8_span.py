#!/usr/bin/env python3
"""A Llama-3-70B-shaped FP8 span on one GPU: the most layers of transformers'
fine-grained FP8 (make_checkpoint.py --llama3-70b --fp8) that this machine's
disk holds, up to all 80, served by one layerserve on the CUDA backend with
sessions, and what its start-up lines say of the memory all 80 layers take.

In BF16 a Llama-3-70B layer is 1.71 GB and 80 of them (137 GB) need two
80 GB GPUs; in FP8 a layer is 0.86 GB (scales included) and 80 of them are
68.7 GB. Where the disk holds fewer than 80 layers (the lent H100 has
64 GiB), the span that fits is served and the 80-layer figures are worked
out from its own: the device memory free for the KV cache after N layers,
less (80 - N) layers' weights, and the KV cache bytes a token takes per
layer. The run also drives a few sessions through the span (layerctl bench
--sessions), so the figures are those of a server that answers.

    python3 bench/server/fp8_span.py BIN_DIR OUT_DIR [--layers N] [--ckpt DIR]

--layers fixes the span (default: as many as the disk holds with 3 GiB to
spare, at most 80); --ckpt is where the checkpoint is written (default
/tmp/layerserve-llama3-70b-fp8-N). Needs torch on the machine (the writer).
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from layerserve_process import LayerserveProcess  # noqa: E402

ALL_LAYERS = 80
LAYER_BYTES = 0.862e9  # one FP8 layer of Llama-3-70B's shapes, 128x128 block scales included
SPARE_BYTES = 3 << 30

MODEL_RE = re.compile(r"layers (\d+):(\d+), (\d+) weight bytes")
KV_RE = re.compile(r"\((\d+) bytes per token; --kv-cache-memory=\S+ of (\d+) bytes available\)")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("bin_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--ckpt", type=Path)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    layers = args.layers
    if layers is None:
        free = shutil.disk_usage("/tmp").free
        layers = max(1, min(ALL_LAYERS, int((free - SPARE_BYTES) // LAYER_BYTES)))
        print(f"fp8_span: {free / 1e9:.1f} GB free on disk: {layers} layers")
    ckpt = args.ckpt or Path(f"/tmp/layerserve-llama3-70b-fp8-{layers}")
    if not (ckpt / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_checkpoint.py")), str(ckpt),
                        "--layers", str(layers), "--llama3-70b", "--fp8"], check=True)

    flags = [f"--model-dir={ckpt}", "--backend=cuda", "--model-name=llama3-70b-fp8"]
    with LayerserveProcess(args.bin_dir / "layerserve", flags, args.out_dir / "server.log",
                           ready_timeout_s=1800) as server:
        report = args.out_dir / "sessions.json"
        subprocess.run([args.bin_dir / "layerctl", "bench", f"--url={server.grpc_url}", f"--model={server.model}",
                        "--sessions=8", "--prefill=256", "--steps=32", f"--json={report}"],
                       check=True, stdout=subprocess.DEVNULL)
        log = server.log_text()
    served = json.loads(report.read_text())
    model, kv = MODEL_RE.search(log), KV_RE.search(log)
    if model is None or kv is None:
        raise SystemExit(f"fp8_span: no weight bytes or KV cache line in {args.out_dir / 'server.log'}")
    n = int(model.group(2)) - int(model.group(1))
    weights = int(model.group(3))
    token_bytes, available = int(kv.group(1)), int(kv.group(2))
    per_layer = weights / n
    available_all = available - (ALL_LAYERS - n) * per_layer
    tokens_all = 0.9 * available_all / (token_bytes / n * ALL_LAYERS)
    print(f"served {n} layers: weights {weights / 1e9:.2f} GB ({per_layer / 1e9:.3f} GB a layer), "
          f"{available / 1e9:.2f} GB free for the KV cache, {token_bytes} KV bytes a token; "
          f"layerctl bench --sessions=8 --prefill=256 --steps=32: "
          f"{served['sessions_completed']} sessions completed, {served['sessions_failed']} failed, "
          f"{served['decode_tokens_per_second']:.0f} decode tokens/s")
    print(f"all {ALL_LAYERS} layers: weights {ALL_LAYERS * per_layer / 1e9:.1f} GB, "
          f"{available_all / 1e9:.2f} GB left for the KV cache: "
          f"{tokens_all:,.0f} tokens at --kv-cache-memory=auto (0.9)")


if __name__ == "__main__":
    main()
