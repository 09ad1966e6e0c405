"""Fixtures for the client-compatibility tests: start a real layerserve
process, wait for its ready line, and stop it (checking a clean exit).

ctest runs these files with LAYERSERVE_BIN (the built server) and
LAYERSERVE_PERF_ANALYZER (the wrapper scripts/install-perf-analyzer.sh writes)
set; see tests/python/CMakeLists.txt. Every wait is bounded.
"""

import os
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

READY_RE = re.compile(
    r"layerserve ready: model=(?P<model>\S+) layers=(?P<first>\d+):(?P<end>\d+) "
    r"backend=(?P<backend>\S+) grpc_port=(?P<grpc_port>\d+) metrics_port=(?P<metrics_port>\d+)")

READY_TIMEOUT_S = 120   # model generation/loading on a slow, shared CI core
STOP_TIMEOUT_S = 45     # above the server's own drain timeout (set to 20 below)


class Server:
    """A running layerserve process and what its ready line said."""

    def __init__(self, args, log_path):
        self.log_path = Path(log_path)
        self._stopped_rc = None
        self._log = open(self.log_path, "w", buffering=1)
        self._log.write("$ " + " ".join(map(str, args)) + "\n")
        self.proc = subprocess.Popen(
            [str(a) for a in args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, text=True, bufsize=1)
        self._lines = queue.Queue()
        # Drains stdout for the whole life of the process so a chatty server
        # can never block on a full pipe; the log keeps everything it said.
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.ready = self._wait_ready()
        self.model = self.ready["model"]
        self.layers = (int(self.ready["first"]), int(self.ready["end"]))
        self.grpc_port = int(self.ready["grpc_port"])
        self.metrics_port = int(self.ready["metrics_port"])
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"

    def _read(self):
        for line in self.proc.stdout:
            self._log.write(line)
            self._lines.put(line)
        self._lines.put(None)

    def log_text(self):
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self):
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.proc.kill()
                self.proc.wait(timeout=10)
                pytest.fail(f"layerserve printed no ready line within {READY_TIMEOUT_S}s; "
                            f"log:\n{self.log_text()}")
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                rc = self.proc.wait(timeout=10)
                pytest.fail(f"layerserve exited with {rc} before it was ready; log:\n"
                            f"{self.log_text()}")
            match = READY_RE.search(line)
            if match:
                return match.groupdict()

    @property
    def stopped(self):
        return self._log.closed

    def stop(self):
        """SIGTERM, then wait for the drain; returns the exit code. Stopping
        a stopped server returns its code again."""
        if self.stopped:
            return self._stopped_rc
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            rc = None
        self._reader.join(timeout=10)
        self._log.close()
        self._stopped_rc = rc
        return rc

    def scrape(self, path="/metrics"):
        """GET http://127.0.0.1:<metrics_port><path> -> (status, content type, body)."""
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        with urllib.request.urlopen(url, timeout=10) as res:
            return res.status, res.headers.get("Content-Type", ""), res.read().decode()


def layerserve_bin():
    path = os.environ.get("LAYERSERVE_BIN")
    if not path:
        pytest.fail("LAYERSERVE_BIN is not set: run these tests through ctest "
                    "(or set it to the built server/layerserve)")
    if not os.access(path, os.X_OK):
        pytest.fail(f"LAYERSERVE_BIN={path} is not an executable file")
    return path


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(*flags) -> Server on 127.0.0.1 with free ports; every
    server a test did not stop itself is stopped at the end of the session
    and must exit with 0."""
    servers = []

    def start(*flags):
        log = tmp_path_factory.mktemp("server") / "layerserve.log"
        args = [layerserve_bin(), "--host=127.0.0.1", "--grpc-port=0", "--metrics-port=0",
                "--drain-timeout-s=20", *flags]
        server = Server(args, log)
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
