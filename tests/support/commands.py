"""The external commands the deployment tests run (docker-compose, kubectl,
promtool, nginx, ...): where to find one, running one to completion, and
docker-compose on the shipped deploy/docker-compose.yml. These fail the
calling test, with what the command printed, rather than raise, so this
module imports pytest (unlike the process helpers beside it)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

COMMAND_TIMEOUT_S = 120
COMPOSE_FILE = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.yml"


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


def compose(*args, env=None):
    """docker-compose with deploy/docker-compose.yml and `args`; its stdout."""
    return run(tool("docker-compose"), "-f", COMPOSE_FILE, *args, env=env)


def compose_services(*profiles, **env):
    """{name: service} of deploy/docker-compose.yml as `docker-compose config`
    resolves it with these profiles enabled and these variables set."""
    args = [a for p in profiles for a in ("--profile", p)]
    return yaml.safe_load(compose(*args, "config", env=env or None))["services"]
