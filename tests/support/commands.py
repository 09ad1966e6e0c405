"""The external commands the deployment tests run (docker-compose, kubectl,
promtool, nginx, ...): where to find one, and running one to completion. Both
fail the calling test, with what the command printed, rather than raise, so
this module imports pytest (unlike the process helpers beside it)."""

import os
import shutil
import subprocess

import pytest

COMMAND_TIMEOUT_S = 120


def tool(name):
    """The path of a command scripts/install-deps.sh installs; the test fails
    where it is missing."""
    path = shutil.which(name)
    if not path:
        pytest.fail(f"missing {name} (run scripts/install-deps.sh)")
    return path


def run(*args, cwd=None, timeout_s=COMMAND_TIMEOUT_S, env=None):
    """Runs a command to completion and returns its stdout; the test fails,
    with the command's output, on a non-zero exit. `env`: variables added to
    this process's environment for the command."""
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout_s,
                          env=None if env is None else {**os.environ, **env})
    assert proc.returncode == 0, (
        f"exit {proc.returncode}: {' '.join(map(str, args))}\n{proc.stdout}{proc.stderr}")
    return proc.stdout
