"""A float64 numpy reference of Llama-family decoder layers, and a writer for
tiny Hugging Face checkpoints (config.json + model.safetensors) to serve.

The compatibility tests write a random checkpoint with this module, start
layerserve on it with --model-dir, and compare what tritonclient gets back
with `decoder_layers` below. Nothing here is shared with the server: the
safetensors file is written by examples/hf_checkpoint.py (numpy, by hand;
its writer and bfloat16 conversions are imported here for the tests) and the
layer math follows Hugging Face's LlamaDecoderLayer / Qwen2DecoderLayer
directly.
"""

import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from hf_checkpoint import bf16_bits_to_f32, f32_to_bf16_bits, write_safetensors  # noqa: E402

# ---------------------------------------------------------------- bfloat16


def round_to_bf16(x):
    """The float32 values nearest to `x` that bfloat16 represents exactly."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


# ------------------------------------------------------------- checkpoint

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16}


def e4m3_codes(values):
    """float8_e4m3fn bit patterns (uint8) of values that e4m3 represents
    exactly (e4m3() rounds to them), as write_safetensors takes an F8_E4M3
    tensor: looked up in a table of the 254 finite codes decoded by hand."""
    codes = np.arange(256)
    codes = codes[(codes & 0x7F) != 0x7F]
    exponent, mantissa = (codes >> 3) & 15, codes & 7
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -9,
                         (1 + mantissa / 8) * 2.0 ** (exponent - 7.0))
    decoded = np.where(codes & 0x80, -magnitude, magnitude)
    table = {float(v): int(c) for v, c in zip(decoded, codes) if not (v == 0 and c & 0x80)}
    flat = np.asarray(values, dtype=np.float64).ravel()
    return np.array([table[float(v)] for v in flat], dtype=np.uint8).reshape(np.shape(values))


def stored_values(value, dtype):
    """What a reader gets back for `value` stored as `dtype`, in float64."""
    if dtype == "BF16":
        return round_to_bf16(value).astype(np.float64)
    return np.asarray(value, dtype=_SAFETENSORS_DTYPES[dtype]).astype(np.float64)


def make_checkpoint(directory, config, weight_dtype="F32", seed=0, extra_tensors=None,
                    moe_layout="per_expert", omit=()):
    """Writes config.json and model.safetensors with random weights for every
    layer of `config` (a Hugging Face config dict), plus `extra_tensors`
    ({full name: array}, e.g. the embedding, final norm and LM head a client
    needs; they replace the small placeholders otherwise written). Returns the
    per-layer weights exactly as stored (float64 numpy arrays, HF names
    without the "model.layers.{i}." prefix), for the reference.

    A mixtral config (num_local_experts) gets a mixture of experts instead of
    the MLP, stored as published checkpoints do (moe_layout "per_expert":
    block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1/w2/w3.weight)
    or as transformers 5 holds it in memory ("fused": mlp.gate.weight,
    mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]);
    the reference gets "moe.router", "moe.w1", "moe.w3" and "moe.w2" either
    way. A qwen2_moe or qwen3_moe config (num_experts) stores the same under
    Qwen's names
    (mlp.gate.weight, mlp.experts.{e}.gate_proj/up_proj/down_proj.weight, or
    fused as above), its experts of moe_intermediate_size, plus its shared
    expert (mlp.shared_expert.gate_proj/up_proj/down_proj.weight,
    mlp.shared_expert_gate.weight; for the reference "moe.shared_w1",
    "moe.shared_w3", "moe.shared_w2", "moe.shared_gate"). The router is scaled
    up so that routing margins are wide. Tensors named in `omit` are left out
    of the file (for loading errors)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", hidden // heads)
    qwen_moe = config["model_type"] in ("qwen2_moe", "qwen3_moe")
    qk_norm = config["model_type"] in ("qwen3", "qwen3_moe")
    biases = (config["model_type"] == "qwen2" or config.get("attention_bias", False)
              or (config["model_type"] == "qwen2_moe" and config.get("qkv_bias", True)))

    def linear(out_features, in_features):
        return rng.normal(0.0, 1.0 / math.sqrt(in_features), (out_features, in_features))

    tensors, layers = {}, []
    for i in range(config["num_hidden_layers"]):
        w = {
            "input_layernorm.weight": 1.0 + 0.1 * rng.normal(size=hidden),
            "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
            "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
            "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            "post_attention_layernorm.weight": 1.0 + 0.1 * rng.normal(size=hidden),
        }
        experts = num_experts(config)
        moe = {}
        if experts:
            e_inter = config.get("moe_intermediate_size", inter)
            moe = {"moe.router": 4 * linear(experts, hidden),
                   "moe.w1": np.stack([linear(e_inter, hidden) for _ in range(experts)]),
                   "moe.w3": np.stack([linear(e_inter, hidden) for _ in range(experts)]),
                   "moe.w2": np.stack([linear(hidden, e_inter) for _ in range(experts)])}
            shared = (config.get("shared_expert_intermediate_size", 5632)
                      if config["model_type"] == "qwen2_moe" else 0)
            if shared:
                moe.update({"moe.shared_w1": linear(shared, hidden),
                            "moe.shared_w3": linear(shared, hidden),
                            "moe.shared_w2": linear(hidden, shared),
                            "moe.shared_gate": linear(1, hidden)})
        else:
            w["mlp.gate_proj.weight"] = linear(inter, hidden)
            w["mlp.up_proj.weight"] = linear(inter, hidden)
            w["mlp.down_proj.weight"] = linear(hidden, inter)
        if qk_norm:
            w["self_attn.q_norm.weight"] = 1.0 + 0.1 * rng.normal(size=head_dim)
            w["self_attn.k_norm.weight"] = 1.0 + 0.1 * rng.normal(size=head_dim)
        if biases:
            w["self_attn.q_proj.bias"] = 0.1 * rng.normal(size=heads * head_dim)
            w["self_attn.k_proj.bias"] = 0.1 * rng.normal(size=kv_heads * head_dim)
            w["self_attn.v_proj.bias"] = 0.1 * rng.normal(size=kv_heads * head_dim)
        for name, value in w.items():
            tensors[f"model.layers.{i}.{name}"] = value
        tensors.update(moe_tensors(i, moe, moe_layout, qwen=qwen_moe))
        layers.append({name: stored_values(value, weight_dtype)
                       for name, value in {**w, **moe}.items()})
    # A checkpoint also holds what a layer span never reads.
    tensors["model.embed_tokens.weight"] = rng.normal(size=(16, hidden))
    tensors["model.norm.weight"] = np.ones(hidden)
    tensors.update(extra_tensors or {})
    for name in omit:
        del tensors[name]

    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(directory / "model.safetensors", tensors, weight_dtype)
    return layers


