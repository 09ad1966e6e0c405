"""The server benchmark scripts' reading of `layerctl bench` reports
(bench/server/bench_errors.py): each error code's count and first message,
and bench/server/session_matrix.py end to end on the CPU demo model, with
--streaming and a server that refuses some sessions, printing why;
bench/server/first_batch.py's table on the same model; and
bench/server/launch_rows.py's lines, one per setting and row, in order;
and bench/server/echo_rows.py's, against grpc_echo.

Needs LAYERSERVE_BIN, LAYERCTL_BIN and GRPC_ECHO_BIN (ctest sets them).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_SERVER = Path(__file__).resolve().parents[2] / "bench" / "server"
sys.path.insert(0, str(BENCH_SERVER))
from bench_errors import error_lines, merged_error_lines  # noqa: E402


def test_error_lines_give_counts_and_first_messages():
    report = {"errors_by_code": {"UNAVAILABLE": 1, "RESOURCE_EXHAUSTED": 3},
              "first_error_by_code": {"RESOURCE_EXHAUSTED": "out of KV cache blocks: 4 needed",
                                      "UNAVAILABLE": ""}}
    assert error_lines(report) == ["    RESOURCE_EXHAUSTED x3: out of KV cache blocks: 4 needed",
                                   "    UNAVAILABLE x1"]
    assert error_lines({"errors_by_code": {}}) == []
    # A report from before first_error_by_code: the counts alone.
    assert error_lines({"errors_by_code": {"INTERNAL": 2}}, indent="") == ["INTERNAL x2"]


def test_merged_error_lines_sum_over_clients():
    runs = [{"errors_by_code": {"INTERNAL": 1}, "first_error_by_code": {"INTERNAL": "first"}},
            {"errors_by_code": {}, "first_error_by_code": {}},
            {"errors_by_code": {"INTERNAL": 2, "CANCELLED": 1},
             "first_error_by_code": {"INTERNAL": "later", "CANCELLED": "gone"}}]
    assert merged_error_lines(runs, indent="") == ["CANCELLED x1: gone", "INTERNAL x3: first"]


def bin_dir_of(tmp_path):
    """A directory holding layerserve and layerctl, as the scripts take them."""
    binaries = {"layerserve": os.environ.get("LAYERSERVE_BIN"),
                "layerctl": os.environ.get("LAYERCTL_BIN")}
    if not all(binaries.values()):
        pytest.fail("LAYERSERVE_BIN and LAYERCTL_BIN must be set: run this file through ctest")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, path in binaries.items():
        (bin_dir / name).symlink_to(path)
    return bin_dir


def test_session_matrix_with_streaming_prints_why_sessions_failed(tmp_path):
    bin_dir = bin_dir_of(tmp_path)
    out = tmp_path / "out"
    # 4 sessions against a server that allows 2: two are refused at their
    # prefill, on either transport.
    result = subprocess.run(
        [sys.executable, str(BENCH_SERVER / "session_matrix.py"), str(bin_dir), str(out),
         "--sessions=4", "--prefill=4", "--steps=2", "--streaming",
         "--kv-cache-memory=8MiB", "--max-sessions=2"],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "LOAD_DURATION_S": "1", "LOAD_CLIENT_ARGS": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (out / "session_summary.txt").read_text().splitlines()
    rows = {line.split()[0]: i for i, line in enumerate(lines) if "=" in line.split()[0]}
    assert set(rows) == {"sessions=4", "sessions-stream=4", "stateless=4"}, lines
    for row in ("sessions=4", "sessions-stream=4"):
        assert lines[rows[row]].endswith("failed 2"), lines
        assert " graphs 0/0/0 " in lines[rows[row]], lines  # the CPU backend launches nothing
        why = lines[rows[row] + 1]
        assert why.startswith("    RESOURCE_EXHAUSTED x2: cannot start session"), lines
        assert why.endswith("the most allowed is 2"), lines
    assert lines[rows["stateless=4"]].endswith("failed 0"), lines
    assert (out / "sessions_stream_4.json").exists()


def test_first_batch_prints_three_latencies_per_size_and_setting(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(BENCH_SERVER / "first_batch.py"), str(bin_dir_of(tmp_path)), str(out),
         "--tokens=1,4", "--setting=warm=", "--setting=cold=--cuda-warmup=false"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = (out / "first_batch.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in lines if "ready in" in line] == ["warm", "cold"], lines
    rows = [line.split() for line in lines if "tokens=" in line]
    assert [(row[0], row[1]) for row in rows] == [
        ("warm", "tokens=1"), ("warm", "tokens=4"), ("cold", "tokens=1"), ("cold", "tokens=4")], lines
    for row in rows:
        assert all(float(ms) > 0 for ms in row[3:6]), row


def test_launch_rows_prints_a_line_per_setting_and_row_in_order(tmp_path):
    bin_dir = bin_dir_of(tmp_path)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(BENCH_SERVER / "launch_rows.py"), str(out),
         f"--settings=a={bin_dir}|;b={bin_dir}|--max-queue-delay-us=0;a={bin_dir}|",
         "--rows=one=--tokens=1 --concurrency=1 --duration-s=0.3;"
         "s2=--sessions=2 --prefill=2 --steps=2", "--ops", "--threads"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "LOAD_CLIENT_ARGS": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    text = (out / "summary.txt").read_text().splitlines()
    lines = [line.split() for line in text if not line.startswith(("#", " "))]
    # --threads: after each row, its CPU per request, the server's by role.
    # A 0.3 s closed loop keeps the CPU backend's batch thread busy for whole
    # clock ticks; the session rows' few requests may round to nothing.
    cpu = [line.split() for line in text if line.startswith("    cpu us per request:")]
    assert len(cpu) == len(lines), text
    for (setting, row, *_), usage in zip(lines, cpu):
        assert "server" in usage and "client" in usage, usage
        if row == "one":
            assert float(usage[usage.index("server") + 1]) > 0, usage
            assert "cpu-batch" in " ".join(usage), usage
    assert [(row[0], row[1]) for row in lines] == [
        ("a", "one"), ("a", "s2"), ("b", "one"), ("b", "s2"), ("a", "one"), ("a", "s2")], lines
    for row in lines:
        assert float(row[2]) > 0, row  # tok/s
        assert float(row[5]) >= 1, row  # batches between the scrapes
        assert row[-2:] == ["failed", "0"], row
        # The client's mean latency and the server's request time, both seen.
        assert float(row[row.index("client") + 1]) > 0, row
        request_ms = float(row[row.index("server") + 1])
        assert request_ms > 0, row
        # Its parts: the queue wait, the batches' compute (per request) and
        # the time outside both, adding up to the request's time.
        queue_ms = float(row[row.index("(queue") + 1])
        batches_ms = float(row[row.index("batches", row.index("server")) + 1])
        outside_ms = float(row[row.index("outside") + 1].rstrip(")"))
        reply_ms = float(row[row.index("reply-wait") + 1].rstrip(")"))
        assert batches_ms > 0, row
        assert 0 <= reply_ms <= outside_ms + 0.002, row
        assert abs(queue_ms + batches_ms + outside_ms - request_ms) < 0.002, row
        # The CPU backend times no kernels (so --ops adds no line) and
        # launches nothing on a GPU.
        assert row[row.index("(gpu") + 1] == "-", row
        # Its host part: the CPU backend packs and unpacks too.
        assert float(row[row.index("in") + 1]) >= 0, row
        assert float(row[row.index("out") + 1].rstrip(")")) >= 0, row
        assert row[row.index("direct/captured/replayed") + 1] == "0/0/0", row
    # Every setting keeps its server's log and the client's reports.
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["00-a", "01-b", "02-a"]
    assert (out / "01-b" / "s2.json").exists()


def echo_rows(tmp_path, *flags):
    """Runs echo_rows.py against grpc_echo with these flags; its row lines, split."""
    out = tmp_path / "echo"
    result = subprocess.run(
        [sys.executable, str(BENCH_SERVER / "echo_rows.py"), str(out),
         f"--echo={os.environ['GRPC_ECHO_BIN']}", f"--layerctl={os.environ['LAYERCTL_BIN']}",
         "--hidden=64", *flags],
        capture_output=True, text=True, timeout=120, env={**os.environ, "LOAD_CLIENT_ARGS": ""})
    assert result.returncode == 0, result.stdout + result.stderr
    return [line.split() for line in (out / "summary.txt").read_text().splitlines()
            if not line.startswith("#")]


def test_echo_rows_answer_every_request_of_every_row(tmp_path):
    lines = echo_rows(tmp_path, "--threads=2",
                      "--rows=one=--tokens=1 --concurrency=1 --duration-s=0.3;"
                      "many=--tokens=3 --batch=2 --concurrency=8 --connections=2 --duration-s=0.3")
    assert [row[:2] for row in lines] == [["echo", "one"], ["echo", "many"]], lines
    for row in lines:
        assert float(row[2]) > 0, row  # tok/s: every reply had the request's shape
        assert float(row[row.index("client") + 1]) > 0, row
        assert row[-2:] == ["failed", "0"], row


def test_a_delayed_echo_answers_no_sooner_than_its_delay(tmp_path):
    lines = echo_rows(tmp_path, "--delay-us=5000",
                      "--rows=one=--tokens=1 --concurrency=1 --duration-s=0.3;"
                      "four=--tokens=1 --concurrency=4 --duration-s=0.3")
    assert [row[:2] for row in lines] == [["echo+5000us", "one"], ["echo+5000us", "four"]], lines
    for row in lines:
        assert float(row[row.index("client") + 1]) >= 5.0, row  # ms
        assert row[-2:] == ["failed", "0"], row
