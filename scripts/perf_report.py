#!/usr/bin/env python3
"""Regenerates the tables of docs/performance.md from benchmark outputs.

  scripts/perf_report.py [--results DIR] [--doc FILE] [--check]

DIR (default docs/results) holds one folder per GPU run, named <gpu>-<commit>: the files
scripts/gpu-run.sh writes to $OUT, copied as they are, plus a meta.txt of `key: value` lines
(gpu, commit and date required; settings, source and note optional). What is read, per stage:

  bench-kernels   gemm_bench.csv          gemm_bench --csv (m,n,k,version,status,median_us,...)
  bench-layer     layer_ours.csv          layer_bench --csv (tokens,seqs,ms[,floor_ms])
                  layer_vs_hf.txt         bench/layer/hf_layer.py's table (hf_ms, speedup, floor)
                  layer_decode.csv        layer_bench --decode-csv (seqs,context,ms,min_ms,floor_ms)
  bench-decode    decode_ours.csv         decode_attention_bench --csv (B,L,q_tokens,us,...,tbps[,of_copy])
  bench-server    server/load_summary.txt bench/server/load_matrix.py (one layerctl report a line)

Each table goes between `<!-- generated: NAME -->` and `<!-- end -->` in FILE; everything
outside the markers is left as written. A section with no results says which stage to run.
--check writes nothing and exits 1 if FILE differs from what it would write (the test does this).
Standard library only.
"""

import argparse
import csv
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"(<!-- generated: ([a-z-]+) -->\n)(.*?)(<!-- end -->)", re.S)
STAGE_OF = {"runs": "bench-kernels bench-layer bench-decode bench-server", "gemm": "bench-kernels",
            "layer": "bench-layer", "layer-decode": "bench-layer", "decode-attention": "bench-decode",
            "server": "bench-server"}


class Run:
    """One results folder: its meta.txt and the bench files found in it."""

    def __init__(self, path):
        self.path = path
        self.meta = {}
        meta = path / "meta.txt"
        if not meta.is_file():
            raise SystemExit(f"perf_report.py: {meta} is missing (gpu, commit, date)")
        for line in meta.read_text().splitlines():
            if ":" in line and not line.startswith("#"):
                key, value = line.split(":", 1)
                self.meta[key.strip()] = value.strip()
        for key in ("gpu", "commit", "date"):
            if not self.meta.get(key):
                raise SystemExit(f"perf_report.py: {meta} has no '{key}:' line")

    def file(self, name):
        p = self.path / name
        return p if p.is_file() else None

    def heading(self):
        return (f"**{self.meta['gpu']}**, commit `{self.meta['commit']}`, {self.meta['date']} "
                f"([{self.path.name}](results/{self.path.name}/))")


def number(x, decimals=0):
    """A figure as the docs write it: thousands apart by a space."""
    s = f"{x:,.{decimals}f}"
    return s.replace(",", " ")