def num_experts(config):
    """Mixtral's num_local_experts or Qwen2-MoE's num_experts; 0: dense."""
    return config.get("num_local_experts", config.get("num_experts", 0))


def moe_tensors(layer, moe, layout, qwen=False):
    """A layer's expert tensors under their checkpoint names (see
    make_checkpoint); nothing for a dense layer."""
    if not moe:
        return {}
    p = f"model.layers.{layer}."
    out = {}
    if "moe.shared_w1" in moe:
        for part, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            out[p + f"mlp.shared_expert.{name}.weight"] = moe[f"moe.shared_{part}"]
        out[p + "mlp.shared_expert_gate.weight"] = moe["moe.shared_gate"]
    if layout == "fused":
        out.update({p + "mlp.gate.weight": moe["moe.router"],
                    p + "mlp.experts.gate_up_proj":
                        np.concatenate([moe["moe.w1"], moe["moe.w3"]], axis=1),
                    p + "mlp.experts.down_proj": moe["moe.w2"]})
        return out
    assert layout == "per_expert", layout
    if qwen:
        out[p + "mlp.gate.weight"] = moe["moe.router"]
        names = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
        for e in range(moe["moe.router"].shape[0]):
            for part, name in names:
                out[p + f"mlp.experts.{e}.{name}.weight"] = moe[f"moe.{part}"][e]
        return out
    out[p + "block_sparse_moe.gate.weight"] = moe["moe.router"]
    for e in range(moe["moe.router"].shape[0]):
        for part in ("w1", "w3", "w2"):
            out[p + f"block_sparse_moe.experts.{e}.{part}.weight"] = moe[f"moe.{part}"][e]
    return out


# -------------------------------------------------------------- reference


