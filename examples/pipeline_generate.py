#!/usr/bin/env python3
"""Greedy generation through a Llama-family model split over layerserve servers.

Each layerserve runs one span of decoder layers (--layers A:B) and keeps, per
session, the keys and values of every token it has seen. This client does
what layerserve does not: the token embedding before the first span, and the
final norm and LM head after the last, read from the checkpoint's own
safetensors with numpy. It then generates greedily:

  prefill   the prompt's embeddings go through every server in layer order,
            with sequence_start (each server opens a session under one id);
  decode    one new token per step: only that token's embedding goes through
            the servers, which attend over what their sessions hold;
  end       the last step carries sequence_end, and the servers free the
            sessions' KV cache.

With --stateless the client sends no sequence parameters and instead sends the
whole prefix every step (what a server without sessions needs); both modes
must produce the same tokens, and the steps/s they print show what sessions
save. Example, a 32-layer checkpoint on two servers:

  layerserve --model-dir /models/llama --layers 0:16  --grpc-port 8001 --metrics-port 8002 &
  layerserve --model-dir /models/llama --layers 16:32 --grpc-port 8011 --metrics-port 8012 &
  python3 examples/pipeline_generate.py --model-dir /models/llama \\
      --servers localhost:8001,localhost:8011 --prompt "The capital of France is" \\
      --max-new-tokens 32

Needs numpy and tritonclient[grpc]; `tokenizers` (for --prompt and decoded
text, when the checkpoint has tokenizer.json) and ml_dtypes (for --datatype
BF16 with tritonclient r26.06 or later) are optional. See examples/README.md.
"""

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

# The safetensors reader, beside this file (installed with it).
from hf_checkpoint import Checkpoint, bf16_bits_to_f32, f32_to_bf16_bits

RPC_TIMEOUT_S = 300

# ------------------------------------------------------------- the model's ends


class ModelEnds:
    """What runs outside the servers: the token embedding, the final RMSNorm
    and the LM head (lm_head.weight, or the embedding itself when the model
    ties them), in float32."""

    def __init__(self, checkpoint, config):
        self.checkpoint = checkpoint
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.embed_name = "model.embed_tokens.weight"
        vocab, self.hidden = checkpoint.raw(self.embed_name).shape
        self.norm = checkpoint.float32("model.norm.weight")
        tied = config.get("tie_word_embeddings", False) or "lm_head.weight" not in checkpoint
        self.lm_head = checkpoint.float32(self.embed_name if tied else "lm_head.weight")
        self.tied = tied
        if self.lm_head.shape[1] != self.hidden or self.norm.shape != (self.hidden,):
            raise SystemExit(f"checkpoint: lm_head {self.lm_head.shape} and norm {self.norm.shape} "
                             f"do not fit hidden size {self.hidden}")
        self.vocab = self.lm_head.shape[0]

    def embed(self, ids):
        """[len(ids)] token ids -> [1, len(ids), hidden] float32."""
        ids = np.asarray(ids, dtype=np.int64)
        rows = self.checkpoint.raw(self.embed_name).shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise SystemExit(f"token ids {ids.tolist()} outside the embedding's vocabulary")
        return self.checkpoint.float32(self.embed_name, rows=ids)[None]

    def next_token(self, last_hidden):
        """[hidden] output of the last span for the last token -> greedy token id."""
        h = np.asarray(last_hidden, dtype=np.float32)
        normed = h / np.sqrt(np.mean(h * h) + self.eps) * self.norm
        return int(np.argmax(self.lm_head @ normed))


# ------------------------------------------------------------- the servers


def bf16_client_dtype():
    """ml_dtypes.bfloat16 where this tritonclient takes BF16 tensors as such
    (r26.06 and later), None where it takes float32 arrays for them."""
    try:
        import ml_dtypes
        bf16 = np.dtype(ml_dtypes.bfloat16)
        return ml_dtypes.bfloat16 if np_to_triton_dtype(bf16) == "BF16" else None
    except Exception:
        return None


