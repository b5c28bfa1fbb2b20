"""Converting an atlas of many .h5ad files: one process against dask.distributed workers.

    python benchmarks/bench_convert.py [--cells-per-file 20000] [--files 1 2 5 10]

``liao2020_balf.h5ad`` stacked with shuffled rows into ``max(--files)`` files of
``--cells-per-file`` cells each (uncompressed h5ad). Each conversion runs in a fresh process:

* the single-process writer (its kernels use every core for encoding);
* a ``LocalCluster`` of 1 and of 2 worker processes (one thread each) passed as ``client=``;

on 1 .. 10 input files, reporting wall time, the speed-up of 2 workers over 1 and over the
single process, the peak RSS of the process that calls ``write_deltacells`` and of each
worker (their own VmHWM, asked with ``client.run``), and whether the outputs are byte-identical
(same manifest). Writes ``benchmarks/results/convert.json``, ``docs/_static/bench_convert.png``
and the docs' table ``docs/_static/bench_convert.md`` (``--from-json`` redraws both).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, page_figure, peak_rss_mb, save_figure, stacked_adata

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"


def child(spec: dict) -> dict:
    """One conversion, in this fresh process."""
    import deltacells as dc

    inputs, out, workers = spec["inputs"], spec["out"], spec["workers"]
    if workers == 0:
        t = time.perf_counter()
        dc.write_deltacells(inputs, out, progress=False)
        seconds = time.perf_counter() - t
        worker_rss: list[float] = []
    else:
        from distributed import Client, LocalCluster

        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               dashboard_address=None)  # fmt: skip
        with cluster, Client(cluster) as client:
            t = time.perf_counter()
            dc.write_deltacells(inputs, out, client=client, progress=False)
            seconds = time.perf_counter() - t
            worker_rss = sorted(client.run(peak_rss_mb).values())
    manifest = (Path(out) / "manifest.json").read_bytes()
    return {"seconds": seconds, "caller_peak_rss_mb": peak_rss_mb(), "worker_peak_rss_mb":
            worker_rss, "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
            "n_cells": json.loads(manifest)["n_cells"]}  # fmt: skip


def run(inputs: list[Path], out: Path, workers: int) -> dict:
    spec = {"inputs": [str(p) for p in inputs], "out": str(out), "workers": workers}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    shutil.rmtree(out)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells-per-file", type=int, default=20_000)
    parser.add_argument("--files", type=int, nargs="+", default=[1, 2, 5, 10])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results"
                        / "convert.json")  # fmt: skip
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--from-json", type=Path, help="only redraw the plot and table")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        plot(results)
        table(results)
        return
    results: dict = {"machine": machine(), "command": " ".join(["python", *sys.argv]),
                     "cells_per_file": args.cells_per_file, "runs": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-convert-") as tmp:
        work = Path(tmp)
        files = []
        for i in range(max(args.files)):
            path = work / f"part{i}.h5ad"
            stacked_adata(DATA, args.cells_per_file, seed=i).write_h5ad(path)
            files.append(path)
        for n in args.files:
            row: dict = {"files": n}
            for label, workers in (("single_process", 0), ("dask_1_worker", 1),
                                   ("dask_2_workers", 2)):  # fmt: skip
                row[label] = run(files[:n], work / "out.dc", workers)
                print(n, label, json.dumps(row[label]), flush=True)
            digests = {row[k]["manifest_sha256"] for k in ("single_process", "dask_1_worker",
                                                           "dask_2_workers")}  # fmt: skip
            row["byte_identical"] = len(digests) == 1
            row["speedup_2_vs_1_worker"] = (row["dask_1_worker"]["seconds"]
                                            / row["dask_2_workers"]["seconds"])  # fmt: skip
            row["speedup_2_workers_vs_single_process"] = (row["single_process"]["seconds"]
                                                          / row["dask_2_workers"]["seconds"])
            results["runs"].append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    if not args.no_plot:
        plot(results)
        table(results)


def table(results: dict) -> None:
    """The docs' table of this run (``docs/_static/bench_convert.md``)."""
    lines = [
        "| files | cells | one process | dask, 1 worker | dask, 2 workers | 2 vs 1 worker | "
        "peak RSS: one process | caller (2 workers) | largest worker (2 workers) | "
        "byte-identical |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        one, w1, w2 = r["single_process"], r["dask_1_worker"], r["dask_2_workers"]
        lines.append(
            f"| {r['files']} | {one['n_cells']:,} | {one['seconds']:.1f} s | "
            f"{w1['seconds']:.1f} s | {w2['seconds']:.1f} s | "
            f"{r['speedup_2_vs_1_worker']:.2f}x | {one['caller_peak_rss_mb']:,.0f} MB | "
            f"{w2['caller_peak_rss_mb']:,.0f} MB | {max(w2['worker_peak_rss_mb']):,.0f} MB | "
            f"{'yes' if r['byte_identical'] else 'NO'} |"
        )
    (ROOT / "docs" / "_static" / "bench_convert.md").write_text("\n".join(lines) + "\n")


def plot(results: dict) -> None:
    fig, (top, bottom) = page_figure(2, panel_height=2.8)
    files = [r["files"] for r in results["runs"]]
    labels = {"single_process": "one process", "dask_1_worker": "dask, 1 worker",
              "dask_2_workers": "dask, 2 workers"}  # fmt: skip
    for key, label in labels.items():
        top.plot(files, [r[key]["seconds"] for r in results["runs"]], marker="o", label=label)
    top.set(ylabel="seconds", xticks=files)
    top.legend(fontsize=7)
    bottom.plot(files, [r["single_process"]["caller_peak_rss_mb"] for r in results["runs"]],
                marker="o", label="one process")  # fmt: skip
    for key, label in (("dask_1_worker", "1 worker"), ("dask_2_workers", "2 workers")):
        bottom.plot(files, [max(r[key]["worker_peak_rss_mb"]) for r in results["runs"]],
                    marker="o", label=f"largest worker ({label})")  # fmt: skip
        bottom.plot(files, [r[key]["caller_peak_rss_mb"] for r in results["runs"]],
                    marker="x", linestyle=":", label=f"calling process ({label})")  # fmt: skip
    bottom.set(xlabel="input files", ylabel="peak RSS (MB)", xticks=files)
    bottom.legend(fontsize=7)
    save_figure(fig, ROOT / "docs" / "_static" / "bench_convert.png",
                f"Converting 1-{max(files)} h5ad files of {results['cells_per_file']:,} cells",
                results)  # fmt: skip


if __name__ == "__main__":
    main()
