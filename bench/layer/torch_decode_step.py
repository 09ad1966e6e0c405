#!/usr/bin/env python3
"""A PyTorch reference decode step of one Llama-3-8B layer, the baseline for
layer_bench's decode rows (bench/layer/layer_bench.cc --decode-csv).

The step is B sessions of one new token each over L cached tokens, as
layer_bench times it: hidden 4096, 32 heads, 8 KV heads, head_dim 128,
intermediate 14336, rope_theta 500000, bf16 on CUDA. It is written with torch
ops in the standard Llama decoder layer's math (HF's LlamaDecoderLayer):

  RMSNorm (torch.nn.functional.rms_norm, fp32 statistics, eps 1e-5; checked
  at start against HF's LlamaRMSNorm formula, which replaces it if the two
  disagree) -> one fused qkv projection (weight [6144, 4096]) -> RoPE at
  position L on q and k (HF's rotate_half; cos/sin computed once per point
  outside the step, as a model shares HF's position_embeddings across its
  layers) -> the new k and v written into the cache at row L (index_copy_ with
  a device index tensor, so a CUDA graph replays the write) -> SDPA of the one
  query over the cache's L + 1 rows, GQA through enable_gqa=True (K and V
  expanded with repeat_interleave if torch refuses it, which then reads and
  writes 4x the K/V bytes) -> o projection + residual -> RMSNorm -> one fused
  gate_up projection (weight [28672, 4096]) -> SiLU(gate) * up -> down
  projection + residual.

Fused qkv and gate_up weights (one GEMM each, as vLLM and SGLang serve Llama)
make a stronger baseline than HF's seven separate projections, which
bench/layer/hf_layer.py times on the stateless rows. SDPA runs on torch's
default backend choice; bench/attention/torch_decode.py (gpu-run.sh
bench-decode) compares its flash and cuDNN backends on the attention alone.
Weights, the input and the cache are random, scaled as layer_bench's.

PyTorch has no paged SDPA, so its cache is a contiguous [B, 8, L + 1, 128]
tensor per K and V (no block tables, no indirection) where ours is a shuffled
paged pool; the K/V bytes a step reads are the same. The cache holds exactly
L + 1 rows so that the slice SDPA reads is the whole tensor: no stride check
can add a copy to PyTorch's step.

Modes, timed the way layer_bench times its steps: warm-up, then CUDA events
around each call with a synchronize after it, median of --iters calls. So
"eager" includes Python's launch latency, as ours includes its host-side
launches; "graph" replays the step captured once per point in a
torch.cuda.CUDAGraph (after warm-up on a side stream), one launch per step.
"e_kern" is the eager step queued behind torch.cuda._sleep
(bench/attention/torch_timing.median_ms, 16 calls): its kernels with
Python's launch latency hidden, though not the stream's gaps between
dependent kernels, which the graph's replay also shortens.

Validation before timing, on every point; any failure exits non-zero:
against an fp32 recomputation from the same bf16 weights and cache rows,
written apart from the timed code (separate q/k/v weight slices, repeat_kv,
an explicit softmax), for the first two sessions: the k row the step wrote,
the attention output and the layer output, each within 3% of the reference's
largest magnitude; then the graph's replay against the eager output
(allclose, rtol = atol = 1e-2), so the graph never times something broken.

With --ours (layer_bench --decode-csv of the Llama-3-8B layer, not --mixtral)
each row adds our median step, layer_bench's floor_ms (max((weight bytes +
B (L + 1) 8 128 2 2 bytes of K/V) / the copy bandwidth, (2 B weight params +
4 32 128 B (L + 1)) FLOP / the bf16 GEMM rate), both rates measured in
layer_bench's run on this device) and the ratios eager/ours and graph/ours
(above 1: ours is faster), ours/floor and graph/floor (1 is the floor); when that CSV
has layer_bench --compare graph's column, also our graph replay and
graph/ours_graph. The two programs run one after the other on the same
machine in one gpu-run.sh call, not interleaved: drift between them (10-25%
at times, layer_bench notes) is not cancelled as --compare's alternation
cancels it inside layer_bench. torch.compile (which would fuse the norms,
RoPE and SiLU) is not timed.

Usage: python3 bench/layer/torch_decode_step.py [--ours PATH]
           [--points 1x1024,64x4096] [--iters N] [--warmup N]
"""

