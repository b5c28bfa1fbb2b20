"""Read benchmark: deltacells next to anndata backed h5ad (gzip and uncompressed) and zarr.

    python benchmarks/bench_read.py [--cells 100000] [--repeats 7] [--no-s3]

On one input (``liao2020_balf.h5ad`` stacked with shuffled rows to ``--cells`` cells), in one
run: 4,096 random cells (sorted and unsorted indices), a contiguous 10,000-cell slice, the whole
matrix into memory, and one obs column; locally and, with moto's S3 server on 127.0.0.1,
through ``s3://`` (requests and bytes counted). Medians of ``--repeats`` runs, each from a freshly
opened object (the OS page cache stays warm for every tool alike). Writes
``benchmarks/results/read.json`` and ``docs/_static/bench_read.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import zarr
from _common import MotoS3, machine, median_time, page_figure, save_figure, stacked_adata

import deltacells as dc
from deltacells.read.obscache import ObsCache

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"


def fine_name(n_chunks: int) -> str:
    return f"deltacells_n_chunks_{n_chunks}"


def make_inputs(source: Path, n_cells: int, workdir: Path, fine_chunks: int = 0) -> dict[str, Path]:
    """The stacked input in every format; with ``fine_chunks``, also a deltacells dataset with
    that many chunks per tile (the random-access layout)."""
    adata = stacked_adata(source, n_cells)
    paths = {
        "h5ad_gzip": workdir / "gzip.h5ad",
        "h5ad": workdir / "plain.h5ad",
        "zarr": workdir / "x.zarr",
        "deltacells": workdir / "x.dc",
    }
    adata.write_h5ad(paths["h5ad_gzip"], compression="gzip")
    adata.write_h5ad(paths["h5ad"])
    adata.write_zarr(paths["zarr"])
    dc.write_deltacells(adata, paths["deltacells"], progress=False)
    if fine_chunks:
        paths[fine_name(fine_chunks)] = workdir / "fine.dc"
        dc.write_deltacells(adata, paths[fine_name(fine_chunks)], n_chunks=fine_chunks,
                            progress=False)  # fmt: skip
    return paths


def stored_bytes(path: Path) -> int:
    """Bytes of a file, or of all files under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def readers(paths: dict[str, Path], cache_dir: Path, storage_options: dict | None = None):
    """Per tool: a function opening X freshly, and one localizing/reading an obs column."""

    def open_h5(path):
        return lambda: ad.io.sparse_dataset(h5py.File(path, "r")["X"])

    def obs_h5(path):
        def read(column):
            with h5py.File(path, "r") as f:
                return ad.io.read_elem(f["obs"][column])

        return read

    def obs_zarr(path):
        return lambda column: ad.io.read_elem(zarr.open_group(str(path), mode="r")["obs"][column])

    def open_dc(path):
        # X alone, as anndata's sparse_dataset opens X alone (read_deltacells also builds
        # obs_names and var: see opening_cost).
        return lambda: dc.DeltacellsCSRDataset(
            dc.open_dataset(path, storage_options=storage_options)
        )

    def obs_dc(path):
        def read(column):
            fresh = Path(tempfile.mkdtemp(dir=cache_dir))
            dataset = dc.open_dataset(path, storage_options=storage_options)
            return ObsCache(dataset, fresh).series(column)

        return read

    tools = {
        name: (open_dc(path), obs_dc(path))
        for name, path in paths.items()
        if name.startswith("deltacells")
    }
    tools |= {
        "anndata_zarr": (
            lambda: ad.io.sparse_dataset(zarr.open_group(str(paths["zarr"]), mode="r")["X"]),
            obs_zarr(paths["zarr"]),
        ),
    }
    if "h5ad" in paths:
        tools["anndata_h5ad_backed"] = (open_h5(paths["h5ad"]), obs_h5(paths["h5ad"]))
        tools["anndata_h5ad_gzip_backed"] = (
            open_h5(paths["h5ad_gzip"]),
            obs_h5(paths["h5ad_gzip"]),
        )
    return tools


def random_cells(n_cells: int) -> np.ndarray:
    """The 4,096 random cells every tool reads (same seed everywhere)."""
    return np.random.default_rng(1).choice(n_cells, 4096, replace=False)


