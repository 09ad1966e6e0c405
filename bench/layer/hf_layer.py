"""Times Hugging Face's LlamaDecoderLayer with Llama-3-8B shapes, the baseline
for bench/layer/layer_bench (the CUDA backend's layer executor).

bf16, attn_implementation="sdpa", on cuda; position_embeddings from
LlamaRotaryEmbedding; attention_mask=None, which transformers' sdpa path turns
into is_causal=True for more than one query token (the probe at start-up
checks this on the installed version: perturbing the last token must leave
the earlier outputs unchanged). Packed sequences become the batch dimension
(HF has no varlen path), i.e. [seqs, tokens / seqs, hidden].

Timing as in layer_bench: warm-up, then CUDA events around each forward,
median. With --ours (layer_bench --csv output) prints both side by side with
the speedup and the roofline floor, which layer_bench computed at the copy
bandwidth and GEMM rate it measured on the device in its own run.

    python3 bench/layer/hf_layer.py [--ours ours.csv] [--csv hf.csv] [--iters 50]
"""
import argparse
import csv
import inspect
import os
import sys

import torch
import transformers
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention"))
from torch_timing import synced_median_ms  # noqa: E402  (bench/attention/torch_timing.py)

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
# The targets: speedup over HF by token count.
TARGETS = {1: 2.5, 16: 2.5, 128: 2.5, 4096: 1.2, 8192: 1.2}
CASES = [(1, 1), (16, 1), (128, 1), (128, 8), (1024, 1), (1024, 8), (4096, 1), (4096, 8),
         (8192, 1), (8192, 8)]


def make_config():
    kwargs = dict(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
                  max_position_embeddings=8192, num_hidden_layers=1)
    try:  # transformers 5.x: rope settings live in rope_parameters
        config = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                             **kwargs)
    except TypeError:
        config = LlamaConfig(rope_theta=500000.0, **kwargs)
    config._attn_implementation = "sdpa"
    return config


def call_layer(layer, x, pos, pe):
    out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return out[0] if isinstance(out, tuple) else out


def probe(layer, rotary):
    print("transformers", transformers.__version__, "torch", torch.__version__)
    print("LlamaDecoderLayer.forward", inspect.signature(LlamaDecoderLayer.forward))
    x = torch.randn(1, 8, HIDDEN, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(8, device="cuda").unsqueeze(0)
    pe = rotary(x, pos)
    with torch.inference_mode():
        a = call_layer(layer, x, pos, pe)
        y = x.clone()
        y[:, -1] += 1.0
        b = call_layer(layer, y, pos, pe)
    earlier = (a[:, :-1] - b[:, :-1]).abs().max().item()
    last = (a[:, -1] - b[:, -1]).abs().max().item()
    causal = earlier <= 1e-3 * last
    print(f"probe: attention_mask=None is causal: {causal} (earlier tokens moved {earlier:.3g}, "
          f"the perturbed one {last:.3g})")
    if not causal:
        sys.exit("hf_layer: the sdpa path is not causal with attention_mask=None on this version")


def time_case(layer, rotary, tokens, seqs, iters):
    length = tokens // seqs
    x = torch.randn(seqs, length, HIDDEN, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(length, device="cuda").unsqueeze(0).expand(seqs, -1)
    pe = rotary(x, pos)
    with torch.inference_mode():
        return synced_median_ms(lambda: call_layer(layer, x, pos, pe), 5, iters)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours", help="layer_bench --csv output to compare with")
    parser.add_argument("--csv", help="write tokens,seqs,ms rows here")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = make_config()
    with torch.device("cuda"):
        layer = LlamaDecoderLayer(config, layer_idx=0).to(torch.bfloat16).eval()
        rotary = LlamaRotaryEmbedding(config=config)
    weight_params = sum(p.numel() for p in layer.parameters())
    print(f"device: {torch.cuda.get_device_name()}; layer params {weight_params / 1e6:.1f} M")
    probe(layer, rotary)

    ours = {}
    if args.ours:
        with open(args.ours) as f:
            for row in csv.DictReader(f):
                floor = row.get("floor_ms")
                ours[(int(row["tokens"]), int(row["seqs"]))] = (float(row["ms"]),
                                                                float(floor) if floor else None)
    rows = []
    for tokens, seqs in CASES:
        rows.append((tokens, seqs, time_case(layer, rotary, tokens, seqs, args.iters)))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("tokens,seqs,ms\n")
            for tokens, seqs, ms in rows:
                f.write(f"{tokens},{seqs},{ms}\n")

    print(f"{'tokens':>7} {'seqs':>5} {'hf_ms':>9} {'ours_ms':>9} {'speedup':>8} "
          f"{'target':>7} {'floor_ms':>9} {'ours/floor':>10}")
    for tokens, seqs, hf_ms in rows:
        mine, floor = ours.get((tokens, seqs), (None, None))
        target = TARGETS.get(tokens)
        print(f"{tokens:>7} {seqs:>5} {hf_ms:>9.4f} "
              f"{(f'{mine:.4f}' if mine else '-'):>9} "
              f"{(f'{hf_ms / mine:.2f}x' if mine else '-'):>8} "
              f"{(f'{target}x' if target else '-'):>7} {(f'{floor:.4f}' if floor else '-'):>9} "
              f"{(f'{mine / floor:.2f}' if mine and floor else '-'):>10}")


if __name__ == "__main__":
    main()
