"""Start a layerserve on loopback, read its ready line, scrape /metrics, stop it.

The one copy of this for Python: the compatibility tests (tests/python), the
deployment tests (tests/deploy) and the server benchmarks (bench/server) all
use it; each puts tests/support on sys.path itself. Nothing here imports
pytest, so a server that does not come up raises ServerStartError, which a
test turns into a failure and a benchmark into a message. Every wait is bounded.

The server picks its ports (--grpc-port=0 --metrics-port=0) and announces them
in one line, so parallel runs never collide on a port:
  layerserve ready: model=demo layers=0:4 backend=cpu grpc_port=N metrics_port=M

Metrics text goes through prometheus_client's parser, not a local regex, into
{(sample name, frozenset of label items): value} with the names as they appear
on the wire (counters keep _total; histograms have _bucket, _sum, _count).
"""

import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

READY_RE = re.compile(
    r"layerserve ready: model=(?P<model>\S+) layers=(?P<first>\d+):(?P<end>\d+) "
    r"backend=(?P<backend>\S+) grpc_port=(?P<grpc_port>\d+) metrics_port=(?P<metrics_port>\d+)")

READY_TIMEOUT_S = 120  # model generation or loading on a slow, shared core
STOP_TIMEOUT_S = 45    # above the drain timeouts the callers give the server
_POLL_S = 0.05


class ServerStartError(RuntimeError):
    """layerserve exited before its ready line, or printed none in time."""


class LayerserveProcess:
    """One running layerserve on 127.0.0.1 and what its ready line said.

    stdout and stderr go straight to log_path: no pipe a chatty server could
    fill, and no reader thread in the caller, whose own CPU use the probe
    measures beside the server's. The ready line is found by polling that file.
    """

    def __init__(self, binary, flags, log_path, ready_timeout_s=READY_TIMEOUT_S,
                 preexec_fn=None):
        self.log_path = Path(log_path)
        argv = [str(binary), "--host=127.0.0.1", "--grpc-port=0", "--metrics-port=0",
                *map(str, flags)]
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(argv) + "\n")
            log.flush()
            # preexec_fn runs in the child before exec (e.g. to set rlimits).
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=preexec_fn)
        self.stopped = False
        self._returncode = None
        self.ready = self._wait_ready(ready_timeout_s)
        self.model = self.ready["model"]
        self.layers = (int(self.ready["first"]), int(self.ready["end"]))
        self.grpc_port = int(self.ready["grpc_port"])
        self.metrics_port = int(self.ready["metrics_port"])
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"

    @property
    def pid(self):
        return self.proc.pid

    def log_text(self):
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while True:
            match = READY_RE.search(self.log_text())
            if match:
                return match.groupdict()
            if self.proc.poll() is not None:
                raise ServerStartError(f"layerserve exited with {self.proc.returncode} before it "
                                       f"was ready; log {self.log_path}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise ServerStartError(f"layerserve printed no ready line within {timeout_s}s; "
                                       f"log {self.log_path}:\n{self.log_text()}")
            time.sleep(_POLL_S)

    def stop(self, timeout_s=STOP_TIMEOUT_S):
        """SIGTERM (a graceful drain), SIGKILL after timeout_s; returns the exit
        code, or None if it had to be killed. Stopping again returns it again."""
        if self.stopped:
            return self._returncode
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self._returncode = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self._returncode = None
        self.stopped = True
        return self._returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def scrape(self, path="/metrics", timeout_s=10):
        """GET http://127.0.0.1:<metrics_port><path> -> (status, content type, body)."""
        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        with urllib.request.urlopen(url, timeout=timeout_s) as res:
            return res.status, res.headers.get("Content-Type", ""), res.read().decode()

    def samples(self):
        """The parsed /metrics of the server now (see parse_samples)."""
        return parse_samples(self.scrape()[2])


def parse_samples(text):
    """Prometheus text format -> {(sample name, frozenset(labels.items())): value}.
    Raises ValueError on a line the format does not allow."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples, name, **labels):
    """The value of the one series with exactly these labels, 0.0 if it does
    not exist (yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def total(samples, name, **labels):
    """The sum over every series of `name` whose labels include these."""
    want = set(labels.items())
    return sum(value for (n, series), value in samples.items() if n == name and want <= series)
