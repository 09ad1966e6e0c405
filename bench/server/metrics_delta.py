"""What a layerserve's /metrics say about the batches run between two scrapes
(each parsed by tests/support/layerserve_process.parse_samples, whose
directory the caller has put on sys.path). Shared by the bench/server
scripts, so that all of them compute a batch's GPU time and a histogram's
mean the same way.
"""

from layerserve_process import total


def delta(before, after, name, **labels):
    """The growth of the series of `name` with these labels (summed)."""
    return total(after, name, **labels) - total(before, name, **labels)


def histogram_mean(before, after, name, **labels):
    """The mean of the observations histogram `name` gained between the
    scrapes (its _sum over its _count), or None when it gained none."""
    count = delta(before, after, f"{name}_count", **labels)
    return delta(before, after, f"{name}_sum", **labels) / count if count > 0 else None


def gpu_ms_per_batch(before, after, layers):
    """(GPU ms per sampled batch, sampled batches) between the scrapes; (None,
    0) where no batch was sampled (the CPU backend has no kernel series).
    A sampled batch reports gemm_down once per layer; its per-op device times
    summed are its GPU time (with any overlap of the other streams' kernels)."""
    sampled = delta(before, after, "layerserve_kernel_duration_seconds_count", op="gemm_down")
    if sampled <= 0 or layers <= 0:
        return None, 0
    batches = sampled / layers
    return 1e3 * delta(before, after, "layerserve_kernel_duration_seconds_sum") / batches, batches


def launch_split(before, after):
    """'direct/captured/replayed': how the batches between the scrapes ran
    their layers (layerserve_batch_launches_total; 0/0/0 on the CPU backend,
    which launches nothing)."""
    return "/".join(f"{delta(before, after, 'layerserve_batch_launches_total', launch=kind):.0f}"
                    for kind in ("direct", "captured", "replayed"))
