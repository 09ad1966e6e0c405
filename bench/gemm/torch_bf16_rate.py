"""PyTorch's dense bf16 GEMM rate on this GPU, for comparison with what the
project's cuBLASLt route reaches (gemm_bench's v0, layer_bench's floor rate):
Y = A W^T at M x N x K, CUDA events, median of 10 after 3 warm-up calls, under
each of torch's cuBLAS settings that change the algorithm: the backend (cuBLAS
or cuBLASLt) and whether bf16 reductions may round in bf16 (split-K). Inputs
as layer_bench's rate: A uniform in [-1, 1), W in [-0.01, 0.01); and as
torch.randn, since the power a product draws depends on its data.

    python3 bench/gemm/torch_bf16_rate.py [--shapes 8192x8192x8192,8192x4096x14336]
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention"))
from torch_timing import median_ms  # noqa: E402  (bench/attention/torch_timing.py)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8192x8192x8192,8192x4096x14336,8192x28672x4096",
                        help="MxNxK[,MxNxK...]")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print(f"{'M x N x K':>20} {'inputs':>8} {'backend':>9} {'bf16 reduce':>11} {'ms':>8} {'TFLOP/s':>8}")
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        for inputs in ("uniform", "randn"):
            if inputs == "uniform":
                a = torch.rand(m, k, device="cuda", dtype=torch.bfloat16) * 2 - 1
                w = (torch.rand(n, k, device="cuda", dtype=torch.bfloat16) * 2 - 1) * 0.01
            else:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            for backend in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(backend)
                for reduced in (True, False):
                    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
                    ms = median_ms([None], 3, 10, lambda _: a @ w.t())
                    print(f"{shape:>20} {inputs:>8} {backend:>9} {str(reduced):>11} {ms:8.3f} "
                          f"{2.0 * m * n * k / (ms * 1e-3) / 1e12:8.0f}")
            del a, w


if __name__ == "__main__":
    main()
