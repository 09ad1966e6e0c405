"""tritonclient against a server with mutual TLS, a bearer token and /metrics
over HTTPS (docs/security.md): InferenceServerClient(url, ssl=True,
root_certificates=..., private_key=..., certificate_chain=...) with
headers={"authorization": "Bearer ..."}, as a tritonclient application would
connect; without the header (or with another token) every call but the
probes is UNAUTHENTICATED, ModelStreamInfer included.

The certificates come from tests/support/make_test_certs.sh (the openssl
command), made for this run.
"""

import queue
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from layerserve_client import RPC_TIMEOUT_S, make_input, output_as_f32
from layerserve_process import parse_samples, sample

TOKEN = "py-test-token-3c9a"
MAKE_CERTS = Path(__file__).resolve().parents[1] / "support" / "make_test_certs.sh"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    made = subprocess.run(["bash", str(MAKE_CERTS), str(directory)], capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, f"make_test_certs.sh (is openssl installed?):\n{made.stderr}"
    (directory / "token").write_text(TOKEN + "\n")
    return directory


@pytest.fixture(scope="module")
def server(start_server, pki):
    return start_server(f"--tls-cert-file={pki / 'server.crt'}",
                        f"--tls-key-file={pki / 'server.key'}",
                        f"--tls-client-ca-file={pki / 'ca.crt'}",
                        f"--auth-token-file={pki / 'token'}", "--metrics-tls")


def connect(server, pki, client_cert="client"):
    """A tritonclient over TLS to `localhost` (the name in the server's
    certificate), with `client_cert` ("" for none) for mutual TLS."""
    extra = {}
    if client_cert:
        extra = {"private_key": str(pki / f"{client_cert}.key"),
                 "certificate_chain": str(pki / f"{client_cert}.crt")}
    return grpcclient.InferenceServerClient(f"localhost:{server.grpc_port}", ssl=True,
                                            root_certificates=str(pki / "ca.crt"), **extra)


def bearer(token=TOKEN):
    return {"authorization": f"Bearer {token}"}


def io_names(client, server):
    """(input name, output name), asked for with the token."""
    metadata = client.get_model_metadata(server.model, headers=bearer(),
                                         client_timeout=RPC_TIMEOUT_S)
    return metadata.inputs[0].name, metadata.outputs[0].name


def activations(seed):
    return np.random.default_rng(seed).normal(size=(1, 4, 512)).astype(np.float32)


def test_infer_over_mutual_tls_with_the_bearer_header(server, pki):
    with connect(server, pki) as client:
        names = io_names(client, server)
        x = activations(1)
        outputs = []
        for _ in range(2):
            result = client.infer(server.model, [make_input(names[0], x, "FP32")],
                                  outputs=[grpcclient.InferRequestedOutput(names[1])],
                                  headers=bearer(), client_timeout=RPC_TIMEOUT_S)
            out, datatype = output_as_f32(result, names[1])
            assert datatype == "FP32" and out.shape == x.shape
            assert np.isfinite(out).all() and not np.array_equal(out, x)
            outputs.append(out)
        np.testing.assert_array_equal(outputs[0], outputs[1])


def test_probes_are_open_without_a_token(server, pki):
    with connect(server, pki) as client:
        assert client.is_server_live(client_timeout=RPC_TIMEOUT_S)
        assert client.is_server_ready(client_timeout=RPC_TIMEOUT_S)
        assert client.is_model_ready(server.model, client_timeout=RPC_TIMEOUT_S)


@pytest.mark.parametrize("headers", [None, bearer("guessed-token"), {"authorization": TOKEN}],
                         ids=["no-header", "wrong-token", "no-scheme"])
def test_calls_without_the_token_are_unauthenticated(server, pki, headers):
    with connect(server, pki) as client:
        with pytest.raises(InferenceServerException) as error:
            client.get_model_metadata(server.model, headers=headers, client_timeout=RPC_TIMEOUT_S)
        assert "UNAUTHENTICATED" in str(error.value.status()), error.value
        assert "guessed-token" not in str(error.value) and TOKEN not in str(error.value)
        with pytest.raises(InferenceServerException) as error:
            client.infer(server.model, [make_input("hidden_states", activations(2), "FP32")],
                         headers=headers, client_timeout=RPC_TIMEOUT_S)
        assert "UNAUTHENTICATED" in str(error.value.status()), error.value


def test_stream_needs_the_token_too(server, pki):
    with connect(server, pki) as client:
        names = io_names(client, server)
        for headers, want_ok in ((bearer(), True), (None, False)):
            responses = queue.Queue()
            client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                stream_timeout=RPC_TIMEOUT_S, headers=headers)
            try:
                try:
                    client.async_stream_infer(server.model,
                                              [make_input(names[0], activations(3), "FP32")],
                                              request_id="7")
                except InferenceServerException:
                    assert not want_ok  # the refusal may have ended the stream already
                result, error = responses.get(timeout=RPC_TIMEOUT_S)
            finally:
                client.stop_stream()
            if want_ok:
                assert error is None, f"stream error: {error}"
                assert output_as_f32(result, names[1])[0].shape == (1, 4, 512)
            else:
                assert result is None and error is not None
                assert "UNAUTHENTICATED" in str(error.status()), error


@pytest.mark.parametrize("client_cert", ["", "other-client"], ids=["none", "other-ca"])
def test_mutual_tls_refuses_clients_without_an_accepted_certificate(server, pki, client_cert):
    with connect(server, pki, client_cert) as client:
        with pytest.raises(InferenceServerException) as error:
            client.is_server_live(client_timeout=10)
        assert "UNAVAILABLE" in str(error.value.status()), error.value


def test_metrics_over_https_with_a_client_certificate(server, pki):
    with connect(server, pki) as client, pytest.raises(InferenceServerException):
        client.get_server_metadata(client_timeout=RPC_TIMEOUT_S)  # refused: no token
    url = f"https://localhost:{server.metrics_port}/metrics"
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    context.load_cert_chain(str(pki / "client.crt"), str(pki / "client.key"))
    with urllib.request.urlopen(url, context=context, timeout=10) as res:
        assert res.status == 200
        body = res.read().decode()
    # The refusal above was counted, as a call of no model.
    samples = parse_samples(body)
    assert sample(samples, "layerserve_requests_total", model="other", code="UNAUTHENTICATED") >= 1
    assert sample(samples, "layerserve_rejections_total", model="other",
                  reason="unauthenticated") >= 1
    # Plain HTTP gets no answer from an HTTPS port.
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://localhost:{server.metrics_port}/metrics", timeout=10)
