#!/usr/bin/env bash
# The server under load: layerctl bench at concurrency 1, 8 and 64 with
# 1-token and 128-token requests, with batching on (--max-batch-tokens 8192)
# and off (--max-batch-tokens = one request's tokens, so every batch holds one
# request). One layerserve per setting, on loopback; one JSON line per run.
#   bench/server/load_matrix.sh BIN_DIR OUT_DIR [layerserve args...]
# BIN_DIR holds layerserve and layerctl; the remaining args choose the model
# and backend (e.g. --model-dir ckpt --backend cuda). LOAD_CLIENT_ARGS adds
# layerctl bench flags (e.g. "--connections=8 --datatype=BF16").
set -euo pipefail
bin=$1 out=$2
shift 2
duration_s=${LOAD_DURATION_S:-5}
read -r -a client_args <<< "${LOAD_CLIENT_ARGS:-}"
mkdir -p "$out"
summary="$out/load_summary.txt"
: > "$summary"

# shellcheck source=bench/server/server_process.sh
source "$(dirname "${BASH_SOURCE[0]}")/server_process.sh"
trap stop_server EXIT

for tokens in 1 128; do
  for batching in on off; do
    max_batch_tokens=8192
    [[ $batching == off ]] && max_batch_tokens=$tokens
    start_server "$out/server_t${tokens}_${batching}.log" "$@" --max-batch-tokens="$max_batch_tokens"
    for concurrency in 1 8 64; do
      json="$out/load_t${tokens}_c${concurrency}_${batching}.json"
      "$bin/layerctl" bench --url="127.0.0.1:$grpc_port" --model="$model" --tokens="$tokens" \
        --concurrency="$concurrency" --duration-s="$duration_s" --warmup-s=1 --no-progress --json="$json" \
        "${client_args[@]}" > "$out/load_t${tokens}_c${concurrency}_${batching}.txt" 2>&1
      printf 'tokens=%-4s concurrency=%-3s batching=%-3s %s\n' "$tokens" "$concurrency" "$batching" \
        "$(tr -d '\n' < "$json")" | tee -a "$summary"
    done
    # The server's own view of the three runs: batch sizes, queue and compute time.
    python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())" \
      "http://127.0.0.1:$metrics_port/metrics" > "$out/metrics_t${tokens}_${batching}.txt" || true
    stop_server
  done
done
