#!/usr/bin/env python3
"""The server under load: layerctl bench at concurrency 1, 8 and 64 with
1-token and 128-token requests, with batching on (--max-batch-tokens 8192)
and off (--max-batch-tokens = one request's tokens, so every batch holds one
request). One layerserve per setting, on loopback; one JSON line per run
(also OUT_DIR/load_summary.txt), and the server's /metrics after each
setting's three runs.

  python3 bench/server/load_matrix.py BIN_DIR OUT_DIR [layerserve args...]

BIN_DIR holds layerserve and layerctl; the remaining args choose the model
and backend (e.g. --model-dir ckpt --backend cuda). Env: LOAD_DURATION_S (5),
LOAD_CLIENT_ARGS (layerctl bench flags, e.g. "--connections=8 --datatype=BF16").
scripts/gpu-run.sh's bench-server stage runs it; the server start is
tests/support/layerserve_process.py, as for probe.py.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))
from layerserve_process import LayerserveProcess, ServerStartError  # noqa: E402
from summary_log import summary_emitter  # noqa: E402

READY_TIMEOUT_S = 60
STOP_TIMEOUT_S = 10


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin_dir", help="holds layerserve and layerctl")
    parser.add_argument("out_dir", help="client reports, server logs and scrapes, load_summary.txt")
    parser.add_argument("server_args", nargs=argparse.REMAINDER,
                        help="layerserve flags (model, backend, ...)")
    args = parser.parse_args()
    bin_dir, out = Path(args.bin_dir), Path(args.out_dir)
    duration_s = os.environ.get("LOAD_DURATION_S", "5")
    client_args = os.environ.get("LOAD_CLIENT_ARGS", "").split()
    out.mkdir(parents=True, exist_ok=True)
    emit = summary_emitter(out / "load_summary.txt")

    for tokens in (1, 128):
        for batching in ("on", "off"):
            max_batch_tokens = 8192 if batching == "on" else tokens
            name = f"t{tokens}_{batching}"
            try:
                server = LayerserveProcess(bin_dir / "layerserve",
                                           [*args.server_args, f"--max-batch-tokens={max_batch_tokens}"],
                                           out / f"server_{name}.log", ready_timeout_s=READY_TIMEOUT_S)
            except ServerStartError as e:
                sys.exit(f"load_matrix.py: {e}")
            with server:
                for concurrency in (1, 8, 64):
                    run = f"load_t{tokens}_c{concurrency}_{batching}"
                    with open(out / f"{run}.txt", "w") as log:
                        bench = subprocess.run(
                            [bin_dir / "layerctl", "bench", f"--url={server.grpc_url}",
                             f"--model={server.model}", f"--tokens={tokens}",
                             f"--concurrency={concurrency}", f"--duration-s={duration_s}",
                             "--warmup-s=1", "--no-progress", f"--json={out / f'{run}.json'}",
                             *client_args],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                    if bench.returncode != 0:
                        sys.exit(f"load_matrix.py: layerctl bench exited with {bench.returncode} "
                                 f"(see {out / f'{run}.txt'})")
                    report = (out / f"{run}.json").read_text().replace("\n", "")
                    emit(f"tokens={tokens:<4} concurrency={concurrency:<3} batching={batching:<3} {report}")
                # The server's own view of the three runs: batch sizes, queue
                # and compute time. A failed scrape loses only this file.
                try:
                    (out / f"metrics_{name}.txt").write_text(server.scrape()[2])
                except OSError as e:
                    print(f"load_matrix.py: /metrics of {name}: {e}", file=sys.stderr)
                server.stop(timeout_s=STOP_TIMEOUT_S)


if __name__ == "__main__":
    main()
