"""Opening an atlas whose cells have stored names (barcodes), against what a user would
otherwise run.

    python benchmarks/bench_names.py [--n-cells 10000000] [--repeats 5] [--workdir DIR]
                                     [--tag _py312] [--quick]

One dataset of ``--n-cells`` cells with unique 18-character barcodes (``ACGT`` x 16 + ``-1``)
and one nonzero per cell (what is measured is the names, not X), written once to
``--workdir`` as deltacells and as ``.h5ad``. Each measure runs in ``--repeats`` fresh
processes, timed after the imports, with the process's peak resident memory:

* ``deltacells``: ``read_deltacells(path, obs=False)`` with the obs cache warm (an AnnData
  whose obs names are the barcodes);
* ``pyarrow_to_pandas``: the same names column from the same cache turned into a pandas
  index by pyarrow's ``to_pandas`` (what deltacells did before, and what a reader of an Arrow
  or Parquet column gets by default: it hashes every string to share repeats);
* ``h5ad_backed``: ``anndata.read_h5ad(path, backed="r")`` (X stays on disk, obs and its
  names are read).

Writes ``benchmarks/results/names<tag>.json``, ``docs/_static/bench_names<tag>.png`` and the
docs' table ``docs/_static/bench_names<tag>.md``. ``--quick`` (CI): 200,000 cells, one
process each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from _common import fresh_processes, machine, page_figure, peak_rss_mb, save_figure

ROOT = Path(__file__).resolve().parent.parent

MODES = ("deltacells", "pyarrow_to_pandas", "h5ad_backed")


def barcodes(n_cells: int):
    """``n_cells`` unique barcodes: 16 bases from a bijection of the cell number (an odd
    multiplier modulo 4^16), then ``-1``."""
    import numpy as np

    codes = (np.arange(n_cells, dtype=np.uint64) * np.uint64(0x9E3779B1)) % np.uint64(4**16)
    digits = (codes[:, None] >> (2 * np.arange(15, -1, -1, dtype=np.uint64))) & np.uint64(3)
    letters = np.frombuffer(b"ACGT", dtype=np.uint8)[digits.astype(np.intp)]
    suffix = np.broadcast_to(np.frombuffer(b"-1", dtype=np.uint8), (n_cells, 2))
    return np.ascontiguousarray(np.concatenate([letters, suffix], axis=1)).view("S18").ravel()


def build(workdir: Path, n_cells: int) -> tuple[Path, Path]:
    import anndata as ad
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp

    import deltacells as dc

    path, h5ad = workdir / f"names_{n_cells}.dc", workdir / f"names_{n_cells}.h5ad"
    if (path / "manifest.json").exists() and h5ad.exists():
        return path, h5ad
    workdir.mkdir(parents=True, exist_ok=True)
    names = pd.Index(barcodes(n_cells).astype(str).astype(object))
    assert names.is_unique
    counts = sp.csr_matrix((np.ones(n_cells, dtype=np.float32),
                            (np.arange(n_cells) % 50).astype(np.int32),
                            np.arange(n_cells + 1)), shape=(n_cells, 50))  # fmt: skip
    adata = ad.AnnData(counts, obs=pd.DataFrame(index=names))
    dc.write_deltacells(adata, path, progress=False, overwrite=True)
    adata.write_h5ad(h5ad)
    dc.read_deltacells(path)  # fills the obs cache: the runs measure a warm open
    return path, h5ad


def child(mode: str, path: str, h5ad: str) -> dict:
    """One measure, as the first thing a fresh process does after its imports."""
    import anndata as ad
    import pandas as pd

    import deltacells as dc

    if mode == "deltacells":
        start = time.perf_counter()
        names = dc.read_deltacells(path, obs=False).obs_names
    elif mode == "pyarrow_to_pandas":
        from deltacells.read.obscache import ObsCache

        dataset = dc.open_dataset(path)
        cache = ObsCache(dataset)
        column = dataset.obs_index_column(dataset.obs_schema())
        start = time.perf_counter()
        names = pd.Index(cache.column(column).to_pandas().astype(str).to_numpy())
    elif mode == "h5ad_backed":
        start = time.perf_counter()
        names = ad.read_h5ad(h5ad, backed="r").obs_names
    else:
        raise ValueError(mode)
    seconds = time.perf_counter() - start
    return {"s": seconds, "process_peak_rss_mb": peak_rss_mb(), "n_names": len(names),
            "first": str(names[0]), "index_dtype": str(names.dtype)}  # fmt: skip


def fresh_runs(mode: str, path: Path, h5ad: Path, repeats: int) -> dict:
    """``child(mode, ...)`` in ``repeats`` fresh processes: the run of median time, with the
    median of every run's time (``median_s``) and each (``s_all``)."""
    runs = fresh_processes([__file__, "--child", mode, str(path), str(h5ad)], repeats)
    return runs | {"median_s": statistics.median(runs["s_all"])}


def table(results: dict) -> str:
    runs = results["runs"]
    lines = ["| measure | median s | fresh processes (s) | peak RSS MB | vs deltacells |",
             "|---|---|---|---|---|"]  # fmt: skip
    base = runs["deltacells"]["median_s"]
    for mode in MODES:
        run = runs[mode]
        spread = ", ".join(f"{s:.2f}" for s in run["s_all"])
        lines.append(f"| `{mode}` | {run['median_s']:.3f} | {spread} | "
                     f"{run['process_peak_rss_mb']:.0f} | {run['median_s'] / base:.1f}x |")
    return (f"{results['n_cells']:,} cells with unique barcodes, pandas {results['pandas']}; "
            f"`{results['command']}`\n\n" + "\n".join(lines) + "\n")


def plot(results: dict, path: Path) -> None:
    fig, (ax,) = page_figure(1, 2.6)
    runs = results["runs"]
    ax.barh(list(MODES), [runs[m]["median_s"] for m in MODES], color=["C0", "C1", "C2"])
    for y, mode in enumerate(MODES):
        ax.plot(runs[mode]["s_all"], [y] * len(runs[mode]["s_all"]), "k.", ms=4)
    ax.set_xlabel("seconds to an AnnData / index of the names (median; dots: each process)")
    ax.invert_yaxis()
    save_figure(fig, path, f"{results['n_cells']:,} stored obs names, fresh processes",
                results)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-cells", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/deltacells-bench-names"))
    parser.add_argument("--tag", default="", help="suffix of the outputs, e.g. _py312")
    parser.add_argument("--quick", action="store_true", help="200,000 cells, one process each")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "_static")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "PATH", "H5AD"),
                        help=argparse.SUPPRESS)  # fmt: skip
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    import pandas as pd

    n_cells, repeats = (200_000, 1) if args.quick else (args.n_cells, args.repeats)
    path, h5ad = build(args.workdir, n_cells)
    results = {"machine": machine(), "command": " ".join(["python", *sys.argv]),
               "n_cells": n_cells, "pandas": pd.__version__,
               "runs": {mode: fresh_runs(mode, path, h5ad, repeats) for mode in MODES}}
    name = f"names{args.tag}" + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    if not args.quick:
        args.docs.mkdir(parents=True, exist_ok=True)
        (args.docs / f"bench_{name}.md").write_text(table(results))
        plot(results, args.docs / f"bench_{name}.png")
    print(table(results))


if __name__ == "__main__":
    main()
