"""The whole-AnnData parts on the read path: does opening or slicing slow down with obsm?

    python benchmarks/bench_elements.py [--repeats 7]

Writes liao2020_balf.h5ad (10,706 cells) with obsm of growing size (none, X_pca of 50 float32
components, and 50 + 500 + 2,000 components: up to 110 MB) plus a counts layer, and measures,
in one run: ``read_deltacells`` open time with ``elements=False``, ``"lazy"`` and ``True``
(obsm read into memory), and a 4,096-random-cell slice of X from each open AnnData, next to
anndata's own ``read_h5ad(backed="r")`` of the same data (which also reads obsm whole) as the
reference. Medians of ``--repeats``. Writes ``benchmarks/results/elements.json`` and
``docs/_static/bench_elements.png``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp
from _common import machine, median_time, page_figure, save_figure

import deltacells as dc

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"
SIZES = {"none": (), "pca50": (50,), "large": (50, 500, 2000)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    base = ad.read_h5ad(DATA)
    base.X = sp.csr_matrix(base.X)
    base.layers["counts"] = base.X.copy()
    rng = np.random.default_rng(0)
    rows = rng.choice(base.n_obs, 4096, replace=False)
    results: dict = {"machine": machine(), "command": "python benchmarks/bench_elements.py",
                     "repeats": args.repeats, "n_cells": base.n_obs, "cases": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-elements-") as tmp:
        for label, widths in SIZES.items():
            adata = base.copy()
            for i, width in enumerate(widths):
                adata.obsm[f"X_{i}"] = rng.random((adata.n_obs, width), dtype=np.float32)
            obsm_mb = sum(v.nbytes for v in adata.obsm.values()) / 1e6
            path = Path(tmp) / label
            dc.write_deltacells(adata, path / "d", progress=False)
            adata.write_h5ad(path / "x.h5ad")
            case = {"obsm_mb": obsm_mb}
            cache = Path(tmp) / "cache"
            for mode, elements in (("elements_false", False), ("elements_lazy", "lazy"),
                                   ("elements_true", True)):  # fmt: skip
                def open_dataset(e=elements, p=path, c=cache):
                    return dc.read_deltacells(p / "d", elements=e, cache_dir=c)

                open_s = median_time(open_dataset, args.repeats, warmup=True)
                lazy = dc.read_deltacells(path / "d", elements=elements, cache_dir=cache)
                slice_s = median_time(lambda a=lazy: a.X.copy()[rows], args.repeats)
                case[mode] = {"open_ms": open_s * 1e3, "slice_ms": slice_s * 1e3}
            backed_s = median_time(lambda p=path: ad.read_h5ad(p / "x.h5ad", backed="r"),
                                   args.repeats, warmup=True)  # fmt: skip
            case["anndata_backed_h5ad"] = {"open_ms": backed_s * 1e3}
            results["cases"][label] = case
            print(label, json.dumps(case))
    out = ROOT / "benchmarks" / "results" / "elements.json"
    out.write_text(json.dumps(results, indent=1))
    plot(results)
    table(results)


def table(results: dict) -> None:
    """The docs' table (``docs/_static/bench_elements.md``), from this run's figures."""
    lines = [
        f"Machine: {results['machine']['cpu']}, {results['machine']['usable_cpus']} CPUs; "
        f"medians of {results['repeats']} repeats, one run.",
        "",
        "| obsm | open, `elements=False` (ms) | `\"lazy\"` (ms) | `True` (ms) "
        "| anndata backed h5ad (ms) | slice 4,096 cells, False / lazy / True (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for case in results["cases"].values():
        f, z, t = (case[m] for m in ("elements_false", "elements_lazy", "elements_true"))
        lines.append(
            f"| {case['obsm_mb']:.1f} MB | {f['open_ms']:.0f} | {z['open_ms']:.0f} "
            f"| {t['open_ms']:.0f} | {case['anndata_backed_h5ad']['open_ms']:.0f} "
            f"| {f['slice_ms']:.1f} / {z['slice_ms']:.1f} / {t['slice_ms']:.1f} |"
        )
    path = ROOT / "docs" / "_static" / "bench_elements.md"
    path.write_text("\n".join(lines) + "\n")


#: The JSON keys of the reading modes and how the plot names them (the option as typed).
LEGEND = {"elements_false": "read_deltacells(elements=False)",
          "elements_lazy": 'read_deltacells(elements="lazy")',
          "elements_true": "read_deltacells(elements=True)"}  # fmt: skip


def plot(results: dict) -> None:
    labels = list(results["cases"])
    sizes = [results["cases"][k]["obsm_mb"] for k in labels]
    fig, (left, right) = page_figure(2, panel_height=2.8)
    for mode, label in LEGEND.items():
        left.plot(sizes, [results["cases"][k][mode]["open_ms"] for k in labels], "o-",
                  label=label)  # fmt: skip
        right.plot(sizes, [results["cases"][k][mode]["slice_ms"] for k in labels], "o-",
                   label=label)  # fmt: skip
    left.plot(sizes, [results["cases"][k]["anndata_backed_h5ad"]["open_ms"] for k in labels],
              "s--", label="anndata read_h5ad(backed='r')")  # fmt: skip
    left.set(xlabel="obsm size (MB)", ylabel="open (ms, median)", title="read_deltacells open")
    right.set(xlabel="obsm size (MB)", ylabel="ms (median)",
              title="slicing X: 4,096 random cells")  # fmt: skip
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    left.legend()
    right.legend()
    save_figure(fig, ROOT / "docs" / "_static" / "bench_elements.png", results=results)


if __name__ == "__main__":
    main()
