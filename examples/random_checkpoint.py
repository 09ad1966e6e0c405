#!/usr/bin/env python3
"""Writes a small Llama checkpoint of random weights that layerserve serves
and the pipeline example generates with, without downloading anything:
config.json and model.safetensors holding every decoder layer and the parts
a client needs around them (the token embedding, the final norm and the LM
head). It has no tokenizer: give the example token ids (--prompt-ids).

  python3 examples/random_checkpoint.py models/tiny-llama
  layerserve --model-dir models/tiny-llama --layers 0:2 &
  layerserve --model-dir models/tiny-llama --layers 2:4 --grpc-port 8011 --metrics-port 8012 &
  python3 examples/pipeline_generate.py --model-dir models/tiny-llama \\
      --servers localhost:8001,localhost:8011 --prompt-ids 1,2,3 --max-new-tokens 8

The defaults (4 layers, hidden 256, 4 heads of 64, 2 KV heads, intermediate
512, vocabulary 1000, F32) load in a moment on a CPU and fit the CUDA
backend too (BF16 weights there: --dtype BF16). The weights are a fixed
function of --seed. Needs numpy only.
"""

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from hf_checkpoint import write_safetensors


def random_tensors(config, seed):
    """{Hugging Face name: float64 array}: linear weights ~ N(0, 1/in) (so
    the residual stream stays in range), norms ~ 1 + N(0, 0.1^2), the
    embedding ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, vocab = config["head_dim"], config["vocab_size"]

    def linear(out_features, in_features):
        return rng.normal(0.0, 1.0 / math.sqrt(in_features), (out_features, in_features))

    def norm(size):
        return 1.0 + 0.1 * rng.normal(size=size)

    tensors = {"model.embed_tokens.weight": rng.normal(size=(vocab, hidden)),
               "model.norm.weight": norm(hidden)}
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = linear(vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
            p + "post_attention_layernorm.weight": norm(hidden),
            p + "mlp.gate_proj.weight": linear(inter, hidden),
            p + "mlp.up_proj.weight": linear(inter, hidden),
            p + "mlp.down_proj.weight": linear(hidden, inter),
        })
    return tensors


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="the checkpoint directory to write (created)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=0, help="default: hidden / heads")
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--tied", action="store_true", help="the LM head is the embedding")
    p.add_argument("--dtype", choices=["F32", "BF16", "F16"], default="F32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        raise SystemExit(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim or args.hidden // args.heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": args.vocab,
        "tie_word_embeddings": args.tied,
        "torch_dtype": {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[args.dtype],
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", random_tensors(config, args.seed), args.dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    print(f"{out}: {args.layers} random layers, hidden {args.hidden}, vocabulary {args.vocab}, "
          f"{args.dtype} (seed {args.seed}); serve it with --model-dir {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
