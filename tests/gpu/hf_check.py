"""End to end against Hugging Face itself, on the GPU machine: for each model
family named, a random small ...ForCausalLM saved with save_pretrained
(whatever layout the installed transformers writes), layers 1:3 of it served
by layerserve, and the same layers run by transformers' own decoder layers.

The truth is HF in float64 on the CPU, with the RoPE frequencies it computes
in float32 (see hf_layers); HF in float32 on the GPU is printed beside it.
HF in bf16 on the GPU shows what bf16 costs on this model (routing included:
a token whose top-k nearly ties can pick other experts in bf16); the CUDA
backend, which computes in bf16, must be no further from the truth than 1.5x
that, and the CPU backend (float32) must agree closely. What is compared is
the layers' contribution y - x (see check).

    python3 tests/gpu/hf_check.py BIN_DIR OUT_DIR [FAMILY ...]

FAMILY is one of FAMILIES below (default: all). Exit status 0 when every
family passes on every backend it lists. Needs torch and transformers.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from layerserve_process import LayerserveProcess  # noqa: E402

SPAN = (1, 3)
HIDDEN = 512
# Shapes every family shares: 8 heads of 64 over 4 KV heads, three layers.
COMMON = dict(hidden_size=HIDDEN, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
              num_hidden_layers=3, vocab_size=64, rms_norm_eps=1e-5, max_position_embeddings=4096)


def config_of(family):
    """The family's transformers config class and its arguments. Routing is
    covered both ways: qwen2_moe keeps the raw top-k softmax weights (its
    default norm_topk_prob=False), qwen3_moe renormalises them (as the
    published Qwen3-30B-A3B does), Mixtral always renormalises."""
    t = transformers
    if family == "mixtral":
        return t.MixtralConfig, dict(intermediate_size=768, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=None)
    if family == "qwen2_moe":
        return t.Qwen2MoeConfig, dict(intermediate_size=1024, moe_intermediate_size=256,
                                      shared_expert_intermediate_size=512, num_experts=8,
                                      num_experts_per_tok=2, norm_topk_prob=False)
    if family == "qwen3":
        return t.Qwen3Config, dict(intermediate_size=768)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig, dict(intermediate_size=1024, moe_intermediate_size=256,
                                      num_experts=8, num_experts_per_tok=4, norm_topk_prob=True)
    raise SystemExit(f"unknown family {family}; one of {', '.join(FAMILIES)}")


# Each family and the backends that serve it.
FAMILIES = {"mixtral": ("cuda", "cpu"), "qwen2_moe": ("cuda", "cpu"), "qwen3": ("cuda", "cpu"),
            "qwen3_moe": ("cuda", "cpu")}


def make_model(family, directory):
    config_class, extra = config_of(family)
    config = config_class(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    # Norm weights away from exactly 1, so a norm the server skipped shows; the
    # same for biases away from exactly 0.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model


def saved_layout(directory):
    index = Path(directory) / "model.safetensors.index.json"
    if index.exists():
        names = json.loads(index.read_text())["weight_map"]
    else:
        from safetensors import safe_open
        with safe_open(str(Path(directory) / "model.safetensors"), "pt") as f:
            names = list(f.keys())
    return sorted(n for n in names if n.startswith("model.layers.1."))


def hf_layers(model, x, dtype, device):
    """Layers SPAN of `model` over x [B, T, hidden] in `dtype`, on `device`.
    float64 runs the experts through transformers' eager loop (its default,
    torch._grouped_mm, takes 16- and 32-bit floats only)."""
    model = model.to(device=device, dtype=dtype)
    # Module.to() casts the rotary embedding's inv_freq buffer too, and a
    # model once cast to bf16 (to be saved as a bf16 checkpoint) keeps
    # frequencies rounded to 8 bits, which move every angle past position 0
    # (by 1.3e-2 in cos at position 32; the layers' output by 2e-4 to 8e-4).
    # Transformers computes them in float32 (as a model loaded with
    # from_pretrained keeps them), and so does the server: recompute them.
    rope = model.config.rope_parameters
    assert rope["rope_type"] == "default", rope
    dim = model.config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    model.model.rotary_emb.inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
    if hasattr(model.config, "_experts_implementation"):
        if not hasattr(model, "experts_default"):
            model.experts_default = model.config._experts_implementation
        model.config._experts_implementation = ("eager" if dtype == torch.float64
                                                else model.experts_default)
    h = torch.from_numpy(x).to(device, dtype)
    pos = torch.arange(x.shape[1], device=device).unsqueeze(0).expand(x.shape[0], -1)
    pe = model.model.rotary_emb(h, pos)
    with torch.inference_mode():
        for layer in model.model.layers[SPAN[0]:SPAN[1]]:
            out = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
            h = out[0] if isinstance(out, tuple) else out
    return h.to(torch.float64).cpu().numpy()


def served(bin_dir, out, directory, backend, x):
    np.save(out / "x.npy", x)
    with LayerserveProcess(Path(bin_dir) / "layerserve",
                           [f"--model-dir={directory}", f"--layers={SPAN[0]}:{SPAN[1]}",
                            f"--backend={backend}"], out / f"server_{backend}.log") as server:
        subprocess.run([Path(bin_dir) / "layerctl", "infer", f"--url={server.grpc_url}",
                        f"--model={server.model}", f"--input={out / 'x.npy'}",
                        f"--output={out / f'y_{backend}.npy'}"], check=True)
    return np.load(out / f"y_{backend}.npy").astype(np.float64)


def rel_rms(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2)))


def check(family, bin_dir, out):
    """Prints one line per backend and input shape ("FAMILY BACKEND: ...");
    True when all pass. What is compared is the layers' contribution y - x:
    the residual stream passes through unchanged and would otherwise hide an
    error in the attention or the MLP by a factor of ten or more here."""
    out.mkdir(parents=True, exist_ok=True)
    directory = out / f"tiny-{family}"
    model = make_model(family, directory)
    print(f"{family}: save_pretrained wrote layer 1 as:", ", ".join(saved_layout(directory)))
    config = json.loads((directory / "config.json").read_text())
    print(f"{family}: config.json rope:", {k: v for k, v in config.items() if "rope" in k})
    passed = True
    # 33 tokens in 2 sequences; and 4 of one token, where RoPE is the identity
    # and attention returns v.
    for shape in ((2, 33), (4, 1)):
        x = np.random.default_rng(1).normal(size=(*shape, HIDDEN)).astype(np.float32)
        truth = hf_layers(model, x, torch.float64, "cpu") - x
        bf16_cost = rel_rms(hf_layers(model, x, torch.bfloat16, "cuda") - x, truth)
        fp32_cost = rel_rms(hf_layers(model, x, torch.float32, "cuda") - x, truth)
        print(f"{family} HF float32 on cuda: [B, T] = {list(shape)}: relative rms error of y - x "
              f"vs HF float64 {fp32_cost:.3g}")
        for backend in FAMILIES[family]:
            limit = 1.5 * bf16_cost + 1e-3 if backend == "cuda" else 1e-4
            try:
                err = rel_rms(served(bin_dir, out, directory, backend, x) - x, truth)
            except Exception as e:  # a refused model or a failed call: report, go on
                print(f"{family} {backend}: FAILED ({e}; see {out}/server_{backend}.log)")
                passed = False
                continue
            ok = err <= limit
            passed &= ok
            print(f"{family} {backend}: [B, T] = {list(shape)}: relative rms error of y - x vs HF "
                  f"float64 {err:.3g} (limit {limit:.3g}; HF bf16's own {bf16_cost:.3g}) "
                  f"{'ok' if ok else 'FAILED'}")
    return passed


def main():
    bin_dir, out = sys.argv[1], Path(sys.argv[2])
    families = sys.argv[3:] or list(FAMILIES)
    print("transformers", transformers.__version__, "torch", torch.__version__)
    failed = [f for f in families if not check(f, bin_dir, out / f)]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
