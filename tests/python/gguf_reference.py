"""A float64 numpy model of a whole Llama-architecture GGUF, computed from the
GGUF's own tensors in llama.cpp's own conventions, for the real-model tests.

Nothing here goes through examples/gguf_to_hf.py: the tensors are read and
dequantized with the gguf package and used in GGUF order, q and k rows as
llama.cpp stores them, and RoPE rotates adjacent pairs (x[2i], x[2i+1]) as
llama.cpp's does for this architecture. A converted checkpoint served by
layerserve (rotate-half RoPE on Hugging Face's row order) must give what
this gives; `rope="half"` instead computes what a server would from GGUF
rows left in llama.cpp's order, which the tests use to show that they would
see the difference.
"""

import math

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class GgufLlama:
    def __init__(self, path):
        self.reader = GGUFReader(str(path))
        fields = self.reader.fields

        def meta(key, default=None):
            return fields[key].contents() if key in fields else default

        self.layers = int(meta("llama.block_count"))
        self.hidden = int(meta("llama.embedding_length"))
        self.heads = int(meta("llama.attention.head_count"))
        self.kv_heads = int(meta("llama.attention.head_count_kv", self.heads))
        self.head_dim = self.hidden // self.heads
        self.eps = float(meta("llama.attention.layer_norm_rms_epsilon"))
        self.theta = float(meta("llama.rope.freq_base", 10000.0))
        self.eos = meta("tokenizer.ggml.eos_token_id")
        self.tensors = {t.name: t for t in self.reader.tensors}
        self._cache = {}

    def weight(self, name):
        """A tensor dequantized, in float64, [rows, columns] as GGUF stores
        it (rows: the output features). Kept once read: converting on every
        use would cost more than the products (all of SmolLM2-135M: 1.1 GB)."""
        if name not in self._cache:
            t = self.tensors[name]
            shape = tuple(int(d) for d in reversed(t.shape))
            self._cache[name] = np.asarray(dequantize(t.data, t.tensor_type),
                                           dtype=np.float64).reshape(shape)
        return self._cache[name]

    def embed(self, ids):
        return self.weight("token_embd.weight")[np.asarray(ids)]

    def lm_head(self):
        name = "output.weight" if "output.weight" in self.tensors else "token_embd.weight"
        return self.weight(name)

    def rope(self, x, mode):
        """x [T, heads, head_dim] at positions 0..T-1."""
        t, _, d = x.shape
        inv_freq = 1.0 / self.theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
        angles = np.outer(np.arange(t, dtype=np.float64), inv_freq)[:, None, :]  # [T, 1, d/2]
        cos, sin = np.cos(angles), np.sin(angles)
        if mode == "pairs":  # llama.cpp: (x[2i], x[2i+1]) rotated by angle i
            a, b = x[..., 0::2], x[..., 1::2]
            out = np.empty_like(x)
            out[..., 0::2] = a * cos - b * sin
            out[..., 1::2] = a * sin + b * cos
            return out
        assert mode == "half", mode  # Hugging Face: (x[i], x[i + d/2])
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)

    def rms_norm(self, x, weight):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def layer(self, x, i, rope="pairs"):
        """Decoder layer i over x [T, hidden] float64."""
        w = lambda name: self.weight(f"blk.{i}.{name}.weight")  # noqa: E731
        t = x.shape[0]
        n = self.rms_norm(x, w("attn_norm"))
        q = self.rope((n @ w("attn_q").T).reshape(t, self.heads, self.head_dim), rope)
        k = self.rope((n @ w("attn_k").T).reshape(t, self.kv_heads, self.head_dim), rope)
        v = (n @ w("attn_v").T).reshape(t, self.kv_heads, self.head_dim)
        group = self.heads // self.kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(self.head_dim)
        scores = np.where(np.tril(np.ones((t, t), dtype=bool)), scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t, self.heads * self.head_dim)
        h = x + attn @ w("attn_output").T
        m = self.rms_norm(h, w("ffn_norm"))
        gate, up = m @ w("ffn_gate").T, m @ w("ffn_up").T
        return h + (gate / (1.0 + np.exp(-gate)) * up) @ w("ffn_down").T

    def layers_over(self, x, first, last, rope="pairs"):
        for i in range(first, last):
            x = self.layer(x, i, rope)
        return x

    def logits(self, ids):
        """float64 logits of the token after `ids`."""
        h = self.layers_over(self.embed(ids), 0, self.layers)[-1]
        h = self.rms_norm(h, self.weight("output_norm.weight"))
        return self.lm_head() @ h

    def greedy(self, prompt, new_tokens, stop_at_eos=True):
        """(greedy token ids, the smallest relative lead of the best logit
        over the second best across the steps)."""
        ids, out, margin = list(prompt), [], math.inf
        for _ in range(new_tokens):
            logits = self.logits(ids)
            top2 = np.sort(logits)[-2:]
            margin = min(margin, (top2[1] - top2[0]) / np.std(logits))
            token = int(np.argmax(logits))
            out.append(token)
            ids.append(token)
            if stop_at_eos and token == self.eos:
                break
        return out, margin