def zstd_floor(path: Path, n_cells: int, repeats: int) -> dict:
    """The speed limit of each read: zstd decompression alone of the frames it must
    decompress (all of them for ``to_memory``; the chunks holding the random cells for the
    random read), by the kernels' libzstd on the default threads, tiles already in memory and
    validated, with no file reads, checks or decoding after zstd."""
    from deltacells.codec import _frames
    from deltacells.codec.threads import effective_n_threads
    from deltacells.read.dataset import group_by_tile

    dataset = dc.open_dataset(path)
    tiles = [dataset.tile(i) for i in range(dataset.manifest.n_tiles)]
    threads = effective_n_threads(None)
    limits = np.cumsum(dataset.manifest.tile_cells)
    random_rows = random_cells(n_cells)
    hit, groups, local = group_by_tile(random_rows, limits)
    touched = [np.zeros((0, tiles[0].layout.chunks.shape[1]), dtype=np.int64)] * len(tiles)
    for i, mine in zip(hit, groups, strict=True):
        chunk_ids = np.unique(tiles[i].chunk_of(local[mine]))
        touched[i] = np.ascontiguousarray(tiles[i].layout.chunks[chunk_ids])

    def decompress(tables):
        for tile, table in zip(tiles, tables, strict=True):
            _frames.decompress_only(tile._buf, table, threads)

    # The split of to_memory's kernel time: the same tiles decoded into buffers allocated
    # once, in the stored gene order (zstd, then the byte planes into CSR) and in the source
    # gene order (each cell renumbered and sorted as well: canonical CSR).
    matrix = dc.DeltacellsCSRDataset(dataset)
    to_source = matrix._to_source
    nnz = int(sum(t.nnz for t in tiles))
    indices, values = np.empty(nnz, dtype=np.int32), np.empty(nnz, dtype=matrix.dtype)
    indices.fill(0)
    values.fill(0)

    def decode(col_map, out=None):
        out_indices, out_values = out or (indices, values)
        offset = 0
        for tile in tiles:
            end = offset + tile.nnz
            tile.decode_into(out_indices[offset:end], out_values[offset:end], col_map=col_map)
            offset = end

    def decode_fresh():
        # As to_memory must: into newly allocated output (the kernel's page faults included).
        decode(None, (np.empty(nnz, dtype=np.int32), np.empty(nnz, dtype=matrix.dtype)))

    # The goals are ratios to zstd alone, and this machine's speed drifts by a third between
    # minutes: each ratio is also measured in alternating rounds (the read, then zstd alone on
    # the same frames), the median of the rounds' ratios.
    rounds = {"random_4096_reused": [], "to_memory": []}
    every_frame = [t.layout.chunks for t in tiles]
    matrix[random_rows]  # the tile cache filled, as for random_4096_reused_s
    for _ in range(repeats):
        ours = median_time(lambda: matrix[random_rows], 3)
        limit = median_time(lambda: decompress(touched), 3)
        rounds["random_4096_reused"].append(limit / ours)
        ours = median_time(lambda: dc.DeltacellsCSRDataset(dataset).to_memory(), 3)
        limit = median_time(lambda: decompress(every_frame), 3)
        rounds["to_memory"].append(limit / ours)
    paired = {f"{name}_vs_zstd": float(np.median(ratios)) for name, ratios in rounds.items()}
    paired |= {f"{name}_vs_zstd_rounds": ratios for name, ratios in rounds.items()}
    return paired | {
        "decode_stored_order_s": median_time(lambda: decode(None), repeats, warmup=True),
        "decode_source_order_s": median_time(lambda: decode(to_source), repeats, warmup=True)
        if to_source is not None else None,
        # What to_memory would cost if no row had to be put back in the source gene order.
        "decode_stored_order_fresh_s": median_time(decode_fresh, repeats, warmup=True),
        "to_memory_s": median_time(
            lambda: decompress([t.layout.chunks for t in tiles]), repeats, warmup=True
        ),
        "random_4096_s": median_time(lambda: decompress(touched), repeats, warmup=True),
        "random_4096_chunks": int(sum(len(t) for t in touched)),
        "random_4096_nnz": int(sum((t[:, 3] - t[:, 2]).sum() for t in touched)),
        "n_threads": threads,
    }


