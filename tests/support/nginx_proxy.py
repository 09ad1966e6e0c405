"""The shipped proxies in front of layerserve replicas on loopback, for the
benchmarks (bench/server) and the deployment tests (tests/deploy):
deploy/nginx/nginx.conf with its listen ports, the unix socket between its
tiers, the stream module's path, the certificate, its upstream servers and
(when asked) its body limit and access log replaced, and nothing else, run in
the foreground from a work directory (its temporary folders there too); and
deploy/haproxy/haproxy.cfg with its port and nginx's address replaced.
Nothing here imports pytest: a proxy that does not come up raises ProxyError.
Every wait is bounded.
"""

import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
# Debian's libnginx-mod-stream; a bundle that carries nginx (scripts/gpu-bundle.sh)
# puts it in modules/ beside the binary.
STREAM_MODULE = Path("/usr/lib/nginx/modules/ngx_stream_module.so")


class ProxyError(RuntimeError):
    """A proxy or what it needs is missing, it exited, or it did not listen
    in time."""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sub(pattern, replacement, text, count, what, flags=0):
    text, n = re.subn(pattern, replacement, text, flags=flags)
    if n != count:
        raise ProxyError(f"the shipped configuration: expected {count} {what}, found {n}")
    return text


def render_nginx_conf(upstreams, h2c_port, tls_port, haproxy_tls_port, socket_path, cert, key,
                      client_max_body_size=None, access_log=None, stream_module=STREAM_MODULE):
    """deploy/nginx/nginx.conf listening on 127.0.0.1 (h2c_port, tls_port,
    and haproxy_tls_port for HAProxy), its tiers joined by socket_path, with
    `upstreams` ("host:port" each) as its replicas, the given certificate,
    and optionally the http server's body limit and the access log's file."""
    text = NGINX_CONF.read_text()
    text = _sub(r"load_module /\S+/ngx_stream_module\.so;", f"load_module {stream_module};",
                text, 1, "load_module line of the stream module")
    if access_log is not None:
        text = _sub(r"access_log /dev/stdout[^;]*;", f"access_log {access_log};", text, 1,
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
    # The upstream's server lines: one per replica, each as the first one
    # reads with its address replaced.
    lines = re.findall(r"^(\s*server )127\.0\.0\.1:\d+( .*;)\n", text, flags=re.M)
    if not lines or not upstreams:
        raise ProxyError(f"{len(upstreams)} replicas, {len(lines)} upstream server lines")
    prefix, suffix = lines[0]
    servers = "".join(f"{prefix}{address}{suffix}\n" for address in upstreams)
    text = _sub(r"(^\s*server 127\.0\.0\.1:\d+ .*;\n)+", lambda _: servers, text, 1,
                "block of upstream server lines", flags=re.M)
    if client_max_body_size is not None:
        text = _sub(r"(\n        client_max_body_size )\S+;", rf"\g<1>{client_max_body_size};",
                    text, 1, "server-level client_max_body_size")
    return text


def make_certificate(workdir):
    """A throwaway ECDSA certificate for 127.0.0.1 and localhost, and its key
    (the openssl command)."""
    cert, key = Path(workdir) / "proxy.crt", Path(workdir) / "proxy.key"
    openssl = shutil.which("openssl")
    if not openssl:
        raise ProxyError("missing the openssl command, which makes the proxy's certificate")
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def _wait_listening(proc, log, port, what, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ProxyError(f"{what} exited with {proc.returncode}: {log.read_text()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise ProxyError(f"{what} did not listen on {port} within {timeout_s}s")


class NginxProxy:
    """nginx on the shipped configuration in the foreground: `url` is its
    plaintext gRPC (h2c) address, `tls_url` its TLS one (certificate `cert`),
    `haproxy_tls_port` the TLS port HAProxy forwards to. `access_log`: each
    call's line goes, unbuffered, to the file self.access_log in the work
    directory rather than where the configuration says. `nginx`: the binary
    (default: the one on PATH, or /usr/sbin/nginx); its stream module is the
    Debian package's, or the one in modules/ beside a bundled binary."""

    def __init__(self, upstreams, workdir, nginx=None, timeout_s=20, client_max_body_size=None,
                 access_log=False):
        binary = nginx or shutil.which("nginx") or shutil.which("/usr/sbin/nginx")
        if not binary:
            raise ProxyError("missing nginx (scripts/install-deps.sh installs it)")
        bundled = Path(binary).resolve().parent / "modules" / "ngx_stream_module.so"
        stream_module = bundled if bundled.exists() else STREAM_MODULE
        if not stream_module.exists():
            raise ProxyError(f"missing {STREAM_MODULE}: the Debian package libnginx-mod-stream "
                             "(scripts/install-deps.sh installs it)")
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.tls_port, self.haproxy_tls_port = free_port(), free_port(), free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.tls_url = f"127.0.0.1:{self.tls_port}"
        self.cert, self.key = make_certificate(workdir)
        # A short path (a unix socket's is limited to 107 bytes) that nginx's
        # workers, which run as nobody under a root master, may reach.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="ls-nginx-"))
        self.socket_dir.chmod(0o755)
        self.access_log = workdir / "access.log" if access_log else None
        conf = workdir / "nginx.conf"
        text = render_nginx_conf(upstreams, self.port, self.tls_port, self.haproxy_tls_port,
                                 self.socket_dir / "http.sock", self.cert, self.key,
                                 client_max_body_size, self.access_log, stream_module)
        # The temporary files' folders in the work directory too: the
        # binary's built-in ones (/var/lib/nginx/...) exist only where the
        # package was installed.
        temp = "".join(f"    {kind}_temp_path {workdir}/{kind};\n"
                       for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        conf.write_text(text.replace("http {\n", "http {\n" + temp, 1))
        self.log = workdir / "nginx.log"
        # Only what a foreground process outside /etc needs: no daemon, its
        # pid and error log in the work directory.
        globals_ = f"daemon off; pid {workdir}/nginx.pid; error_log {workdir}/error.log;"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([binary, "-p", str(workdir), "-c", str(conf),
                                          "-g", globals_], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        try:
            for port in (self.port, self.tls_port, self.haproxy_tls_port):
                _wait_listening(self.proc, self.log, port, "nginx", timeout_s)
        except ProxyError:
            self.stop()
            raise

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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def render_haproxy_cfg(port, nginx_port):
    """deploy/haproxy/haproxy.cfg bound to 127.0.0.1:port, in front of nginx's
    TLS port for it, and nothing else changed."""
    text = HAPROXY_CFG.read_text()
    text = _sub(r"bind :9443\n", f"bind 127.0.0.1:{port}\n", text, 1, "bind line")
    text = _sub(r"server nginx 127\.0\.0\.1:8444 ", f"server nginx 127.0.0.1:{nginx_port} ",
                text, 1, "nginx server line")
    return text


class HAProxy:
    """HAProxy on the shipped configuration in front of `nginx` (an
    NginxProxy), on 127.0.0.1:port (`url`)."""

    def __init__(self, nginx, workdir, timeout_s=20):
        binary = shutil.which("haproxy") or shutil.which("/usr/sbin/haproxy")
        if not binary:
            raise ProxyError("missing haproxy (scripts/install-deps.sh installs it)")
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        cfg = workdir / "haproxy.cfg"
        cfg.write_text(render_haproxy_cfg(self.port, nginx.haproxy_tls_port))
        self.log = workdir / "haproxy.log"
        with open(self.log, "w") as log:
            # -db: in the foreground.
            self.proc = subprocess.Popen([binary, "-db", "-f", str(cfg)], stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_listening(self.proc, self.log, self.port, "haproxy", timeout_s)
        except ProxyError:
            self.stop()
            raise

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
