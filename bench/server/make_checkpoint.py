"""Writes a Hugging Face-style Llama checkpoint with random bf16 weights, for
load tests of layerserve with realistic shapes and no download:
config.json + model.safetensors, Llama-3-8B shapes by default.

    python3 bench/server/make_checkpoint.py OUT_DIR [--layers 4] [--device cuda]
        [--head --vocab V] [--mixtral | --qwen2-moe | --qwen3-moe | --llama3-70b] [--fp8]

--head also writes the model's ends (model.embed_tokens, model.norm, lm_head,
with --vocab rows), so examples/pipeline_generate.py can generate through it.
--mixtral writes Mixtral-8x7B layers instead (8 experts of intermediate 14336,
top 2, in the published per-expert layout): about 2.9 GB per layer.
--qwen3-moe writes Qwen3-30B-A3B layers (q/k head norms, 128 experts of 768,
top 8; about 1.25 GB per layer), --qwen2-moe Qwen1.5-MoE-A2.7B ones (q/k/v
biases, 60 experts of 1408, top 4 with raw weights, a shared expert of 5632;
about 1.1 GB per layer), both in their published per-expert layouts.
--llama3-70b writes Llama-3-70B layers (hidden 8192, 64 heads, 8 kv heads,
intermediate 28672): 1.71 GB per layer, 0.86 GB with --fp8.

--fp8 writes the projections (attention, MLP, experts, shared expert; never
norms, routers or the shared expert's gate) as transformers' fine-grained
FP8 does (what FineGrainedFP8Config then save_pretrained write):
float8_e4m3fn `weight` and float32 `weight_scale_inv` per 128x128 block
(amax / 448), and quantization_config {"quant_method": "fp8",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}.

Tensors go to shards of at most 4 GB (model-0000i-of-0000n.safetensors and
model.safetensors.index.json) when they do not fit one; a shard is written
as soon as it fills, so host memory holds one shard at a time.

Needs torch and safetensors (both on the GPU machine). Weights are scaled so
activations stay O(1) through the layers (uniform(-1,1)/sqrt(fan_in)); the
numbers are meaningless, the shapes and bytes are real.
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "max_position_embeddings": 8192, "vocab_size": 128256,
}
MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "torch_dtype": "bfloat16",
    "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
    "max_position_embeddings": 32768, "vocab_size": 32000, "num_local_experts": 8,
    "num_experts_per_tok": 2, "sliding_window": None,
}
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "torch_dtype": "bfloat16",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 1e6, "max_position_embeddings": 40960, "vocab_size": 151936, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "use_sliding_window": False, "sliding_window": None,
}
LLAMA3_70B = dict(CONFIG, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
                  num_key_value_heads=8)
QWEN2_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "torch_dtype": "bfloat16",
    "hidden_size": 2048, "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_attention_heads": 16, "num_key_value_heads": 16,
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 8192,
    "vocab_size": 151936, "num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
    "decoder_sparse_step": 1, "use_sliding_window": False, "sliding_window": 32768,
}


BLOCK = 128
SHARD_BYTES = 4 << 30


def quantize_fine_grained(w):
    """bf16 [out, in] (dims multiples of 128) as float8_e4m3fn codes and the
    float32 scale of each 128x128 block, amax / 448, as transformers' fine-
    grained FP8 quantizes; both on the host."""
    rows, cols = w.shape
    blocks = w.float().reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    codes = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.reshape(rows, cols).cpu(), scale.cpu()


class Shards:
    """Writes tensors to model.safetensors, or to 4 GB shards and their index
    when they do not fit one; add() moves the caller's tensors out."""

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.pending, self.pending_bytes, self.files, self.weight_map = {}, 0, [], {}
        os.makedirs(out_dir, exist_ok=True)

    def add(self, tensors):
        for name in list(tensors):
            t = tensors.pop(name)
            self.pending[name] = t
            self.pending_bytes += t.numel() * t.element_size()
            if self.pending_bytes >= SHARD_BYTES:
                self._write()

    def _write(self):
        if not self.pending:
            return
        file = f"shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, os.path.join(self.out_dir, file))
        self.weight_map.update({name: file for name in self.pending})
        self.files.append(file)
        self.pending, self.pending_bytes = {}, 0

    def finish(self):
        if not self.files:  # everything fits one file
            save_file(self.pending, os.path.join(self.out_dir, "model.safetensors"))
            return
        self._write()
        n = len(self.files)
        names = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(self.files)}
        for old, new in names.items():
            os.rename(os.path.join(self.out_dir, old), os.path.join(self.out_dir, new))
        index = {"metadata": {}, "weight_map": {k: names[v] for k, v in self.weight_map.items()}}
        with open(os.path.join(self.out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--head", action="store_true",
                        help="also write embed_tokens, the final norm and lm_head")
    parser.add_argument("--vocab", type=int,
                        help="rows of embed_tokens and lm_head (config's vocab_size; default the "
                             "model's)")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--mixtral", action="store_true",
                       help="Mixtral-8x7B layers (8 experts, top 2) instead of Llama-3-8B's")
    model.add_argument("--qwen3-moe", action="store_true", help="Qwen3-30B-A3B layers")
    model.add_argument("--qwen2-moe", action="store_true", help="Qwen1.5-MoE-A2.7B layers")
    model.add_argument("--llama3-70b", action="store_true", help="Llama-3-70B layers")
    parser.add_argument("--fp8", action="store_true",
                        help="projections in transformers' fine-grained FP8 (128x128 blocks)")
    args = parser.parse_args()
    base = (MIXTRAL if args.mixtral else QWEN3_MOE if args.qwen3_moe else
            QWEN2_MOE if args.qwen2_moe else LLAMA3_70B if args.llama3_70b else CONFIG)
    qwen = args.qwen3_moe or args.qwen2_moe
    vocab = args.vocab or base["vocab_size"]
    config = dict(base, num_hidden_layers=args.layers, vocab_size=vocab)
    if args.fp8:
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [BLOCK, BLOCK]}
    h = config["hidden_size"]
    i = config["moe_intermediate_size"] if qwen else config["intermediate_size"]
    head_dim = config.get("head_dim", h // config["num_attention_heads"])
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    gen = torch.Generator(device=args.device).manual_seed(0)

    def linear(out_features, in_features):
        w = torch.rand(out_features, in_features, generator=gen, device=args.device) * 2 - 1
        return (w / in_features ** 0.5).to(torch.bfloat16).cpu()

    tensors = {}
    shards = Shards(args.out_dir)

    def projection(name, out_features, in_features):
        """A projection's weight, in FP8 with --fp8 (quantized on the device)."""
        w = torch.rand(out_features, in_features, generator=gen, device=args.device) * 2 - 1
        w = (w / in_features ** 0.5).to(torch.bfloat16)
        if not args.fp8:
            tensors[name] = w.cpu()
            return
        tensors[name], tensors[name + "_scale_inv"] = quantize_fine_grained(w)

    def gated_mlp(prefix, width, names=("gate_proj", "up_proj", "down_proj")):
        """A SwiGLU block of `width` under `prefix`: gate, up, then down (the
        order the generator draws them in, so a checkpoint stays the same)."""
        gate, up, down = names
        projection(prefix + gate + ".weight", width, h)
        projection(prefix + up + ".weight", width, h)
        projection(prefix + down + ".weight", h, width)

    for layer in range(args.layers):
        p = f"model.layers.{layer}."
        tensors[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        projection(p + "self_attn.q_proj.weight", q, h)
        projection(p + "self_attn.k_proj.weight", kv, h)
        projection(p + "self_attn.v_proj.weight", kv, h)
        projection(p + "self_attn.o_proj.weight", h, q)
        if args.qwen2_moe:  # q/k/v biases
            for name, width in (("q", q), ("k", kv), ("v", kv)):
                tensors[p + f"self_attn.{name}_proj.bias"] = linear(1, width)[0]
        if args.qwen3_moe:  # each q and k head RMS-normalised
            tensors[p + "self_attn.q_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
            tensors[p + "self_attn.k_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
        if qwen:
            mlp = p + "mlp."
            tensors[mlp + "gate.weight"] = linear(config["num_experts"], h)
            for e in range(config["num_experts"]):
                gated_mlp(mlp + f"experts.{e}.", i)
            shared = config.get("shared_expert_intermediate_size", 0)
            if shared:
                gated_mlp(mlp + "shared_expert.", shared)
                tensors[mlp + "shared_expert_gate.weight"] = linear(1, h)
        elif args.mixtral:
            moe = p + "block_sparse_moe."
            tensors[moe + "gate.weight"] = linear(config["num_local_experts"], h)
            for e in range(config["num_local_experts"]):
                gated_mlp(moe + f"experts.{e}.", i, names=("w1", "w3", "w2"))
        else:
            gated_mlp(p + "mlp.", i)
        shards.add(tensors)
    if args.head:
        # Entries uniform in (-1, 1): rows of RMS ~0.6, activations O(1).
        embed = torch.rand(vocab, h, generator=gen, device=args.device) * 2 - 1
        tensors["model.embed_tokens.weight"] = embed.to(torch.bfloat16).cpu()
        tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        tensors["lm_head.weight"] = linear(vocab, h)
    shards.add(tensors)
    shards.finish()
    # Last, so that a checkpoint with a config.json is whole.
    with open(os.path.join(args.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"wrote {args.layers} layers to {args.out_dir}")


if __name__ == "__main__":
    main()
