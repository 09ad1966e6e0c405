#!/usr/bin/env python3
"""Version 0 of the decode attention benchmark: PyTorch's scaled_dot_product_attention.

Measures torch.nn.functional.scaled_dot_product_attention (bf16) with the flash
backend and with the cuDNN backend on the points of decode_attention_bench
(Llama-3-8B heads: 32 query heads, 8 KV heads, head_dim 128; B sequences with
L tokens of context and q_tokens new ones), by the same method: CUDA events
around each call after a warm-up, queued behind torch.cuda._sleep so that the
events time the kernels and not Python's launch latency, input sets rotated so
their total is at least twice the L2, median reported.

PyTorch has no paged SDPA, so K and V here are contiguous [B, 8, L + q_tokens,
128] tensors (the cache plus the step's own rows, no block-table indirection)
and q is [B, 32, q_tokens, 128]. With torch >= 2.5 the call passes
enable_gqa=True; a backend that refuses it (or an older torch) gets K and V
expanded to 32 heads with repeat_interleave before timing, which then reads 4x
the bytes counted. The "how" column says which. A single new token sees every
key (is_causal=False, no mask); for q_tokens > 1 the mask is the
bottom-right-aligned causal boolean mask (query i sees keys 0 .. L + i).

TB/s counts the K and V bytes a step must read, as decode_attention_bench
does: B * (L + q_tokens) * 8 * 128 * 2 bytes, for K and for V. With --ours
(decode_attention_bench's --csv) each row also shows our time and the ratio
torch_us / ours_us: above 1, ours is faster. A backend that refuses a shape is
listed as "unsupported: <reason>".

Usage: python3 torch_decode.py [--ours PATH] [--points 1x1024,64x4096]
           [--q-tokens N] [--iters N] [--warmup N]
"""

import argparse
import csv
import os
import re
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch_timing import median_ms, num_sets, parse_points

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
POINTS = [(1, 1024), (1, 4096), (1, 16384), (1, 32768), (16, 1024), (16, 4096), (64, 1024), (64, 4096),
          (256, 1024), (256, 2048)]
