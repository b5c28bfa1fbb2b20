"""scanpy's usual chain: in memory, on the default read, and on ``dask=True``.

    python benchmarks/bench_scanpy.py [--cells 1000000] [--repeats 1]

``liao2020_balf.h5ad`` stacked with shuffled rows to ``--cells`` cells is written as deltacells
once (kept in ``--workdir`` for reruns). Each way of reading then runs the same chain in a
process of its own, so that its peak memory is its own: ``calculate_qc_metrics``,
``filter_cells(min_genes=200)``, ``filter_genes(min_cells=3)``, ``normalize_total``,
``log1p``, ``highly_variable_genes`` (2,000 genes), the subset to those genes and ``pca``
(50 components, ``covariance_eigh``, the solver scanpy has for sparse dask and memory alike).
``scale`` is left out: it makes the matrix dense (8 GB at 1M cells x 2,000 genes in
memory), which says nothing about the reader.

* ``memory``: ``read_deltacells(path).to_memory()`` (the first step is that load);
* ``default``: ``read_deltacells(path)``, the lazy X handing scanpy its dask array;
* ``dask``: ``read_deltacells(path, dask=True)``.

Per step: wall time (median of ``--repeats``) and the peak resident memory of the process
while the step ran (sampled every 10 ms), plus the process's RSS before the chain. Checks that
the three give the same highly variable genes and PCA (up to sign). Writes
``benchmarks/results/scanpy.json``, ``docs/_static/bench_scanpy.png`` and the docs' table
``docs/_static/bench_scanpy.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _common import machine, page_figure, rss_mb, save_figure, stacked_adata

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"
MODES = ("memory", "default", "dask")
STEPS = ("read", "calculate_qc_metrics", "filter_cells", "filter_genes", "normalize_total",
         "log1p", "highly_variable_genes", "subset_hvg", "pca")  # fmt: skip


class PeakSampler:
    """The highest RSS (MB) seen while a step runs, sampled on a thread."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval, self.peak, self._stop = interval, 0.0, threading.Event()

    def __enter__(self) -> PeakSampler:
        self.peak = rss_mb()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb())


def run_chain(path: str, mode: str) -> dict:
    """The chain in this process; per step its seconds and peak RSS."""
    import warnings

    import scanpy as sc

    import deltacells as dc

    warnings.simplefilter("ignore")
    steps = {
        "read": lambda a: (dc.read_deltacells(path, dask=mode == "dask", elements=False)
                           if mode != "memory" else
                           dc.read_deltacells(path, elements=False).to_memory()),
        "calculate_qc_metrics": lambda a: sc.pp.calculate_qc_metrics(
            a, percent_top=None, log1p=False, inplace=True),
        "filter_cells": lambda a: sc.pp.filter_cells(a, min_genes=200),
        "filter_genes": lambda a: sc.pp.filter_genes(a, min_cells=3),
        "normalize_total": lambda a: sc.pp.normalize_total(a, target_sum=1e4),
        "log1p": lambda a: sc.pp.log1p(a),
        "highly_variable_genes": lambda a: sc.pp.highly_variable_genes(a, n_top_genes=2000),
        "subset_hvg": lambda a: a[:, a.var["highly_variable"].to_numpy()].copy(),
        "pca": lambda a: sc.pp.pca(a, n_comps=50, svd_solver="covariance_eigh"),
    }  # fmt: skip
    out = {"rss_start_mb": rss_mb(), "steps": {}}
    adata = None
    for name in STEPS:
        with PeakSampler() as sampler:
            t = time.perf_counter()
            result = steps[name](adata)
            if name == "pca" and hasattr(adata.obsm["X_pca"], "compute"):
                adata.obsm["X_pca"] = adata.obsm["X_pca"].compute()
            seconds = time.perf_counter() - t
        if name in ("read", "subset_hvg"):
            adata = result
        out["steps"][name] = {"seconds": seconds, "peak_rss_mb": sampler.peak}
    out["x_kind"] = type(adata.X).__name__
    out["genes"] = list(map(str, adata.var_names))
    out["pca"] = np.asarray(adata.obsm["X_pca"])[:2000, :10].tolist()
    return out


