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


def run_chain(path: str, mode: str, result_file: str | None = None) -> dict:
    """The chain in this process; per step its seconds and peak RSS (written to
    ``result_file`` after each step, so that a run killed for memory leaves what it did)."""
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
        if result_file is not None:
            Path(result_file).write_text(json.dumps(out))
    out["x_kind"] = type(adata.X).__name__
    out["genes"] = list(map(str, adata.var_names))
    out["pca"] = np.asarray(adata.obsm["X_pca"])[:2000, :10].tolist()
    return out


def _child(path: str, mode: str, repeats: int, result_file: str) -> list[dict]:
    """``repeats`` runs of the chain, each in a new process; a run that fails (killed when
    the machine runs out of memory) ends the repeats and keeps the steps it finished, with
    ``failed`` naming the step and why."""
    runs = []
    for _ in range(repeats):
        Path(result_file).unlink(missing_ok=True)
        done = subprocess.run([sys.executable, __file__, "--child", path, mode, result_file])
        run = json.loads(Path(result_file).read_text()) if Path(result_file).exists() \
            else {"steps": {}, "rss_start_mb": float("nan")}  # fmt: skip
        if done.returncode != 0:
            step = next((s for s in STEPS if s not in run["steps"]), "after the chain")
            why = "killed (out of memory)" if done.returncode == -9 else \
                f"exit status {done.returncode}"  # fmt: skip
            run["failed"] = {"step": step, "reason": why}
        runs.append(run)
        if "failed" in run:
            break
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "dc-bench-scanpy")  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scanpy.json")
    parser.add_argument("--docs-dir", type=Path, default=ROOT / "docs" / "_static",
                        help="where the table and the plot go")  # fmt: skip
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, mode, result_file = args.child
        out = run_chain(path, mode, result_file)
        Path(result_file).write_text(json.dumps(out))
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
            "x_kind_at_end": runs[-1].get("x_kind"),
            "failed": runs[-1].get("failed"),
            "rss_start_mb": statistics.median(r["rss_start_mb"] for r in runs),
            "steps": {step: {
                "median_s": statistics.median(r["steps"][step]["seconds"] for r in runs),
                "peak_rss_mb": max(r["steps"][step]["peak_rss_mb"] for r in runs),
            } for step in STEPS if all(step in r["steps"] for r in runs)},
        }  # fmt: skip
        print(mode, json.dumps(results["modes"][mode]), flush=True)
    results["same_as_memory"], results["pca_max_relative_difference"] = compare(raw)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    write_docs(results, args.docs_dir)


def compare(raw: dict) -> tuple[dict, dict]:
    """Per reading mode: the same highly variable genes as in memory and the same PCA up to
    each component's sign (largest difference at most 1e-3 of the largest value: float32
    sums over a million cells differ in their last digits with the order of summation), or
    None for a run that did not finish; and that largest relative difference."""
    base = raw["memory"]
    same, differences = {}, {}
    for mode in ("default", "dask"):
        if "pca" not in raw[mode] or "pca" not in base:
            same[mode] = differences[mode] = None
            continue
        a, b = np.asarray(base["pca"]), np.asarray(raw[mode]["pca"])
        signs = np.sign(np.sum(a * b, axis=0))
        differences[mode] = float(np.abs(a - b * signs).max() / max(np.abs(a).max(), 1e-30))
        same[mode] = bool(raw[mode]["genes"] == base["genes"] and differences[mode] <= 1e-3)
    return same, differences


def write_docs(results: dict, docs_dir: Path = ROOT / "docs" / "_static") -> None:
    modes = results["modes"]

    def same(mode: str) -> str:
        value = results["same_as_memory"][mode]
        return "not finished" if value is None else ("yes" if value else "NO")

    failures = [f"{mode} stopped in `{m['failed']['step']}`: {m['failed']['reason']}"
                for mode, m in modes.items() if m.get("failed")]  # fmt: skip
    lines = [f"{results['cells']:,} cells (liao stacked), medians of {results['repeats']} "
             f"run(s); peak RSS of the process during the step, MB. Same genes and PCA as in "
             f"memory: default read {same('default')}, dask=True {same('dask')}."
             + (" " + "; ".join(failures) + "." if failures else ""), "",
             "| step | " + " | ".join(f"{m} s | {m} peak MB" for m in MODES) + " |",
             "|---" * (1 + 2 * len(MODES)) + "|"]  # fmt: skip

    def cell(mode: str, step: str) -> str:
        got = modes[mode]["steps"].get(step)
        if got is None:
            failed = modes[mode].get("failed") or {}
            return "failed | " + (
                "out of memory"
                if failed.get("step") == step and "memory" in failed.get("reason", "")
                else "–"
            )
        return f"{got['median_s']:.2f} | {got['peak_rss_mb']:,.0f}"

    for step in STEPS:
        lines.append(f"| `{step}` | " + " | ".join(cell(m, step) for m in MODES) + " |")
    whole = []
    for m in MODES:
        steps = modes[m]["steps"]
        if len(steps) < len(STEPS):
            whole.append("– | –")
        else:
            whole.append(f"{sum(v['median_s'] for v in steps.values()):.1f} | "
                         f"{max(v['peak_rss_mb'] for v in steps.values()):,.0f}")  # fmt: skip
    lines.append("| **whole chain** | " + " | ".join(whole) + " |")
    docs_dir.mkdir(parents=True, exist_ok=True)
    (docs_dir / "bench_scanpy.md").write_text("\n".join(lines) + "\n")

    fig, axes = page_figure(2)
    x = np.arange(len(STEPS))
    width = 0.27
    labels = {"memory": "in memory (to_memory())", "default": "read_deltacells(path)",
              "dask": "read_deltacells(path, dask=True)"}  # fmt: skip
    for i, mode in enumerate(MODES):
        steps = modes[mode]["steps"]
        label = labels[mode] + (" (stopped: out of memory)" if modes[mode].get("failed") else "")
        axes[0].bar(x + (i - 1) * width, [steps[s]["median_s"] if s in steps else 0
                                          for s in STEPS], width, label=label)  # fmt: skip
        axes[1].bar(x + (i - 1) * width, [steps[s]["peak_rss_mb"] / 1024 if s in steps else 0
                                          for s in STEPS], width, label=label)  # fmt: skip
    axes[0].set_ylabel("seconds")
    axes[1].set_ylabel("peak RSS, GB")
    for ax in axes:
        ax.set_xticks(x, STEPS, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.45)  # room for the legend above the bars
    axes[0].legend(fontsize=8, loc="upper center")
    save_figure(fig, docs_dir / "bench_scanpy.png",
                f"scanpy's chain on {results['cells']:,} cells", results)  # fmt: skip


if __name__ == "__main__":
    main()
