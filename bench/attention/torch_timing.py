"""The timing methods of the PyTorch baselines, the same as the CUDA
benchmarks': CUDA events around each call after a warm-up, median reported.
median_ms (torch_sdpa.py, torch_decode.py, the kernel-only column of
bench/layer/torch_decode_step.py) rotates input sets whose total is at least
twice the L2 and queues its calls back to back; synced_median_ms
(bench/layer/torch_decode_step.py, hf_layer.py, hf_moe.py) synchronizes after each call,
as layer_bench does. parse_points reads the decode benches' BxL points.
device_rates measures a floor's two denominators as bench/layer/device_rates.h
does."""

import math
import statistics

import torch


def median_ms(sets, warmup, iters, fn, spin_cycles=0):
    """Median milliseconds of fn(set) over `iters` calls, cycling through
    `sets`, after `warmup` untimed calls. spin_cycles > 0 first queues
    torch.cuda._sleep(spin_cycles) (where torch has it), so the timed calls are
    enqueued behind it and the events time the kernels, not Python's launch
    latency: what short calls (decode steps) need."""
    for i in range(warmup):
        fn(sets[i % len(sets)])
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    if spin_cycles > 0 and hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(spin_cycles)
    for i in range(iters):
        starts[i].record()
        fn(sets[i % len(sets)])
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def num_sets(bytes_per_set, l2_bytes):
    """Input sets to rotate so that together they hold at least twice the L2."""
    return max(2, math.ceil(2 * l2_bytes / bytes_per_set))


def synced_median_ms(fn, warmup, iters):
    """Median milliseconds of fn() over `iters` calls, each between two events
    and synchronized after, following `warmup` untimed calls: what a caller
    that waits for every step sees, Python's launch latency included."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def device_rates():
    """(copy bytes read plus written per second, bf16 FLOP/s): a device-to-device
    copy of 1 GiB and an 8192^3 bf16 matmul (cuBLASLt under torch), random
    inputs, median of 10 after 3 warm-up calls; bench/layer/device_rates.h
    measures the same two for layer_bench."""
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = median_ms([None], 3, 10, lambda _: dst.copy_(src))
    del src, dst
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, n, device="cuda", dtype=torch.bfloat16) * 0.01
    mm_ms = median_ms([None], 3, 10, lambda _: a @ w.t())
    return 2.0 * (1 << 30) / (copy_ms * 1e-3), 2.0 * n ** 3 / (mm_ms * 1e-3)


def parse_points(text):
    """"1x1024,64x4096" -> [(1, 1024), (64, 4096)]: B sequences at context L."""
    points = []
    for item in text.split(","):
        b, l = item.lower().split("x")
        points.append((int(b), int(l)))
    return points