import argparse
import csv
import math
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention"))
from torch_timing import median_ms, parse_points, synced_median_ms  # noqa: E402  (bench/attention/torch_timing.py)

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
Q_WIDTH, KV_WIDTH = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
EPS, ROPE_THETA = 1e-5, 500000.0
POINTS = [(1, 1024), (1, 4096), (16, 1024), (16, 4096), (64, 1024), (64, 4096)]
# About 50 ms at the H100's clock: longer than enqueueing QUEUED_CALLS eager steps takes.
SPIN_CYCLES = 100_000_000
QUEUED_CALLS = 16  # ~30 launches each: well inside the device's launch queue
CHECKED_SESSIONS = 2
REL_TOL = 3e-2


def uniform(shape, center, half_width):
    return torch.empty(shape, device="cuda", dtype=torch.bfloat16).uniform_(center - half_width,
                                                                            center + half_width)


def make_weights():
    """Random bf16 weights scaled as layer_bench's: norms 1 +- 0.1, projections
    uniform with variance 1 / fan_in. gate_up's first INTER rows are the gate."""
    def proj(rows, fan_in):
        return uniform((rows, fan_in), 0.0, math.sqrt(3.0 / fan_in))

    return {
        "input_norm": uniform((HIDDEN,), 1.0, 0.1),
        "qkv": proj(Q_WIDTH + 2 * KV_WIDTH, HIDDEN),
        "o": proj(HIDDEN, Q_WIDTH),
        "post_norm": uniform((HIDDEN,), 1.0, 0.1),
        "gate_up": proj(2 * INTER, HIDDEN),
        "down": proj(HIDDEN, INTER),
    }


