"""End to end against an independent implementation: write a tiny Hugging
Face checkpoint with numpy, serve it with --model-dir, run it through
tritonclient, and compare with llama_numpy's float64 decoder layers.

The variants cover what real checkpoints differ in: grouped-query attention
and a served sub-span of the layers, bfloat16 weights with Llama 3 RoPE
scaling, and Qwen2's q/k/v biases with a head_dim that is not hidden/heads.
"""

import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from server_binary import layerserve_bin
from layerserve_client import RPC_TIMEOUT_S, infer, io_names
from llama_numpy import assert_close, decoder_layers, make_checkpoint, round_to_bf16

VARIANTS = {
    "tiny-llama-gqa": dict(
        config=dict(model_type="llama", hidden_size=64, intermediate_size=160,
                    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                    rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="float32"),
        weight_dtype="F32", layers="1:3"),
    "tiny-llama3-bf16": dict(
        config=dict(model_type="llama", hidden_size=64, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
                    rms_norm_eps=1e-6, rope_theta=500000.0, torch_dtype="bfloat16",
                    # A short original context puts every head_dim/2 frequency in
                    # one of the three llama3 regimes (kept, smoothed, scaled).
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=16)),
        weight_dtype="BF16", layers=":"),
    "tiny-qwen2-bias": dict(
        config=dict(model_type="qwen2", hidden_size=64, intermediate_size=96,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                    num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    torch_dtype="float32"),
        weight_dtype="F32", layers=":"),
}


def served_range(spec, num_layers):
    first, _, end = spec.partition(":")
    return int(first or 0), int(end or num_layers)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def served(request, tmp_path_factory, start_server):
    """(server, config, reference layers) for one checkpoint variant."""
    name = request.param
    variant = VARIANTS[name]
    directory = tmp_path_factory.mktemp("checkpoints") / name
    layers = make_checkpoint(directory, variant["config"], variant["weight_dtype"], seed=11)
    server = start_server(f"--model-dir={directory}", f"--layers={variant['layers']}")
    first, end = served_range(variant["layers"], variant["config"]["num_hidden_layers"])
    assert server.model == name, "the model is named after its directory by default"
    assert server.layers == (first, end), server.ready
    return server, variant["config"], layers[first:end]


def test_metadata_reflects_the_checkpoint(served):
    server, config, _ = served
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        metadata = client.get_model_metadata(server.model, client_timeout=RPC_TIMEOUT_S)
    assert list(metadata.inputs[0].shape) == [-1, -1, config["hidden_size"]]


@pytest.mark.parametrize("batch,tokens", [(3, 7), (1, 1), (2, 16)])
def test_fp32_matches_numpy_reference(served, batch, tokens):
    server, config, layers = served
    x = np.random.default_rng(batch * 100 + tokens).normal(
        size=(batch, tokens, config["hidden_size"])).astype(np.float32)
    want = decoder_layers(x, layers, config)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        names = io_names(client, server.model)
        got, datatype, _ = infer(client, server.model, *names, x, "FP32")
    assert datatype == "FP32"
    # float32 compute against float64: errors of a few ulps per operation.
    assert_close(got, want, max_rel=2e-4, rms_rel=5e-5,
                 what=f"{server.model} FP32 [B={batch}, T={tokens}]")


def test_bf16_matches_numpy_reference(served):
    server, config, layers = served
    x = round_to_bf16(np.random.default_rng(5).normal(size=(2, 9, config["hidden_size"])))
    want = decoder_layers(x, layers, config)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        names = io_names(client, server.model)
        got, datatype, _ = infer(client, server.model, *names, x, "BF16")
    assert datatype == "BF16"
    assert_close(got, want, max_rel=3e-2, rms_rel=1e-2, what=f"{server.model} BF16")


def test_layer_range_beyond_the_checkpoint_fails_at_start(tmp_path):
    config = dict(VARIANTS["tiny-llama-gqa"]["config"], num_hidden_layers=2)
    make_checkpoint(tmp_path / "two-layers", config, "F32", seed=1)
    proc = subprocess.run(
        [layerserve_bin(), f"--model-dir={tmp_path / 'two-layers'}", "--layers=1:5",
         "--host=127.0.0.1", "--grpc-port=0", "--metrics-port=0"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, f"started with layers 1:5 of 2:\n{proc.stdout}{proc.stderr}"
    assert "layerserve ready" not in proc.stdout
    assert "layer" in proc.stderr.lower(), f"no error that names the layers:\n{proc.stderr}"
