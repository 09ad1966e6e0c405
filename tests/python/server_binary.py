"""The server binary the compatibility tests start: $LAYERSERVE_BIN, which ctest
sets. A module of its own rather than conftest.py, so that the tests import it
by a name no other test folder's conftest.py shadows (pytest run over
tests/python and tests/deploy at once loads both conftest modules)."""

import os

import pytest


def layerserve_bin():
    path = os.environ.get("LAYERSERVE_BIN")
    if not path:
        pytest.fail("LAYERSERVE_BIN is not set: run these tests through ctest "
                    "(or set it to the built server/layerserve)")
    if not os.access(path, os.X_OK):
        pytest.fail(f"LAYERSERVE_BIN={path} is not an executable file")
    return path
