"""Fixtures for the client-compatibility tests: start a real layerserve
process, wait for its ready line, and stop it (checking a clean exit). The
process handling is tests/support/layerserve_process.py.

ctest runs these files with LAYERSERVE_BIN (the built server) and
LAYERSERVE_PERF_ANALYZER (the wrapper scripts/install-perf-analyzer.sh writes)
set; see tests/python/CMakeLists.txt. LAYERSERVE_SERVER_ARGS adds flags to
every server (server_binary.py). Every wait is bounded.
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from layerserve_process import LayerserveProcess, ServerStartError  # noqa: E402
from server_binary import layerserve_bin, server_args  # noqa: E402




@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(*flags) -> LayerserveProcess on 127.0.0.1 with free ports; every
    server a test did not stop itself is stopped at the end of the session
    and must exit with 0."""
    servers = []

    def start(*flags):
        log = tmp_path_factory.mktemp("server") / "layerserve.log"
        try:
            # Drain timeouts below the helper's stop timeout, so that a server
            # stuck in its drain shows as a non-zero exit, not as a kill; the
            # sessions' share short, since tests leave sessions open.
            server = LayerserveProcess(
                layerserve_bin(),
                ["--drain-timeout-s=20", "--drain-sessions-timeout-s=2", *server_args(), *flags], log)
        except ServerStartError as e:
            pytest.fail(str(e), pytrace=False)
        servers.append(server)
        return server

    yield start
    failures = []
    for server in servers:
        if server.stopped:
            continue  # the test that stopped it checked its exit code
        rc = server.stop()
        if rc != 0:
            failures.append(f"layerserve exited with {rc} after SIGTERM; log:\n{server.log_text()}")
    if failures:
        pytest.fail("\n\n".join(failures))


@pytest.fixture(scope="session")
def demo_server(start_server):
    """The built-in demo model (hidden 512), shared by a whole test file."""
    return start_server()


def pytest_sessionfinish(session, exitstatus):
    """With LAYERSERVE_ALL_SKIPPED_EXIT_CODE set, a run in which every test
    was skipped exits with that code, so ctest reports it as skipped rather
    than passed (pytest itself would exit 0)."""
    code = os.environ.get("LAYERSERVE_ALL_SKIPPED_EXIT_CODE")
    if not code or exitstatus != 0 or session.testscollected == 0:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    if not reporter.stats.get("passed") and reporter.stats.get("skipped"):
        session.exitstatus = int(code)