def rope_inv_freq(config):
    """head_dim/2 inverse frequencies, with Llama 3 scaling if configured
    (as Hugging Face's _compute_llama3_parameters)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    theta = config.get("rope_theta", 10000.0)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    scaling = config.get("rope_scaling")
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv_freq
    assert scaling.get("rope_type", scaling.get("type")) == "llama3", scaling
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled)


def rms_norm(x, weight, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def apply_rope(x, inv_freq):
    """x: [B, T, heads, head_dim]; rotate-half RoPE at positions 0..T-1."""
    positions = np.arange(x.shape[1], dtype=np.float64)
    angles = np.outer(positions, inv_freq)                    # [T, d/2]
    angles = np.concatenate([angles, angles], axis=-1)        # [T, d]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def e4m3(v):
    """The nearest float8_e4m3fn values to float64 `v` (ties to even,
    saturating at 448), computed here rather than with ml_dtypes: 3 mantissa
    bits below the leading one, subnormals in steps of 2^-9."""
    a = np.abs(v)
    _, e = np.frexp(a)  # a = f * 2^e, f in [0.5, 1)
    step = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    q = np.where(a >= 464, 448.0, np.minimum(np.round(a / step) * step, 448.0))  # np.round: ties to even
    return np.copysign(q, v)


def quantize_fp8(x, group=None, static_scale=None):
    """W8A8 activation quantization of x [..., channels] as the FP8 formats
    define it: each token's (or each token's `group`-channel slice's) values
    divided by s = amax / 448 (float32, as torch computes it), rounded to
    e4m3 and multiplied back; `static_scale` instead of s when given."""
    x = np.asarray(x, dtype=np.float64)
    shape = x.shape
    g = group or shape[-1]
    pad = (-shape[-1]) % g
    xs = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(*shape[:-1], -1, g)
    if static_scale is not None:
        s = np.full(xs.shape[:-1] + (1,), float(static_scale))
    else:
        amax = np.abs(xs).max(axis=-1, keepdims=True)
        s = (amax.astype(np.float32) / np.float32(448)).astype(np.float64)
        s = np.where(amax == 0, 1.0, s)
    q = e4m3(xs / s) * s
    return q.reshape(*shape[:-1], -1)[..., :shape[-1]]


def decoder_layer(x, w, config, margins=None, qdq=None):
    """One decoder layer. x: [B, T, hidden] float64 -> [B, T, hidden]. A
    mixture-of-experts layer appends its routing margin to `margins`. In an
    FP8 checkpoint qdq(v, name) gives the input that projection `name` reads
    (quantize_fp8 for an FP8 projection, v for a BF16 one): its names are
    the modules' ("self_attn.q_proj", "mlp.down_proj", "moe.w1" for the
    experts' gate and up, "moe.w2" for their down, "moe.shared_w1"/"w2",
    "moe.shared_gate" for the shared expert's sigmoid gate)."""
    b, t, hidden = x.shape
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim", hidden // heads)
    eps = config.get("rms_norm_eps", 1e-6)
    qdq = qdq or (lambda v, name: v)

    def proj(v, name):
        out = qdq(v, name) @ w[f"{name}.weight"].T
        bias = w.get(f"{name}.bias")
        return out if bias is None else out + bias

    n = rms_norm(x, w["input_layernorm.weight"], eps)
    q = proj(n, "self_attn.q_proj").reshape(b, t, heads, head_dim)
    k = proj(n, "self_attn.k_proj").reshape(b, t, kv_heads, head_dim)
    v = proj(n, "self_attn.v_proj").reshape(b, t, kv_heads, head_dim)
    if "self_attn.q_norm.weight" in w:  # Qwen3: each q and k head normalised before RoPE
        q = rms_norm(q, w["self_attn.q_norm.weight"], eps)
        k = rms_norm(k, w["self_attn.k_norm.weight"], eps)
    inv_freq = rope_inv_freq(config)
    q, k = apply_rope(q, inv_freq), apply_rope(k, inv_freq)
    group = heads // kv_heads
    k = np.repeat(k, group, axis=2)  # query head h reads KV head h // group
    v = np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    attn = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, heads * head_dim)
    h = x + proj(attn, "self_attn.o_proj")

    m = rms_norm(h, w["post_attention_layernorm.weight"], eps)
    if "moe.router" in w:
        top_k, normalize = routing_of(config)
        if margins is not None:
            margins.append(moe_routing(m, w["moe.router"], top_k, normalize)[2])
        out = h + experts_mlp(m, w, top_k, normalize, qdq)
        if "moe.shared_w1" in w:  # Qwen2-MoE's shared expert, gated by a sigmoid
            y = gated_mlp(qdq(m, "moe.shared_w1"), w["moe.shared_w1"], w["moe.shared_w3"],
                          w["moe.shared_w2"], lambda a: qdq(a, "moe.shared_w2"))
            out += y / (1.0 + np.exp(-(qdq(m, "moe.shared_gate") @ w["moe.shared_gate"].T)))
        return out
    gate = proj(m, "mlp.gate_proj")
    up = proj(m, "mlp.up_proj")
    return h + proj(gate / (1.0 + np.exp(-gate)) * up, "mlp.down_proj")