def run_suite(tools: dict, n_cells: int, repeats: int) -> dict:
    random_rows = random_cells(n_cells)
    sorted_rows = np.sort(random_rows)
    start = n_cells // 3
    results: dict = {}
    for name, (open_x, read_obs) in tools.items():
        row: dict = {}

        def unsorted_on(X, name):
            if name.startswith("deltacells"):
                return X[random_rows]
            # anndata's backed datasets want increasing indices: sort, read, put back in order.
            order = np.argsort(random_rows)
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(order))
            return X[random_rows[order]][inverse]

        def unsorted(open_x=open_x, name=name):
            return unsorted_on(open_x(), name)

        row["random_4096_unsorted_s"] = median_time(unsorted, repeats, warmup=True)
        # The same read on an X opened once, as in a session that reads again and again:
        # deltacells keeps parsed, checked tiles (tile_cache_bytes), h5py and zarr their own.
        opened = open_x()
        row["random_4096_reused_s"] = median_time(
            lambda opened=opened, name=name: unsorted_on(opened, name), repeats, warmup=True)
        row["random_4096_sorted_s"] = median_time(
            lambda open_x=open_x: open_x()[sorted_rows], repeats, warmup=True
        )
        row["slice_10000_s"] = median_time(
            lambda open_x=open_x: open_x()[start : start + 10_000], repeats, warmup=True
        )
        row["to_memory_s"] = median_time(
            lambda open_x=open_x: open_x().to_memory(), max(3, repeats // 2), warmup=True
        )
        row["obs_column_s"] = median_time(
            lambda read_obs=read_obs: read_obs("sample"), repeats, warmup=True
        )
        row["random_4096_unsorted_cells_per_s"] = 4096 / row["random_4096_unsorted_s"]
        row["random_4096_sorted_cells_per_s"] = 4096 / row["random_4096_sorted_s"]
        results[name] = row
        print(f"  {name:26s} " + "  ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    keys = (
        "random_4096_unsorted_s",
        "random_4096_reused_s",
        "random_4096_sorted_s",
        "slice_10000_s",
        "to_memory_s",
        "obs_column_s",
    )
    ours = [name for name in results if name.startswith("deltacells")]
    # ratios[ours][other][key]: how many times longer `other` takes than that deltacells layout.
    results["ratios"] = {
        mine: {
            other: {key: results[other][key] / results[mine][key] for key in keys}
            for other in results
            if not other.startswith("deltacells")
        }
        for mine in ours
    }
    return results


def opening_cost(path: Path, repeats: int, cache_dir: Path) -> dict:
    """Seconds to open the dataset (the manifest only, whatever the number of tiles), and to
    open it as an AnnData with obs_names and var (obs index column cached)."""
    seconds = median_time(lambda: dc.open_dataset(path), repeats, warmup=True)
    anndata_s = median_time(
        lambda: dc.read_deltacells(path, obs=False, cache_dir=cache_dir), repeats, warmup=True
    )
    return {"open_s": seconds, "read_deltacells_obs_false_s": anndata_s,
            "n_tiles": dc.open_dataset(path).manifest.n_tiles}  # fmt: skip


def s3_suite(paths: dict[str, Path], n_cells: int, repeats: int, cache_dir: Path) -> dict:
    """The same reads through moto's S3 server, with requests and bytes counted per tool."""
    import s3fs

    with MotoS3() as s3:
        for key in ("deltacells", "zarr"):
            s3.upload(key, paths[key])
        options = s3.options
        counts = {"requests": 0, "bytes": 0}
        original = s3fs.S3FileSystem._call_s3

        async def counted(self, method, *args, **kwargs):
            result = await original(self, method, *args, **kwargs)
            counts["requests"] += 1
            if isinstance(result, dict):
                counts["bytes"] += int(result.get("ContentLength", 0) or 0)
            return result

        s3fs.S3FileSystem._call_s3 = counted
        try:
            fs = s3fs.S3FileSystem(**options)
            remote = {"deltacells": "s3://bench/deltacells", "zarr": fs.get_mapper("bench/zarr")}
            tools = {
                "deltacells": readers(
                    {"deltacells": remote["deltacells"], "zarr": paths["zarr"]}, cache_dir, options
                )["deltacells"],
                "anndata_zarr": (
                    lambda: ad.io.sparse_dataset(zarr.open_group(remote["zarr"], mode="r")["X"]),
                    lambda column: ad.io.read_elem(
                        zarr.open_group(remote["zarr"], mode="r")["obs"][column]
                    ),
                ),
            }
            result = {}
            rows = np.sort(random_cells(n_cells))
            for name, (open_x, _) in tools.items():
                counts.update(requests=0, bytes=0)
                seconds = median_time(
                    lambda open_x=open_x: open_x()[rows], max(3, repeats // 2), warmup=True
                )
                per_call = {k: v / (max(3, repeats // 2) + 1) for k, v in counts.items()}
                result[name] = {
                    "random_4096_sorted_s": seconds,
                    **{f"{k}_per_call": v for k, v in per_call.items()},
                }
                print(f"  s3 {name:23s} {seconds:.3f} s, {per_call['requests']:.0f} requests, "
                      f"{per_call['bytes'] / 1e6:.1f} MB per call", flush=True)  # fmt: skip
            return result
        finally:
            s3fs.S3FileSystem._call_s3 = original


def plot(results: dict, path: Path) -> None:
    local = {k: v for k, v in results["local"].items() if k not in ("ratios", "bytes")}
    keys = [
        "random_4096_unsorted_s",
        "random_4096_reused_s",
        "random_4096_sorted_s",
        "slice_10000_s",
        "to_memory_s",
        "obs_column_s",
    ]
    # zstd alone on the frames each deltacells read decompresses (zstd_floor): the limit,
    # drawn as a black line across that layout's bar.
    limit_of = {"random_4096_reused_s": "random_4096_s", "to_memory_s": "to_memory_s"}
    floor = results.get("zstd_floor") or {}
    fig, (ax,) = page_figure(1, panel_height=4.2)
    width = 0.8 / len(local)
    limit_label = "zstd alone on the same frames (the limit)"
    for i, (tool, row) in enumerate(local.items()):
        x = np.arange(len(keys)) + i * width
        ax.bar(x, [row[k] for k in keys], width, label=tool)
        for j, key in enumerate(keys):
            limit = (floor.get(tool) or {}).get(limit_of.get(key, ""))
            if limit:
                ax.hlines(limit, x[j] - width / 2, x[j] + width / 2, colors="black",
                          linewidth=2.5, label=limit_label)  # fmt: skip
                limit_label = None  # one legend entry
    ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2,
                  [k.removesuffix("_s").replace("_", "\n", 1) for k in keys])  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 12)  # room for the legend above the bars
    ax.set_ylabel("seconds (median, lower is better)")
    ax.legend(fontsize=8, ncols=3, loc="upper center")
    save_figure(fig, path, f"Reads from {results['n_cells']:,} cells, local disk", results)


def layout_table(results: dict) -> str:
    """A Markdown table comparing the deltacells layouts of this run (for the docs)."""
    local = results["local"]
    ours = list(local["ratios"])

    def times(name: str, other: str, key: str) -> float:
        return local["ratios"][name][other][key]

    sizes = local["bytes"]
    floor = results["zstd_floor"]
    zarr, gzip = local["anndata_zarr"], local["anndata_h5ad_gzip_backed"]
    rows = [
        ("dataset bytes", lambda n: f"{sizes[n] / 1e6:.1f} MB ({sizes[n] / sizes[ours[0]]:.3f}x)"),
        ("random 4,096 cells, unsorted", lambda n: f"{local[n]['random_4096_unsorted_s']:.3f} s"),
        ("... on an X opened once, its tiles cached (a session reading again)",
         lambda n: f"{local[n]['random_4096_reused_s']:.3f} s"),
        (f"... vs gzip `.h5ad` ({gzip['random_4096_unsorted_s']:.2f} s)",
         lambda n: f"{times(n, 'anndata_h5ad_gzip_backed', 'random_4096_unsorted_s'):.1f}x"),
        (f"... vs zarr ({zarr['random_4096_unsorted_s']:.3f} s)",
         lambda n: f"{times(n, 'anndata_zarr', 'random_4096_unsorted_s'):.2f}x"),
        ("zstd alone on the chunks those cells touch (the limit)",
         lambda n: f"{floor[n]['random_4096_s']:.3f} s ({floor[n]['random_4096_chunks']:,} "
                   f"chunks, {floor[n]['random_4096_nnz'] / 1e6:.1f}M nonzeros)"),
        ("... the limit vs gzip `.h5ad`",
         lambda n: f"{gzip['random_4096_unsorted_s'] / floor[n]['random_4096_s']:.1f}x"),
        ("... the limit vs zarr",
         lambda n: f"{zarr['random_4096_unsorted_s'] / floor[n]['random_4096_s']:.2f}x"),
        ("random 4,096 cells vs zstd alone (goal: 0.8x): X opened for the read / reused",
         lambda n: f"{floor[n]['random_4096_s'] / local[n]['random_4096_unsorted_s']:.2f}x / "
                   f"{floor[n]['random_4096_s'] / local[n]['random_4096_reused_s']:.2f}x"),
        ("... reused, in alternating rounds with zstd alone (median of the rounds' ratios)",
         lambda n: f"{floor[n]['random_4096_reused_vs_zstd']:.2f}x"),
        ("`to_memory()` (source gene order)", lambda n: f"{local[n]['to_memory_s']:.3f} s"),
        (f"... vs zarr ({zarr['to_memory_s']:.3f} s)",
         lambda n: f"{times(n, 'anndata_zarr', 'to_memory_s'):.2f}x"),
        ("zstd alone on every frame (the limit)",
         lambda n: f"{floor[n]['to_memory_s']:.3f} s"),
        ("... the limit vs zarr",
         lambda n: f"{zarr['to_memory_s'] / floor[n]['to_memory_s']:.2f}x"),
        ("... decoded to CSR in the stored gene order (buffers reused)",
         lambda n: f"{floor[n]['decode_stored_order_s']:.3f} s"),
        ("... and renumbered + sorted to the source gene order",
         lambda n: f"{floor[n]['decode_source_order_s'] or float('nan'):.3f} s"),
        ("... in the stored gene order into fresh buffers (to_memory without the sort)",
         lambda n: f"{floor[n]['decode_stored_order_fresh_s']:.3f} s"),
        ("`to_memory()` vs zstd alone (goal: 0.8x)",
         lambda n: f"{floor[n]['to_memory_s'] / local[n]['to_memory_s']:.2f}x"),
        ("... in alternating rounds with zstd alone (median of the rounds' ratios)",
         lambda n: f"{floor[n]['to_memory_vs_zstd']:.2f}x"),
    ]  # fmt: skip
    lines = [
        f"From `{results['command']}` on {results['machine']['cpu']} "
        f"({results['machine']['usable_cpus']} CPUs), {results['n_cells']:,} cells, medians of "
        f"{results['repeats']}:",
        "",
        "| | " + " | ".join(f"`{n}`" for n in ours) + " |",
        "|---|" + "---|" * len(ours),
    ]
    lines += [f"| {label} | " + " | ".join(cell(n) for n in ours) + " |" for label, cell in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--cells", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument(
        "--fine-chunks",
        type=int,
        default=512,
        help="also time a dataset with this many chunks per tile (0: skip)",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "read.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "_static" / "bench_read.png")
    parser.add_argument(
        "--table", type=Path, default=ROOT / "docs" / "_static" / "bench_read_layouts.md"
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="dc-bench-read-"))
    try:
        print(f"making a {args.cells:,}-cell input in four formats ...", flush=True)
        paths = make_inputs(args.data, args.cells, workdir, args.fine_chunks)
        cache_dir = workdir / "cache"
        cache_dir.mkdir()
        results = {"machine": machine(), "command": "python benchmarks/bench_read.py",
                   "n_cells": args.cells, "repeats": args.repeats}  # fmt: skip
        print("local:", flush=True)
        results["local"] = run_suite(readers(paths, cache_dir), args.cells, args.repeats)
        results["local"]["bytes"] = {name: stored_bytes(path) for name, path in paths.items()}
        print(f"  bytes: {results['local']['bytes']}", flush=True)
        results["zstd_floor"] = {
            name: zstd_floor(path, args.cells, args.repeats)
            for name, path in paths.items()
            if name.startswith("deltacells")
        }
        print(f"  zstd alone (the speed limit): {results['zstd_floor']}", flush=True)
        results["open"] = opening_cost(paths["deltacells"], args.repeats, cache_dir)
        print(f"  opening: {results['open']}", flush=True)
        if not args.no_s3:
            print("through S3 (moto server on 127.0.0.1):", flush=True)
            results["s3"] = s3_suite(paths, args.cells, args.repeats, cache_dir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    plot(results, args.plot)
    args.table.write_text(layout_table(results))
    print(f"wrote {args.json}, {args.plot} and {args.table}")


if __name__ == "__main__":
    main()
