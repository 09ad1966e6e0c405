"""scripts/perf_report.py: the tables it generates from a fixture results folder (the
formats scripts/gpu-run.sh's bench stages write), that it leaves the hand-written text alone,
and that docs/performance.md is what it generates from the committed docs/results/.

No build and no GPU needed; scripts/test.sh runs this file in its "docs-check" stage:
  python3 -m pytest -q tests/docs
"""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "results"
sys.path.insert(0, str(ROOT / "scripts"))
import perf_report  # noqa: E402

DOC = """# Page

Hand-written text before.

<!-- generated: runs -->
stale
<!-- end -->

<!-- generated: gemm -->
<!-- end -->

Between the tables, by hand.

<!-- generated: layer -->
<!-- end -->

<!-- generated: layer-decode -->
<!-- end -->

<!-- generated: decode-attention -->
<!-- end -->

<!-- generated: server -->
old table
<!-- end -->

Hand-written text after.
"""


def generated(text, name):
    """The body between a section's markers."""
    start = text.index(f"<!-- generated: {name} -->\n") + len(f"<!-- generated: {name} -->\n")
    return text[start:text.index("<!-- end -->", start)]


def table_rows(body):
    return [line for line in body.splitlines() if line.startswith("| ") and not line.startswith("|---")]


@pytest.fixture
def page(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(DOC)
    assert perf_report.main(["--results", str(FIXTURE), "--doc", str(doc)]) == 0
    return doc.read_text()


def test_runs_table_names_gpu_commit_date_and_stages(page):
    rows = table_rows(generated(page, "runs"))
    assert rows[0] == "| results | GPU | commit | date | stages | from |"
    assert rows[1] == ("| [testgpu-abc1234](results/testgpu-abc1234/) | Test GPU 80GB | `abc1234` | 2030-01-02 | "
                       "bench-kernels, bench-layer, bench-decode, bench-server | scripts/gpu-run.sh |")


def test_gemm_table_compares_fastest_own_version_and_router_with_cublaslt(page):
    body = generated(page, "gemm")
    assert "**Test GPU 80GB**, commit `abc1234`, 2030-01-02" in body
    assert "Settings: fixture settings" in body
    rows = table_rows(body)
    assert rows[0] == ("| N×K | M | cuBLASLt µs | cuBLASLt TFLOP/s | fastest own | own µs | cuBLASLt / own | "
                       "router picks | router µs |")
    # v5's row failed ("not supported") and is left out; v4 is the fastest of v3/v4.
    assert rows[1] == "| 4096×4096 | 1 | 16.8 | 2 | v4 | 15.3 | 1.10× | v4s4 | 15.4 |"
    assert rows[2] == "| 4096×4096 | 4096 | 180.2 | 763 | v3 | 204.8 | 0.88× | v0 | 181.0 |"
    assert len(rows) == 3


def test_layer_table_takes_hf_time_speedup_and_floor_from_hf_layer_output(page):
    rows = table_rows(generated(page, "layer"))
    assert rows[1] == "| 1 | 1 | 0.1900 | 0.6430 | 3.38× | 2.5× | 0.1454 | 1.31 |"
    assert rows[2] == "| 8192 | 8 | 5.7630 | 7.0620 | 1.23× | 1.2× | 4.5530 | 1.27 |"


def test_layer_table_without_hf_output_has_our_times_only(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(FIXTURE, results)
    (results / "testgpu-abc1234" / "layer_vs_hf.txt").unlink()
    doc = tmp_path / "p.md"
    doc.write_text(DOC)
    perf_report.main(["--results", str(results), "--doc", str(doc)])
    rows = table_rows(generated(doc.read_text(), "layer"))
    assert rows[1] == "| 1 | 1 | 0.1900 | – | – | – | – | – |"


def test_layer_table_takes_the_floor_layer_bench_measured_where_its_csv_has_it(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(FIXTURE, results)
    (results / "testgpu-abc1234" / "layer_ours.csv").write_text("tokens,seqs,ms,floor_ms\n1,1,0.19,0.1\n")
    doc = tmp_path / "p.md"
    doc.write_text(DOC)
    perf_report.main(["--results", str(results), "--doc", str(doc)])
    rows = table_rows(generated(doc.read_text(), "layer"))
    # HF's time and speedup from hf_layer.py's table, the floor from the CSV.
    assert rows[1] == "| 1 | 1 | 0.1900 | 0.6430 | 3.38× | 2.5× | 0.1000 | 1.90 |"


def test_decode_tables(page):
    assert table_rows(generated(page, "layer-decode"))[1:] == ["| 1 | 1 024 | 0.2100 | 0.1460 | 1.44 |",
                                                                 "| 64 | 4 096 | 0.9000 | 0.6000 | 1.50 |"]
    assert table_rows(generated(page, "decode-attention"))[1:] == ["| 1 | 1 024 | 1 | 16.800 | 0.2500 | – |"]


def test_server_table_pairs_batching_on_and_off(page):
    rows = table_rows(generated(page, "server"))
    assert rows[0] == ("| tokens/request | concurrency | batching on: tok/s | p50 / p99 ms | batching off: tok/s | "
                       "p50 / p99 ms | on / off |")
    assert rows[1] == "| 1 | 64 | 21 663 | 2.84 / 6.27 | 1 572 | 40.01 / 47.58 | 13.78× |"
    # No batching-off run of this point: its cells and the ratio say so.
    assert rows[2] == "| 128 | 1 | 28 571 | 4.17 / 11.23 | – | – | – |"
    assert "old table" not in page


def test_hand_written_text_is_kept_and_regenerating_changes_nothing(page, tmp_path):
    outside = [part.split("<!-- end -->")[-1] for part in page.split("<!-- generated:")]
    expected = [part.split("<!-- end -->")[-1] for part in DOC.split("<!-- generated:")]
    assert outside == expected
    doc = tmp_path / "again.md"
    doc.write_text(page)
    assert perf_report.main(["--results", str(FIXTURE), "--doc", str(doc), "--check"]) == 0


def test_sections_without_results_say_which_stage_to_run(tmp_path):
    empty = tmp_path / "results"
    empty.mkdir()
    doc = tmp_path / "p.md"
    doc.write_text(DOC)
    perf_report.main(["--results", str(empty), "--doc", str(doc)])
    text = doc.read_text()
    assert "No results recorded yet; run `scripts/gpu-run.sh bench-kernels`" in generated(text, "gemm")
    assert "`scripts/gpu-run.sh bench-server`" in generated(text, "server")
    assert "`scripts/perf_report.py`" in generated(text, "layer")


def test_check_fails_on_a_stale_page(tmp_path):
    doc = tmp_path / "p.md"
    doc.write_text(DOC)
    assert perf_report.main(["--results", str(FIXTURE), "--doc", str(doc), "--check"]) == 1
    assert doc.read_text() == DOC  # --check writes nothing


def test_a_run_without_its_commit_is_refused(tmp_path):
    results = tmp_path / "results"
    (results / "gpu-x").mkdir(parents=True)
    (results / "gpu-x" / "meta.txt").write_text("gpu: G\ndate: 2030-01-01\n")
    doc = tmp_path / "p.md"
    doc.write_text(DOC)
    with pytest.raises(SystemExit, match="commit"):
        perf_report.main(["--results", str(results), "--doc", str(doc)])


def test_performance_md_is_up_to_date_with_committed_results():
    # The one command the page names, as a user runs it.
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "perf_report.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr + "\nrun scripts/perf_report.py and commit docs/performance.md"


def test_every_committed_run_names_gpu_commit_date_and_where_it_came_from():
    runs = perf_report.load_runs(ROOT / "docs" / "results")
    assert runs, "docs/results/ holds no run"
    for run in runs:
        assert run.meta.get("source"), f"{run.path}/meta.txt: say where the figures came from (source:)"