def routing_of(config):
    """(top_k, normalize): Mixtral always renormalises the chosen experts'
    probabilities, Qwen2-MoE only with norm_topk_prob (default false)."""
    if config["model_type"] in ("qwen2_moe", "qwen3_moe"):
        default = 4 if config["model_type"] == "qwen2_moe" else 8
        return config.get("num_experts_per_tok", default), config.get("norm_topk_prob", False)
    return config.get("num_experts_per_tok", 2), True


def moe_routing(m, router, top_k, normalize=True):
    """Mixtral's routing of rows m [..., hidden]: softmax over the experts,
    the top_k by probability (highest first; ties to the lower index), and
    their probabilities, renormalised if `normalize`. Returns (ids, weights,
    margin): margin
    is the smallest gap between a row's last chosen and best unchosen
    probability, where a lower-precision server could choose otherwise."""
    logits = m @ router.T
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    order = np.argsort(-p, axis=-1, kind="stable")
    ids = order[..., :top_k]
    chosen = np.take_along_axis(p, ids, axis=-1)
    margin = np.inf
    if top_k < p.shape[-1]:
        nxt = np.take_along_axis(p, order[..., top_k:top_k + 1], axis=-1)
        margin = float(np.min(chosen[..., -1:] - nxt))
    weights = chosen / chosen.sum(axis=-1, keepdims=True) if normalize else chosen
    return ids, weights, margin


def gated_mlp(m, w1, w3, w2, down_input=None):
    """(silu(m W1ᵀ) · (m W3ᵀ)) W2ᵀ: an expert's (or the shared expert's) MLP;
    down_input(a) is what W2 reads of a (FP8: its quantization)."""
    gate = m @ w1.T
    act = gate / (1.0 + np.exp(-gate)) * (m @ w3.T)
    return (act if down_input is None else down_input(act)) @ w2.T


def experts_mlp(m, w, top_k, normalize=True, qdq=None):
    """Σ over each row's chosen experts of weight · (silu(m W1ᵀ) · (m W3ᵀ)) W2ᵀ."""
    qdq = qdq or (lambda v, name: v)
    ids, weights, _ = moe_routing(m, w["moe.router"], top_k, normalize)
    out = np.zeros_like(m)
    mq = qdq(m, "moe.w1")
    for e in range(w["moe.router"].shape[0]):
        y = gated_mlp(mq, w["moe.w1"][e], w["moe.w3"][e], w["moe.w2"][e],
                      lambda a: qdq(a, "moe.w2"))
        out += np.sum(np.where(ids == e, weights, 0.0), axis=-1, keepdims=True) * y
    return out


def decoder_layers(x, layers, config, margins=None, qdq=None):
    """Runs `layers` (a list of weight dicts) in order over x [B, T, hidden];
    mixture-of-experts layers append their routing margins to `margins`;
    qdq as decoder_layer's."""
    out = np.asarray(x, dtype=np.float64)
    for w in layers:
        out = decoder_layer(out, w, config, margins, qdq)
    return out


def worst_element(actual, expected):
    """A readable description of the largest absolute difference."""
    diff = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
    idx = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return (f"worst at {tuple(int(i) for i in idx)}: got {float(actual[idx]):.6g}, "
            f"expected {float(expected[idx]):.6g} (|diff| {float(diff[idx]):.3g}, "
            f"max |expected| {float(np.max(np.abs(expected))):.3g})")


def assert_close(actual, expected, max_rel, rms_rel, what):
    """Fails unless max|a-e| <= max_rel * max|e| and rms(a-e) <= rms_rel * rms(e),
    naming the worst element."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: non-finite output"
    diff = actual - expected
    scale = float(np.max(np.abs(expected)))
    rms_err = float(np.sqrt(np.mean(diff * diff)))
    rms_ref = float(np.sqrt(np.mean(expected * expected)))
    ok_max = float(np.max(np.abs(diff))) <= max_rel * scale
    ok_rms = rms_err <= rms_rel * rms_ref
    assert ok_max and ok_rms, (
        f"{what}: rms error {rms_err:.3g} (limit {rms_rel * rms_ref:.3g}), "
        f"max error limit {max_rel * scale:.3g}; {worst_element(actual, expected)}")
