"""The shipped proxies, run by the deployment tests: deploy/nginx/nginx.conf
with its ports, socket, certificate, upstream servers and (when asked) body
limit replaced, and nothing else, under Debian's nginx in the foreground; and
deploy/haproxy/haproxy.cfg with its port and nginx's address replaced, under
Debian's haproxy. test_session_routing.py and test_proxy_limits.py use them.
"""

import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
STREAM_MODULE = "/usr/lib/nginx/modules/ngx_stream_module.so"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sub(pattern, replacement, text, count, what, flags=0):
    text, n = re.subn(pattern, replacement, text, flags=flags)
    assert n == count, f"deploy/nginx/nginx.conf: expected {count} {what}, found {n}"
    return text


def render_nginx_conf(upstreams, h2c_port, tls_port, haproxy_tls_port, socket_path, cert, key,
                      client_max_body_size=None, access_log=None):
    """The shipped configuration with its listen ports, the unix socket
    between its tiers, the certificate, its upstream servers and optionally
    the http server's body limit and the access log's file replaced."""
    text = NGINX_CONF.read_text()
    if access_log is not None:
        text = _sub(r"access_log /dev/stdout;", f"access_log {access_log};", text, 1,
                    "access_log line")
    text = _sub(r"listen 8001;", f"listen 127.0.0.1:{h2c_port};", text, 1, "h2c listen line")
    text = _sub(r"listen 8443 ssl;", f"listen 127.0.0.1:{tls_port} ssl;", text, 1,
                "TLS listen line")
    text = _sub(r"listen 127\.0\.0\.1:8444 ssl proxy_protocol;",
                f"listen 127.0.0.1:{haproxy_tls_port} ssl proxy_protocol;", text, 1,
                "listen line of TLS behind HAProxy")
    text = _sub(r"unix:/run/layerserve-nginx\.sock", f"unix:{socket_path}", text, 4,
                "uses of the tiers' unix socket")
    text = _sub(r"ssl_certificate /\S+;", f"ssl_certificate {cert};", text, 1, "certificate")
    text = _sub(r"ssl_certificate_key /\S+;", f"ssl_certificate_key {key};", text, 1, "key")
    # The upstream's server lines, one per replica, each as the first one
    # reads with its address replaced.
    lines = re.findall(r"^(\s*server )127\.0\.0\.1:\d+( .*;)\n", text, flags=re.M)
    assert lines, "deploy/nginx/nginx.conf: no upstream server lines"
    prefix, suffix = lines[0]
    servers = "".join(f"{prefix}{address}{suffix}\n" for address in upstreams)
    text = _sub(r"(^\s*server 127\.0\.0\.1:\d+ .*;\n)+", lambda _: servers, text, 1,
                "block of upstream server lines", flags=re.M)
    if client_max_body_size is not None:
        text = _sub(r"(\n        client_max_body_size )\S+;", rf"\g<1>{client_max_body_size};",
                    text, 1, "server-level client_max_body_size")
    return text


def make_certificate(workdir):
    """A throwaway ECDSA certificate for 127.0.0.1 and localhost, and its key."""
    cert, key = workdir / "proxy.crt", workdir / "proxy.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


class Nginx:
    """nginx on the shipped configuration: h2c on `h2c_port`, TLS on
    `tls_port` (both on 127.0.0.1), in front of `upstreams`."""

    def __init__(self, upstreams, workdir, client_max_body_size=None):
        nginx = shutil.which("nginx") or shutil.which("/usr/sbin/nginx")
        if not nginx:
            pytest.fail("missing nginx (run scripts/install-deps.sh)")
        if not Path(STREAM_MODULE).exists():
            pytest.fail(f"missing {STREAM_MODULE}: the Debian package libnginx-mod-stream "
                        "(run scripts/install-deps.sh)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.h2c_port, self.tls_port, self.haproxy_tls_port = free_port(), free_port(), free_port()
        self.h2c_url = f"127.0.0.1:{self.h2c_port}"
        self.tls_url = f"127.0.0.1:{self.tls_port}"
        self.cert, self.key = make_certificate(workdir)
        # A short path (a unix socket's is limited to 107 bytes) that nginx's
        # workers, which run as nobody under a root master, may reach.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="ls-nginx-"))
        self.socket_dir.chmod(0o755)
        conf = workdir / "nginx.conf"
        conf.write_text(render_nginx_conf(upstreams, self.h2c_port, self.tls_port,
                                          self.haproxy_tls_port, self.socket_dir / "http.sock",
                                          self.cert, self.key, client_max_body_size,
                                          workdir / "access.log"))
        self.log = workdir / "nginx.log"
        self.access_log = workdir / "access.log"
        # Only what a foreground process outside /etc needs: no daemon, its
        # pid and error log in the test's directory.
        globals_ = f"daemon off; pid {workdir}/nginx.pid; error_log {workdir}/error.log;"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([nginx, "-p", str(workdir), "-c", str(conf),
                                          "-g", globals_], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        for port in (self.h2c_port, self.tls_port, self.haproxy_tls_port):
            self.wait_listening(port)

    def wait_listening(self, port, timeout_s=20):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"nginx exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        pytest.fail(f"nginx did not listen on {port} within {timeout_s}s")

    def alive(self):
        return self.proc.poll() is None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"


def render_haproxy_cfg(port, nginx_port):
    """deploy/haproxy/haproxy.cfg with its bind port and nginx's address
    replaced, and nothing else."""
    text = HAPROXY_CFG.read_text()
    text = _sub(r"bind :9443\n", f"bind 127.0.0.1:{port}\n", text, 1, "bind line")
    text = _sub(r"server nginx 127\.0\.0\.1:8444 ", f"server nginx 127.0.0.1:{nginx_port} ",
                text, 1, "nginx server line")
    return text


class HAProxy:
    """HAProxy on the shipped configuration in front of `nginx`'s TLS
    listener for it, on 127.0.0.1:port."""

    def __init__(self, nginx, workdir):
        haproxy = shutil.which("haproxy") or shutil.which("/usr/sbin/haproxy")
        if not haproxy:
            pytest.fail("missing haproxy (run scripts/install-deps.sh)")
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        cfg = workdir / "haproxy.cfg"
        cfg.write_text(render_haproxy_cfg(self.port, nginx.haproxy_tls_port))
        self.log = workdir / "haproxy.log"
        with open(self.log, "w") as log:
            # -db: foreground, no daemon.
            self.proc = subprocess.Popen([haproxy, "-db", "-f", str(cfg)], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"haproxy exited with {self.proc.returncode}: {self.log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"haproxy did not listen on {self.port} within 20 s")
                time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
