"""The shipped nginx configuration (deploy/nginx/nginx.conf) in front of
layerserve replicas on loopback, for the benchmarks (bench/server) and the
deployment tests: the configuration with its listen port and upstream
servers replaced and nothing else, run in the foreground from a work
directory. Nothing here imports pytest: a proxy that does not come up
raises ProxyError. Every wait is bounded.
"""

import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"


class ProxyError(RuntimeError):
    """nginx is missing, exited, or did not listen in time."""


def render_nginx_conf(listen_port, upstreams, conf_text=None):
    """The shipped configuration listening on 127.0.0.1:listen_port with
    `upstreams` ("host:port" each) as its replicas. It must keep one `listen
    ... http2` line and hold at least as many upstream server lines as
    `upstreams`: the ones past them are dropped."""
    text = conf_text if conf_text is not None else NGINX_CONF.read_text()
    text, listens = re.subn(r"listen \d+ http2;", f"listen 127.0.0.1:{listen_port} http2;", text)
    if listens != 1:
        raise ProxyError("deploy/nginx/nginx.conf lost its `listen ... http2` line")
    lines = re.findall(r"^\s*server 127\.0\.0\.1:\d+ .*;\n", text, flags=re.M)
    if len(lines) < len(upstreams) or not upstreams:
        raise ProxyError(f"{len(upstreams)} replicas, {len(lines)} upstream server lines")
    addresses = iter(upstreams)
    for i, line in enumerate(lines):
        replacement = (re.sub(r"127\.0\.0\.1:\d+", next(addresses), line)
                       if i < len(upstreams) else "")
        text = text.replace(line, replacement, 1)
    return text


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NginxProxy:
    """nginx -c <rendered conf> in the foreground, listening on a free
    loopback port; `url` is its gRPC address. `nginx`: the binary (default:
    the one on PATH, or /usr/sbin/nginx)."""

    def __init__(self, upstreams, workdir, nginx=None, timeout_s=20):
        binary = nginx or shutil.which("nginx") or shutil.which("/usr/sbin/nginx")
        if not binary:
            raise ProxyError("missing nginx (scripts/install-deps.sh installs it)")
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        conf = workdir / "nginx.conf"
        # The temporary files' folders in the work directory too: the
        # binary's built-in ones (/var/lib/nginx/...) exist only where the
        # package was installed.
        temp = "".join(f"    {kind}_temp_path {workdir}/{kind};\n"
                       for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        conf.write_text(render_nginx_conf(self.port, upstreams).replace("http {\n",
                                                                       "http {\n" + temp, 1))
        self.log = workdir / "nginx.log"
        # Only what a foreground process outside /etc needs: no daemon, its
        # pid and error log in the work directory.
        globals_ = f"daemon off; pid {workdir}/nginx.pid; error_log {workdir}/error.log;"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([binary, "-p", str(workdir), "-c", str(conf),
                                          "-g", globals_], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        try:
            self._wait_listening(timeout_s)
        except ProxyError:
            self.stop()
            raise

    def _wait_listening(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ProxyError(f"nginx exited with {self.proc.returncode}: "
                                 f"{self.log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise ProxyError(f"nginx did not listen on {self.port} within {timeout_s}s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