def hf_rms_norm(x, weight):
    """HF's LlamaRMSNorm."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def fused_rms_norm(x, weight):
    return F.rms_norm(x, (HIDDEN,), weight, EPS)


def pick_norm():
    """F.rms_norm where it agrees with HF's formula (one kernel on recent torch), else HF's."""
    if not hasattr(F, "rms_norm"):
        return hf_rms_norm, "HF's LlamaRMSNorm formula (no F.rms_norm)"
    x = uniform((64, HIDDEN), 0.0, 1.7)
    w = uniform((HIDDEN,), 1.0, 0.1)
    a, b = fused_rms_norm(x, w).float(), hf_rms_norm(x, w).float()
    diff = (a - b).abs().max().item()
    if diff <= 1e-2 * b.abs().max().item():
        return fused_rms_norm, f"F.rms_norm (max diff from HF's formula {diff:.3g})"
    return hf_rms_norm, f"HF's LlamaRMSNorm formula (F.rms_norm differs by {diff:.3g})"


def gqa_native():
    """Whether SDPA takes enable_gqa here, with HF's head mapping (query head h
    reads KV head h // 4, as repeat_interleave expands)."""
    q = uniform((2, HEADS, 1, HEAD_DIM), 0.0, 1.0)
    k = uniform((2, KV_HEADS, 40, HEAD_DIM), 0.0, 1.0)
    v = uniform((2, KV_HEADS, 40, HEAD_DIM), 0.0, 1.0)
    try:
        a = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except (TypeError, RuntimeError) as err:
        return False, f"enable_gqa refused ({str(err).strip().splitlines()[0][:80]}): K/V repeat_interleave'd"
    group = HEADS // KV_HEADS
    b = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    if not torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2):
        return False, "enable_gqa disagrees with repeat_interleave: K/V repeat_interleave'd"
    # Only flash takes enable_gqa without a mask; were it to refuse, the
    # default dispatch would fall back to the math backend.
    try:
        with warnings.catch_warnings(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            warnings.simplefilter("ignore")  # a refusing backend warns why, then raises
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return True, "enable_gqa=True (the flash backend takes it)"
    except RuntimeError:
        return True, "enable_gqa=True (the flash backend refuses it: the default dispatch may run math)"


def rope_cos_sin(position):
    """cos and sin at one position, [HEAD_DIM], computed in fp32 and rounded to
    bf16 as HF's LlamaRotaryEmbedding does."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, HEAD_DIM, 2, device="cuda", dtype=torch.float32) / HEAD_DIM))
    angles = float(position) * inv_freq
    emb = torch.cat((angles, angles))
    return emb.cos(), emb.sin()


def rotate_half(x):
    return torch.cat((-x[..., HEAD_DIM // 2:], x[..., :HEAD_DIM // 2]), dim=-1)


class DecodeStep:
    """One point's state: the input, the cache, the position; __call__ is the
    timed step, with no host synchronization in it (graph-capturable)."""

    def __init__(self, weights, batch, context, norm, gqa):
        self.w, self.batch, self.context, self.norm, self.gqa = weights, batch, context, norm, gqa
        self.x = uniform((batch, HIDDEN), 0.0, 1.7)
        # Exactly L + 1 rows: row L is the step's own, written on every call.
        self.k_cache = uniform((batch, KV_HEADS, context + 1, HEAD_DIM), 0.0, 1.0)
        self.v_cache = uniform((batch, KV_HEADS, context + 1, HEAD_DIM), 0.0, 1.0)
        self.index = torch.tensor([context], device="cuda", dtype=torch.int64)
        cos, sin = rope_cos_sin(context)
        self.cos, self.sin = cos.to(torch.bfloat16), sin.to(torch.bfloat16)

    def __call__(self, trace=None):
        w, b, x = self.w, self.batch, self.x
        qkv = F.linear(self.norm(x, w["input_norm"]), w["qkv"])
        q, k, v = qkv.split([Q_WIDTH, KV_WIDTH, KV_WIDTH], dim=-1)
        q = q.view(b, HEADS, 1, HEAD_DIM)
        k = k.view(b, KV_HEADS, 1, HEAD_DIM)
        v = v.view(b, KV_HEADS, 1, HEAD_DIM)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        self.k_cache.index_copy_(2, self.index, k)
        self.v_cache.index_copy_(2, self.index, v)
        keys = self.k_cache[:, :, :self.context + 1]
        values = self.v_cache[:, :, :self.context + 1]
        if self.gqa:
            attn = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        else:
            group = HEADS // KV_HEADS
            attn = F.scaled_dot_product_attention(q, keys.repeat_interleave(group, dim=1),
                                                  values.repeat_interleave(group, dim=1))
        attn = attn.reshape(b, Q_WIDTH)  # one query: [B, 32, 1, 128] is HF's transpose-and-reshape order
        if trace is not None:
            trace["attn"] = attn
        h = x + F.linear(attn, w["o"])
        gate, up = F.linear(self.norm(h, w["post_norm"]), w["gate_up"]).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, w["down"])


def reference(step, n):
    """fp32 recomputation of the first n sessions from the same bf16 weights,
    input and cache rows 0 .. L-1: (k row L, attention output, layer output)."""
    w = {name: t.float() for name, t in step.w.items()}

    def norm(t, weight):
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS))

    L = step.context
    x = step.x[:n].float()
    h = norm(x, w["input_norm"])
    wq, wk, wv = w["qkv"][:Q_WIDTH], w["qkv"][Q_WIDTH:Q_WIDTH + KV_WIDTH], w["qkv"][Q_WIDTH + KV_WIDTH:]
    q = (h @ wq.T).view(n, HEADS, HEAD_DIM)
    k = (h @ wk.T).view(n, KV_HEADS, HEAD_DIM)
    v = (h @ wv.T).view(n, KV_HEADS, HEAD_DIM)
    cos, sin = rope_cos_sin(L)
    half = HEAD_DIM // 2
    q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
    k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
    keys = torch.cat((step.k_cache[:n, :, :L].float(), k.unsqueeze(2)), dim=2)  # [n, 8, L + 1, 128]
    values = torch.cat((step.v_cache[:n, :, :L].float(), v.unsqueeze(2)), dim=2)
    keys = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)  # HF's repeat_kv
    values = values.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("nhd,nhld->nhl", q, keys) / math.sqrt(HEAD_DIM)
    attn = torch.einsum("nhl,nhld->nhd", torch.softmax(scores, dim=-1), values).reshape(n, Q_WIDTH)
    h = x + attn @ w["o"].T
    g = norm(h, w["post_norm"])
    gate, up = g @ w["gate_up"][:INTER].T, g @ w["gate_up"][INTER:].T
    out = h + (F.silu(gate) * up) @ w["down"].T
    return k, attn, out


def check(label, got, want, point):
    """Exits with the worst element unless got is within REL_TOL of want's largest magnitude."""
    got, want = got.float(), want.float()
    err = (got - want).abs()
    worst = int(err.argmax())
    bound = REL_TOL * want.abs().max().item()
    if not torch.isfinite(got).all() or err.max().item() > bound:
        sys.exit(f"torch_decode_step: {point}: {label} wrong: worst element {worst} got "
                 f"{got.flatten()[worst].item():.5g}, want {want.flatten()[worst].item():.5g} "
                 f"(|err| {err.max().item():.3g} > {bound:.3g})")
    return err.max().item() / max(want.abs().max().item(), 1e-30)


def capture(step):
    """The step captured in a CUDA graph after warm-up on a side stream: (graph, its output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def bench_point(weights, batch, context, norm, gqa, warmup, iters):
    """(eager_ms, eager kernels' ms, graph_ms, worst relative errors) for one point."""
    point = f"B={batch} L={context}"
    step = DecodeStep(weights, batch, context, norm, gqa)
    trace = {}
    eager_out = step(trace).clone()
    n = min(batch, CHECKED_SESSIONS)
    k_ref, attn_ref, out_ref = reference(step, n)
    errors = (check("k row L", step.k_cache[:n, :, context], k_ref, point),
              check("attention output", trace["attn"][:n], attn_ref, point),
              check("layer output", eager_out[:n], out_ref, point))
    del trace, k_ref, attn_ref, out_ref

    graph, graph_out = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    if not torch.allclose(graph_out.float(), eager_out.float(), rtol=1e-2, atol=1e-2):
        err = (graph_out.float() - eager_out.float()).abs()
        worst = int(err.argmax())
        sys.exit(f"torch_decode_step: {point}: graph replay differs from eager: worst element {worst} "
                 f"graph {graph_out.flatten()[worst].item():.5g}, eager {eager_out.flatten()[worst].item():.5g}")

    eager = synced_median_ms(step, warmup, iters)
    kernels = median_ms([None], warmup, QUEUED_CALLS, lambda _: step(), spin_cycles=SPIN_CYCLES)
    replay = synced_median_ms(graph.replay, warmup, iters)
    del graph, graph_out, step
    torch.cuda.empty_cache()
    return eager, kernels, replay, errors


def read_ours(path):
    """layer_bench --decode-csv: {(B, L): row}."""
    if not os.path.exists(path):
        print(f"--ours: {path} does not exist; printing PyTorch alone")
        return {}
    with open(path, newline="") as f:
        return {(int(r["seqs"]), int(r["context"])): r for r in csv.DictReader(f)}


def fmt(value, spec, width):
    return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}}"


