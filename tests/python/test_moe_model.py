"""Mixtral end to end against an independent implementation: tiny mixture-
of-experts checkpoints written with numpy in both layouts the server reads
(the published per-expert tensors and transformers 5's fused ones), served
with --model-dir, run through tritonclient, and compared with llama_numpy's
float64 layers; plus the routing metric and a checkpoint missing an expert.

The variants: 8 experts with 2 per token; 4 experts with 1 per token, fused,
bf16 weights, a served sub-span; 16 experts with 1 per token, where a short
request leaves most experts without a token; Qwen2-MoE's (qwen2_moe)
experts, weights used as they are, with a shared expert, in both layouts;
and Qwen3-MoE's, behind Qwen3's q/k head norms. Each comparison
uses inputs whose routing does not nearly tie in the reference (a float32
server could then choose another expert, and the comparison would test the
inputs, not the server).
"""

import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from server_binary import layerserve_bin
from layerserve_client import RPC_TIMEOUT_S, infer, io_names
from llama_numpy import (assert_close, decoder_layers, make_checkpoint, moe_routing, num_experts,
                         rms_norm, round_to_bf16, routing_of)

BASE = dict(model_type="mixtral", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=None)
VARIANTS = {
    "tiny-mixtral-top2": dict(
        config=dict(BASE, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                    torch_dtype="float32"),
        weight_dtype="F32", layout="per_expert", layers=":"),
    "tiny-mixtral-top1-fused": dict(
        config=dict(BASE, intermediate_size=128, num_local_experts=4, num_experts_per_tok=1,
                    torch_dtype="bfloat16"),
        weight_dtype="BF16", layout="fused", layers="1:2"),
    "tiny-mixtral-sparse": dict(
        config=dict(BASE, intermediate_size=64, num_local_experts=16, num_experts_per_tok=1,
                    torch_dtype="float32"),
        weight_dtype="F32", layout="per_expert", layers=":"),
}
QWEN2_MOE = dict(model_type="qwen2_moe", hidden_size=64, intermediate_size=96,
                 moe_intermediate_size=48, shared_expert_intermediate_size=80,
                 num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, rms_norm_eps=1e-6,
                 rope_theta=1000000.0, torch_dtype="float32")
VARIANTS.update({
    "tiny-qwen2-moe": dict(config=QWEN2_MOE, weight_dtype="F32", layout="per_expert",
                           layers=":"),
    "tiny-qwen2-moe-fused": dict(config=dict(QWEN2_MOE, num_experts_per_tok=3,
                                             norm_topk_prob=True, torch_dtype="bfloat16"),
                                 weight_dtype="BF16", layout="fused", layers="1:2"),
    # Qwen3-MoE: q/k head norms, head_dim 32 over hidden 64 with 4 heads, no
    # shared expert, weights renormalised.
    "tiny-qwen3-moe": dict(config=dict(model_type="qwen3_moe", hidden_size=64,
                                       intermediate_size=96, moe_intermediate_size=48,
                                       num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=32, num_hidden_layers=2, num_experts=8,
                                       num_experts_per_tok=2, norm_topk_prob=True,
                                       rms_norm_eps=1e-6, rope_theta=1000000.0,
                                       torch_dtype="float32"),
                           weight_dtype="F32", layout="per_expert", layers=":"),
})
# Routing gaps (in probability) below this could flip in float32.
MIN_MARGIN = 1e-4


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def served(request, tmp_path_factory, start_server):
    """(server, config, reference layers) for one checkpoint variant."""
    name = request.param
    variant = VARIANTS[name]
    directory = tmp_path_factory.mktemp("checkpoints") / name
    layers = make_checkpoint(directory, variant["config"], variant["weight_dtype"], seed=21,
                             moe_layout=variant["layout"])
    server = start_server(f"--model-dir={directory}", f"--layers={variant['layers']}",
                          "--backend=cpu")
    first, _, end = variant["layers"].partition(":")
    span = layers[int(first or 0):int(end or len(layers))]
    return server, variant["config"], span


def routable_input(shape, layers, config, seed, bf16=False):
    """Random activations of `shape` (rounded to bf16 if asked) whose routing
    is clear in every layer, and the reference's output for them: the first
    of a few seeds from `seed` whose margins all exceed MIN_MARGIN."""
    for s in range(seed, seed + 20):
        x = np.random.default_rng(s).normal(size=shape)
        x = round_to_bf16(x) if bf16 else x.astype(np.float32)
        margins = []
        want = decoder_layers(x, layers, config, margins)
        if min(margins) > MIN_MARGIN:
            return x, want
    pytest.fail(f"no input of shape {shape} routes clearly from seed {seed}")


