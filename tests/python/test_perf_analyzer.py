"""Triton's perf_analyzer (2.40, the binary from the tritonclient wheel) load-
tests the demo model over gRPC, unary and streaming, and must finish with
zero failed requests: checked by its exit code, its CSV report and the
server's own requests_total counters. The demo server keeps sessions, so its
ModelConfig announces sequence_batching and perf_analyzer runs in sequence
mode (sequence_id, sequence_start, sequence_end on its requests): the session
metrics show it did.

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
from layerserve_process import sample

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


def session_counts(server):
    """(sessions open, sessions freed by sequence_end, by a reset) for the
    served model, from the server's metrics."""
    samples = server.samples()
    return (sample(samples, "layerserve_sessions_open", model=server.model),
            sample(samples, "layerserve_sessions_freed_total", model=server.model, reason="end"),
            sample(samples, "layerserve_sessions_freed_total", model=server.model, reason="reset"))


def run_perf_analyzer(perf_analyzer, server, tmp_path, mode, concurrency, extra_args=()):
    """Runs perf_analyzer against `server` with [1, 8, hidden] requests and
    checks that it finished without errors, by its exit code and output and
    by the server's requests_total. Returns (output, CSV rows, OK requests)."""
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        input_name, _ = io_names(client, server.model)
        hidden = client.get_model_metadata(
            server.model, client_timeout=RPC_TIMEOUT_S).inputs[0].shape[-1]
    report = tmp_path / "perf.csv"
    args = [str(perf_analyzer), "-m", server.model, "-u", server.grpc_url, "-i", "grpc",
            "--shape", f"{input_name}:1,8,{hidden}",
            "--concurrency-range", concurrency,
            # Short, bounded windows: this checks compatibility, not speed, on
            # a shared CI machine where latency is noisy.
            "--measurement-interval", "2000", "--max-trials", "10", "--stability-percentage", "500",
            "-f", str(report), *extra_args]
    if mode == "streaming":
        args.append("--streaming")
    before = request_counts(server)
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=PERF_ANALYZER_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"perf_analyzer did not finish in {PERF_ANALYZER_TIMEOUT_S}s:\n{e.stdout}{e.stderr}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"perf_analyzer exited with {proc.returncode}:\n{output}"
    assert "error" not in output.lower(), f"perf_analyzer reported an error:\n{output}"

    with open(report, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        assert float(row["Inferences/Second"]) > 0, row

    after = request_counts(server)
    ok = after.get("OK", 0) - before.get("OK", 0)
    failed = {code: n - before.get(code, 0) for code, n in after.items()
              if code != "OK" and n != before.get(code, 0)}
    assert ok > 0, f"the server saw no successful requests; perf_analyzer said:\n{output}"
    assert not failed, f"the server answered perf_analyzer with errors {failed}:\n{output}"
    return output, rows, ok


@pytest.mark.parametrize("mode,concurrency,expected_levels", [
    ("unary", "1:4:3", [1, 4]),
    ("streaming", "2", [2]),
])
def test_perf_analyzer_runs_without_errors(perf_analyzer, demo_server, tmp_path, mode,
                                           concurrency, expected_levels):
    output, rows, _ = run_perf_analyzer(perf_analyzer, demo_server, tmp_path, mode, concurrency)
    # perf_analyzer writes its CSV rows ordered by throughput, not by level:
    # on a loaded CI machine concurrency 4 can measure below 1.
    assert sorted(int(r["Concurrency"]) for r in rows) == expected_levels, f"{rows}\n{output}"


@pytest.mark.parametrize("mode", ["unary", "streaming"])
def test_perf_analyzer_drives_sessions(perf_analyzer, demo_server, tmp_path, mode):
    """ModelConfig announces sequence_batching, so perf_analyzer runs in
    sequence mode by itself: each of its concurrent slots starts a sequence
    (sequence_start), sends its steps with that sequence_id and ends it
    (sequence_end). The server must have seen that: sessions ended in step
    with the requests, none reset (a start on an open id) and none left open."""
    sequence_length, concurrency = 4, 2
    open_before, ended_before, reset_before = session_counts(demo_server)
    output, rows, ok = run_perf_analyzer(
        perf_analyzer, demo_server, tmp_path, mode, str(concurrency),
        ["--sequence-length", str(sequence_length), "--sequence-length-variation", "0",
         # Ids no other run of this server uses, so any start on an open one
         # would be perf_analyzer's own.
         "--sequence-id-range", "1000000:1000100" if mode == "unary" else "2000000:2000100"])
    assert "Sequence count" in output, f"perf_analyzer did not run in sequence mode:\n{output}"
    assert [int(r["Concurrency"]) for r in rows] == [concurrency], f"{rows}\n{output}"

    open_after, ended_after, reset_after = session_counts(demo_server)
    ended = ended_after - ended_before
    assert ended >= 1, f"no session ended with sequence_end in {ok} requests:\n{output}"
    # Every sequence is at most sequence_length requests (perf_analyzer may
    # end one early when it stops), each started and ended.
    assert ended <= ok <= sequence_length * ended + sequence_length * concurrency, (
        f"{ok} requests for {ended} sessions of up to {sequence_length} steps")
    assert reset_after == reset_before, f"{reset_after - reset_before} sessions reset"
    assert open_after == open_before, (
        f"sessions open went from {open_before} to {open_after}: perf_analyzer left some open")
