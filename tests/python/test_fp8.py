"""FP8 checkpoints end to end on the CPU backend: a random one-layer Llama
written with numpy in each format's layout (float8_e4m3fn weights, their
scales under the format's names and dtypes, its quantization_config), served
with --model-dir and run through tritonclient, against llama_numpy's float64
forward with the activations quantized as the format says (W8A8). Each is
also checked to be much closer to that than to the weight-only forward, so a
server that skipped the activation quantization fails. One layer and float32
inputs: see docs/fp8.md ("Why the bounds are what they are").

The checkpoints transformers itself writes are checked on the GPU machine
(tests/gpu/fp8_check.py), where transformers runs.
"""

import json
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from server_binary import layerserve_bin
from layerserve_client import infer, io_names
from llama_numpy import (decoder_layers, e4m3, e4m3_codes, make_checkpoint, quantize_fp8,
                         round_to_bf16, write_safetensors)

CONFIG = dict(model_type="llama", hidden_size=256, intermediate_size=384, num_attention_heads=4,
              num_key_value_heads=2, num_hidden_layers=1, rms_norm_eps=1e-5, rope_theta=10000.0,
              torch_dtype="bfloat16")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Static input scales: q, k and v read one input, as gate and up do.
STATIC_INPUT = {"self_attn.q_proj": 4 / 448, "self_attn.k_proj": 4 / 448,
                "self_attn.v_proj": 4 / 448, "self_attn.o_proj": 1 / 448,
                "mlp.gate_proj": 4 / 448, "mlp.up_proj": 4 / 448, "mlp.down_proj": 1 / 448}


def compressed_tensors(weights, inputs):
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float",
                                                      "strategy": weights, "symmetric": True,
                                                      "dynamic": False},
                                          "input_activations": inputs}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed"}


# name: (quantization_config, weight block (rows, cols; None: the whole
# dimension), scale tensor suffix and dtype, activation quantization)
SCHEMES = {
    "fine-grained": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
         "modules_to_not_convert": None},
        (128, 128), ("weight_scale_inv", "F32"), dict(group=128)),
    "compressed-channel-dynamic": (
        compressed_tensors("channel", {"num_bits": 8, "type": "float", "strategy": "token",
                                       "dynamic": True, "symmetric": True}),
        (1, None), ("weight_scale", "BF16"), dict()),
    "compressed-tensor-static": (
        compressed_tensors("tensor", {"num_bits": 8, "type": "float", "strategy": "tensor",
                                      "dynamic": False, "symmetric": True}),
        (None, None), ("weight_scale", "F32"), dict(static=True)),
}


def quantize_weight(w, block, scale_dtype):
    """(dequantized weight, FP8 values, scales as stored) of w [rows, cols]
    with one scale (amax / 448, stored in scale_dtype) per block."""
    rows, cols = w.shape
    br, bc = block[0] or rows, block[1] or cols
    grid = (-(-rows // br), -(-cols // bc))
    scales = np.zeros(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax = np.abs(w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]).max()
            scales[i, j] = np.float32(amax) / np.float32(448)
    if scale_dtype == "BF16":
        scales = round_to_bf16(scales).astype(np.float64)
    full = np.repeat(np.repeat(scales, br, axis=0)[:rows], bc, axis=1)[:, :cols]
    q = e4m3(w / full)
    return q * full, q, scales


@pytest.fixture(scope="module", params=sorted(SCHEMES))
def served(request, tmp_path_factory, start_server):
    """(server, the W8A8 reference's layers, its qdq) for one scheme."""
    quantization, block, (suffix, scale_dtype), activations = SCHEMES[request.param]
    directory = tmp_path_factory.mktemp("fp8") / request.param
    layers = make_checkpoint(directory, CONFIG, "F32", seed=21)
    config = dict(CONFIG, quantization_config=quantization)
    tensors, dtypes = {"model.embed_tokens.weight": np.zeros((16, 256))}, {}
    for name, value in layers[0].items():
        tensors["model.layers.0." + name] = value
    for module in PROJECTIONS:
        name = f"model.layers.0.{module}.weight"
        w, q, scales = quantize_weight(layers[0][module + ".weight"], block, scale_dtype)
        layers[0][module + ".weight"] = w
        tensors[name], dtypes[name] = e4m3_codes(q), "F8_E4M3"
        scale_name = f"model.layers.0.{module}.{suffix}"
        tensors[scale_name] = scales if block[0] != 1 else scales.reshape(-1, 1)
        if block == (None, None):
            tensors[scale_name] = scales.reshape(1)
        dtypes[scale_name] = scale_dtype
        if activations.get("static"):
            tensors[f"model.layers.0.{module}.input_scale"] = np.array([STATIC_INPUT[module]])
    (directory / "config.json").write_text(json.dumps(config))
    write_safetensors(directory / "model.safetensors", tensors, "F32", dtypes)

    def qdq(v, module):
        if activations.get("static"):
            return quantize_fp8(v, static_scale=np.float32(STATIC_INPUT[module]))
        return quantize_fp8(v, group=activations.get("group"))

    server = start_server(f"--model-dir={directory}")
    return server, layers, qdq


def rel_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


@pytest.mark.parametrize("batch,tokens", [(2, 17), (3, 1)])
def test_fp8_checkpoint_matches_the_w8a8_reference(served, batch, tokens):
    server, layers, qdq = served
    x = np.random.default_rng(batch * 10 + tokens).normal(size=(batch, tokens, 256))
    x = x.astype(np.float32)
    w8a8 = decoder_layers(x, layers, CONFIG, qdq=qdq) - x
    weight_only = decoder_layers(x, layers, CONFIG) - x
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        got, datatype, _ = infer(client, server.model, *io_names(client, server.model), x, "FP32")
    assert datatype == "FP32"
    err, err_weight_only = rel_rms(got - x, w8a8), rel_rms(got - x, weight_only)
    print(f"{server.model}: y - x against W8A8 {err:.3g}, against weight-only {err_weight_only:.3g}")
    assert err < 2e-3, f"{err:.3g} from the W8A8 reference"
    assert err_weight_only > 10 * err, "no closer to W8A8 than to the weight-only forward"


def test_an_unsupported_quantization_is_refused_in_one_line(tmp_path):
    make_checkpoint(tmp_path / "awq", dict(CONFIG, quantization_config={"quant_method": "awq"}),
                    "F32", seed=1)
    config = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq"}
    proc = subprocess.run(
        [layerserve_bin(), f"--model-dir={tmp_path / 'awq'}", "--host=127.0.0.1",
         "--grpc-port=0", "--metrics-port=0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "quant_method" in errors[0] and "'awq'" in errors[0], proc.stderr