def test_metadata_reflects_the_checkpoint(served):
    server, config, _ = served
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        metadata = client.get_model_metadata(server.model, client_timeout=RPC_TIMEOUT_S)
    assert list(metadata.inputs[0].shape) == [-1, -1, config["hidden_size"]]


@pytest.mark.parametrize("batch,tokens", [(3, 7), (1, 1), (2, 16)])
def test_fp32_matches_numpy_reference(served, batch, tokens):
    server, config, layers = served
    x, want = routable_input((batch, tokens, config["hidden_size"]), layers, config,
                             seed=batch * 100 + tokens)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        names = io_names(client, server.model)
        got, datatype, _ = infer(client, server.model, *names, x, "FP32")
    assert datatype == "FP32"
    assert_close(got, want, max_rel=2e-4, rms_rel=5e-5,
                 what=f"{server.model} FP32 [B={batch}, T={tokens}]")


def test_bf16_matches_numpy_reference(served):
    server, config, layers = served
    x, want = routable_input((2, 9, config["hidden_size"]), layers, config, seed=5, bf16=True)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        names = io_names(client, server.model)
        got, datatype, _ = infer(client, server.model, *names, x, "BF16")
    assert datatype == "BF16"
    assert_close(got, want, max_rel=3e-2, rms_rel=1e-2, what=f"{server.model} BF16")


def expert_tokens(server):
    """{(layer, expert): tokens} from the server's /metrics."""
    counts = {}
    for family in text_string_to_metric_families(server.scrape()[2]):
        if family.name == "layerserve_expert_tokens":
            for s in family.samples:
                if s.name.endswith("_total"):
                    counts[(int(s.labels["layer"]), int(s.labels["expert"]))] = s.value
    return counts


def layer_routing(h, w, config):
    """The experts layer w picks for input h [B, T, hidden], as the
    reference computes them: its attention half is the layer's output with
    every expert (and a shared one) silenced (w2 zero), normed as the
    experts' input."""
    silent = dict(w, **{name: np.zeros_like(w[name])
                        for name in ("moe.w2", "moe.shared_w2") if name in w})
    residual = decoder_layers(h, [silent], config)
    m = rms_norm(residual, w["post_attention_layernorm.weight"], config["rms_norm_eps"])
    ids, _, margin = moe_routing(m, w["moe.router"], *routing_of(config))
    assert margin > MIN_MARGIN, f"inputs route ambiguously (margin {margin:.2g})"
    return ids


def test_tokens_per_expert_metric_counts_the_routing(served):
    """One request moves each served layer's per-expert counters by exactly
    its routing (as the reference computes it); a short request to the
    16-expert model leaves most experts idle."""
    server, config, layers = served
    x, _ = routable_input((1, 3, config["hidden_size"]), layers, config, seed=77)
    experts = num_experts(config)
    first = int(VARIANTS[server.model]["layers"].partition(":")[0] or 0)
    want = {}
    h = np.asarray(x, np.float64)
    for i, w in enumerate(layers):
        ids = layer_routing(h, w, config)
        for e in range(experts):
            want[(first + i, e)] = float(np.sum(ids == e))
        h = decoder_layers(h, [w], config)
    before = expert_tokens(server)
    assert set(before) == set(want), "one series per served layer and expert"
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        infer(client, server.model, *io_names(client, server.model), x, "FP32")
    after = expert_tokens(server)
    assert {key: after[key] - before[key] for key in want} == want
    if experts == 16:
        assert sum(v == 0 for v in want.values()) >= 13, "3 tokens, top 1: most experts idle"


def test_missing_expert_fails_at_start_naming_it(tmp_path):
    variant = VARIANTS["tiny-mixtral-top2"]
    missing = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    make_checkpoint(tmp_path / "missing-expert", variant["config"], "F32", seed=1, omit=[missing])
    proc = subprocess.run(
        [layerserve_bin(), f"--model-dir={tmp_path / 'missing-expert'}", "--backend=cpu",
         "--host=127.0.0.1", "--grpc-port=0", "--metrics-port=0"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0, f"started without {missing}:\n{proc.stdout}{proc.stderr}"
    assert "layerserve ready" not in proc.stdout
    assert missing in proc.stderr, f"no error that names the tensor:\n{proc.stderr}"
