#!/usr/bin/env python3
"""Writes tests/unit/base/fp8_e4m3_golden.txt: float32 inputs and the
float8_e4m3fn code ml_dtypes rounds each to, for base_dtype_test's check that
FloatToFp8E4M3 is bit-exact with ml_dtypes (so CI needs no ml_dtypes).

The inputs: every finite e4m3fn value, every midpoint between two neighbours
(the ties, where round-to-nearest-even decides) and the float32 values just
either side of it, values up to 464 (above it ml_dtypes gives NaN where the
server saturates), and random values over the whole range; each with both
signs. Deterministic (fixed seed).

  python3 tests/support/make_fp8_golden.py [OUT]
"""
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

F8 = ml_dtypes.float8_e4m3fn


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else (
        Path(__file__).resolve().parents[1] / "unit" / "base" / "fp8_e4m3_golden.txt")
    codes = np.arange(0, 0x7F, dtype=np.uint8)  # 0x00..0x7e: every non-negative finite value
    values = codes.view(F8).astype(np.float32)
    mids = ((values[:-1].astype(np.float64) + values[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(1e9))])
    tail = np.array([448, 452, 456, 460, 463.99, 464], dtype=np.float32)
    rng = np.random.default_rng(20261127)
    random = np.exp2(rng.uniform(-12, np.log2(464), 3000)).astype(np.float32)
    xs = np.concatenate([values, mids, near, tail, random]).astype(np.float32)
    xs = np.concatenate([xs, -xs])
    got = xs.astype(F8).view(np.uint8)
    assert not np.any((got & 0x7F) == 0x7F), "an input ml_dtypes turns into NaN"
    lines = [f"{int(b):08x} {int(c):02x}" for b, c in zip(xs.view(np.uint32), got)]
    out.write_text("# float32 bits, float8_e4m3fn code (ml_dtypes " + ml_dtypes.__version__ +
                   "; tests/support/make_fp8_golden.py)\n" + "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} pairs to {out}")


if __name__ == "__main__":
    main()