BACKENDS = (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
# About 50 ms at the H100's clock: far longer than enqueueing the timed calls takes.
SPIN_CYCLES = 100_000_000


def kv_bytes(batch, context, q_tokens):
    return 2 * batch * (context + q_tokens) * KV_HEADS * HEAD_DIM * 2


def torch_has_gqa():
    major, minor = (int(re.match(r"\d+", x).group()) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def decode_inputs(batch, context, q_tokens, expand, l2_bytes):
    """Input sets (q, k, v) totalling at least twice the L2."""
    kv_heads = HEADS if expand else KV_HEADS
    set_bytes = 2 * batch * HEAD_DIM * (2 * HEADS * q_tokens + 2 * kv_heads * (context + q_tokens))  # q, out, k, v
    sets = []
    for _ in range(num_sets(set_bytes, l2_bytes)):
        q = torch.empty(batch, HEADS, q_tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)
        k = torch.empty(batch, KV_HEADS, context + q_tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k.uniform_(-1, 1)
        v = torch.empty_like(k).uniform_(-1, 1)
        if expand:
            k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
            v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        sets.append((q, k, v))
    return sets


def refusal(err, caught):
    """Why a backend refused: its own warnings, else the error's first line."""
    reasons = []
    for w in caught:
        msg = re.sub(r"\s*\(Triggered internally at.*", "", str(w.message), flags=re.S).strip()
        if msg and not msg.endswith("because:") and msg not in reasons:
            reasons.append(msg)
    text = "; ".join(reasons) if reasons else (str(err).strip().splitlines() or ["?"])[0]
    return text[:110]


def bench_point(batch, context, q_tokens, warmup, iters, l2_bytes, gqa_native):
    """{backend label: (ms or None, how)} for one point."""
    # Query i sits at position context + i and sees keys 0 .. context + i.
    mask = None
    if q_tokens > 1:
        mask = torch.ones(q_tokens, context + q_tokens, device="cuda", dtype=torch.bool).tril(diagonal=context)
    results = {}
    pending = list(BACKENDS)
    for form in (["enable_gqa"] if gqa_native else []) + ["kv expanded"]:
        if not pending:
            break
        sets = decode_inputs(batch, context, q_tokens, form == "kv expanded", l2_bytes)
        extra = {"enable_gqa": True} if form == "enable_gqa" else {}

        def run(qkv):
            F.scaled_dot_product_attention(*qkv, attn_mask=mask, is_causal=False, **extra)

        for label, backend in list(pending):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    with sdpa_kernel([backend]):
                        ms = median_ms(sets, warmup, iters, run, spin_cycles=SPIN_CYCLES)
                    results[label] = (ms, form)
                    pending.remove((label, backend))
                except RuntimeError as err:  # no kernel of this backend takes the input
                    results[label] = (None, "unsupported: " + refusal(err, caught))
        del sets
        torch.cuda.empty_cache()
    return results


def read_ours(path):
    """decode_attention_bench's CSV: {(B, L, q_tokens): us}."""
    if not os.path.exists(path):
        print(f"--ours: {path} does not exist; printing PyTorch alone")
        return {}
    with open(path, newline="") as f:
        return {(int(r["B"]), int(r["L"]), int(r["q_tokens"])): float(r["us"]) for r in csv.DictReader(f)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--points", type=parse_points, default=POINTS, help="BxL[,BxL...], e.g. 1x1024,64x4096")
    parser.add_argument("--q-tokens", type=int, default=1)
    parser.add_argument("--ours", help="decode_attention_bench --csv output, printed beside PyTorch's times")
    parser.add_argument("--kv-cache", choices=("auto", "fp8"), default="auto",
                        help="the cache --ours read (PyTorch's side reads bf16 K/V either way)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2_bytes = props.L2_cache_size
    gqa_native = torch_has_gqa()
    ours = read_ours(args.ours) if args.ours else {}
    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {l2_bytes >> 20} MB, "
          f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"enable_gqa {'available' if gqa_native else 'unavailable (torch < 2.5)'}")
    print(f"\ntorch sdpa decode: bf16, heads {HEADS}, kv heads {KV_HEADS}, head_dim {HEAD_DIM}, "
          f"q_tokens {args.q_tokens}, contiguous K/V (median of {args.iters}); ours from a "
          f"{'bf16' if args.kv_cache == 'auto' else 'fp8'} cache")
    print(f"{'B':>5} {'L':>6} {'q':>3}  {'backend':<7} {'us':>10} {'TB/s':>7} {'ours us':>10} {'torch/ours':>10}  how")
    for batch, context in args.points:
        results = bench_point(batch, context, args.q_tokens, args.warmup, args.iters, l2_bytes, gqa_native)
        mine = ours.get((batch, context, args.q_tokens))
        for label, _ in BACKENDS:
            ms, how = results[label]
            ours_col = f"{mine:10.1f}" if mine is not None else f"{'-':>10}"
            if ms is None:
                print(f"{batch:>5} {context:>6} {args.q_tokens:>3}  {label:<7} {'-':>10} {'-':>7} {ours_col} "
                      f"{'-':>10}  {how}")
                continue
            us = ms * 1e3
            tbps = kv_bytes(batch, context, args.q_tokens) / (ms * 1e-3) / 1e12
            ratio = f"{us / mine:10.2f}" if mine is not None else f"{'-':>10}"
            if how == "kv expanded":
                how += " (reads 4x the K/V bytes counted)"
            print(f"{batch:>5} {context:>6} {args.q_tokens:>3}  {label:<7} {us:10.1f} {tbps:7.2f} {ours_col} "
                  f"{ratio}  {how}")


if __name__ == "__main__":
    main()
