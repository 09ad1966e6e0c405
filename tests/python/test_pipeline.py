"""examples/pipeline_generate.py end to end: a small random Llama checkpoint
(with the embedding, final norm and LM head a client needs) served by two
layerserve processes, each one span of its layers, and greedy generation
through both, run as a user runs the example.

What must hold: generating with sessions (prefill, then one token a step)
gives the same tokens as sending the whole prefix every step (--stateless),
and both the tokens of a float64 numpy model (llama_numpy) of the whole
checkpoint, which checks the example's own embedding, norm and LM head; the
servers free the sessions when the generation ends, also when it stops early
at the model's end-of-sequence token.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from layerserve_process import sample
from llama_numpy import decoder_layers, make_checkpoint, stored_values, write_safetensors

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "pipeline_generate.py"
EXAMPLE_TIMEOUT_S = 120
NEW_TOKENS = 12
PROMPT = [3, 14, 15, 92, 65]
KV_CACHE_FLAGS = ("--kv-cache-memory=16MiB",)

UNTIED = dict(
    config=dict(model_type="llama", hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=97,
                tie_word_embeddings=False, torch_dtype="float32"),
    weight_dtype="F32", spans=("0:2", "2:4"))
# bfloat16 weights and no lm_head.weight: the example must read bf16 and use
# the embedding as the LM head.
TIED = dict(
    config=dict(model_type="llama", hidden_size=64, intermediate_size=96,
                num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=3,
                rms_norm_eps=1e-6, rope_theta=500000.0, vocab_size=101,
                tie_word_embeddings=True, torch_dtype="bfloat16"),
    weight_dtype="BF16", spans=("0:1", "1:3"))


class Served:
    """A checkpoint, its float64 reference and the two servers of its spans."""

    def __init__(self, directory, variant, start_server, seed):
        config = variant["config"]
        rng = np.random.default_rng(seed)
        hidden, vocab = config["hidden_size"], config["vocab_size"]
        ends = {
            "model.embed_tokens.weight": rng.normal(size=(vocab, hidden)),
            "model.norm.weight": 1.0 + 0.1 * rng.normal(size=hidden),
        }
        if not config["tie_word_embeddings"]:
            ends["lm_head.weight"] = rng.normal(0.0, 1.0 / math.sqrt(hidden), (vocab, hidden))
        self.layers = make_checkpoint(directory, config, variant["weight_dtype"], seed=seed,
                                      extra_tensors=ends)
        self.ends = {name: stored_values(v, variant["weight_dtype"]) for name, v in ends.items()}
        self.config, self.directory = config, Path(directory)
        self.servers = [start_server(f"--model-dir={directory}", f"--layers={span}",
                                     *KV_CACHE_FLAGS) for span in variant["spans"]]
        self.urls = ",".join(s.grpc_url for s in self.servers)

    def reference(self, prompt, new_tokens):
        """Greedy tokens of the whole model in float64, and the smallest gap
        between the best and second-best logit over the steps (relative to
        the logits' spread), which says how safe comparing argmaxes is."""
        embed = self.ends["model.embed_tokens.weight"]
        lm_head = self.ends.get("lm_head.weight", embed)
        eps = self.config["rms_norm_eps"]
        ids, out, margin = list(prompt), [], math.inf
        for _ in range(new_tokens):
            h = decoder_layers(embed[ids][None], self.layers, self.config)[0, -1]
            h = h / np.sqrt(np.mean(h * h) + eps) * self.ends["model.norm.weight"]
            logits = lm_head @ h
            top2 = np.sort(logits)[-2:]
            margin = min(margin, (top2[1] - top2[0]) / np.std(logits))
            token = int(np.argmax(logits))
            out.append(token)
            ids.append(token)
        return out, margin

    def session_counts(self):
        """[(open, freed by end)] of each server."""
        counts = []
        for server in self.servers:
            samples = server.samples()
            counts.append((sample(samples, "layerserve_sessions_open", model=server.model),
                           sample(samples, "layerserve_sessions_freed_total", model=server.model,
                                  reason="end")))
        return counts


def run_example(served, tmp_path, *args, model_dir=None):
    """Runs the example as a user would; returns its JSON result."""
    result = tmp_path / f"result-{len(list(tmp_path.iterdir()))}.json"
    argv = [sys.executable, str(EXAMPLE), "--model-dir", str(model_dir or served.directory),
            "--servers", served.urls, "--json", str(result), *map(str, args)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{' '.join(argv)}\nexited with {proc.returncode}:\n{proc.stdout}{proc.stderr}")
    assert "decode steps" in proc.stdout and "token ids:" in proc.stdout, proc.stdout
    return json.loads(result.read_text()), proc.stdout


@pytest.fixture(scope="module")
def untied(tmp_path_factory, start_server):
    return Served(tmp_path_factory.mktemp("ckpt") / "tiny-gen", UNTIED, start_server, seed=21)


@pytest.fixture(scope="module")
def tied(tmp_path_factory, start_server):
    return Served(tmp_path_factory.mktemp("ckpt") / "tiny-gen-tied", TIED, start_server, seed=22)


def test_sessions_and_stateless_generate_the_reference_tokens(untied, tmp_path):
    want, margin = untied.reference(PROMPT, NEW_TOKENS)
    # float32 serving against float64 picks the same argmax when the best
    # logit leads by far more than float32 rounding (this checkpoint: fixed).
    assert margin > 1e-3, f"a near tie in the reference ({margin:.2g}): pick another seed"
    assert len(set(want)) > 1, f"the reference generates one token only: {want}"

    before = untied.session_counts()
    sessions, stdout = run_example(untied, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT)),
                                   "--max-new-tokens", NEW_TOKENS)
    assert sessions["mode"] == "sessions"
    assert sessions["prompt_ids"] == PROMPT
    assert sessions["decode_steps"] == NEW_TOKENS - 1
    assert sessions["steps_per_s"] > 0
    after = untied.session_counts()
    for server, (open_before, ended_before), (open_after, ended_after) in zip(
            untied.servers, before, after):
        assert (open_after, ended_after - ended_before) == (open_before, 1), (
            f"server {server.layers}: sessions open {open_before} -> {open_after}, "
            f"ended {ended_after - ended_before} (want 1)")

    stateless, _ = run_example(untied, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT)),
                               "--max-new-tokens", NEW_TOKENS, "--stateless")
    assert stateless["mode"] == "stateless"
    assert untied.session_counts() == after, "--stateless used sessions"

    assert sessions["generated_ids"] == stateless["generated_ids"], (
        f"sessions {sessions['generated_ids']} != stateless {stateless['generated_ids']}")
    assert sessions["generated_ids"] == want, (
        f"served {sessions['generated_ids']} != float64 reference {want}\n{stdout}")


