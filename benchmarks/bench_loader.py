"""Loader benchmark: cells/s and peak RSS over one epoch, deltacells next to annbatch and anndata.

    python benchmarks/bench_loader.py [--cells 100000] [--batch-size 4096] [--repeats 5]
                                      [--later-epochs 3] [--no-annbatch] [--no-s3]
                                      [--annbatch-python PATH]

On one input (``liao2020_balf.h5ad`` stacked with shuffled rows to ``--cells`` cells), each
loader runs one shuffled epoch of ``--batch-size`` batches in its own fresh process (so peak RSS
is that process's own), in one run; deltacells and annbatch run ``--repeats`` such processes
(median cells/s, largest peak RSS), the others one. The repeated loaders take turns, one
process of each per round, so that every one of them is timed in the same stretches of time;
``paired_speed_ratio`` (and ``paired_steady_speed_ratio``) is the median over rounds of each
round's ratio against annbatch. Locally, each deltacells and annbatch
process then runs ``--later-epochs`` more epochs, timed apart: ``steady_cells_per_s`` (median
over processes of each one's median later epoch) is the pace of a training run, without the
first epoch's start-up (threads, pools and pages made on first use), and the peak RSS covers
every epoch:

- deltacells ``Loader`` (default ``shuffle="tiles"``, source gene order; the stored gene
  order; and the source order with ``sorted_indices=False``), locally and through moto's S3
  server;
- annbatch 0.3.x with the zarrs codec pipeline and its README's settings (``chunk_size=32``,
  ``preload_nchunks=256``) on a collection it made itself (``shuffle=True``); annbatch needs
  Python >= 3.12, so it runs in its own virtualenv (``benchmarks/.annbatch-venv``, created on
  first use with ``pip install 'annbatch[zarrs]==0.3.1'``);
- anndata backed h5ad (uncompressed and gzip): random minibatches of sorted indices from
  ``sparse_dataset``; gzip is timed over its first batches only (it is about 100 times slower).

Through S3, annbatch and anndata are timed over their first ``--gzip-batches`` batches (each
is hundreds of times slower there than deltacells).

The source gene order's limit (``sort_floor`` in the JSON): in one more process, ``--repeats``
rounds of a stored-order epoch (rows copied as decoded), the row step's renumbering and sort
alone on every row of every tile (``_rows.sort_rows_only``: the row step's own sort into a
buffer that stays in cache), and a default epoch. A loader that decodes tiles and copies rows
out of them cannot beat the first two together (``floor_s``); ``source_vs_floor`` is the
default epoch against that sum, and ``floor_vs_annbatch_steady`` the sum's cells/s against
annbatch's later epochs. The default decodes straight into its batches (no copy), so it can
beat that sum; the limit no exact source-order loader on this zstd and this sort can beat is
zstd alone on every frame (``_frames.decompress_only``, ``zstd_only_s``) plus the sort alone
(``zstd_sort_s``; ``source_vs_zstd_sort`` and ``zstd_sort_vs_annbatch_steady`` likewise).

Writes ``benchmarks/results/loader.json`` and ``docs/_static/bench_loader.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"
ANNBATCH_VENV = HERE / ".annbatch-venv"
ANNBATCH_SPEC = ("annbatch[zarrs]==0.3.1", "s3fs")


# -- children: one epoch each, in a fresh process ------------------------------------------


def child_deltacells(path: str, batch_size: int, options: dict) -> dict:
    import deltacells as dc

    storage_options = options.pop("storage_options", None)
    epochs = options.pop("epochs", 1)
    loader = dc.Loader(path, batch_size=batch_size, seed=0, storage_options=storage_options,
                       **options)  # fmt: skip
    times, counts, cpu0 = [], [], time.process_time()
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        cells = 0
        for batch in loader:
            cells += batch.X.shape[0]
        times.append(time.perf_counter() - t0)
        counts.append(cells)
        if epoch == 0:
            cpu = time.process_time() - cpu0
    if len(set(counts)) != 1:
        raise RuntimeError(f"epochs gave different numbers of cells: {counts}")
    return {"cells": cells, "seconds": times[0], "cpu_s": cpu, "later_seconds": times[1:]}


def child_floor(path: str, batch_size: int, options: dict) -> dict:
    """The source order's limits in one process: per round, a stored-order epoch (rows copied
    as decoded), renumbering and sorting every row alone (``_rows.sort_rows_only``, the row
    step's own sort on all tiles, rows in random order), zstd alone on every frame, and a
    default (source-order) epoch. The first plus the second bound a loader that copies rows
    out of decoded tiles; zstd plus the sort bound any exact source-order loader.
    """
    import numpy as np

    import deltacells as dc
    from deltacells.codec import _frames, _rows
    from deltacells.codec.threads import effective_n_threads

    rounds = options.get("rounds", 5)
    n_threads = effective_n_threads(None)
    dataset = dc.open_dataset(path)
    col_map = dc.Loader(path, batch_size=batch_size)._col_map
    rng = np.random.default_rng(0)
    tiles = []
    for t in range(dataset.manifest.n_tiles):
        m = dataset.tile(t).decode(np.float32)
        tiles.append((m.indptr.astype(np.int64), m.indices, m.data, rng.permutation(m.shape[0])))

    def epoch(**kw) -> float:
        loader = dc.Loader(path, batch_size=batch_size, seed=0, **kw)
        t0 = time.perf_counter()
        for _ in loader:
            pass
        return time.perf_counter() - t0

    blobs = [dataset.tile(t) for t in range(dataset.manifest.n_tiles)]

    def zstd_all() -> float:
        t0 = time.perf_counter()
        for tile in blobs:
            _frames.decompress_only(tile._buf, tile.layout.chunks, n_threads)
        return time.perf_counter() - t0

    def sort_all() -> float:
        t0 = time.perf_counter()
        for indptr, indices, data, rows in tiles:
            _rows.sort_rows_only(indptr, indices, data, rows, col_map, n_threads)
        return time.perf_counter() - t0

    epoch(), epoch(column_order="stored")  # threads, pools and pages made once
    stored, sort, source, zstd = [], [], [], []
    for _ in range(rounds):
        stored.append(epoch(column_order="stored"))
        sort.append(sort_all())
        zstd.append(zstd_all())
        source.append(epoch())
    floor = [a + b for a, b in zip(stored, sort, strict=True)]
    bound = [a + b for a, b in zip(zstd, sort, strict=True)]
    return {"cells": dataset.manifest.n_cells, "rounds": rounds, "stored_epoch_s": stored,
            "sort_only_s": sort, "source_epoch_s": source, "floor_s": floor,
            "source_vs_floor_rounds": [f / s for f, s in zip(floor, source, strict=True)],
            "zstd_only_s": zstd, "zstd_sort_s": bound,
            "source_vs_zstd_sort_rounds": [b / s for b, s in zip(bound, source, strict=True)],
            "seconds": float(np.median(source))}  # fmt: skip


def child_anndata(path: str, batch_size: int, options: dict) -> dict:
    import anndata as ad
    import h5py
    import numpy as np

    storage_options = options.get("storage_options")
    if storage_options is None:
        X = ad.io.sparse_dataset(h5py.File(path, "r")["X"])
    else:  # h5py reads through an fsspec file object: one ranged request per HDF5 read
        import fsspec

        handle = fsspec.filesystem("s3", **storage_options).open(path, "rb")
        X = ad.io.sparse_dataset(h5py.File(handle, "r")["X"])
    order = np.random.default_rng(0).permutation(X.shape[0])
    max_batches = options.get("max_batches")
    t0 = time.perf_counter()
    cells = 0
    for i, start in enumerate(range(0, len(order), batch_size)):
        if max_batches is not None and i >= max_batches:
            break
        rows = np.sort(order[start : start + batch_size])
        cells += X[rows].shape[0]
    return {"cells": cells, "seconds": time.perf_counter() - t0}


def run_child(python: str, tool: str, path: str, batch_size: int, options: dict) -> dict:
    """One epoch of ``tool`` in a new process: cells, seconds, cells/s and its peak RSS."""
    spec = json.dumps({"tool": tool, "path": path, "batch_size": batch_size, "options": options})
    script = HERE / ("_annbatch_child.py" if tool == "annbatch" else "bench_loader.py")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([python, str(script), "--child", spec], capture_output=True,
                          text=True, env=env, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{tool} child failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["cells_per_s"] = result["cells"] / result["seconds"]
    later = result.get("later_seconds") or []
    if later:  # the epochs after the first, in the same process: a training run's pace
        result["steady_cells_per_s"] = result["cells"] / sorted(later)[len(later) // 2]
    return result


# -- set-up ------------------------------------------------------------------------------------


def make_inputs(source: Path, n_cells: int, workdir: Path) -> dict[str, Path]:
    """The stacked input as uncompressed and gzip .h5ad and as a deltacells dataset."""
    from _common import stacked_adata

    import deltacells as dc

    adata = stacked_adata(source, n_cells)
    paths = {"h5ad": workdir / "plain.h5ad", "h5ad_gzip": workdir / "gzip.h5ad",
             "deltacells": workdir / "x.dc"}  # fmt: skip
    adata.write_h5ad(paths["h5ad"])
    adata.write_h5ad(paths["h5ad_gzip"], compression="gzip")
    dc.write_deltacells(adata, paths["deltacells"], progress=False)
    return paths


def annbatch_python(explicit: str | None) -> str:
    """The annbatch virtualenv's Python (made on first use from a Python >= 3.12)."""
    from deltacells.testing import side_python

    python = side_python(ANNBATCH_VENV, list(ANNBATCH_SPEC), explicit)
    if python is None:
        raise RuntimeError("annbatch needs Python >= 3.12: pass --annbatch-python")
    return python


def paired_ratios(mine: list[dict], theirs: list[dict]) -> dict:
    """Median over rounds of each round's ratio (the two processes of a round ran one after
    the other), first epoch and later epochs."""

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    first = [a["cells_per_s"] / b["cells_per_s"] for a, b in zip(mine, theirs, strict=True)]
    out = {"paired_speed_ratio": median(first), "paired_speed_ratio_rounds": first}
    if all("steady_cells_per_s" in e for e in mine + theirs):
        later = [a["steady_cells_per_s"] / b["steady_cells_per_s"]
                 for a, b in zip(mine, theirs, strict=True)]  # fmt: skip
        out |= {"paired_steady_speed_ratio": median(later),
                "paired_steady_speed_ratio_rounds": later}  # fmt: skip
    return out


def summarize_floor(floor: dict, annbatch: dict | None) -> dict:
    """Medians of the floor child's rounds, and what they mean against annbatch."""

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    out = {key: median(floor[key]) for key in
           ("stored_epoch_s", "sort_only_s", "source_epoch_s", "floor_s", "zstd_only_s",
            "zstd_sort_s")}  # fmt: skip
    out["source_vs_floor"] = median(floor["source_vs_floor_rounds"])
    out["source_vs_floor_rounds"] = floor["source_vs_floor_rounds"]
    out["floor_cells_per_s"] = floor["cells"] / out["floor_s"]
    out["source_vs_zstd_sort"] = median(floor["source_vs_zstd_sort_rounds"])
    out["source_vs_zstd_sort_rounds"] = floor["source_vs_zstd_sort_rounds"]
    out["zstd_sort_cells_per_s"] = floor["cells"] / out["zstd_sort_s"]
    if annbatch is not None and "steady_cells_per_s" in annbatch:
        # The best an exact source-order loader on this sort could show in later epochs.
        out["floor_vs_annbatch_steady"] = out["floor_cells_per_s"] / annbatch["steady_cells_per_s"]
        out["zstd_sort_vs_annbatch_steady"] = (out["zstd_sort_cells_per_s"]
                                               / annbatch["steady_cells_per_s"])  # fmt: skip
    return out


def plot(results: dict, path: Path) -> None:
    runs = results["runs"]
    names = list(runs)
    from _common import page_figure, save_figure

    fig, axes = page_figure(2, panel_height=0.3 * len(names) + 0.9)
    axes[0].barh(names, [runs[n]["cells_per_s"] for n in names], color="tab:blue")
    # On the default loader's bar: the source order's floor (stored-order epoch plus the
    # sort alone, later epochs in one process) and the goal, 3x annbatch's first epoch.
    if "deltacells" in runs:
        y = names.index("deltacells")
        floor = (results.get("sort_floor") or {}).get("floor_cells_per_s")
        if floor:
            axes[0].plot([floor] * 2, [y - 0.45, y + 0.45], color="black", lw=2,
                         label="stored-order epoch + sort alone")  # fmt: skip
        bound = (results.get("sort_floor") or {}).get("zstd_sort_cells_per_s")
        if bound:
            axes[0].plot([bound] * 2, [y - 0.45, y + 0.45], color="tab:gray", lw=2, ls=":",
                         label="limit: zstd alone + sort alone")  # fmt: skip
        if "annbatch (zarrs)" in runs:
            goal = 3 * runs["annbatch (zarrs)"]["cells_per_s"]
            axes[0].plot([goal] * 2, [y - 0.45, y + 0.45], color="tab:red", lw=2, ls="--",
                         label="goal: 3x annbatch")  # fmt: skip
        if floor or "annbatch (zarrs)" in runs:
            axes[0].legend(fontsize=8, loc="upper right")
    axes[0].set_xscale("log")
    axes[0].set_xlabel("cells / s, log scale (higher is better)")
    axes[1].barh(names, [runs[n]["peak_rss_mb"] for n in names], color="tab:orange")
    axes[1].set_xlabel("peak RSS, MB (lower is better)")
    save_figure(fig, path, f"One epoch, {results['n_cells']:,} cells, batch "
                f"{results['batch_size']}", results)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--cells", type=int, default=100_000)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--gzip-batches", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="epochs per loader (median)")
    parser.add_argument("--later-epochs", type=int, default=3,
                        help="epochs after the first in each deltacells and annbatch process, "
                        "timed apart (steady_cells_per_s: a training run's pace)")
    parser.add_argument("--no-annbatch", action="store_true")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--annbatch-python")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --json")
    parser.add_argument("--json", type=Path, default=HERE / "results" / "loader.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "_static" / "bench_loader.png")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.json.read_text()), args.plot)
        return
    from _common import machine

    me = sys.executable
    workdir = Path(tempfile.mkdtemp(prefix="dc-bench-loader-"))
    runs: dict[str, dict] = {}
    floor: dict | None = None

    rounds: dict[str, list[dict]] = {}  # each interleaved loader's processes, in round order

    def record_rounds(loaders: list[tuple[str, str, str, Any, dict]], repeats: int) -> None:
        # One process of each loader per round, ``repeats`` rounds: every loader is timed in
        # the same stretches of time, so the machine's drift (up to a third from minute to
        # minute here) does not land on one of them.
        for _ in range(repeats):
            for name, python, tool, path, options in loaders:
                rounds.setdefault(name, []).append(
                    run_child(python, tool, str(path), args.batch_size, dict(options)))
        for name, *_ in loaders:
            record(name, epochs=rounds[name])

    def record(name: str, python: str = "", tool: str = "", path=None, options=None,
               repeats: int = 1, epochs: list[dict] | None = None) -> None:  # fmt: skip
        # Median cells/s and largest peak RSS of ``repeats`` epochs, each in a fresh process.
        if epochs is None:
            epochs = [run_child(python, tool, str(path), args.batch_size, dict(options))
                      for _ in range(repeats)]  # fmt: skip
        repeats = len(epochs)
        speeds = sorted(e["cells_per_s"] for e in epochs)
        runs[name] = {"cells": epochs[0]["cells"], "repeats": repeats,
                      "cells_per_s": speeds[len(speeds) // 2], "cells_per_s_all": speeds,
                      "peak_rss_mb": max(e["peak_rss_mb"] for e in epochs)}  # fmt: skip
        steady = sorted(e["steady_cells_per_s"] for e in epochs if "steady_cells_per_s" in e)
        if steady:
            runs[name] |= {"steady_cells_per_s": steady[len(steady) // 2],
                           "steady_cells_per_s_all": steady}  # fmt: skip
        row = runs[name]
        steady_text = (f", later epochs {row['steady_cells_per_s']:>10,.0f} cells/s"
                       if steady else "")  # fmt: skip
        print(f"  {name:34s} {row['cells_per_s']:>10,.0f} cells/s first epoch{steady_text}, "
              f"peak RSS {row['peak_rss_mb']:,.0f} MB", flush=True)  # fmt: skip

    try:
        print(f"making a {args.cells:,}-cell input ...", flush=True)
        paths = make_inputs(args.data, args.cells, workdir)
        if not args.no_annbatch:
            python = annbatch_python(args.annbatch_python)
            collection = workdir / "annbatch.zarr"
            run_child(python, "annbatch", str(paths["h5ad"]), args.batch_size,
                      {"convert_to": str(collection)})  # fmt: skip
        print("one epoch each:", flush=True)
        n = args.repeats
        more = {"epochs": 1 + args.later_epochs}
        loaders = [
            ("deltacells", me, "deltacells", paths["deltacells"], more),
            ("deltacells (stored gene order)", me, "deltacells", paths["deltacells"],
             {"column_order": "stored", **more}),
            ("deltacells (unsorted indices)", me, "deltacells", paths["deltacells"],
             {"sorted_indices": False, **more}),
        ]  # fmt: skip
        if not args.no_annbatch:
            loaders.append(("annbatch (zarrs)", python, "annbatch", str(collection), more))
        record_rounds(loaders, n)
        floor = run_child(me, "floor", str(paths["deltacells"]), args.batch_size,
                          {"rounds": n})  # fmt: skip
        record("anndata backed h5ad", me, "anndata", paths["h5ad"], {}, 1)
        record(f"anndata backed h5ad gzip ({args.gzip_batches} batches)", me, "anndata",
               paths["h5ad_gzip"], {"max_batches": args.gzip_batches}, 1)  # fmt: skip
        if not args.no_s3:
            remote = {k: paths[k] for k in ("deltacells", "h5ad")}
            if not args.no_annbatch:
                remote["annbatch"] = collection
            from _common import MotoS3

            with MotoS3() as s3:
                urls = {key: s3.upload(key, path) for key, path in remote.items()}
                so = {"storage_options": s3.options}
                record("deltacells via S3 (moto)", me, "deltacells", urls["deltacells"], so, 1)
                few = {**so, "max_batches": args.gzip_batches}
                if not args.no_annbatch:
                    record(f"annbatch via S3 ({args.gzip_batches} batches)", python, "annbatch",
                           urls["annbatch"], few, 1)  # fmt: skip
                record(f"anndata backed h5ad via S3 ({args.gzip_batches} batches)", me,
                       "anndata", urls["h5ad"], few, 1)  # fmt: skip
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results = {"machine": machine(), "command": "python benchmarks/bench_loader.py",
               "n_cells": args.cells, "batch_size": args.batch_size, "repeats": args.repeats,
               "runs": runs}  # fmt: skip
    if "annbatch (zarrs)" in runs:
        # Each deltacells run against annbatch on the same storage (local, or through S3).
        remote = runs.get("annbatch via S3 (5 batches)", runs["annbatch (zarrs)"])
        results["vs_annbatch"] = {
            name: {
                "speed_ratio": row["cells_per_s"] / ref["cells_per_s"],
                "rss_ratio": row["peak_rss_mb"] / ref["peak_rss_mb"],
            }
            for name, row in runs.items()
            if name.startswith("deltacells")
            for ref in [remote if "via S3" in name else runs["annbatch (zarrs)"]]
        }
        local_ref = runs["annbatch (zarrs)"]
        for name, ratios in results["vs_annbatch"].items():
            if "steady_cells_per_s" in runs[name] and "steady_cells_per_s" in local_ref:
                ratios["steady_speed_ratio"] = (runs[name]["steady_cells_per_s"]
                                                / local_ref["steady_cells_per_s"])  # fmt: skip
            if name in rounds and "annbatch (zarrs)" in rounds:
                ratios |= paired_ratios(rounds[name], rounds["annbatch (zarrs)"])
        print(json.dumps(results["vs_annbatch"], indent=1))
    if floor is not None:
        results["sort_floor"] = summarize_floor(floor, runs.get("annbatch (zarrs)"))
        print(json.dumps({k: v for k, v in results["sort_floor"].items() if "rounds" not in k},
                         indent=1))  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    plot(results, args.plot)
    print(f"wrote {args.json} and {args.plot}")


def child_main(spec: dict) -> None:
    from _common import peak_rss_mb

    tool, path, batch_size, options = (spec["tool"], spec["path"], spec["batch_size"],
                                       spec["options"])  # fmt: skip
    run = {"deltacells": child_deltacells, "anndata": child_anndata, "floor": child_floor}[tool]
    result = run(path, batch_size, options)
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child_main(json.loads(sys.argv[2]))
    else:
        main()