def wait_until_ready(client, url, wait_s):
    """Waits up to wait_s for the server at `url` to answer ready (a server
    started just before this client may still be loading its layers)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if client.is_server_ready(client_timeout=5):
                return
            why = "not ready"
        except Exception as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
        if time.monotonic() >= deadline:
            raise SystemExit(f"{url}: not ready after {wait_s:g} s ({why})")
        time.sleep(0.5)


class Stage:
    """One server and the span of layers it runs."""

    def __init__(self, url, model, datatype, wait_s=0.0):
        self.url, self.model, self.datatype = url, model, datatype
        self.client = grpcclient.InferenceServerClient(url)
        wait_until_ready(self.client, url, wait_s)
        try:
            config = self.client.get_model_config(model, client_timeout=RPC_TIMEOUT_S).config
        except Exception as e:
            raise SystemExit(f"{url}: cannot read model {model!r}'s configuration: {e}")
        params = {k: v.string_value for k, v in config.parameters.items()}
        self.layers = (tuple(int(x) for x in params["layers"].split(":"))
                       if "layers" in params else None)
        self.hidden = int(params["hidden_size"]) if "hidden_size" in params else None
        self.sessions = config.HasField("sequence_batching")
        self.input_name = config.input[0].name
        self.output_name = config.output[0].name

    def run(self, hidden, **sequence):
        """[B, T, hidden] float32 through this span; `sequence` holds
        tritonclient's sequence_id/sequence_start/sequence_end, if any."""
        tensor = grpcclient.InferInput(self.input_name, list(hidden.shape), self.datatype)
        if self.datatype == "BF16":
            bits = f32_to_bf16_bits(hidden)
            bf16 = bf16_client_dtype()
            tensor.set_data_from_numpy(
                bits.view(bf16) if bf16 is not None else bf16_bits_to_f32(bits))
        else:
            tensor.set_data_from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))
        # A session's steps carry its id as the x-session-id header too, so a
        # proxy that hashes on it (deploy/README.md, Sessions behind replicas)
        # sends each step to the replica of this stage that holds the session.
        headers = ({"x-session-id": str(sequence["sequence_id"])}
                   if sequence.get("sequence_id") else None)
        result = self.client.infer(self.model, [tensor],
                                   outputs=[grpcclient.InferRequestedOutput(self.output_name)],
                                   headers=headers, client_timeout=RPC_TIMEOUT_S, **sequence)
        # Decoded from the raw bytes, whichever BF16 convention the client has.
        response = result.get_response()
        output = response.outputs[0]
        raw = response.raw_output_contents[0]
        if output.datatype == "BF16":
            values = bf16_bits_to_f32(np.frombuffer(raw, dtype="<u2"))
        elif output.datatype == "FP32":
            values = np.frombuffer(raw, dtype="<f4")
        else:
            raise SystemExit(f"{self.url}: unexpected output datatype {output.datatype}")
        return values.reshape(list(output.shape)).astype(np.float32)

    def close(self):
        self.client.close()


def connect(urls, models, datatype, num_layers, hidden, wait_s=0.0):
    stages = [Stage(url, model, datatype, wait_s) for url, model in zip(urls, models)]
    spans = [s.layers for s in stages]
    if all(spans):
        chained = spans[0][0] == 0 and spans[-1][1] == num_layers and all(
            a[1] == b[0] for a, b in zip(spans, spans[1:]))
        if not chained:
            raise SystemExit(f"the servers' layers {['%d:%d' % s for s in spans]} do not chain "
                             f"0:{num_layers} in the order given")
    for s in stages:
        if s.hidden is not None and s.hidden != hidden:
            raise SystemExit(f"{s.url}: hidden size {s.hidden}, the checkpoint's is {hidden}")
    return stages


# ------------------------------------------------------------- generation


def through(stages, hidden, **sequence):
    for stage in stages:
        hidden = stage.run(hidden, **sequence)
    return hidden


def generate(stages, ends, prompt_ids, max_new_tokens, stateless=False, sequence_id=None,
             eos_ids=(), on_token=None):
    """Greedy generation; returns (new token ids, prefill seconds, decode
    seconds, decode steps). With sessions, every server holds a session
    named sequence_id from the prefill to the last step."""
    if max_new_tokens < 1:
        return [], 0.0, 0.0, 0
    sequence_id = sequence_id or f"pipeline-{uuid.uuid4().hex[:16]}"
    ids = list(prompt_ids)
    new = []
    session_open = False
    try:
        t0 = time.perf_counter()
        last = max_new_tokens == 1
        sequence = {} if stateless else dict(sequence_id=sequence_id, sequence_start=True,
                                             sequence_end=last)
        session_open = not stateless and not last
        out = through(stages, ends.embed(ids), **sequence)
        token = ends.next_token(out[0, -1])
        t1 = time.perf_counter()
        new.append(token)
        if on_token:
            on_token(token)
        while len(new) < max_new_tokens and token not in eos_ids:
            ids.append(token)
            last = len(new) + 1 == max_new_tokens
            if stateless:
                out = through(stages, ends.embed(ids))
            else:
                out = through(stages, ends.embed([token]), sequence_id=sequence_id,
                              sequence_end=last)
                session_open = not last
            token = ends.next_token(out[0, -1])
            new.append(token)
            if on_token:
                on_token(token)
        t2 = time.perf_counter()
    finally:
        if session_open:
            end_sessions(stages, ends.embed(ids[-1:]), sequence_id)
    return new, t1 - t0, t2 - t1, len(new) - 1