def ratio(a, b):
    return a / b if a is not None and b else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours", help="layer_bench --decode-csv output, printed beside PyTorch's times")
    parser.add_argument("--points", type=parse_points, default=POINTS, help="BxL[,BxL...], e.g. 1x1024,64x4096")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("torch_decode_step: needs a CUDA device")

    torch.manual_seed(0)
    ours = read_ours(args.ours) if args.ours else {}
    with torch.inference_mode():
        weights = make_weights()
        weight_params = sum(t.numel() for t in weights.values())
        norm, norm_how = pick_norm()
        gqa, gqa_how = gqa_native()
        props = torch.cuda.get_device_properties(0)
        print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}; "
              f"layer weights {2 * weight_params / 1e6:.1f} MB (bf16)")
        print(f"PyTorch decode step: fused qkv and gate_up weights, norm {norm_how}, SDPA {gqa_how}, "
              f"contiguous K/V [B, 8, L + 1, 128]; median of {args.iters} synchronized calls "
              f"(e_kern: {QUEUED_CALLS} eager calls queued behind a spin)")
        rows = []
        for batch, context in args.points:
            eager, kernels, replay, errors = bench_point(weights, batch, context, norm, gqa, args.warmup,
                                                         args.iters)
            rows.append((batch, context, eager, kernels, replay, errors))

    ours_graph_col = "graph_ms" if any("graph_ms" in r for r in ours.values()) else None
    print(f"\n{'B':>4} {'L':>6} {'eager_ms':>9} {'e_kern_ms':>9} {'graph_ms':>9} {'floor_ms':>9} "
          f"{'ours_ms':>9} {'eager/ours':>10} {'graph/ours':>10} {'ours/floor':>10} {'graph/floor':>11}"
          + (f" {'ours_graph':>10} {'graph/ours_graph':>16}" if ours_graph_col else "")
          + "  worst rel err (k, attn, out)")
    for batch, context, eager, kernels, replay, errors in rows:
        row = ours.get((batch, context))
        mine = float(row["ms"]) if row else None
        floor = float(row["floor_ms"]) if row else None
        line = (f"{batch:>4} {context:>6} {eager:9.4f} {kernels:9.4f} {replay:9.4f} {fmt(floor, '.4f', 9)} "
                f"{fmt(mine, '.4f', 9)} {fmt(ratio(eager, mine), '.2f', 10)} {fmt(ratio(replay, mine), '.2f', 10)} "
                f"{fmt(ratio(mine, floor), '.2f', 10)} {fmt(ratio(replay, floor), '.2f', 11)}")
        if ours_graph_col:
            mine_graph = float(row[ours_graph_col]) if row and row.get(ours_graph_col) else None
            line += f" {fmt(mine_graph, '.4f', 10)} {fmt(ratio(replay, mine_graph), '.2f', 16)}"
        print(line + "  " + " ".join(f"{e:.1e}" for e in errors))


if __name__ == "__main__":
    main()
