"""How opening, reading and loading grow from 100k to 100M cells.

    python benchmarks/bench_scale.py [--repeats 1 10 98 977] [--quick] [--workdir DIR]
                                     [--base-tiles 25]

A base dataset of 102,400 cells (``liao2020_balf.h5ad`` stacked with shuffled rows; 25 tiles
of 4,096 cells, obs in one shard) is repeated by :func:`deltacells.testing.repeat_tiles`
(hard links, no disk space) to 1x, 10x, 98x and 977x its size: 102,400 to 100,044,800 cells.
For each size, a fresh process measures:

* ``open_dataset``: median time, bytes and reads, peak traced memory; the manifest's size;
* the ``Loader`` (4,096-cell batches, tiles shuffled): start-up (construction to the first
  batch), the median latency of the next batches, memory;
* a random batch: 4,096 random cells read with ``ranged_reads=True`` (only their chunks);
* ``read_deltacells``: open without obs columns (cells named ``"0" .. "n-1"``), and with all
  obs columns from a warm cache, time and memory;
* ``read_deltacells`` alone in a fresh process, as a user opening an atlas: once with obs
  names (``obs_names="names"``, the default) and once with ``obs_names="positions"`` (a
  RangeIndex, no string per cell): time, memory added and the process's peak resident
  memory, imports included (``open_fresh``). Each is run in ``--open-repeats`` fresh
  processes (default 5); the JSON keeps the run of median time, and every run's time under
  ``s_all`` (one process differs from the next by up to a third here).

The tiles are hard links to 25 files, so the page cache holds them all: this measures the
software's own growth, not a disk's. Writes ``benchmarks/results/scale.json``,
``docs/_static/bench_scale.png`` and the docs' table ``docs/_static/bench_scale.md``
(``--from-json`` redraws both from a saved run). ``--quick`` (CI) runs 1x and 10x;
``--base-tiles`` makes a smaller base (the CI smoke test: 5 tiles, 20,480 cells).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
from _common import (
    fresh_processes,
    machine,
    page_figure,
    peak_rss_mb,
    rss_mb,
    save_figure,
    stacked_adata,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"
BASE_TILES = 25
TILE_SIZE = 4096
BATCH = 4096
OBS_NAMES_MODES = ("names", "positions")
# The names' strings alone (``names_limit``) are measured up to this size: at 100M cells they
# would take gigabytes, as the names themselves do.
STRINGS_LIMIT_MAX_CELLS = 20_000_000


class Step:
    """Wall time, resident memory added by a block and its peak (tracemalloc would slow it
    down; the peak is the kernel's high-water mark, reset before the block where Linux allows)."""

    def __enter__(self):
        gc.collect()
        self.rss0 = rss_mb()
        self.peak_reset = reset_peak_rss()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
        self.rss_added_mb = rss_mb() - self.rss0
        self.peak_mb = peak_rss_mb() if self.peak_reset else None

    def record(self, **extra) -> dict:
        peak = {"peak_rss_mb": self.peak_mb}
        return {"s": self.s, "rss_added_mb": self.rss_added_mb, **peak, **extra}


def reset_peak_rss() -> bool:
    """Reset this process's peak resident memory (VmHWM) to its current one."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def traced_peak_mb(fn) -> float:
    """Peak memory numpy and Python allocate while ``fn()`` runs (its result dropped)."""
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def count_reads():
    """Patch the store to count the bytes and calls of every read (the child only)."""
    from deltacells.store.storage import Store

    counts = {"bytes": 0, "reads": 0}
    depth = threading.local()

    def counted(method):
        def wrapper(self, *args, **kwargs):
            # read_bytes may call read_buffer: count the outermost call only.
            depth.n = getattr(depth, "n", 0) + 1
            try:
                out = method(self, *args, **kwargs)
            finally:
                depth.n -= 1
            if depth.n == 0:
                counts["reads"] += 1
                counts["bytes"] += getattr(out, "nbytes", None) or len(out)
            return out

        return wrapper

    for name in ("read_bytes", "read_buffer", "read_range"):
        setattr(Store, name, counted(getattr(Store, name)))
    return counts


def child(path: str, repeats: int) -> dict:
    """Every measurement of one dataset, in this fresh process."""
    import deltacells as dc
    from deltacells.read.lazy_matrix import DeltacellsCSRDataset

    counts = count_reads()
    out: dict = {"manifest_bytes": (Path(path) / "manifest.json").stat().st_size}
    times = []
    for _ in range(7):
        t = time.perf_counter()
        dc.open_dataset(path)
        times.append(time.perf_counter() - t)
    counts.update(bytes=0, reads=0)
    with Step() as step:
        ds = dc.open_dataset(path)
    out["open"] = step.record(median_s=statistics.median(times), **counts)
    out["open"]["traced_peak_mb"] = traced_peak_mb(lambda: dc.open_dataset(path))
    out["n_cells"], out["n_tiles"] = ds.shape[0], ds.manifest.n_tiles

    with Step() as step:
        loader = dc.Loader(ds, batch_size=BATCH, shuffle="tiles", seed=0)
        batches = iter(loader)
        next(batches)
    latencies = []
    for _ in range(min(20, len(loader) - 1)):  # the first batch was start-up
        t = time.perf_counter()
        next(batches)
        latencies.append(time.perf_counter() - t)
    del batches

    def start_epoch() -> None:
        next(iter(dc.Loader(ds, batch_size=BATCH, shuffle="tiles", seed=1)))

    out["loader"] = step.record(batch_median_s=statistics.median(latencies),
                                batches_per_epoch=len(loader),
                                traced_peak_mb=traced_peak_mb(start_epoch))  # fmt: skip
    del loader

    X = DeltacellsCSRDataset(ds, ranged_reads=True, column_order="stored")
    rng = np.random.default_rng(0)
    picks = [np.sort(rng.choice(ds.shape[0], BATCH, replace=False)) for _ in range(repeats)]
    X[picks[0]]  # warm the page cache and the decoder's pools
    random_times = []
    for rows in picks:
        t = time.perf_counter()
        X[rows]
        random_times.append(time.perf_counter() - t)
    touched = len(np.unique(np.searchsorted(ds.manifest.limits, picks[0], side="right")))
    out["random_batch"] = {"median_s": statistics.median(random_times), "tiles_touched": touched}
    del X

    with Step() as step:
        adata = dc.read_deltacells(path, obs=False)
    out["read_deltacells_no_obs"] = step.record()
    del adata
    dc.read_deltacells(path, obs=True)  # fills the obs cache
    gc.collect()
    with Step() as step:
        adata = dc.read_deltacells(path, obs=True)
    out["read_deltacells_obs"] = step.record(columns=list(adata.obs.columns))
    return out


def child_open(path: str, obs_names: str) -> dict:
    """read_deltacells(obs=False) as the first thing a fresh process does after its imports;
    ``obs_names="strings"``: the limit instead, the names' Python strings alone."""
    import deltacells as dc

    read = dc.read_deltacells  # imports the reading stack (anndata): not part of the open
    if obs_names == "strings":
        from deltacells.codec._rows import name_objects_only

        n_cells = dc.open_dataset(path).manifest.n_cells
        with Step() as step:
            names = name_objects_only(range(n_cells))
        return step.record(process_peak_rss_mb=peak_rss_mb(), n_names=len(names))
    with Step() as step:
        adata = read(path, obs=False, obs_names=obs_names)
    return step.record(process_peak_rss_mb=peak_rss_mb(),
                       obs_names_type=type(adata.obs_names).__name__)  # fmt: skip


def fresh_runs(path: Path, mode: str, repeats: int) -> dict:
    """``child_open(path, mode)`` in ``repeats`` fresh processes: the run of median time, and
    every run's time under ``s_all``."""
    return fresh_processes([__file__, "--child-open", str(path), mode], repeats)


def base_dataset(workdir: Path, tiles: int) -> Path:
    import deltacells as dc

    base = workdir / "base"
    if not (base / "manifest.json").exists():
        adata = stacked_adata(DATA, tiles * TILE_SIZE)
        dc.write_deltacells(adata, base, tile_size=TILE_SIZE, obs_tiles_per_file=tiles,
                            progress=False)  # fmt: skip
    return base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 10, 98, 977])
    parser.add_argument("--quick", action="store_true", help="1x and 10x only (CI)")
    parser.add_argument("--open-repeats", type=int, default=5,
                        help="fresh processes per read_deltacells open (median; 1 with --quick)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/deltacells-bench-scale"))
    parser.add_argument("--base-tiles", type=int, default=BASE_TILES,
                        help="tiles of 4,096 cells in the base dataset (default 25)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--child-open", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--from-json", type=Path, help="only redraw the plot and table")
    parser.add_argument("--tag", default="", help="suffix of the JSON, table and plot names "
                        "(e.g. _py312 for a run on the other stack)")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]))))
        return
    if args.child_open:
        print(json.dumps(child_open(*args.child_open)))
        return
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        plot(results, args.tag)
        table(results, args.tag)
        return
    from deltacells.testing import repeat_tiles

    sizes = [1, 10] if args.quick else args.repeats
    # One folder per base size: a smaller base is never taken for the default one.
    workdir = args.workdir if args.base_tiles == BASE_TILES \
        else args.workdir / f"base_tiles_{args.base_tiles}"
    workdir.mkdir(parents=True, exist_ok=True)
    base = base_dataset(workdir, args.base_tiles)
    results: dict = {"machine": machine(), "command": " ".join(["python", *sys.argv]),
                     "base_cells": args.base_tiles * TILE_SIZE, "tile_size": TILE_SIZE,
                     "batch_size": BATCH, "sizes": []}  # fmt: skip
    for repeats in sizes:
        path = workdir / f"x{repeats}"
        if not (path / "manifest.json").exists():
            repeat_tiles(base, path, args.base_tiles * repeats)
        run = subprocess.run([sys.executable, __file__, "--child", str(path), "3"],
                             capture_output=True, text=True, check=True)  # fmt: skip
        size = json.loads(run.stdout.strip().splitlines()[-1])
        repeats_fresh = 1 if args.quick else args.open_repeats
        size["open_fresh"] = {mode: fresh_runs(path, mode, repeats_fresh)
                              for mode in OBS_NAMES_MODES}  # fmt: skip
        if size["n_cells"] <= STRINGS_LIMIT_MAX_CELLS:
            size["names_limit"] = fresh_runs(path, "strings", repeats_fresh)
        results["sizes"].append(size)
        print(
            f"{size['n_cells']:>12,} cells: open {size['open']['median_s'] * 1e3:.1f} ms "
            f"({size['manifest_bytes'] / 1e6:.2f} MB manifest), loader start "
            f"{size['loader']['s']:.2f} s, batch {size['loader']['batch_median_s'] * 1e3:.1f} "
            f"ms, random batch {size['random_batch']['median_s'] * 1e3:.0f} ms, "
            f"read_deltacells {size['read_deltacells_no_obs']['s']:.2f} s "
            f"(+{size['read_deltacells_no_obs']['rss_added_mb']:.0f} MB); fresh process: "
            + ", ".join(f"{mode} {step['s']:.2f} s, peak {step['process_peak_rss_mb']:.0f} MB"
                        for mode, step in size["open_fresh"].items()),
            flush=True,
        )
    first, last = results["sizes"][0], results["sizes"][-1]
    batch = [size["loader"]["batch_median_s"] for size in results["sizes"]]
    results["growth"] = {
        "loader_batch_latency_max_over_min": max(batch) / min(batch),
        "cells": last["n_cells"] / first["n_cells"],
        "loader_batch_latency": last["loader"]["batch_median_s"]
        / first["loader"]["batch_median_s"],
        "open_s": last["open"]["median_s"] / first["open"]["median_s"],
    }
    results["targets"] = {
        "open_under_100ms_and_10MB": last["open"]["median_s"] < 0.1
        and last["open"]["bytes"] < 10e6,
        "open_reads_only_the_manifest": last["open"]["reads"] == 1
        and last["open"]["bytes"] == last["manifest_bytes"],
        "loader_batch_latency_within_20pct": results["growth"]["loader_batch_latency_max_over_min"]
        <= 1.2,
        # The atlas goals, read_deltacells(obs=False) in a fresh process: 10M cells in 0.5 s
        # with obs names; 100M cells in 2 s and 1 GB peak resident memory of the whole
        # process (imports included), with obs_names="positions" (a pandas index of 100M
        # strings alone is over 1 GB) and, for comparison, with names. None: no such size.
        "read_deltacells_10M_under_0_5s": _open_goal(results, 1e7, 0.5, None, "names"),
        "read_deltacells_100M_under_2s_and_1GB": _open_goal(results, 1e8, 2.0, 1024.0,
                                                            "positions"),
        "read_deltacells_100M_names_under_2s_and_1GB": _open_goal(results, 1e8, 2.0, 1024.0,
                                                                  "names"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    name = "scale_quick.json" if args.quick else f"scale{args.tag}.json"
    (args.out / name).write_text(json.dumps(results, indent=1))
    if not args.quick:
        plot(results, args.tag)
        table(results, args.tag)


def size_near(results: dict, cells: float) -> dict | None:
    """The measured size within 10% of ``cells`` (the repeats give 10,035,200 for "10M"), or
    None when the run had none."""
    near = [s for s in results["sizes"] if 0.9 * cells <= s["n_cells"] <= 1.1 * cells]
    return near[0] if near else None


def _open_goal(results: dict, cells: float, seconds: float, peak_mb: float | None,
               mode: str) -> bool | None:  # fmt: skip
    """Whether read_deltacells (no obs, fresh process, ``obs_names=mode``) of the size
    nearest ``cells`` met its goal."""
    size = size_near(results, cells)
    if size is None or mode not in size.get("open_fresh", {}):
        return None
    step = size["open_fresh"][mode]
    if peak_mb is None:
        return step["s"] <= seconds
    return step["s"] <= seconds and step["process_peak_rss_mb"] <= peak_mb


def table(results: dict, tag: str = "") -> None:
    """The docs' table of this run (``docs/_static/bench_scale{tag}.md``)."""
    lines = [
        "| cells | tiles | manifest | open | loader start-up | loader batch | random 4,096 "
        "(ranged) | read_deltacells, no obs | with obs (warm cache) | fresh process, names | "
        "fresh process, positions |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in results["sizes"]:
        no_obs, obs = s["read_deltacells_no_obs"], s["read_deltacells_obs"]
        lines.append(
            f"| {s['n_cells']:,} | {s['n_tiles']:,} | {s['manifest_bytes'] / 1e6:.2f} MB | "
            f"{s['open']['median_s'] * 1e3:.1f} ms, {s['open']['reads']} read, "
            f"{s['open']['traced_peak_mb']:.1f} MB | {s['loader']['s'] * 1e3:.0f} ms, "
            f"{s['loader']['traced_peak_mb']:.1f} MB | "
            f"{s['loader']['batch_median_s'] * 1e3:.1f} ms | "
            f"{s['random_batch']['median_s'] * 1e3:,.0f} ms "
            f"({s['random_batch']['tiles_touched']:,} tiles) | "
            f"{no_obs['s']:.2f} s, +{no_obs['rss_added_mb']:,.0f} MB{_peak(no_obs)} | "
            f"{obs['s']:.2f} s, +{max(obs['rss_added_mb'], 0):,.0f} MB | "
            + " | ".join(_fresh(s, mode) for mode in OBS_NAMES_MODES)
            + " |"
        )
    g, t = results["growth"], results["targets"]
    lines += [
        "",
        f"From {results['sizes'][0]['n_cells']:,} to {results['sizes'][-1]['n_cells']:,} cells "
        f"({g['cells']:.0f}x): loader batch latency x{g['loader_batch_latency']:.2f}, the "
        f"slowest size's {g.get('loader_batch_latency_max_over_min', float('nan')):.2f}x the "
        f"fastest's (target within 20%: "
        f"{'met' if t['loader_batch_latency_within_20pct'] else 'missed'}); open "
        f"under 100 ms and 10 MB: {'met' if t['open_under_100ms_and_10MB'] else 'missed'}; open "
        f"reads only the manifest: {'yes' if t['open_reads_only_the_manifest'] else 'no'}. "
        'Memory: "MB" after open and loader start-up is the peak numpy and Python allocate '
        "(tracemalloc); after read_deltacells, the resident memory it added (and the "
        "process's peak resident memory during the call); fresh process: read_deltacells"
        "(obs=False) as the first call after the imports, with obs names or with "
        'obs_names="positions", and the peak resident memory of the whole process during it.',
        "",
        f"Atlas goals on this stack (pandas {results['machine']['packages'].get('pandas')}, "
        f"anndata {results['machine']['packages'].get('anndata')}): read_deltacells of 10M "
        f"cells in 0.5 s (with names): {_met(t.get('read_deltacells_10M_under_0_5s'))}; of "
        f"100M cells in 2 s and 1 GB peak with obs_names=\"positions\": "
        f"{_met(t.get('read_deltacells_100M_under_2s_and_1GB'))}, with names: "
        f"{_met(t.get('read_deltacells_100M_names_under_2s_and_1GB'))}." + _limit_text(results),
    ]
    (ROOT / "docs" / "_static" / f"bench_scale{tag}.md").write_text("\n".join(lines) + "\n")


def _limit_text(results: dict) -> str:
    """The docs' sentence on the 10M names' limit, when this run measured it."""
    near = [s for s in results["sizes"] if 0.9e7 <= s["n_cells"] <= 1.1e7 and "names_limit" in s]
    if not near:
        return ""
    limit = near[0]["names_limit"]
    return (f" The limit beside the 10M goal: making the {near[0]['n_cells']:,} names' Python "
            f"strings alone (right lengths, no digits written; `names_limit`, a fresh process "
            f"after the same imports) took {limit['s']:.2f} s "
            f"({min(limit['s_all']):.2f}-{max(limit['s_all']):.2f} s over "
            f"{len(limit['s_all'])} processes): the least an index of Python strings (pandas 2) "
            f"costs here.")


def _fresh(size: dict, mode: str) -> str:
    step = size.get("open_fresh", {}).get(mode)
    if step is None:
        return "not measured"
    return (f"{step['s']:.2f} s, +{step['rss_added_mb']:,.0f} MB "
            f"(peak {step['process_peak_rss_mb']:,.0f} MB)")  # fmt: skip


def _peak(step: dict) -> str:
    peak = step.get("peak_rss_mb")
    return "" if peak is None else f" (peak {peak:,.0f} MB)"


def _met(value: bool | None) -> str:
    return "not measured" if value is None else "met" if value else "missed"


def plot(results: dict, tag: str = "") -> None:
    fig, (top, bottom) = page_figure(2, panel_height=3.0)
    cells = [s["n_cells"] for s in results["sizes"]]
    lines = {
        "open_dataset": [s["open"]["median_s"] for s in results["sizes"]],
        "loader batch": [s["loader"]["batch_median_s"] for s in results["sizes"]],
        "loader start-up": [s["loader"]["s"] for s in results["sizes"]],
        "random 4,096 cells (ranged)": [s["random_batch"]["median_s"] for s in results["sizes"]],
        "read_deltacells (no obs)": [s["read_deltacells_no_obs"]["s"] for s in results["sizes"]],
    }
    for mode in OBS_NAMES_MODES:
        lines[f"read_deltacells, fresh process, obs_names={mode}"] = [
            s.get("open_fresh", {}).get(mode, {}).get("s", float("nan")) for s in results["sizes"]
        ]
    for label, values in lines.items():
        top.plot(cells, values, marker="o", label=label)
    top.set(xscale="log", yscale="log", ylabel="seconds")
    top.legend(fontsize=7)
    memory = {
        "manifest (MB)": [s["manifest_bytes"] / 1e6 for s in results["sizes"]],
        "read_deltacells, no obs (MB added)": [
            max(s["read_deltacells_no_obs"]["rss_added_mb"], 0.01) for s in results["sizes"]
        ],
        "read_deltacells, fresh, positions (process peak MB)": [
            s.get("open_fresh", {}).get("positions", {}).get("process_peak_rss_mb", float("nan"))
            for s in results["sizes"]
        ],
        "loader start-up (MB traced)": [s["loader"]["traced_peak_mb"] for s in results["sizes"]],
        "open_dataset (MB traced)": [s["open"]["traced_peak_mb"] for s in results["sizes"]],
    }
    for label, values in memory.items():
        bottom.plot(cells, values, marker="o", label=label)
    bottom.set(xscale="log", yscale="log", xlabel="cells (log)", ylabel="MB")
    bottom.legend(fontsize=7)
    save_figure(fig, ROOT / "docs" / "_static" / f"bench_scale{tag}.png",
                "Growth from 100k to 100M cells (tiles repeated)", results)  # fmt: skip


if __name__ == "__main__":
    main()
