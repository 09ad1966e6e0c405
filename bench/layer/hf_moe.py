"""The baselines for a mixture-of-experts layer (bench/layer/layer_bench
--model M): Hugging Face's decoder layer and its sparse MoE block, a plain
PyTorch loop over the experts, and torch._grouped_mm, all bf16 on cuda, with
the same shapes: Mixtral-8x7B (hidden 4096, 8 experts of intermediate 14336,
top 2), Qwen1.5-MoE-A2.7B (qwen2-moe: hidden 2048, 60 experts of 1408, top 4
with raw weights, a shared expert of 5632) or Qwen3-30B-A3B (qwen3-moe:
hidden 2048, 128 experts of 768, top 8, q/k head norms).

The experts' part is timed three ways:
  hf_block    HF's MoE block: router, top-k, its own expert dispatch
  loop        router, top-k, then per used expert: gather its tokens, w1/w3,
              SiLU·mul, w2, weighted index_add (what HF did before v5);
              then the shared expert and its gate, where the model has one
  grouped_mm  only the two torch._grouped_mm calls and the SiLU·mul between
              them, on tokens already in expert order (routing and the
              permutation left out, which favours it)
and set beside ours: layer_bench's experts part (routing through combine, and
the shared expert) and its grouped GEMMs with the SiLU between them (the
like-for-like match for grouped_mm). Floors: max(bytes / 3.0 TB/s, FLOPs /
800 TFLOP/s), the bytes being the experts a batch reads under uniform routing
(E (1 - (1 - k/E)^T)) and the shared expert, plus, for the whole layer, the
attention's.

Timing: warm-up, CUDA events around each call, median of --iters.

    python3 bench/layer/hf_moe.py [--model mixtral|qwen2-moe|qwen3-moe] [--ours ours.csv] [--iters 30]
"""
import argparse
import csv
import os
import sys

import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "attention"))
from torch_timing import device_rates, synced_median_ms  # noqa: E402  (bench/attention/torch_timing.py)

# The shapes of each model (layer_bench's configs), and its routing.
MODELS = {
    "mixtral": dict(hidden=4096, inter=14336, heads=32, kv_heads=8, experts=8, top_k=2, normalize=True,
                    shared=0),
    "qwen2-moe": dict(hidden=2048, inter=1408, heads=16, kv_heads=16, experts=60, top_k=4,
                      normalize=False, shared=5632),
    "qwen3-moe": dict(hidden=2048, inter=768, heads=32, kv_heads=4, experts=128, top_k=8,
                      normalize=True, shared=0),
}
HEAD_DIM = 128
# Set by main() from --model.
HIDDEN = INTER = HEADS = KV_HEADS = EXPERTS = TOP_K = SHARED = 0
NORMALIZE = True
# The floors' denominators, measured on the device by main() (device_rates).
HBM_BYTES_PER_S = BF16_FLOPS_PER_S = 0.0
TOKENS = [1, 16, 128, 1024, 4096, 8192]


def median_ms(fn, iters):
    with torch.inference_mode():
        return synced_median_ms(fn, 3, iters)


def make_layer(model):
    kwargs = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  head_dim=HEAD_DIM, num_experts_per_tok=TOP_K, max_position_embeddings=8192,
                  num_hidden_layers=1)
    if model == "mixtral":
        from transformers.models.mixtral import modeling_mixtral as mm
        config_class, prefix = transformers.MixtralConfig, "Mixtral"
        kwargs.update(intermediate_size=INTER, num_local_experts=EXPERTS, rms_norm_eps=1e-5,
                      sliding_window=None)
    elif model == "qwen2-moe":
        from transformers.models.qwen2_moe import modeling_qwen2_moe as mm
        config_class, prefix = transformers.Qwen2MoeConfig, "Qwen2Moe"
        kwargs.update(intermediate_size=5632, moe_intermediate_size=INTER, num_experts=EXPERTS,
                      shared_expert_intermediate_size=SHARED, norm_topk_prob=NORMALIZE,
                      rms_norm_eps=1e-6)
    else:
        from transformers.models.qwen3_moe import modeling_qwen3_moe as mm
        config_class, prefix = transformers.Qwen3MoeConfig, "Qwen3Moe"
        kwargs.update(intermediate_size=6144, moe_intermediate_size=INTER, num_experts=EXPERTS,
                      norm_topk_prob=NORMALIZE, rms_norm_eps=1e-6)
    try:
        config = config_class(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **kwargs)
    except TypeError:
        config = config_class(rope_theta=1e6, **kwargs)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        layer = getattr(mm, prefix + "DecoderLayer")(config, layer_idx=0).to(torch.bfloat16).eval()
        rotary = getattr(mm, prefix + "RotaryEmbedding")(config=config)
    block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe")
    return layer, rotary, block


