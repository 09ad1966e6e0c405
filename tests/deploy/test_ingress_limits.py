"""The ingress-nginx Ingress carries deploy/nginx/nginx.conf's limits as far
as ingress-nginx can say them (issue 40's leftover): each value below is read
from nginx.conf itself, so the two cannot drift apart.

  per Ingress (deploy/k8s/ingress.yaml annotations): calls in flight per
  client address (limit-connections = calls_per_address), the bytes of a
  unary call (proxy-body-size = client_max_body_size) and none for
  ModelStreamInfer, gRPC read and send timeouts;
  per controller (deploy/k8s/ingress-nginx-values.yaml, the ConfigMap's keys):
  streams at once per connection, streams in a connection's life, a stream's
  silent body, the TLS handshake's time, and the clients' own addresses.

What ingress-nginx cannot say is listed in deploy/README.md and
docs/security.md; the last test checks that both name it.
"""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
NGINX_CONF = (DEPLOY / "nginx/nginx.conf").read_text()
PREFIX = "nginx.ingress.kubernetes.io/"
STREAM_PATH = "/inference.GRPCInferenceService/ModelStreamInfer"


def block(text, opening):
    """The text inside the braces of the first block whose opening line
    matches the regex `opening` (nested blocks included)."""
    start = re.search(opening + r"[^{]*\{", text).end()
    depth, i = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1]


def directive(text, name):
    """The argument of the one `name ARG;` line of `text` outside its nested
    blocks."""
    flat = re.sub(r"\{[^{}]*\}", "{}", text)
    (value,) = re.findall(rf"^\s*{name} (\S+);", flat, re.M)
    return value


def seconds(value):
    """An nginx time ("5s", "1h", "90") in seconds."""
    number, unit = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", value).groups()
    return int(number) * {None: 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


# The tiers of nginx.conf: the stream tier, and the http tier's one server.
STREAM_TIER = block(NGINX_CONF, r"\nstream ")
HTTP_SERVER = block(block(NGINX_CONF, r"\nhttp "), r"\n    server ")
assert "listen unix:" in HTTP_SERVER
STREAM_LOCATION = block(HTTP_SERVER, r"location = " + re.escape(STREAM_PATH))


def ingresses():
    objects = [o for o in yaml.safe_load_all((DEPLOY / "k8s/ingress.yaml").read_text()) if o]
    by_path = {}
    for ingress in objects:
        assert ingress["kind"] == "Ingress"
        (rule,) = ingress["spec"]["rules"]
        (path,) = rule["http"]["paths"]
        by_path[(path["path"], path["pathType"])] = ingress["metadata"]["annotations"]
    return by_path


def test_both_ingresses_carry_nginx_confs_per_call_limits():
    by_path = ingresses()
    unary, stream = by_path[("/", "Prefix")], by_path[(STREAM_PATH, "Exact")]
    assert len(by_path) == 2
    (calls,) = re.findall(r"^\s*limit_conn calls_per_address (\d+);", HTTP_SERVER, re.M)
    for annotations in (unary, stream):
        assert annotations[PREFIX + "limit-connections"] == calls
        assert int(annotations[PREFIX + "proxy-read-timeout"]) == \
            seconds(directive(HTTP_SERVER, "grpc_read_timeout"))
        assert int(annotations[PREFIX + "proxy-send-timeout"]) == \
            seconds(directive(HTTP_SERVER, "grpc_send_timeout"))
    assert unary[PREFIX + "proxy-body-size"] == directive(HTTP_SERVER, "client_max_body_size")
    assert stream[PREFIX + "proxy-body-size"] == directive(STREAM_LOCATION,
                                                           "client_max_body_size") == "0"
    # Otherwise the same annotations: session hashing included.
    differ = {k for k in unary.keys() | stream.keys() if unary.get(k) != stream.get(k)}
    assert differ == {PREFIX + "proxy-body-size"}, differ


def test_controller_values_carry_nginx_confs_connection_limits():
    values = yaml.safe_load((DEPLOY / "k8s/ingress-nginx-values.yaml").read_text())
    config = values["controller"]["config"]
    assert all(isinstance(v, str) for v in config.values()), "ConfigMap values are strings"
    assert config["http2-max-concurrent-streams"] == directive(HTTP_SERVER,
                                                               "http2_max_concurrent_streams")
    assert config["keep-alive-requests"] == directive(HTTP_SERVER, "keepalive_requests")
    assert int(config["client-body-timeout"]) == seconds(directive(HTTP_SERVER,
                                                                   "client_body_timeout"))
    assert int(config["client-header-timeout"]) == seconds(directive(STREAM_TIER,
                                                                     "ssl_handshake_timeout"))
    # A gRPC client reads 429 as UNAVAILABLE, as the status nginx.conf gives
    # its refusals is not to be had without a custom error backend.
    assert config["limit-conn-status-code"] == directive(HTTP_SERVER, "limit_conn_status")
    # Limits per client address need the client's address.
    assert values["controller"]["service"]["externalTrafficPolicy"] == "Local"


def test_docs_say_what_ingress_nginx_cannot_enforce():
    """deploy/README.md and docs/security.md name the limits of nginx.conf
    that have no ingress-nginx form."""
    cannot = ["connections_per_address", "max_conns", "haproxy"]
    for doc in [DEPLOY / "README.md", ROOT / "docs/security.md"]:
        text = doc.read_text()
        section = re.search(r"ingress-nginx cannot[^\n]*\n(.*?)(\n\n\S|\Z)", text, re.S)
        assert section, f"{doc.name}: no list of what ingress-nginx cannot enforce"
        missing = [c for c in cannot if c not in section.group(0).lower()]
        assert not missing, f"{doc.name}: the list does not name {missing}"
