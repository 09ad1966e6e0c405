"""examples/gguf_to_hf.py on small GGUF files written here with the gguf
package, as llama.cpp's converter writes them from a Hugging Face checkpoint
(no download, no server): the conversion must give back that checkpoint.

  - every tensor under its Hugging Face name with its values (exactly for
    F32, the gguf package's dequantization for Q8_0);
  - q_proj and k_proj rows back in Hugging Face's order, with grouped-query
    heads (k is reordered per KV head, q per query head);
  - config.json from the metadata; tie_word_embeddings where the GGUF has no
    output.weight;
  - a tokenizer.json whose BPE merges, digits and control tokens work;
  - what the converter does not take (another architecture, a head_dim
    partly rotated) refused with a line naming it.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import gguf  # these two: scripts/install-deps.sh installs them
import numpy as np
import pytest
import tokenizers

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from gguf_to_hf import gguf_rope_rows_from_hf_rows, hf_rows_from_gguf_rope_rows  # noqa: E402
from hf_checkpoint import Checkpoint  # noqa: E402

CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=50000.0)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["t h", "th e", "Ġ th", "Ġth e", "i s", "Ġ is"]


def llama_cpp_rows(w, heads):
    """llama.cpp's converter's reordering of q/k rows, restated from its
    description: within each head, the first half of the rows and the second
    half are interleaved (row i -> 2i, row i + d/2 -> 2i + 1)."""
    d = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        block = w[h * d:(h + 1) * d]
        out[h * d:(h + 1) * d:2] = block[: d // 2]
        out[h * d + 1:(h + 1) * d:2] = block[d // 2:]
    return out


def vocabulary():
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    merged = [a + b for a, b in (m.split(" ") for m in MERGES)]
    tokens = SPECIAL + alphabet + merged
    types = [3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL))
    return tokens, types


def hf_weights(rng, tied):
    c = CONFIG
    hidden, inter, heads, kv = (c["hidden_size"], c["intermediate_size"],
                                c["num_attention_heads"], c["num_key_value_heads"])
    d = hidden // heads
    vocab = len(vocabulary()[0])
    lin = lambda o, i: rng.normal(0, 1 / math.sqrt(i), (o, i)).astype(np.float32)  # noqa: E731
    norm = lambda: (1 + 0.1 * rng.normal(size=hidden)).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": rng.normal(size=(vocab, hidden)).astype(np.float32),
         "model.norm.weight": norm()}
    if not tied:
        w["lm_head.weight"] = lin(vocab, hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": norm(),
                  p + "self_attn.q_proj.weight": lin(heads * d, hidden),
                  p + "self_attn.k_proj.weight": lin(kv * d, hidden),
                  p + "self_attn.v_proj.weight": lin(kv * d, hidden),
                  p + "self_attn.o_proj.weight": lin(hidden, heads * d),
                  p + "post_attention_layernorm.weight": norm(),
                  p + "mlp.gate_proj.weight": lin(inter, hidden),
                  p + "mlp.up_proj.weight": lin(inter, hidden),
                  p + "mlp.down_proj.weight": lin(hidden, inter)})
    return w


GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
              "self_attn.q_proj.weight": "attn_q.weight",
              "self_attn.k_proj.weight": "attn_k.weight",
              "self_attn.v_proj.weight": "attn_v.weight",
              "self_attn.o_proj.weight": "attn_output.weight",
              "post_attention_layernorm.weight": "ffn_norm.weight",
              "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
              "mlp.down_proj.weight": "ffn_down.weight"}


def write_gguf(path, weights, arch="llama", rope_dims=None, quantize_embedding=False):
    """A GGUF of `weights` (Hugging Face names and layout) as llama.cpp's
    converter lays it out. Returns what a reader should get back for each
    Hugging Face name (the embedding through Q8_0 if quantized)."""
    c = CONFIG
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(1024)
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_rope_dimension_count(rope_dims or head_dim)
    tokens, types = vocabulary()
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    expected = dict(weights)
    for name, value in weights.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            target = f"blk.{i}.{GGUF_NAMES[rest]}"
            if rest == "self_attn.q_proj.weight":
                value = llama_cpp_rows(value, c["num_attention_heads"])
            elif rest == "self_attn.k_proj.weight":
                value = llama_cpp_rows(value, c["num_key_value_heads"])
        else:
            target = {"model.embed_tokens.weight": "token_embd.weight",
                      "model.norm.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"}[name]
        if target == "token_embd.weight" and quantize_embedding:
            q8 = gguf.GGMLQuantizationType.Q8_0
            codes = gguf.quants.quantize(value, q8)
            writer.add_tensor(target, codes, raw_dtype=q8)
            expected[name] = gguf.quants.dequantize(codes, q8).reshape(value.shape)
        else:
            writer.add_tensor(target, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def convert(source, out):
    return subprocess.run([sys.executable, str(EXAMPLES / "gguf_to_hf.py"), str(source), str(out)],
                          capture_output=True, text=True, timeout=120)


def test_row_reordering_round_trips_and_matches_llama_cpp():
    w = np.random.default_rng(0).normal(size=(3 * 8, 5))
    assert np.array_equal(gguf_rope_rows_from_hf_rows(w, 3), llama_cpp_rows(w, 3))
    assert np.array_equal(hf_rows_from_gguf_rope_rows(llama_cpp_rows(w, 3), 3), w)
    assert not np.array_equal(hf_rows_from_gguf_rope_rows(llama_cpp_rows(w, 3), 1), w)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_conversion_gives_back_the_checkpoint(tmp_path, tied):
    weights = hf_weights(np.random.default_rng(1), tied)
    expected = write_gguf(tmp_path / "m.gguf", weights, quantize_embedding=tied)
    proc = convert(tmp_path / "m.gguf", tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "hf/config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    for key, value in CONFIG.items():
        assert config[key] == value, key
    assert config["head_dim"] == 16 and config["model_type"] == "llama"
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 2)
    ckpt = Checkpoint(tmp_path / "hf")
    assert set(ckpt.names()) == set(expected)
    for name, value in expected.items():
        got = ckpt.float32(name)
        assert got.shape == value.shape and np.array_equal(got, value), name

    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "hf/tokenizer.json"))
    tokens = vocabulary()[0]
    encoded = tokenizer.encode("the 42 is<|im_end|>")
    assert encoded.tokens == ["the", "Ġ", "4", "2", "Ġis", "<|im_end|>"], encoded.tokens
    assert encoded.ids == [tokens.index(t) for t in encoded.tokens]
    assert tokenizer.decode(encoded.ids) == "the 42 is"


def test_refuses_what_it_does_not_convert(tmp_path):
    weights = hf_weights(np.random.default_rng(2), tied=True)
    write_gguf(tmp_path / "qwen.gguf", weights, arch="qwen2")
    proc = convert(tmp_path / "qwen.gguf", tmp_path / "out1")
    assert proc.returncode != 0 and "architecture 'qwen2'" in proc.stderr, proc.stderr
    write_gguf(tmp_path / "partial.gguf", weights, rope_dims=8)
    proc = convert(tmp_path / "partial.gguf", tmp_path / "out2")
    assert proc.returncode != 0 and "RoPE over 8 of 16" in proc.stderr, proc.stderr
    assert not (tmp_path / "out2").exists()
