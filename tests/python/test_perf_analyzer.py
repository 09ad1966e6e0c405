"""Triton's perf_analyzer (2.40, the binary from the tritonclient wheel) load-
tests the demo model over gRPC, unary and streaming, and must finish with
zero failed requests: checked by its exit code, its CSV report and the
server's own requests_total counters.

perf_analyzer is installed by scripts/install-perf-analyzer.sh; if that
failed (it downloads from PyPI) these tests skip and show the recorded reason.
"""

import csv
import os
import subprocess
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from layerserve_client import RPC_TIMEOUT_S, io_names

PERF_ANALYZER_TIMEOUT_S = 240


# Session scope: pytest sets up wider-scoped fixtures first, and the check
# must come before the session-scoped demo server starts.
@pytest.fixture(scope="session")
def perf_analyzer():
    path = Path(os.environ.get("LAYERSERVE_PERF_ANALYZER", ""))
    if not path.name or not os.access(path, os.X_OK):
        error_file = path.parent / "perf_analyzer.install-error" if path.name else None
        reason = (error_file.read_text().strip() if error_file and error_file.is_file()
                  else "not installed; run scripts/install-perf-analyzer.sh")
        pytest.skip(f"perf_analyzer unavailable at '{path}': {reason}")
    return path


def request_counts(server):
    """{code: count} of layerserve_requests_total for the served model."""
    counts = {}
    for (name, labels), value in server.samples().items():
        labels = dict(labels)
        if name == "layerserve_requests_total" and labels.get("model") == server.model:
            counts[labels["code"]] = value
    return counts


@pytest.mark.parametrize("mode,concurrency,expected_levels", [
    ("unary", "1:4:3", [1, 4]),
    ("streaming", "2", [2]),
])
def test_perf_analyzer_runs_without_errors(perf_analyzer, demo_server, tmp_path, mode,
                                           concurrency, expected_levels):
    with grpcclient.InferenceServerClient(demo_server.grpc_url) as client:
        input_name, _ = io_names(client, demo_server.model)
        hidden = client.get_model_metadata(
            demo_server.model, client_timeout=RPC_TIMEOUT_S).inputs[0].shape[-1]
    report = tmp_path / "perf.csv"
    args = [str(perf_analyzer), "-m", demo_server.model, "-u", demo_server.grpc_url, "-i", "grpc",
            "--shape", f"{input_name}:1,8,{hidden}",
            "--concurrency-range", concurrency,
            # Short, bounded windows: this checks compatibility, not speed, on
            # a shared CI machine where latency is noisy.
            "--measurement-interval", "2000", "--max-trials", "10", "--stability-percentage", "500",
            "-f", str(report)]
    if mode == "streaming":
        args.append("--streaming")
    before = request_counts(demo_server)
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=PERF_ANALYZER_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"perf_analyzer did not finish in {PERF_ANALYZER_TIMEOUT_S}s:\n{e.stdout}{e.stderr}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"perf_analyzer exited with {proc.returncode}:\n{output}"
    assert "error" not in output.lower(), f"perf_analyzer reported an error:\n{output}"

    with open(report, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["Concurrency"]) for r in rows] == expected_levels, f"{rows}\n{output}"
    for row in rows:
        assert float(row["Inferences/Second"]) > 0, row

    after = request_counts(demo_server)
    ok = after.get("OK", 0) - before.get("OK", 0)
    failed = {code: n - before.get(code, 0) for code, n in after.items()
              if code != "OK" and n != before.get(code, 0)}
    assert ok > 0, f"the server saw no successful requests; perf_analyzer said:\n{output}"
    assert not failed, f"the server answered perf_analyzer with errors {failed}:\n{output}"