def table(header, rows):
    aligns = ["---:" if h.startswith(">") else "---" for h in header]
    names = [h.lstrip(">") for h in header]
    lines = ["| " + " | ".join(names) + " |", "|" + "|".join(aligns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def gemm_section(run):
    path = run.file("gemm_bench.csv")
    if path is None:
        return None
    by_point = {}
    for r in read_csv(path):
        if r["status"] != "ok":
            continue
        by_point.setdefault((int(r["n"]), int(r["k"]), int(r["m"])), []).append(r)
    rows = []
    for (n, k, m), rs in sorted(by_point.items()):
        v0 = next((r for r in rs if r["version"] == "v0"), None)
        own = [r for r in rs if r["version"] not in ("v0", "auto")]
        best = min(own, key=lambda r: float(r["median_us"])) if own else None
        auto = next((r for r in rs if r["version"] == "auto"), None)
        rows.append([
            f"{n}×{k}", m,
            f"{float(v0['median_us']):.1f}" if v0 else "–",
            f"{float(v0['tflops']):.0f}" if v0 else "–",
            best["version"] if best else "–",
            f"{float(best['median_us']):.1f}" if best else "–",
            f"{float(v0['median_us']) / float(best['median_us']):.2f}×" if v0 and best else "–",
            (auto["chosen"] or "auto") if auto else "–",
            f"{float(auto['median_us']):.1f}" if auto else "–",
        ])
    return table(["N×K", ">M", ">cuBLASLt µs", ">cuBLASLt TFLOP/s", "fastest own", ">own µs",
                  ">cuBLASLt / own", "router picks", ">router µs"], rows)


HF_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+|-)\s+([\d.]+x|-)\s+(\S+)\s+([\d.]+|-)\s+([\d.]+|-)\s*$")


def layer_section(run):
    ours_path = run.file("layer_ours.csv")
    if ours_path is None:
        return None
    hf = {}
    hf_path = run.file("layer_vs_hf.txt")
    if hf_path is not None:
        for line in hf_path.read_text().splitlines():
            m = HF_ROW.match(line)
            if m:
                hf[(int(m[1]), int(m[2]))] = {"hf_ms": m[3], "speedup": m[5], "target": m[6], "floor": m[7],
                                              "over_floor": m[8]}
    rows = []
    for r in read_csv(ours_path):
        key = (int(r["tokens"]), int(r["seqs"]))
        h = hf.get(key, {})
        speedup = h.get("speedup", "-")
        target = h.get("target", "-")
        # The floor layer_bench measured in its run, where its CSV has it;
        # older runs' came through hf_layer.py's table.
        if r.get("floor_ms"):
            floor = f"{float(r['floor_ms']):.4f}"
            over = f"{float(r['ms']) / float(r['floor_ms']):.2f}"
        else:
            floor, over = h.get("floor", "–"), h.get("over_floor", "–")
        rows.append([key[0], key[1], f"{float(r['ms']):.4f}", h.get("hf_ms", "–"),
                     speedup.replace("x", "×") if speedup != "-" else "–",
                     target.replace("x", "×") if target != "-" else "–",
                     floor.replace("-", "–"), over.replace("-", "–")])
    return table([">tokens", ">seqs", ">ours ms", ">HF ms", ">HF / ours", ">target", ">floor ms", ">ours / floor"],
                 rows)


def layer_decode_section(run):
    path = run.file("layer_decode.csv")
    if path is None:
        return None
    rows = []
    for r in read_csv(path):
        ms, floor = float(r["ms"]), float(r["floor_ms"])
        rows.append([r["seqs"], number(int(r["context"])), f"{ms:.4f}", f"{floor:.4f}",
                     f"{ms / floor:.2f}" if floor > 0 else "–"])
    return table([">sessions", ">context", ">ms", ">floor ms", ">ms / floor"], rows)


def decode_attention_section(run):
    path = run.file("decode_ours.csv")
    if path is None:
        return None
    rows = [[r["B"], number(int(r["L"])), r["q_tokens"], r["us"], r["tbps"], r.get("of_copy") or "–"]
            for r in read_csv(path)]
    return table([">B", ">L", ">new tokens", ">µs", ">TB/s", ">of copy"], rows)


SERVER_LINE = re.compile(r"^tokens=(\d+)\s+concurrency=(\d+)\s+batching=(on|off)\s+(\{.*\})\s*$")


def server_section(run):
    path = run.file("server/load_summary.txt")
    if path is None:
        return None
    cells = {}
    for line in path.read_text().splitlines():
        m = SERVER_LINE.match(line)
        if m:
            cells[(int(m[1]), int(m[2]), m[3])] = json.loads(m[4])
    rows = []
    for tokens, conc in sorted({(t, c) for t, c, _ in cells}):
        row = [tokens, conc]
        rates = {}
        for batching in ("on", "off"):
            rep = cells.get((tokens, conc, batching))
            if rep is None:
                row += ["–", "–"]
                continue
            rates[batching] = rep["tokens_per_second"]
            lat = rep.get("latency_ms", {})
            row += [number(rep["tokens_per_second"]),
                    f"{lat['p50']:.2f} / {lat['p99']:.2f}" if "p50" in lat and "p99" in lat else "–"]
        row.append(f"{rates['on'] / rates['off']:.2f}×" if len(rates) == 2 and rates["off"] else "–")
        rows.append(row)
    return table([">tokens/request", ">concurrency", ">batching on: tok/s", ">p50 / p99 ms",
                  ">batching off: tok/s", ">p50 / p99 ms", ">on / off"], rows)


def runs_section(runs):
    if not runs:
        return None
    rows = []
    for run in runs:
        stages = [s for s, f in (("bench-kernels", "gemm_bench.csv"), ("bench-layer", "layer_ours.csv"),
                                 ("bench-decode", "decode_ours.csv"), ("bench-server", "server/load_summary.txt"))
                  if run.file(f)]
        rows.append([f"[{run.path.name}](results/{run.path.name}/)", run.meta["gpu"], f"`{run.meta['commit']}`",
                     run.meta["date"], ", ".join(stages) or "–", run.meta.get("source", "scripts/gpu-run.sh")])
    return table(["results", "GPU", "commit", "date", "stages", "from"], rows)


SECTIONS = {"gemm": gemm_section, "layer": layer_section, "layer-decode": layer_decode_section,
            "decode-attention": decode_attention_section, "server": server_section}


def render(name, runs):
    if name == "runs":
        body = runs_section(runs)
    elif name in SECTIONS:
        parts = []
        for run in runs:
            t = SECTIONS[name](run)
            if t is not None:
                extra = [f"Settings: {run.meta['settings']}"] if run.meta.get("settings") else []
                if run.meta.get("note"):
                    extra.append(run.meta["note"])
                parts.append("\n\n".join([run.heading(), *extra, t]))
        body = "\n\n".join(parts) if parts else None
    else:
        raise SystemExit(f"perf_report.py: unknown generated section '{name}'")
    if body is None:
        stage = STAGE_OF[name]
        body = (f"No results recorded yet; run `scripts/gpu-run.sh {stage}` on a GPU machine, copy its "
                f"`$OUT` into `docs/results/<gpu>-<commit>/` with a `meta.txt`, then `scripts/perf_report.py`.")
    return body + "\n"


def generate(doc_text, runs):
    def replace(m):
        return m[1] + "\n" + render(m[2], runs) + "\n" + m[4]

    out, count = MARKER.subn(replace, doc_text)
    if count == 0:
        raise SystemExit("perf_report.py: no <!-- generated: NAME --> markers in the document")
    return out


def load_runs(results):
    if not results.is_dir():
        return []
    return [Run(p) for p in sorted(results.iterdir()) if p.is_dir()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "performance.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if the document is not up to date")
    args = parser.parse_args(argv)
    old = args.doc.read_text()
    new = generate(old, load_runs(args.results))
    if args.check:
        if new != old:
            print(f"perf_report.py: {args.doc} is not up to date; run scripts/perf_report.py", file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.doc.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