def test_bf16_wire_sessions_match_stateless(untied, tmp_path):
    args = ("--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 8,
            "--datatype", "BF16")
    sessions, _ = run_example(untied, tmp_path, *args)
    stateless, _ = run_example(untied, tmp_path, *args, "--stateless")
    assert sessions["generated_ids"] == stateless["generated_ids"]
    assert len(sessions["generated_ids"]) == 8


def test_tied_bf16_checkpoint(tied, tmp_path):
    want, margin = tied.reference(PROMPT, 6)
    assert margin > 1e-2, f"a near tie in the reference ({margin:.2g}): pick another seed"
    sessions, _ = run_example(tied, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT)),
                              "--max-new-tokens", 6)
    stateless, _ = run_example(tied, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT)),
                               "--max-new-tokens", 6, "--stateless")
    assert sessions["generated_ids"] == stateless["generated_ids"] == want


def test_stops_at_eos_and_frees_the_sessions(untied, tmp_path):
    """With eos_token_id in config.json generation stops there; the client
    ends the sessions itself, since its last step did not know it was last."""
    want, _ = untied.reference(PROMPT, NEW_TOKENS)
    eos = want[3]
    stop = want.index(eos) + 1
    model_dir = tmp_path / untied.directory.name  # the servers' model name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(dict(untied.config, eos_token_id=eos)))
    (model_dir / "model.safetensors").symlink_to(untied.directory / "model.safetensors")

    before = untied.session_counts()
    result, _ = run_example(untied, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT)),
                            "--max-new-tokens", NEW_TOKENS, model_dir=model_dir)
    assert result["generated_ids"] == want[:stop]
    after = untied.session_counts()
    assert [(o, e - eb) for (o, e), (_, eb) in zip(after, before)] == [
        (o, 1) for o, _ in before], f"sessions not freed: {before} -> {after}"

    result, _ = run_example(untied, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT)),
                            "--max-new-tokens", NEW_TOKENS, "--ignore-eos", model_dir=model_dir)
    assert result["generated_ids"] == want


