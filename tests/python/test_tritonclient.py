"""Triton's Python gRPC client (tritonclient.grpc) against the demo model:
health, metadata, configuration, statistics, FP32 and BF16 inference, error
codes, and the Prometheus endpoint those calls feed.

The demo model's weights exist only inside the server, so values are checked
for consistency here (FP32 vs BF16, batched vs alone, repeatable);
test_reference_model.py checks values against a numpy implementation.
"""

import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from layerserve_client import (RPC_TIMEOUT_S, client_bf16_dtype, infer, io_names, make_input,
                               output_as_f32)
from layerserve_process import parse_samples, sample
from llama_numpy import assert_close, round_to_bf16

DEMO_HIDDEN = 512


@pytest.fixture(scope="module")
def client(demo_server):
    with grpcclient.InferenceServerClient(demo_server.grpc_url) as c:
        yield c


@pytest.fixture(scope="module")
def names(client, demo_server):
    return io_names(client, demo_server.model)


def activations(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_ready_line_describes_the_demo_model(demo_server):
    assert demo_server.model == "demo"
    assert demo_server.ready["backend"] == "cpu"
    first, end = demo_server.layers
    assert 0 <= first < end


def test_health(client, demo_server):
    assert client.is_server_live(client_timeout=RPC_TIMEOUT_S)
    assert client.is_server_ready(client_timeout=RPC_TIMEOUT_S)
    assert client.is_model_ready(demo_server.model, client_timeout=RPC_TIMEOUT_S)
    assert not client.is_model_ready("no-such-model", client_timeout=RPC_TIMEOUT_S)


def test_server_metadata(client):
    metadata = client.get_server_metadata(client_timeout=RPC_TIMEOUT_S)
    assert metadata.name == "layerserve"
    assert metadata.version
    # perf_analyzer asks for ModelStatistics only when this is advertised.
    assert "statistics" in metadata.extensions


def test_repository_index_names_the_served_model(client, demo_server):
    index = client.get_model_repository_index(client_timeout=RPC_TIMEOUT_S)
    assert [(m.name, m.version, m.state) for m in index.models] == [
        (demo_server.model, "1", "READY")]


def test_model_metadata(client, demo_server):
    metadata = client.get_model_metadata(demo_server.model, client_timeout=RPC_TIMEOUT_S)
    assert metadata.name == demo_server.model
    assert list(metadata.versions)
    for tensor in (*metadata.inputs, *metadata.outputs):
        assert list(tensor.shape) == [-1, -1, DEMO_HIDDEN], tensor
        assert tensor.datatype in ("FP32", "BF16", "FP16"), tensor


def test_model_config_agrees_with_metadata(client, demo_server, names):
    config = client.get_model_config(demo_server.model, client_timeout=RPC_TIMEOUT_S).config
    assert config.name == demo_server.model
    # 0: perf_analyzer keeps all three dims of --shape (no implicit batch dim).
    assert config.max_batch_size == 0
    assert [i.name for i in config.input] == [names[0]]
    assert [o.name for o in config.output] == [names[1]], (
        "ModelConfig and ModelMetadata name the output differently")
    assert list(config.input[0].dims) == [-1, -1, DEMO_HIDDEN]
    assert list(config.output[0].dims) == [-1, -1, DEMO_HIDDEN]
    # One scheduler or the other (a oneof in Triton's ModelConfig): the
    # sequence batcher where the backend keeps a KV cache (the CPU backend
    # does), so perf_analyzer runs in sequence mode.
    if config.HasField("sequence_batching"):
        assert config.sequence_batching.oldest.max_candidate_sequences >= 1
        assert int(config.parameters["kv_blocks"].string_value) >= 1
    else:
        assert config.HasField("dynamic_batching")


def test_infer_fp32(client, demo_server, names):
    x = activations((2, 5, DEMO_HIDDEN), seed=1)
    out, datatype, result = infer(client, demo_server.model, *names, x, "FP32", request_id="req-7")
    assert datatype == "FP32"
    assert out.shape == x.shape
    assert np.all(np.isfinite(out))
    assert float(np.max(np.abs(out - x))) > 1e-3, "the layers returned their input unchanged"
    response = result.get_response()
    assert response.id == "req-7"
    assert response.model_name == demo_server.model
    # The client's own decoding agrees with the raw bytes.
    np.testing.assert_array_equal(result.as_numpy(names[1]), out)


def test_infer_is_repeatable(client, demo_server, names):
    x = activations((1, 6, DEMO_HIDDEN), seed=2)
    first, _, _ = infer(client, demo_server.model, *names, x, "FP32")
    second, _, _ = infer(client, demo_server.model, *names, x, "FP32")
    np.testing.assert_array_equal(first, second)


def test_sequences_do_not_interact(client, demo_server, names):
    """Each sequence of a request, and each of many concurrent requests that
    the server batches together, gives what it gives alone."""
    x = activations((3, 4, DEMO_HIDDEN), seed=3)
    together, _, _ = infer(client, demo_server.model, *names, x, "FP32")
    for b in range(x.shape[0]):
        alone, _, _ = infer(client, demo_server.model, *names, x[b:b + 1], "FP32")
        assert_close(together[b:b + 1], alone, max_rel=1e-4, rms_rel=1e-5,
                     what=f"sequence {b} in a batch of 3 vs alone")

    requests = [activations((1 + i % 2, 2 + i % 5, DEMO_HIDDEN), seed=100 + i) for i in range(12)]
    alone = [infer(client, demo_server.model, *names, r, "FP32")[0] for r in requests]

    def call(r):
        with grpcclient.InferenceServerClient(demo_server.grpc_url) as c:
            return infer(c, demo_server.model, *names, r, "FP32")[0]

    with ThreadPoolExecutor(max_workers=6) as pool:
        concurrent = list(pool.map(call, requests))
    for i, (got, want) in enumerate(zip(concurrent, alone)):
        assert_close(got, want, max_rel=1e-4, rms_rel=1e-5, what=f"concurrent request {i}")


def test_infer_bf16_matches_fp32(client, demo_server, names):
    x = round_to_bf16(activations((2, 7, DEMO_HIDDEN), seed=4))
    want, _, _ = infer(client, demo_server.model, *names, x, "FP32")
    got, datatype, result = infer(client, demo_server.model, *names, x, "BF16")
    assert datatype == "BF16"
    assert got.shape == x.shape
    np.testing.assert_array_equal(round_to_bf16(got), got)  # really bfloat16 values
    # bfloat16 keeps 8 significant bits: its rounding alone is ~0.2% rms.
    assert_close(got, want, max_rel=3e-2, rms_rel=1e-2, what="BF16 vs FP32 output")
    if client_bf16_dtype() is not None:  # this tritonclient decodes BF16 itself
        np.testing.assert_array_equal(result.as_numpy(names[1]).astype(np.float32), got)


def test_errors_carry_canonical_codes(client, demo_server, names):
    wrong_hidden = activations((1, 3, DEMO_HIDDEN - 1), seed=5)
    with pytest.raises(InferenceServerException) as error:
        infer(client, demo_server.model, *names, wrong_hidden, "FP32")
    assert "INVALID_ARGUMENT" in str(error.value.status()), error.value

    with pytest.raises(InferenceServerException) as error:
        infer(client, "no-such-model", *names, activations((1, 1, DEMO_HIDDEN), 6), "FP32")
    assert "NOT_FOUND" in str(error.value.status()), error.value

    wrong_name = make_input("not_" + names[0], activations((1, 2, DEMO_HIDDEN), 7), "FP32")
    with pytest.raises(InferenceServerException) as error:
        client.infer(demo_server.model, [wrong_name], client_timeout=RPC_TIMEOUT_S)
    assert "INVALID_ARGUMENT" in str(error.value.status()), error.value


def test_statistics_count_inferences(client, demo_server, names):
    def counts():
        stats = client.get_inference_statistics(demo_server.model, client_timeout=RPC_TIMEOUT_S)
        (model,) = stats.model_stats
        return model.inference_count, model.execution_count, model.inference_stats.success.count

    before = counts()
    # With max_batch_size 0 a request is one inference whatever its B (as in
    # Triton, where a non-batching model counts each request once).
    infer(client, demo_server.model, *names, activations((2, 3, DEMO_HIDDEN), 8), "FP32")
    infer(client, demo_server.model, *names, activations((1, 5, DEMO_HIDDEN), 9), "FP32")
    after = counts()
    assert after[0] - before[0] == 2, f"inference_count {before[0]} -> {after[0]} for 2 requests"
    assert after[1] - before[1] >= 1, f"execution_count {before[1]} -> {after[1]}"
    assert after[2] - before[2] == 2, f"success.count {before[2]} -> {after[2]} for 2 requests"


def test_metrics_endpoint_counts_these_calls(client, demo_server, names):
    status, content_type, body = demo_server.scrape("/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4"), content_type
    before = parse_samples(body)

    for seed in (9, 10):
        infer(client, demo_server.model, *names, activations((1, 4, DEMO_HIDDEN), seed), "FP32")
    with pytest.raises(InferenceServerException):
        infer(client, demo_server.model, *names, activations((1, 4, 3), 11), "FP32")

    model = demo_server.model

    def delta(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    # The edge records a call as it replies, so the client can see the reply
    # a moment before the metrics do.
    deadline = time.monotonic() + 10
    while True:
        after = parse_samples(demo_server.scrape("/metrics")[2])
        settled = (delta("layerserve_request_duration_seconds_count", model=model) >= 3 and
                   sample(after, "layerserve_inflight_requests", model=model) == 0)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    assert delta("layerserve_requests_total", model=model, code="OK") == 2
    assert delta("layerserve_requests_total", model=model, code="INVALID_ARGUMENT") == 1
    assert delta("layerserve_request_duration_seconds_count", model=model) == 3
    assert delta("layerserve_batch_tokens_count", model=model) >= 1
    assert delta("layerserve_batch_tokens_sum", model=model) >= 8
    assert delta("layerserve_queue_duration_seconds_count", model=model) == 2
    # The two that ran each report their batch's compute; the refused one none.
    assert delta("layerserve_request_compute_seconds_count", model=model) == 2
    assert delta("layerserve_reply_wait_seconds_count", model=model) == 2
    assert delta("layerserve_request_compute_seconds_sum", model=model) > 0
    assert (delta("layerserve_request_compute_seconds_sum", model=model) <=
            delta("layerserve_request_duration_seconds_sum", model=model))
    assert sample(after, "layerserve_inflight_requests", model=model) == 0
    assert sample(after, "layerserve_queue_depth", model=model) == 0
    assert demo_server.scrape("/healthz")[0] == 200


def test_stream_infer_matches_unary(demo_server, names):
    """ModelStreamInfer through tritonclient's stream API: one response per
    request, matched by id, equal to the unary answer."""
    requests = {f"s{i}": activations((1, 3 + i, DEMO_HIDDEN), seed=20 + i) for i in range(4)}
    responses = queue.Queue()
    with grpcclient.InferenceServerClient(demo_server.grpc_url) as client:
        unary = {rid: infer(client, demo_server.model, *names, x, "FP32")[0]
                 for rid, x in requests.items()}
        client.start_stream(callback=lambda result, error: responses.put((result, error)),
                            stream_timeout=RPC_TIMEOUT_S)
        try:
            for rid, x in requests.items():
                client.async_stream_infer(demo_server.model, [make_input(names[0], x, "FP32")],
                                          request_id=rid,
                                          outputs=[grpcclient.InferRequestedOutput(names[1])])
            got = {}
            for _ in requests:
                result, error = responses.get(timeout=RPC_TIMEOUT_S)
                assert error is None, f"stream error: {error}"
                got[result.get_response().id] = output_as_f32(result, names[1])[0]
        finally:
            client.stop_stream()
    assert sorted(got) == sorted(requests)
    for rid, want in unary.items():
        assert_close(got[rid], want, max_rel=1e-4, rms_rel=1e-5, what=f"stream response {rid}")


def test_sigterm_drains_in_flight_calls_and_exits_zero(start_server):
    """Kubernetes stops pods with SIGTERM: calls already sent must still be
    answered, and the process must exit 0. Repeated, because a signal that
    reaches a thread which does not block it kills the process only sometimes."""
    for attempt in range(3):
        server = start_server()
        with grpcclient.InferenceServerClient(server.grpc_url) as c:
            names = io_names(c, server.model)
        x = activations((4, 32, DEMO_HIDDEN), seed=30 + attempt)

        def call(_):
            with grpcclient.InferenceServerClient(server.grpc_url) as c:
                return infer(c, server.model, *names, x, "FP32")[0]

        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [pool.submit(call, i) for i in range(4)]
            time.sleep(0.05)  # let the calls reach the server
            rc = server.stop()
            for future in futures:
                try:
                    assert future.result(timeout=RPC_TIMEOUT_S).shape == x.shape
                except InferenceServerException as e:
                    # A call that arrived after the drain began may be refused,
                    # but only as UNAVAILABLE, never dropped silently.
                    assert "UNAVAILABLE" in str(e.status()), e
        assert rc == 0, f"attempt {attempt}: exit code {rc} after SIGTERM; log:\n{server.log_text()}"


def test_sigterm_right_after_ready_exits_zero(start_server):
    """A pod can be stopped the moment it is up: the ready line promises that
    SIGTERM is handled from then on."""
    codes = []
    for _ in range(5):
        server = start_server()
        codes.append(server.stop())
    assert codes == [0] * 5, f"exit codes after SIGTERM: {codes}; last log:\n{server.log_text()}"
