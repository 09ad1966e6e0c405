"""What the deployment tests share: the built binaries they start, from
LAYERSERVE_BIN and LAYERCTL_BIN or the build folder (the test fails, naming
the path, where one is missing), and tests/support and tests/python on
sys.path for their helpers (the process and proxy helpers, llama_numpy)."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT / "tests" / "python"))


def binary(env, default):
    path = Path(os.environ.get(env) or ROOT / default)
    if not os.access(path, os.X_OK):
        pytest.fail(f"no binary at {path} (run scripts/build.sh, or set {env})")
    return path


@pytest.fixture(scope="session")
def server_bin():
    return binary("LAYERSERVE_BIN", "build/server/layerserve")


@pytest.fixture(scope="session")
def ctl_bin():
    return binary("LAYERCTL_BIN", "build/client/layerctl")
