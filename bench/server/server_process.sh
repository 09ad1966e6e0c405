# Sourced by load_matrix.sh and probe.sh: one layerserve on loopback with
# ports picked by the kernel, read back from its ready line.
#
# start_server LOG [layerserve args...]: starts "$bin/layerserve" (stdout to
# LOG.stdout, stderr to LOG) and waits up to 60 s for the ready line; sets
# server_pid, grpc_port, metrics_port, model and layers (the span's layer
# count). Returns 1, with the log's tail on stderr, if the server exits or
# never gets ready. Both are safe under `set -e`.
# stop_server: SIGTERM (a graceful drain), SIGKILL after 10 s; no-op when
# no server runs.

start_server() {
  local log=$1
  shift
  : > "$log.stdout"  # exists before the first poll below
  "$bin/layerserve" --host=127.0.0.1 --grpc-port=0 --metrics-port=0 "$@" > "$log.stdout" 2> "$log" &
  server_pid=$!
  for _ in $(seq 1 600); do
    grpc_port=$(sed -n 's/.*grpc_port=\([0-9]*\).*/\1/p' "$log.stdout")
    metrics_port=$(sed -n 's/.*metrics_port=\([0-9]*\).*/\1/p' "$log.stdout")
    if [[ -n $grpc_port ]]; then
      model=$(sed -n 's/.*model=\([^ ]*\).*/\1/p' "$log.stdout")
      local range
      range=$(sed -n 's/.* layers=\([0-9]*:[0-9]*\).*/\1/p' "$log.stdout")
      layers=$(( ${range#*:} - ${range%:*} ))
      return 0
    fi
    kill -0 "$server_pid" 2>/dev/null || { tail -n 5 "$log" >&2; server_pid=""; return 1; }
    sleep 0.1
  done
  echo "server did not start in 60 s" >&2
  stop_server
  return 1
}

stop_server() {
  [[ -z ${server_pid:-} ]] && return 0
  kill -TERM "$server_pid" 2>/dev/null || true
  for _ in $(seq 1 100); do
    kill -0 "$server_pid" 2>/dev/null || break
    sleep 0.1
  done
  kill -KILL "$server_pid" 2>/dev/null || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=""
}