def call(module, *args, **kwargs):
    out = module(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class Experts:
    """Random experts of our own (bf16), shared by the loop and grouped_mm."""

    def __init__(self):
        g = torch.Generator(device="cuda").manual_seed(0)
        s = HIDDEN ** -0.5
        self.router = (torch.rand(EXPERTS, HIDDEN, device="cuda", generator=g) * 2 - 1).mul(s).bfloat16()
        self.w1 = (torch.rand(EXPERTS, INTER, HIDDEN, device="cuda", generator=g) * 2 - 1).mul(s).bfloat16()
        self.w3 = (torch.rand(EXPERTS, INTER, HIDDEN, device="cuda", generator=g) * 2 - 1).mul(s).bfloat16()
        self.w2 = (torch.rand(EXPERTS, HIDDEN, INTER, device="cuda", generator=g) * 2 - 1).mul(
            INTER ** -0.5).bfloat16()
        # grouped_mm wants [E, K, N]: transposed views of [E, N, K] weights.
        self.gate_up_t = torch.cat([self.w1, self.w3], dim=1).transpose(1, 2)
        self.down_t = self.w2.transpose(1, 2)
        if SHARED:
            self.s1 = (torch.rand(SHARED, HIDDEN, device="cuda", generator=g) * 2 - 1).mul(s).bfloat16()
            self.s3 = (torch.rand(SHARED, HIDDEN, device="cuda", generator=g) * 2 - 1).mul(s).bfloat16()
            self.s2 = (torch.rand(HIDDEN, SHARED, device="cuda", generator=g) * 2 - 1).mul(
                SHARED ** -0.5).bfloat16()
            self.s_gate = (torch.rand(1, HIDDEN, device="cuda", generator=g) * 2 - 1).mul(s).bfloat16()

    def route(self, x):
        probs = F.softmax(x @ self.router.T, dim=-1, dtype=torch.float)
        weights, ids = torch.topk(probs, TOP_K, dim=-1)
        if NORMALIZE:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids

    def loop(self, x):
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        mask = F.one_hot(ids, EXPERTS).permute(2, 1, 0)  # [E, k, T]
        for e in range(EXPERTS):
            slot, token = torch.where(mask[e])
            if token.numel() == 0:
                continue
            h = x[token]
            y = (F.silu(h @ self.w1[e].T) * (h @ self.w3[e].T)) @ self.w2[e].T
            out.index_add_(0, token, y * weights[token, slot, None])
        if SHARED:
            shared = (F.silu(x @ self.s1.T) * (x @ self.s3.T)) @ self.s2.T
            out += torch.sigmoid(x @ self.s_gate.T) * shared
        return out

    def permuted(self, x):
        """x's rows in expert order and the group ends, as grouped_mm takes them."""
        _, ids = self.route(x)
        order = torch.argsort(ids.flatten(), stable=True)
        rows = x[order // TOP_K]
        counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
        return rows, torch.cumsum(counts, 0).to(torch.int32)

    def grouped(self, rows, offs):
        gu = torch._grouped_mm(rows, self.gate_up_t, offs=offs)
        act = F.silu(gu[:, :INTER]) * gu[:, INTER:]
        return torch._grouped_mm(act, self.down_t, offs=offs)


def experts_floor_ms(tokens):
    expert_bytes = 2 * 3 * HIDDEN * INTER
    used = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** tokens)
    flops = 2 * tokens * 3 * HIDDEN * (TOP_K * INTER + SHARED)
    return 1e3 * max((used * expert_bytes + 2 * 3 * HIDDEN * SHARED) / HBM_BYTES_PER_S,
                     flops / BF16_FLOPS_PER_S)


def layer_floor_ms(tokens):
    attn_params = HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * HIDDEN
    attn_ms = 1e3 * max(2 * attn_params / HBM_BYTES_PER_S,
                        (2 * tokens * attn_params + 2 * HEADS * HEAD_DIM * tokens * (tokens + 1))
                        / BF16_FLOPS_PER_S)
    return attn_ms + experts_floor_ms(tokens)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="mixtral")
    parser.add_argument("--ours", help="layer_bench --model M --csv output")
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    global HIDDEN, INTER, HEADS, KV_HEADS, EXPERTS, TOP_K, SHARED, NORMALIZE, HBM_BYTES_PER_S, BF16_FLOPS_PER_S
    m = MODELS[args.model]
    HIDDEN, INTER, HEADS, KV_HEADS = m["hidden"], m["inter"], m["heads"], m["kv_heads"]
    EXPERTS, TOP_K, SHARED, NORMALIZE = m["experts"], m["top_k"], m["shared"], m["normalize"]
    torch.manual_seed(0)
    HBM_BYTES_PER_S, BF16_FLOPS_PER_S = device_rates()
    print(f"floors at this run's rates: copy {HBM_BYTES_PER_S / 1e12:.2f} TB/s (read + written), "
          f"bf16 8192^3 matmul {BF16_FLOPS_PER_S / 1e12:.0f} TFLOP/s")
    print("transformers", transformers.__version__, "torch", torch.__version__, "device",
          torch.cuda.get_device_name(), "model", args.model)
    layer, rotary, block = make_layer(args.model)
    experts = Experts()
    has_grouped_mm = hasattr(torch, "_grouped_mm")
    ours = {}
    if args.ours:
        with open(args.ours) as f:
            for row in csv.DictReader(f):
                if int(row["seqs"]) == 1:
                    ours[int(row["tokens"])] = (float(row["ms"]), float(row["experts_ms"]),
                                                float(row["grouped_gemms_ms"]))

    def fmt(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    print("experts' part (ms; ratios are the baseline's time over ours):")
    print(f"{'tokens':>6} {'floor':>7} {'ours':>7} {'ours/fl':>7} {'hf_block':>8} {'x':>5} {'loop':>7} "
          f"{'x':>5} {'ours_gg':>7} {'grp_mm':>7} {'x':>5} {'gg/fl':>5}")
    whole = []
    for t in TOKENS:
        x = torch.randn(1, t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        flat = x.view(t, HIDDEN)
        hf_block = median_ms(lambda: call(block, x), args.iters)
        loop = median_ms(lambda: experts.loop(flat), args.iters)
        grouped = None
        if has_grouped_mm:
            rows, offs = experts.permuted(flat)
            grouped = median_ms(lambda: experts.grouped(rows, offs), args.iters)
        pos = torch.arange(t, device="cuda").unsqueeze(0)
        pe = rotary(x, pos)
        hf_layer = median_ms(lambda: call(layer, x, attention_mask=None, position_ids=pos,
                                          position_embeddings=pe), args.iters)
        whole.append((t, hf_layer))
        o_layer, o_experts, o_gg = ours.get(t, (None, None, None))
        floor = experts_floor_ms(t)

        def ratio(base, mine):
            return None if base is None or mine is None else base / mine

        print(f"{t:>6} {floor:>7.3f} {fmt(o_experts):>7} {fmt(ratio(o_experts, floor), '.2f'):>7} "
              f"{hf_block:>8.3f} {fmt(ratio(hf_block, o_experts), '.2f'):>5} {loop:>7.3f} "
              f"{fmt(ratio(loop, o_experts), '.2f'):>5} {fmt(o_gg):>7} {fmt(grouped):>7} "
              f"{fmt(ratio(grouped, o_gg), '.2f'):>5} {fmt(ratio(o_gg, floor), '.2f'):>5}")
    print("whole layer (ms):")
    print(f"{'tokens':>6} {'floor':>7} {'ours':>7} {'hf_layer':>8} {'speedup':>7} {'ours/fl':>7}")
    for t, hf_layer in whole:
        o_layer = ours.get(t, (None,))[0]
        print(f"{t:>6} {layer_floor_ms(t):>7.3f} {fmt(o_layer):>7} {hf_layer:>8.3f} "
              f"{fmt(None if o_layer is None else hf_layer / o_layer, '.2f'):>7} "
              f"{fmt(None if o_layer is None else o_layer / layer_floor_ms(t), '.2f'):>7}")


if __name__ == "__main__":
    main()
