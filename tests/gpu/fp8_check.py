"""FP8 checkpoints written by transformers itself, served by layerserve, on the
GPU machine: for each model family, a random small model saved in BF16,
loaded again with FineGrainedFP8Config (transformers quantizes it on the GPU)
and saved with save_pretrained, so the checkpoint holds what transformers
writes: float8_e4m3fn weights, float32 weight_scale_inv per 128x128 block and
its quantization_config. Layers 1:3 of it are served by layerserve.

The oracle is a float64 forward over the saved tensors (tests/python/
llama_numpy.py) with the activations quantized as the format says, per token
and 128-channel group (W8A8): transformers' own FP8 forward loads its kernels
from the Hub, which this machine cannot reach. The weight-only forward (the
same weights, activations unquantized, W8A16) is printed beside it; the two
differ by a few percent, so a server that skipped or misplaced the activation
quantization fails. What is compared is the layers' contribution y - x.

The CPU backend must be within 1.6e-2 of the W8A8 oracle (BF16's bound
elsewhere; without an e4m3 tie that float32 and float64 round apart it lands
near 1e-6, and one such tie moves the rest of its layer by ~1e-3) and at
most a quarter of its distance to the weight-only forward. The CUDA backend
(the FP8 GEMM, grouped for the experts) must be within 1.5x the W8A8-to-
weight-only distance and 8e-2: no closer, for a reason every bf16 server shares
(vLLM and transformers quantize bf16 activations too). Quantization is
discontinuous, so the bf16 rounding of each quantized input and the bf16
noise upstream of it move a few percent of the elements across an e4m3
midpoint, a one-code step each, which leaves the output about as far from
the oracle as W8A8 is from weight-only (tests/gpu/cuda_fp8_test.cc holds
the discriminating checks: element-level kernel tests and a static-scale
model).

    python3 tests/gpu/fp8_check.py BIN_DIR OUT_DIR [FAMILY ...]
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from hf_check import COMMON, HIDDEN, SPAN, rel_rms, served  # noqa: E402
from layerserve_process import ServerStartError  # noqa: E402
from llama_numpy import decoder_layers, quantize_fp8  # noqa: E402

GROUP = 128


def config_of(family):
    t = transformers
    if family == "llama":
        return t.LlamaConfig, dict(intermediate_size=768)
    if family == "qwen3":
        return t.Qwen3Config, dict(intermediate_size=768)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig, dict(intermediate_size=1024, moe_intermediate_size=256,
                                      num_experts=8, num_experts_per_tok=4, norm_topk_prob=True)
    if family == "mixtral":
        return t.MixtralConfig, dict(intermediate_size=768, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=None)
    if family == "qwen2_moe":
        return t.Qwen2MoeConfig, dict(intermediate_size=1024, moe_intermediate_size=256,
                                      shared_expert_intermediate_size=512, num_experts=8,
                                      num_experts_per_tok=2, norm_topk_prob=False)
    raise SystemExit(f"unknown family {family}")


FAMILIES = ("llama", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe")
# Checkpoints both backends refuse, and the words of the refusal: transformers
# also quantizes Qwen2-MoE's one-row shared_expert_gate (reporting its
# weight_scale_inv as MISSING and newly initialized while it quantizes), a
# projection the server does not take in FP8.
REFUSED = {"qwen2_moe": "shared_expert_gate is FP8"}


def write_fp8_checkpoint(family, out):
    """The BF16 model, and the FP8 checkpoint transformers writes of it."""
    config_class, extra = config_of(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_class(**COMMON, **extra))
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    bf16_dir, fp8_dir = out / "bf16", out / "fp8"
    model.save_pretrained(bf16_dir)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        bf16_dir, quantization_config=transformers.FineGrainedFP8Config(), device_map="cuda")
    quantized.save_pretrained(fp8_dir)
    return fp8_dir


def saved_tensors(directory, layer):
    """Layer `layer`'s tensors as saved: {name after the layer prefix: torch tensor}."""
    prefix = f"model.layers.{layer}."
    index = directory / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else ["model.safetensors"])
    tensors = {}
    for file in files:
        with safe_open(str(directory / file), "pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    tensors[name[len(prefix):]] = f.get_tensor(name)
    return tensors


def dequantize(weight, scale_inv):
    """weight (float8_e4m3fn [..., rows, cols]) times the scale of its 128x128
    block, in float64."""
    w = weight.to(torch.float64)
    s = scale_inv.to(torch.float64)
    s = s.repeat_interleave(GROUP, dim=-2)[..., :w.shape[-2], :]
    s = s.repeat_interleave(GROUP, dim=-1)[..., :w.shape[-1]]
    return (w * s).numpy()


def oracle_layer(tensors):
    """llama_numpy's weight dict for one saved layer and the names of its
    FP8 projections (as llama_numpy's qdq names them)."""
    w, fp8 = {}, set()
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            w[name] = dequantize(t, tensors[name + "_scale_inv"])
            fp8.add(name.removesuffix(".weight"))
        else:
            w[name] = t.to(torch.float64).numpy()
    # Experts: stacked as llama_numpy's moe.w1 / w3 / w2, from any of the
    # saved layouts (fused, Qwen's per-expert names, Mixtral's).
    def stack(fmt):
        parts, e = [], 0
        while fmt.format(e) in w:
            parts.append(w.pop(fmt.format(e)))
            e += 1
        return np.stack(parts) if parts else None
    for router, expert, names in (
            ("mlp.gate.weight", "mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj")),
            ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{}.", ("w1", "w3", "w2"))):
        if router not in w:
            continue
        w["moe.router"] = w.pop(router)
        if "mlp.experts.gate_up_proj" in w:
            gate_up = w.pop("mlp.experts.gate_up_proj")
            half = gate_up.shape[1] // 2
            w["moe.w1"], w["moe.w3"] = gate_up[:, :half], gate_up[:, half:]
            w["moe.w2"] = w.pop("mlp.experts.down_proj")
            experts_fp8 = "mlp.experts.gate_up_proj" in fp8
        else:
            experts_fp8 = (expert.format(0) + names[0]) in fp8
            for part, name in zip(("w1", "w3", "w2"), names):
                w[f"moe.{part}"] = stack(expert + name + ".weight")
        if experts_fp8:
            fp8 |= {"moe.w1", "moe.w2"}
    for part, name in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        key = f"mlp.shared_expert.{name}.weight"
        if key in w:
            w[f"moe.shared_{part}"] = w.pop(key)
            if f"mlp.shared_expert.{name}" in fp8:
                fp8.add(f"moe.shared_{part}")
    if "mlp.shared_expert_gate.weight" in w:
        w["moe.shared_gate"] = w.pop("mlp.shared_expert_gate.weight")
    return w, fp8


def check(family, bin_dir, out):
    out.mkdir(parents=True, exist_ok=True)
    directory = write_fp8_checkpoint(family, out)
    config = json.loads((directory / "config.json").read_text())
    print(f"{family}: quantization_config {json.dumps(config.get('quantization_config'))}")
    # transformers 5 writes rope_theta inside rope_parameters (Mixtral's is
    # 1e6); llama_numpy reads the top-level key.
    config.setdefault("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta", 1e4))
    if family in REFUSED:
        try:
            served(bin_dir, out, directory, "cpu",
                   np.random.default_rng(2).normal(size=(1, 1, HIDDEN)).astype(np.float32))
            print(f"{family} cpu: FAILED (served a checkpoint it should refuse)")
            return False
        except ServerStartError:
            log = (out / "server_cpu.log").read_text()
            ok = REFUSED[family] in log
            line = next((l for l in log.splitlines() if "ERROR" in l), "(no error line)")
            print(f"{family} cpu: refused {'ok' if ok else 'FAILED'}: {line.strip()}")
            return ok
    layers, fp8 = [], set()
    for layer in range(*SPAN):
        tensors = saved_tensors(directory, layer)
        if layer == SPAN[0]:
            print(f"{family}: layer {layer} as saved: " + ", ".join(
                f"{n} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                for n, t in sorted(tensors.items()) if "experts." not in n or ".0." in n))
        w, names = oracle_layer(tensors)
        layers.append(w)
        fp8 |= names
    print(f"{family}: FP8 projections: {', '.join(sorted(fp8))}")

    def qdq(v, name):
        return quantize_fp8(v, group=GROUP) if name in fp8 else v

    passed = True
    for backend in ("cpu", "cuda"):
        for shape in ((2, 33), (4, 1)):
            x = np.random.default_rng(1).normal(size=(*shape, HIDDEN)).astype(np.float32)
            w8a8 = decoder_layers(x, layers, config, qdq=qdq) - x
            w8a16 = decoder_layers(x, layers, config) - x
            try:
                y = served(bin_dir, out, directory, backend, x) - x
            except (ServerStartError, subprocess.CalledProcessError) as e:
                print(f"{family} {backend}: FAILED ({e}; see {out}/server_{backend}.log)")
                passed = False
                continue
            err, err_weight_only, gap = rel_rms(y, w8a8), rel_rms(y, w8a16), rel_rms(w8a8, w8a16)
            ok = (err <= 1.6e-2 and err <= err_weight_only / 4 if backend == "cpu"
                  else err <= 8e-2 and err <= 1.5 * gap)
            passed &= ok
            print(f"{family} {backend}: [B, T] = {list(shape)}: relative rms error of y - x vs the W8A8 "
                  f"oracle {err:.3g}, vs weight-only {err_weight_only:.3g} (W8A8 vs weight-only "
                  f"{gap:.3g}) {'ok' if ok else 'FAILED'}")
    return passed


def main():
    bin_dir, out = sys.argv[1], Path(sys.argv[2])
    families = sys.argv[3:] or list(FAMILIES)
    print("transformers", transformers.__version__, "torch", torch.__version__)
    failed = [f for f in families if not check(f, bin_dir, out / f)]
    print("fp8_check:", "FAILED " + ", ".join(failed) if failed else "all passed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
