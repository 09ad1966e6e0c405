"""The server binary the compatibility tests start: $LAYERSERVE_BIN, which ctest
sets. A module of its own rather than conftest.py, so that the tests import it
by a name no other test folder's conftest.py shadows (pytest run over
tests/python and tests/deploy at once loads both conftest modules)."""

import os
import shlex

import pytest


def layerserve_bin():
    path = os.environ.get("LAYERSERVE_BIN")
    if not path:
        pytest.fail("LAYERSERVE_BIN is not set: run these tests through ctest "
                    "(or set it to the built server/layerserve)")
    if not os.access(path, os.X_OK):
        pytest.fail(f"LAYERSERVE_BIN={path} is not an executable file")
    return path


def server_args():
    """Flags every server a test starts gets first: $LAYERSERVE_SERVER_ARGS, as
    the integration suite reads it (scripts/gpu-run.sh passes --backend=cuda)."""
    return shlex.split(os.environ.get("LAYERSERVE_SERVER_ARGS", ""))


def compute_dtype():
    """The serving backend's compute type, $LAYERSERVE_COMPUTE_DTYPE: FP32 (the
    CPU backend, the default) or BF16 (the CUDA backend)."""
    dtype = os.environ.get("LAYERSERVE_COMPUTE_DTYPE", "FP32")
    if dtype not in ("FP32", "BF16"):
        pytest.fail(f"LAYERSERVE_COMPUTE_DTYPE={dtype}: FP32 or BF16")
    return dtype