def end_sessions(stages, hidden, sequence_id):
    """Frees the session on every server after an early stop (end of
    sequence, an error, ^C) rather than at the servers' idle timeout. A
    request needs at least one token: `hidden` [1, 1, hidden] is computed and
    thrown away. Each server on its own, so one that never opened the
    session (a prefill that failed half way) does not keep the others'."""
    for stage in stages:
        try:
            stage.run(hidden, sequence_id=sequence_id, sequence_end=True)
        except Exception as e:  # its idle timeout frees it anyway
            print(f"note: {stage.url}: could not end session {sequence_id}: {e}", file=sys.stderr)


# ------------------------------------------------------------------- main


def load_tokenizer(model_dir):
    """(tokenizers.Tokenizer or None, why not)."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None, f"{path} does not exist"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None, "the tokenizers package is not installed (pip install tokenizers)"
    return Tokenizer.from_file(str(path)), None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True,
                   help="the checkpoint the servers serve "
                        "(config.json, safetensors, tokenizer.json)")
    p.add_argument("--servers", required=True,
                   help="host:port of each server, comma-separated, in layer order")
    p.add_argument("--model", default="",
                   help="model name on the servers, or one per server comma-separated "
                        "(default: the directory's name, as layerserve names it)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, tokenized with the checkpoint's tokenizer.json")
    prompt.add_argument("--prompt-ids", help="token ids, comma-separated (no tokenizer needed)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--stateless", action="store_true",
                   help="no sessions: send the whole prefix through the servers every step")
    p.add_argument("--datatype", choices=["FP32", "BF16"], default="FP32",
                   help="hidden states on the wire (BF16 halves the bytes, rounds each hop)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate --max-new-tokens even past the model's eos_token_id")
    p.add_argument("--wait-s", type=float, default=60.0,
                   help="how long to wait for each server to be ready (default 60)")
    p.add_argument("--json", help="also write the result to this JSON file")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model_dir = Path(args.model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    urls = [u.strip() for u in args.servers.split(",") if u.strip()]
    models = ([m.strip() for m in args.model.split(",")] if args.model
              else [model_dir.resolve().name])
    if len(models) == 1:
        models *= len(urls)
    if len(models) != len(urls):
        raise SystemExit(f"--model names {len(models)} models for {len(urls)} servers")

    tokenizer, no_tokenizer = load_tokenizer(model_dir)
    if args.prompt is not None:
        if tokenizer is None:
            raise SystemExit(f"--prompt needs a tokenizer: {no_tokenizer}; "
                             "give --prompt-ids instead")
        prompt_ids = tokenizer.encode(args.prompt).ids
    else:
        prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    if not prompt_ids:
        raise SystemExit("the prompt has no tokens")
    eos = config.get("eos_token_id")
    eos_ids = (() if args.ignore_eos or eos is None
               else tuple(eos if isinstance(eos, list) else [eos]))

    ends = ModelEnds(Checkpoint(model_dir), config)
    stages = connect(urls, models, args.datatype, int(config["num_hidden_layers"]), ends.hidden,
                     args.wait_s)
    if not args.stateless:
        refusing = [s.url for s in stages if not s.sessions]
        if refusing:
            raise SystemExit(f"{', '.join(refusing)} keep(s) no sessions (no sequence_batching "
                             f"in ModelConfig): run with --stateless")
    spans = ", ".join(f"{s.url} layers {'%d:%d' % s.layers if s.layers else '?'}" for s in stages)
    mode = "stateless (whole prefix each step)" if args.stateless else "sessions"
    print(f"{len(prompt_ids)} prompt tokens, {mode}, {args.datatype} through {spans}", flush=True)

    try:
        new, prefill_s, decode_s, steps = generate(stages, ends, prompt_ids, args.max_new_tokens,
                                                   stateless=args.stateless, eos_ids=eos_ids)
    finally:
        for s in stages:
            s.close()
    text = tokenizer.decode(new) if tokenizer is not None else None
    rate = steps / decode_s if steps and decode_s > 0 else None
    print("token ids: " + " ".join(map(str, new)))
    if text is not None:
        print(f"text: {text!r}")
    print(f"prefill {prefill_s * 1e3:.1f} ms; {steps} decode steps in {decode_s:.3f} s"
          + (f": {rate:.1f} steps/s" if rate else " (no steps/s to report)"))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "mode": "stateless" if args.stateless else "sessions", "datatype": args.datatype,
            "prompt_ids": prompt_ids, "generated_ids": new, "text": text,
            "prefill_s": prefill_s, "decode_steps": steps, "decode_s": decode_s,
            "steps_per_s": rate}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