def _child(path: str, mode: str, repeats: int, result_file: str) -> dict:
    runs = []
    for _ in range(repeats):
        subprocess.run([sys.executable, __file__, "--child", path, mode, result_file],
                       check=True)  # fmt: skip
        runs.append(json.loads(Path(result_file).read_text()))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "dc-bench-scanpy")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scanpy.json")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, mode, result_file = args.child
        Path(result_file).write_text(json.dumps(run_chain(path, mode)))
        return

    import deltacells as dc

    path = args.workdir / f"liao-{args.cells}.dc"
    if not (path / "manifest.json").exists():
        args.workdir.mkdir(parents=True, exist_ok=True)
        dc.write_deltacells(stacked_adata(DATA, args.cells), path, overwrite=True,
                            progress=False)  # fmt: skip
    results = {"machine": machine(), "cells": args.cells, "repeats": args.repeats,
               "command": " ".join(["python", *sys.argv]), "modes": {}}  # fmt: skip
    raw = {}
    for mode in MODES:
        runs = _child(str(path), mode, args.repeats, str(args.workdir / f"{mode}.json"))
        raw[mode] = runs[-1]
        results["modes"][mode] = {
            "x_kind_at_end": runs[-1]["x_kind"],
            "rss_start_mb": statistics.median(r["rss_start_mb"] for r in runs),
            "steps": {step: {
                "median_s": statistics.median(r["steps"][step]["seconds"] for r in runs),
                "peak_rss_mb": max(r["steps"][step]["peak_rss_mb"] for r in runs),
            } for step in STEPS},
        }  # fmt: skip
        print(mode, json.dumps(results["modes"][mode]), flush=True)
    base = raw["memory"]
    same = {}
    for mode in ("default", "dask"):
        a, b = np.asarray(base["pca"]), np.asarray(raw[mode]["pca"])
        signs = np.sign(np.sum(a * b, axis=0))
        same[mode] = bool(raw[mode]["genes"] == base["genes"]
                          and np.allclose(a, b * signs, rtol=1e-3, atol=1e-3))  # fmt: skip
    results["same_as_memory"] = same
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    write_docs(results)


def write_docs(results: dict) -> None:
    modes = results["modes"]
    lines = [f"{results['cells']:,} cells (liao stacked), medians of {results['repeats']} "
             f"run(s); peak RSS of the process during the step, MB. Same genes and PCA as in "
             f"memory: default read {'yes' if results['same_as_memory']['default'] else 'NO'}, "
             f"dask=True {'yes' if results['same_as_memory']['dask'] else 'NO'}.", "",
             "| step | " + " | ".join(f"{m} s | {m} peak MB" for m in MODES) + " |",
             "|---" * (1 + 2 * len(MODES)) + "|"]  # fmt: skip
    for step in STEPS:
        cells = [f"{modes[m]['steps'][step]['median_s']:.2f} | "
                 f"{modes[m]['steps'][step]['peak_rss_mb']:,.0f}" for m in MODES]  # fmt: skip
        lines.append(f"| `{step}` | " + " | ".join(cells) + " |")
    totals = [sum(modes[m]["steps"][s]["median_s"] for s in STEPS) for m in MODES]
    peaks = [max(modes[m]["steps"][s]["peak_rss_mb"] for s in STEPS) for m in MODES]
    lines.append("| **whole chain** | " + " | ".join(
        f"{t:.1f} | {p:,.0f}" for t, p in zip(totals, peaks, strict=True)) + " |")
    (ROOT / "docs" / "_static" / "bench_scanpy.md").write_text("\n".join(lines) + "\n")

    fig, axes = page_figure(2)
    x = np.arange(len(STEPS))
    width = 0.27
    for i, mode in enumerate(MODES):
        axes[0].bar(x + (i - 1) * width, [modes[mode]["steps"][s]["median_s"] for s in STEPS],
                    width, label=mode)  # fmt: skip
        axes[1].bar(x + (i - 1) * width,
                    [modes[mode]["steps"][s]["peak_rss_mb"] / 1024 for s in STEPS], width,
                    label=mode)  # fmt: skip
    axes[0].set_ylabel("seconds")
    axes[1].set_ylabel("peak RSS, GB")
    for ax in axes:
        ax.set_xticks(x, STEPS, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    save_figure(fig, ROOT / "docs" / "_static" / "bench_scanpy.png",
                f"scanpy's chain on {results['cells']:,} cells", results)  # fmt: skip


if __name__ == "__main__":
    main()