def test_sharded_checkpoint(untied, tmp_path):
    """The example finds the embedding, norm and LM head through
    model.safetensors.index.json when the checkpoint is sharded."""
    model_dir = tmp_path / untied.directory.name
    model_dir.mkdir()
    (model_dir / "config.json").symlink_to(untied.directory / "config.json")
    shards = {"model-00001-of-00002.safetensors": ["model.embed_tokens.weight"],
              "model-00002-of-00002.safetensors": ["model.norm.weight", "lm_head.weight"]}
    for file, tensors in shards.items():
        write_safetensors(model_dir / file, {n: untied.ends[n] for n in tensors}, "F32")
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    want, _ = untied.reference(PROMPT, 4)
    result, _ = run_example(untied, tmp_path, "--prompt-ids", ",".join(map(str, PROMPT)),
                            "--max-new-tokens", 4, model_dir=model_dir)
    assert result["generated_ids"] == want


def test_text_prompt_through_tokenizer_json(untied, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {f"w{i}": i for i in range(untied.config["vocab_size"])}
    tokenizer = tokenizers.Tokenizer(WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    model_dir = tmp_path / untied.directory.name
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        (model_dir / name).symlink_to(untied.directory / name)
    tokenizer.save(str(model_dir / "tokenizer.json"))

    want, _ = untied.reference(PROMPT, 5)
    result, stdout = run_example(untied, tmp_path, "--prompt",
                                 " ".join(f"w{i}" for i in PROMPT), "--max-new-tokens", 5,
                                 model_dir=model_dir)
    assert result["prompt_ids"] == PROMPT
    assert result["generated_ids"] == want
    assert result["text"] == " ".join(f"w{i}" for i in want), result["text"]
    assert "text:" in stdout


def test_the_documented_random_checkpoint(start_server, tmp_path):
    """examples/random_checkpoint.py with its defaults, as examples/README.md
    runs it: two servers of its spans and the example with token ids give
    the float64 model of what the command wrote (read back from its file)."""
    directory = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, str(EXAMPLES / "random_checkpoint.py"), str(directory)],
                   check=True, capture_output=True, timeout=EXAMPLE_TIMEOUT_S)
    config = json.loads((directory / "config.json").read_text())
    sys.path.insert(0, str(EXAMPLES))
    from hf_checkpoint import Checkpoint

    ckpt = Checkpoint(directory)
    read = lambda name: ckpt.float32(name).astype(np.float64)  # noqa: E731
    layers = [{n[len(f"model.layers.{i}."):]: read(n) for n in ckpt.names()
               if n.startswith(f"model.layers.{i}.")} for i in range(config["num_hidden_layers"])]
    embed, norm = read("model.embed_tokens.weight"), read("model.norm.weight")
    lm_head = read("lm_head.weight")
    ids, want, margin = list(PROMPT), [], math.inf
    for _ in range(8):
        h = decoder_layers(embed[ids][None], layers, config)[0, -1]
        logits = lm_head @ (h / np.sqrt(np.mean(h * h) + config["rms_norm_eps"]) * norm)
        top2 = np.sort(logits)[-2:]
        margin = min(margin, (top2[1] - top2[0]) / np.std(logits))
        want.append(int(np.argmax(logits)))
        ids.append(want[-1])
    assert margin > 1e-3 and len(set(want)) > 1, (want, margin)

    servers = [start_server(f"--model-dir={directory}", f"--layers={span}", *KV_CACHE_FLAGS)
               for span in ("0:2", "2:4")]
    result = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--model-dir", str(directory),
                           "--servers", ",".join(s.grpc_url for s in servers),
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8",
                           "--json", str(result)],
                          capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(result.read_text())["generated_ids"] == want
    for server in servers:
        assert server.stop() == 0, server.log_text()
