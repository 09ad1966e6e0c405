"""The vendor's FP8 GEMMs against its BF16 ones on the Llama-3-8B projections,
on the GPU machine (issue 34's baseline): torch.mm in BF16 (cuBLAS), and
torch._scaled_mm (cuBLASLt) in FP8 e4m3 with one scale per tensor, with
per-token x per-channel scales ("row-wise"), and with 1x128 x 128x128 block
scales where this torch takes them. y = x W^T with W [N, K] as checkpoints
store it.

Each case replays, from one CUDA graph, one GEMM per weight copy over enough
copies that the weights are several times the L2 (a served layer reads each
weight once per step), timed with CUDA events over repeated replays (median
of 7); the first replay is a warm-up. Outputs are checked against a float32
product of the same (dequantized) operands before timing.

    python3 bench/gemm/torch_fp8.py [--m 1,16,64,2048] [--shapes qkv,o,gate_up,down]
                                     [--csv OUT]
Prints one line per (shape, M): microseconds per GEMM and the weight bytes
read per second for each kernel, and FP8's speed-up over BF16.
"""
import argparse
import csv
import statistics
import sys

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "square8k": (8192, 8192)}
F8 = torch.float8_e4m3fn
L2_MULTIPLE = 4


def copies_for(weight_bytes):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, -(-L2_MULTIPLE * l2 // weight_bytes))


def time_graph(fn, calls):
    """Median milliseconds of one replay of `calls` GEMMs, per GEMM."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the graph (handles, workspaces)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 5 / calls)
    return statistics.median(times)


def rel_err(got, want):
    return float((got.float() - want).norm() / want.norm())


def quantize_rows(t):
    """e4m3 values and one float32 scale per row (amax / 448)."""
    scale = (t.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (t.float() / scale).to(F8), scale


def quantize_blocks(t, rows, cols=128):
    """e4m3 values and one float32 scale per rows x cols block."""
    n, k = t.shape
    v = t.float().reshape(n // rows, rows, k // cols, cols)
    scale = (v.abs().amax(dim=(1, 3), keepdim=True) / 448.0).clamp(min=1e-12)
    return (v / scale).to(F8).reshape(n, k), scale.reshape(n // rows, k // cols)


def run_case(name, n, k, m, writer):
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + m)
    x = torch.randn(m, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k ** 0.5
    want = x.float() @ w.float().t()
    copies = copies_for(n * k * 2)
    results = {}

    ws = [w.clone() for _ in range(copies)]
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    torch.mm(x, ws[0].t(), out=out)
    err = rel_err(out, want)
    results["bf16"] = (time_graph(lambda: [torch.mm(x, wi.t(), out=out) for wi in ws], copies),
                       n * k * 2, err)

    def scaled(kernel, xq, wq, sa, sb, ref):
        """_scaled_mm over rotated copies of wq, checked against `ref`; a
        scaling this torch does not take is reported, not fatal."""
        wqs = [wq.clone() for _ in range(copies_for(n * k))]
        try:
            y = torch._scaled_mm(xq, wqs[0].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
            results[kernel] = (time_graph(lambda: [torch._scaled_mm(
                xq, wi.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16) for wi in wqs],
                len(wqs)), n * k, rel_err(y, ref))
        except (RuntimeError, TypeError, ValueError) as e:
            results[kernel] = (float("nan"), n * k, str(e).splitlines()[0][:100])

    # One scale per tensor.
    xs = (x.float().abs().max() / 448.0).reshape(())
    wsc = (w.float().abs().max() / 448.0).reshape(())
    xq, wq = (x.float() / xs).to(F8), (w.float() / wsc).to(F8)
    scaled("fp8_tensor", xq, wq, xs, wsc, (xq.float() * xs) @ (wq.float() * wsc).t())

    # Per token x per output channel ("row-wise").
    xq, xs = quantize_rows(x)
    wq, wsc = quantize_rows(w)
    scaled("fp8_rowwise", xq, wq, xs, wsc.t(), (xq.float() * xs) @ (wq.float() * wsc).t())

    # Block scales: activations 1 x 128 per token, weights 128 x 128; torch
    # takes the activations' [M, K/128] outer-dim-major and the weight's
    # [N/128, K/128] transposed with its operand.
    xq, xs = quantize_blocks(x, 1)
    wq, wsc = quantize_blocks(w, 128)
    ref = ((xq.float().reshape(m, k // 128, 128) * xs.unsqueeze(-1)).reshape(m, k)
           @ (wq.float().reshape(n // 128, 128, k // 128, 128)
              * wsc[:, None, :, None]).reshape(n, k).t())
    scaled("fp8_block", xq, wq, xs.t().contiguous().t(), wsc.t(), ref)

    parts = []
    for kernel, (ms, weight_bytes, err) in results.items():
        us = ms * 1e3
        tbps = weight_bytes / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
        tflops = 2 * m * n * k / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
        parts.append(f"{kernel} {us:8.1f} us {tbps:5.2f} TB/s {tflops:6.0f} TFLOP/s "
                     f"(err {err if isinstance(err, str) else f'{err:.1e}'})")
        writer.writerow([name, n, k, m, kernel, f"{us:.2f}", f"{tbps:.3f}", f"{tflops:.1f}",
                         err if isinstance(err, str) else f"{err:.3e}"])
    bf16 = results["bf16"][0]
    speedups = " ".join(f"{k_}/bf16 {bf16 / v[0]:.2f}x" for k_, v in results.items()
                        if k_ != "bf16" and v[0] == v[0])
    print(f"{name:8s} {n}x{k} M={m:5d}: " + " | ".join(parts) + " || " + speedups)


def copy_tbps():
    """A 1 GiB device-to-device copy, bytes read plus written per second:
    the memory ceiling the weight-read rates above compare with."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * a.numel() / (statistics.median(times) * 1e-3) / 1e12


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", default="1,16,64,2048")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MB, "
          f"torch {torch.__version__}; device copy {copy_tbps():.2f} TB/s")
    out = open(args.csv, "w", newline="") if args.csv else sys.stdout
    writer = csv.writer(out if args.csv else open("/dev/null", "w"))
    writer.writerow(["shape", "n", "k", "m", "kernel", "us", "weight_tbps", "tflops", "rel_err"])
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        for m in map(int, args.m.split(",")):
            run_case(name, n, k, m, writer)


if __name__ == "__main__":
    main()
