"""Conversion benchmark: write_deltacells next to anndata's gzip h5ad and zarr writers.

    python benchmarks/bench_write.py [--big-cells 1000000] [--repeats 3]

Measures, on the same data in one run: wall time and peak RSS of converting
``liao2020_balf.h5ad`` (10,706 cells) and of inputs made by stacking it with shuffled rows
(100,000 and ``--big-cells`` cells, written once as uncompressed .h5ad), next to
``AnnData.write_h5ad(compression="gzip")`` and ``AnnData.write_zarr`` of the same data; plus a
zstd level table for the liao conversion. Each measurement runs in a fresh process so peak RSS
is its own. Writes ``benchmarks/results/write.json`` and ``docs/_static/bench_write.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import machine, page_figure, save_figure, stacked_adata

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"

# Each job runs in its own interpreter: python -c JOB src dst level. It reports its own peak
# RSS from /proc/self/status (VmHWM belongs to the new process image; ru_maxrss would carry the
# launching process's high-water mark across exec).
PEAK = (
    "; print('PEAK_KB', next(line.split()[1] for line in open('/proc/self/status') "
    "if line.startswith('VmHWM')))"
)
JOBS = {
    "deltacells": (
        "import sys, deltacells as dc, time; t = time.perf_counter(); "
        "dc.write_deltacells(sys.argv[1], sys.argv[2], zstd_level=int(sys.argv[3]), "
        "progress=False); print('WRITE_SECONDS', time.perf_counter() - t)"
    ),
    "deltacells_in_memory": (
        "import sys, anndata as ad, deltacells as dc, time; a = ad.read_h5ad(sys.argv[1]); "
        "t = time.perf_counter(); "
        "dc.write_deltacells(a, sys.argv[2], zstd_level=int(sys.argv[3]), progress=False); "
        "print('WRITE_SECONDS', time.perf_counter() - t)"
    ),
    "anndata_h5ad_gzip": (
        "import sys, anndata as ad, time; a = ad.read_h5ad(sys.argv[1]); "
        "t = time.perf_counter(); a.write_h5ad(sys.argv[2], compression='gzip'); "
        "print('WRITE_SECONDS', time.perf_counter() - t)"
    ),
    "anndata_zarr": (
        "import sys, anndata as ad, time; a = ad.read_h5ad(sys.argv[1]); "
        "t = time.perf_counter(); a.write_zarr(sys.argv[2]); "
        "print('WRITE_SECONDS', time.perf_counter() - t)"
    ),
}


def run_job(job: str, src: Path, dst: Path, level: int) -> dict:
    """Wall time of the whole process, and of the write alone where it can be separated."""
    shutil.rmtree(dst, ignore_errors=True)
    if dst.exists():
        dst.unlink()
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", JOBS[job] + PEAK, str(src), str(dst), str(level)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    reported = dict(
        line.split()[:2] for line in out.stdout.splitlines() if line.isupper() or " " in line
    )
    write_s = float(reported["WRITE_SECONDS"]) if "WRITE_SECONDS" in reported else None
    size = (
        sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
        if dst.is_dir()
        else dst.stat().st_size
    )
    return {
        "job": job,
        "wall_s": wall,
        "write_s": write_s,
        "peak_rss_mb": int(reported["PEAK_KB"]) / 1024,
        "bytes": size,
    }


def make_stacked(source: Path, n_cells: int, path: Path, seed: int = 0) -> None:
    """``source`` stacked with shuffled rows up to ``n_cells`` cells, written uncompressed."""
    stacked_adata(source, n_cells, seed).write_h5ad(path)


def measure(job: str, src: Path, workdir: Path, level: int, repeats: int) -> dict:
    runs = [run_job(job, src, workdir / f"out-{job}", level) for _ in range(repeats)]
    rss = max(r["peak_rss_mb"] for r in runs)
    walls = [r["wall_s"] for r in runs]
    writes = [r["write_s"] for r in runs if r["write_s"] is not None]
    return {
        "job": job,
        "wall_s_median": statistics.median(walls),
        "write_s_median": statistics.median(writes) if writes else None,
        "peak_rss_mb": rss,
        "bytes": runs[-1]["bytes"],
        "repeats": repeats,
    }


def plot(results: dict, path: Path) -> None:
    fig, axes = page_figure(2, panel_height=3.0)
    sizes = sorted(results["conversions"], key=int)
    jobs = [r["job"] for r in results["conversions"][sizes[0]]]
    for job in jobs:
        rows = [next(r for r in results["conversions"][n] if r["job"] == job) for n in sizes]
        x = [int(n) for n in sizes]
        axes[0].plot(x, [r["write_s_median"] for r in rows], "o-", label=job)
        axes[1].plot(x, [r["peak_rss_mb"] for r in rows], "o-", label=job)
    for ax, label in ((axes[0], "seconds to write (median)"), (axes[1], "peak RSS (MB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("cells")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    save_figure(fig, path, "Conversion", results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--mid-cells", type=int, default=100_000)
    parser.add_argument("--big-cells", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--levels", default="1,3,6,9,12,15,19")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "write.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "_static" / "bench_write.png")
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --json")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads(args.json.read_text()), args.plot)
        return
    from deltacells.codec.tile import DEFAULT_LEVEL

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dc-bench-write-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine(), "command": "python benchmarks/bench_write.py",
                     "default_level": DEFAULT_LEVEL, "conversions": {}}  # fmt: skip
    try:
        inputs = {10_706: args.data}
        for n in (args.mid_cells, args.big_cells):
            if n:
                path = workdir / f"stacked_{n}.h5ad"
                if not path.exists():
                    print(f"making {n:,}-cell input ...", flush=True)
                    make_stacked(args.data, n, path)
                inputs[n] = path
        for n, src in inputs.items():
            repeats = args.repeats if n < 500_000 else 1
            rows = []
            for job in ("deltacells", "deltacells_in_memory", "anndata_h5ad_gzip", "anndata_zarr"):
                row = measure(job, src, workdir, DEFAULT_LEVEL, repeats)
                rows.append(row)
                print(
                    f"{n:>9,} cells  {job:22s} process {row['wall_s_median']:8.2f} s  write "
                    f"{row['write_s_median']:8.2f} s  peak RSS {row['peak_rss_mb']:8.0f} MB  "
                    f"{row['bytes'] / 1e6:9.1f} MB",
                    flush=True,
                )
            results["conversions"][n] = rows
            by_job = {r["job"]: r for r in rows}
            gzip_write = by_job["anndata_h5ad_gzip"]["write_s_median"]
            in_memory = by_job["deltacells_in_memory"]["write_s_median"]
            from_file = by_job["deltacells"]
            results.setdefault("ratios", {})[n] = {
                "in_memory_write_vs_h5ad_gzip_write": in_memory / gzip_write,
                "file_conversion_vs_h5ad_gzip_write": from_file["write_s_median"] / gzip_write,
                "file_conversion_process_vs_h5ad_gzip_process": from_file["wall_s_median"]
                / by_job["anndata_h5ad_gzip"]["wall_s_median"],
            }
            print(f"  ratios: {results['ratios'][n]}", flush=True)
        sizes = [n for n in inputs if n >= args.mid_cells]
        if len(sizes) == 2:
            rss = {
                n: {r["job"]: r["peak_rss_mb"] for r in results["conversions"][n]} for n in sizes
            }
            results["rss_growth_deltacells"] = (
                rss[sizes[1]]["deltacells"] / rss[sizes[0]]["deltacells"]
            )
            print(f"deltacells peak RSS {sizes[1]:,} / {sizes[0]:,} cells: "
                  f"{results['rss_growth_deltacells']:.2f}")  # fmt: skip
        print("level table (liao, file conversion):")
        table = []
        for level in [int(x) for x in args.levels.split(",")]:
            row = measure("deltacells", args.data, workdir, level, 1)
            tile_bytes = sum(
                p.stat().st_size for p in (workdir / "out-deltacells" / "tiles").iterdir()
            )
            import deltacells as dc

            ds = dc.open_dataset(workdir / "out-deltacells")
            t0 = time.perf_counter()
            for i in range(ds.manifest.n_tiles):
                ds.tile(i).decode()
            decode_s = time.perf_counter() - t0
            per_nnz = tile_bytes / ds.manifest.nnz
            table.append(
                {"level": level, "convert_s": row["write_s_median"], "bytes_per_nnz": per_nnz,
                 "decode_s": decode_s}
            )  # fmt: skip
            print(
                f"  level {level:2d}: {per_nnz:.4f} B/nnz, convert {row['write_s_median']:.2f} s, "
                f"decode {decode_s:.3f} s",
                flush=True,
            )
        results["levels"] = table
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    plot(results, args.plot)
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
