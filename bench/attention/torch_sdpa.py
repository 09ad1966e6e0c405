#!/usr/bin/env python3
"""Version 0 of the attention benchmark: PyTorch's scaled_dot_product_attention.

Measures torch.nn.functional.scaled_dot_product_attention (is_causal=True,
bf16) with the flash backend and with the cuDNN backend on the shapes of
flash_attention_bench (32 heads, 8 KV heads, head_dim 128 and 64), by the same
method: CUDA events around each call after a warm-up, input sets rotated so
their total is at least twice the L2, median reported. Also times the eager
PyTorch equivalents of the RMSNorm, RoPE and SiLU-gate kernels (as Hugging
Face's Llama code runs them) in GB/s with the same byte counts.

Inputs are laid out as a model produces them, [batch, seq, heads, dim]
transposed to [batch, heads, seq, dim] (a strided view). The uneven packed mix
has no varlen entry point in SDPA; it is timed as one call per sequence.

Usage: python3 torch_sdpa.py [--iters N] [--warmup N]
"""

import argparse
import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch_timing import median_ms, num_sets

HEADS, KV_HEADS = 32, 8
SHAPES = [
    ("1x2048", [2048]),
    ("4x512", [512] * 4),
    ("1x4096", [4096]),
    ("4x1024", [1024] * 4),
    ("1x8192", [8192]),
    ("8x1024", [1024] * 8),
    ("mix8k", [4096, 2048, 1024, 512, 512]),
]


def attention_inputs(lengths, n_sets, gqa_native, head_dim):
    """One input set: per group of equal lengths, (q, k, v) as [B, H, L, D] views."""
    groups = {}
    for n in lengths:
        groups[n] = groups.get(n, 0) + 1
    sets = []
    for _ in range(n_sets):
        calls = []
        for length, batch in groups.items():
            q = torch.empty(batch, length, HEADS, head_dim, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)
            k = torch.empty(batch, length, KV_HEADS, head_dim, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)
            v = torch.empty_like(k).uniform_(-1, 1)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            if not gqa_native:
                # Expanded outside the timed region: the backend then sees
                # 32 KV heads (same FLOPs, 4x the K/V bytes).
                k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
                v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
            calls.append((q, k, v))
        sets.append(calls)
    return sets


def bench_attention(backend, head_dim, shapes, warmup, iters, l2_bytes):
    rows = []
    for name, lengths in shapes:
        flops = sum(4.0 * n * n * head_dim * HEADS / 2 for n in lengths)
        tokens = sum(lengths)
        set_bytes = tokens * (2 * HEADS + 2 * KV_HEADS) * head_dim * 2
        n_sets = num_sets(set_bytes, l2_bytes)
        result = None
        for gqa_native in (True, False):
            sets = attention_inputs(lengths, n_sets, gqa_native, head_dim)

            def run(calls):
                for q, k, v in calls:
                    if gqa_native:
                        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                    else:
                        F.scaled_dot_product_attention(q, k, v, is_causal=True)

            try:
                with sdpa_kernel([backend]):
                    ms = median_ms(sets, warmup, iters, run)
                result = (ms, "enable_gqa" if gqa_native else "kv expanded")
                break
            except RuntimeError as err:  # backend refuses this input form
                last_error = str(err).splitlines()[0]
            finally:
                del sets
        if result is None:
            rows.append((name, tokens, None, None, "unsupported: " + last_error[:60]))
        else:
            ms, how = result
            rows.append((name, tokens, ms, flops / (ms * 1e-3) / 1e12, how))
    return rows


def bench_layer_ops(warmup, iters, l2_bytes):
    tokens, eps = 8192, 1e-5
    out = []

    cols = 4096
    nbytes = 4 * tokens * cols * 2 + cols * 2
    w = torch.empty(cols, device="cuda", dtype=torch.bfloat16).uniform_(0.5, 1.5)
    sets = [
        tuple(torch.empty(tokens, cols, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1) for _ in range(2))
        for _ in range(num_sets(nbytes, l2_bytes))
    ]

    def rms_norm(xr):
        h = xr[0] + xr[1]
        hf = h.float()
        var = hf.pow(2).mean(-1, keepdim=True)
        return h, w * (hf * torch.rsqrt(var + eps)).to(torch.bfloat16)

    out.append(("rms_norm+residual 8192x4096 (HF eager)", median_ms(sets, warmup, iters, rms_norm), nbytes))
    out.append(
        (
            "rms_norm+residual 8192x4096 (F.rms_norm)",
            median_ms(sets, warmup, iters, lambda xr: F.rms_norm(xr[0] + xr[1], (cols,), w, eps)),
            nbytes,
        )
    )
    del sets

    heads, kv_heads, d = 32, 8, 128
    nbytes = 2 * tokens * (heads + kv_heads) * d * 2
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d))
    positions = torch.arange(tokens, device="cuda", dtype=torch.float32)
    sets = [
        torch.empty(tokens, heads + 2 * kv_heads, d, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)
        for _ in range(num_sets(tokens * (heads + 2 * kv_heads) * d * 2, l2_bytes))
    ]

    def rotate_half(x):
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    def rope(qkv):
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(torch.bfloat16)[:, None, :], emb.sin().to(torch.bfloat16)[:, None, :]
        q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    out.append(("rope q,k 8192 tok, 32+8 heads x128 (HF eager)", median_ms(sets, warmup, iters, rope), nbytes))
    del sets

    width = 14336
    nbytes = 3 * tokens * width * 2
    sets = [
        torch.empty(tokens, 2 * width, device="cuda", dtype=torch.bfloat16).uniform_(-1, 1)
        for _ in range(num_sets(nbytes, l2_bytes))
    ]
    out.append(
        (
            "silu_mul 8192x14336 (F.silu(g) * u)",
            median_ms(sets, warmup, iters, lambda gu: F.silu(gu[:, :width]) * gu[:, width:]),
            nbytes,
        )
    )
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    l2_bytes = props.L2_cache_size
    print(f"device: {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    runs = [(128, SHAPES), (64, [SHAPES[0], SHAPES[2], SHAPES[4], SHAPES[5]])]
    for (head_dim, shapes), (label, backend) in itertools.product(
        runs, (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION))
    ):
        print(f"\ntorch sdpa [{label}]: causal, bf16, heads {HEADS}, kv heads {KV_HEADS}, head_dim {head_dim} "
              f"(median of {args.iters})")
        print(f"{'shape':<8} {'tokens':>6}  {'ms':>9} {'TFLOP/s':>9}  how")
        for name, tokens, ms, tflops, how in bench_attention(backend, head_dim, shapes, args.warmup, args.iters,
                                                             l2_bytes):
            if ms is None:
                print(f"{name:<8} {tokens:>6}  {'-':>9} {'-':>9}  {how}")
            else:
                print(f"{name:<8} {tokens:>6}  {ms:9.3f} {tflops:9.1f}  {how}")
        torch.cuda.empty_cache()
    print(f"\ntorch layer ops, bf16 (median of {args.iters})")
    print(f"{'op':<48} {'us':>9} {'GB/s':>9}")
    for name, ms, nbytes in bench_layer_ops(args.warmup, args.iters, l2_bytes):
        print(f"{name:<48} {ms * 1e3:9.1f} {nbytes / (ms * 1e-3) / 1e9:9.0f}")


if __name__ == "__main__":
    main()
