"""The timing method of the PyTorch baselines (torch_sdpa.py, torch_decode.py),
the same as the CUDA benchmarks': CUDA events around each call after a
warm-up, input sets rotated so their total is at least twice the L2, median
reported."""

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
