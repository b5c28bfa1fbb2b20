"""Spatial reads: box queries and one gene for every cell, deltacells next to SpatialData,
h5ad and zarr, on the same synthetic spatial dataset in one run.

    python benchmarks/bench_spatial.py [--cells 200000] [--repeats 5]

The dataset: Visium counts (``visium_multisample.h5ad``) resampled to ``--cells`` cells, placed
uniformly on a square, each cell a triangle or hexagon of log-normally varied size. Written as a
deltacells dataset in spatial order with the gene-major companion; as a SpatialData store by
spatialdata 0.8 itself (in its own Python 3.12 virtualenv); as uncompressed h5ad with X in CSR
and in CSC; and as zarr with X in CSC. Measured:

* box queries of 1% and 5% of the area (10 boxes each): deltacells' query alone, and with X of
  the selected cells by ranged chunk reads and by whole tiles (time, bytes read, cells);
  spatialdata's ``bounding_box_query`` on the shapes it read; an h5ad reader filtering
  ``obsm["spatial"]`` and reading the rows backed;
* one gene for all cells: the gene-major companion, a scan of the CSR tiles, anndata's backed
  CSC and CSR h5ad, and a backed zarr CSC;
* export time (``to_spatialdata``) and sizes.

Medians of ``--repeats``. Writes ``benchmarks/results/spatial.json``,
``docs/_static/bench_spatial.png`` and ``docs/_static/bench_spatial.md``, and the docs'
picture ``docs/_static/spatial_box.png`` (the cells of one box of the real Visium data coloured
by one gene, from the query result).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp
from _common import machine, median_time, page_figure, save_figure

import deltacells as dc
from deltacells.store.storage import Store
from deltacells.testing import SPATIALDATA_SPEC, side_python

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
VISIUM = ROOT.parent / "shared" / "data" / "visium_multisample.h5ad"
SPATIALDATA_VENV = ROOT / ".venvs" / "spatialdata"

SPATIALDATA_CHILD = r"""
import json, sys, time, statistics
import anndata as ad, geopandas as gpd
import spatialdata as sd
from spatialdata import bounding_box_query
from spatialdata.models import ShapesModel, TableModel
shapes_path, table_path, out, boxes, repeats = sys.argv[1:6]
boxes, repeats = json.loads(boxes), int(repeats)
t = time.perf_counter()
shapes = ShapesModel.parse(gpd.read_parquet(shapes_path))
table = ad.read_h5ad(table_path)
table.obs["region"] = "cells"
table.obs["region"] = table.obs["region"].astype("category")
table.obs["instance_id"] = table.obs_names.astype(str)
table = TableModel.parse(table, region="cells", region_key="region", instance_key="instance_id")
sd.SpatialData(shapes={"cells": shapes}, tables={"table": table}).write(out, overwrite=True)
write_s = time.perf_counter() - t
t = time.perf_counter()
s = sd.read_zarr(out)
read_s = time.perf_counter() - t
shapes = s.shapes["cells"]
result = {"write_s": write_s, "read_zarr_s": read_s, "boxes": []}
for box in boxes:
    times, cells = [], 0
    for _ in range(repeats):
        t = time.perf_counter()
        hit = bounding_box_query(shapes, axes=("x", "y"), min_coordinate=box[:2],
                                 max_coordinate=box[2:], target_coordinate_system="global")
        times.append(time.perf_counter() - t)
        cells = 0 if hit is None else len(hit)
    result["boxes"].append({"s": statistics.median(times), "cells": cells})
print(json.dumps(result))
"""


class ByteCounter:
    """Counts the bytes deltacells' stores return (whole objects and ranges) while active."""

    def __init__(self) -> None:
        self.bytes = 0
        self._saved = {}

    def __enter__(self) -> ByteCounter:
        for name in ("read_range", "read_bytes", "read_buffer"):
            original = getattr(Store, name)
            self._saved[name] = original

            def counting(store, *args, _original=original, **kwargs):
                data = _original(store, *args, **kwargs)
                self.bytes += len(data) if not hasattr(data, "nbytes") else data.nbytes
                return data

            setattr(Store, name, counting)
        # Several ranged reads of one object go through a reader made once (a local file
        # opened once): count what those readers return as well.
        original_reader = Store.range_reader
        self._saved["range_reader"] = original_reader

        def counting_reader(store, *args, **kwargs):
            read = original_reader(store, *args, **kwargs)

            def counted(start, stop):
                data = read(start, stop)
                self.bytes += len(data)
                return data

            return counted

        Store.range_reader = counting_reader
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._saved.items():
            setattr(Store, name, original)


def synthetic(n_cells: int, seed: int = 0):
    """Resampled Visium counts on a square, one triangle or hexagon per cell."""
    import geopandas as gpd
    import shapely

    base = ad.read_h5ad(VISIUM)
    counts = sp.csr_matrix(base.X)
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, counts.shape[0], n_cells)
    side = 40.0 * np.sqrt(n_cells)  # about 1,600 square units per cell
    centres = rng.uniform(0, side, size=(n_cells, 2))
    radius = np.exp(rng.normal(np.log(6.0), 0.5, n_cells))
    corners = np.where(rng.random(n_cells) < 0.5, 3, 6)
    polys = []
    for (x, y), r, k in zip(centres, radius, corners, strict=True):
        angle = np.linspace(0, 2 * np.pi, k, endpoint=False) + rng.uniform(0, np.pi)
        polys.append(np.column_stack([x + r * np.cos(angle), y + r * np.sin(angle)]))
    geometry = [shapely.Polygon(p) for p in polys]
    names = [f"cell-{i}" for i in range(n_cells)]
    adata = ad.AnnData(X=counts[rows], var=base.var.copy())
    adata.obs_names = names
    adata.obsm["spatial"] = centres
    shapes = gpd.GeoDataFrame(geometry=geometry, index=adata.obs_names)
    return adata, shapes, side


def boxes_of(side: float, fraction: float, n: int, seed: int) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    width = side * np.sqrt(fraction)
    corner = rng.uniform(0, side - width, size=(n, 2))
    return [[float(x), float(y), float(x + width), float(y + width)] for x, y in corner]


def folder_bytes(path: Path) -> int:
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def time_box(dataset_path: Path, box, repeats: int, mode: str):
    """(median seconds, bytes, cells) of one box: the query alone, or with X of its cells by
    ranged chunk reads or whole tiles."""
    times, spent, cells = [], 0, 0
    for _ in range(repeats):
        with ByteCounter() as counter:
            t = time.perf_counter()
            dataset = dc.open_dataset(dataset_path)
            rows = dataset.query_bbox(box).rows
            if mode != "query":
                X = dc.DeltacellsCSRDataset(dataset, column_order="stored",
                                            ranged_reads=mode == "ranged")  # fmt: skip
                X.get_rows(rows)
            times.append(time.perf_counter() - t)
        spent, cells = counter.bytes, len(rows)
    return statistics.median(times), spent, cells


def time_h5ad_box(path: Path, box, repeats: int):
    """An h5ad reader's box query: read the centroids, filter, read the rows backed."""
    times, cells = [], 0
    for _ in range(repeats):
        t = time.perf_counter()
        adata = ad.read_h5ad(path, backed="r")
        xy = np.asarray(adata.obsm["spatial"])
        keep = np.flatnonzero((xy[:, 0] >= box[0]) & (xy[:, 0] <= box[2])
                              & (xy[:, 1] >= box[1]) & (xy[:, 1] <= box[3]))  # fmt: skip
        adata.X[keep]
        adata.file.close()
        times.append(time.perf_counter() - t)
        cells = len(keep)
    return statistics.median(times), cells


BUILD_CHILD = r"""
import json, sys, time
import deltacells as dc

def hwm_mb():  # this process's own peak RSS (ru_maxrss would carry the parent's over exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

dataset = dc.open_dataset(sys.argv[1])
before = hwm_mb()
t = time.perf_counter()
record = dc.add_gene_major(dataset)
print(json.dumps({"s": time.perf_counter() - t, "rss_before_mb": before,
                  "peak_rss_mb": hwm_mb(),
                  "block_cells": record["block_cells"], "n_blocks": record["n_blocks"]}))
"""


def build_rss(adata, shapes, tmp: Path) -> dict:
    """Peak RSS of building the gene-major companion, each size in a fresh process: it
    should stay flat as the dataset grows (memory is bounded by one block)."""
    import sys

    out = {}
    for n in (adata.n_obs // 2, adata.n_obs):
        path = tmp / f"build-{n}.dc"
        dc.write_deltacells(adata[:n].copy(), path, shapes=shapes.iloc[:n], progress=False)
        done = subprocess.run([sys.executable, "-c", BUILD_CHILD, str(path)], check=True,
                              capture_output=True, text=True)  # fmt: skip
        out[str(n)] = json.loads(done.stdout.strip().splitlines()[-1])
        shutil.rmtree(path)
    return out


def one_gene(paths: dict, gene: str, j: int, repeats: int) -> dict:
    import zarr

    out = {}
    counted = {}

    def genemajor():
        dataset = dc.open_dataset(paths["deltacells"])
        with ByteCounter() as counter:
            column = dataset.genes(gene)
        counted["genemajor"] = counter.bytes
        return column

    def csr_scan():
        dataset = dc.open_dataset(paths["deltacells"])
        stored = int(np.argsort(dataset.gene_order())[j])
        with ByteCounter() as counter:
            parts = [dataset.tile(t).decode(np.float32)[:, stored]
                     for t in range(dataset.manifest.n_tiles)]  # fmt: skip
        counted["csr_scan"] = counter.bytes
        return sp.vstack(parts)

    def backed(path):
        def run():
            adata = ad.read_h5ad(path, backed="r")
            column = adata.X[:, j]
            adata.file.close()
            return column

        return run

    def zarr_csc():
        group = zarr.open_group(str(paths["zarr_csc"]), mode="r")
        return ad.io.sparse_dataset(group["X"])[:, j]

    runs = {"deltacells gene-major": genemajor, "deltacells CSR scan": csr_scan,
            "anndata backed CSC h5ad": backed(paths["h5ad_csc"]),
            "anndata backed CSR h5ad": backed(paths["h5ad_csr"]),
            "zarr CSC (anndata sparse_dataset)": zarr_csc}  # fmt: skip
    # deltacells returns cells in stored (spatial) order, the others in source order.
    to_source = np.argsort(dc.open_dataset(paths["deltacells"]).cell_order())
    reference = None
    for name, run in runs.items():
        column = sp.csc_matrix(run())
        if name.startswith("deltacells"):
            column = sp.csc_matrix(column.tocsr()[to_source])
        reference = column if reference is None else reference
        assert (column != reference).nnz == 0, name
        out[name] = {"s": median_time(run, repeats, warmup=True)}
    out["deltacells gene-major"]["bytes"] = counted["genemajor"]
    out["deltacells CSR scan"]["bytes"] = counted["csr_scan"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--boxes", type=int, default=10, help="boxes per size")
    parser.add_argument("--no-spatialdata", action="store_true")
    args = parser.parse_args()
    results: dict = {"machine": machine(), "n_cells": args.cells, "repeats": args.repeats,
                     "command": "python benchmarks/bench_spatial.py"}  # fmt: skip
    adata, shapes, side = synthetic(args.cells)
    with tempfile.TemporaryDirectory(prefix="bench-spatial-") as tmp:
        tmp = Path(tmp)
        paths = {"deltacells": tmp / "cells.dc", "h5ad_csr": tmp / "csr.h5ad",
                 "h5ad_csc": tmp / "csc.h5ad", "zarr_csc": tmp / "csc.zarr",
                 "export": tmp / "export.zarr", "spatialdata": tmp / "sd.zarr"}  # fmt: skip
        t = time.perf_counter()
        dc.write_deltacells(adata, paths["deltacells"], shapes=shapes, gene_major=True,
                            progress=False)  # fmt: skip
        results["deltacells_write_s"] = time.perf_counter() - t
        adata.write_h5ad(paths["h5ad_csr"])
        csc = adata.copy()
        csc.X = csc.X.tocsc()
        csc.write_h5ad(paths["h5ad_csc"])
        csc.write_zarr(paths["zarr_csc"])
        t = time.perf_counter()
        dc.to_spatialdata(paths["deltacells"], paths["export"])
        results["export_s"] = time.perf_counter() - t

        manifest = dc.open_dataset(paths["deltacells"]).manifest
        tiles = sum(manifest.tile_bytes)
        # What the spatial default of 64-cell chunks costs in size, next to 8 chunks per tile.
        eight = tmp / "eight.dc"
        dc.write_deltacells(adata, eight, shapes=shapes, n_chunks=8, progress=False)
        results["chunking"] = {
            "n_chunks_default_spatial": manifest.n_chunks,
            "tile_bytes_default_spatial": tiles,
            "tile_bytes_8_chunks": sum(dc.open_dataset(eight).manifest.tile_bytes),
        }  # fmt: skip
        results["chunking"]["size_ratio"] = tiles / results["chunking"]["tile_bytes_8_chunks"]
        shutil.rmtree(eight)
        companion = sum(manifest.metadata["gene_major"]["block_bytes"])
        results["sizes"] = {
            "deltacells_dataset": folder_bytes(paths["deltacells"]),
            "deltacells_tiles": tiles, "deltacells_gene_major": companion,
            "deltacells_spatial": folder_bytes(paths["deltacells"] / "spatial"),
            "companion_vs_tiles": companion / tiles,
            "h5ad_csr": folder_bytes(paths["h5ad_csr"]),
            "h5ad_csc": folder_bytes(paths["h5ad_csc"]),
            "zarr_csc": folder_bytes(paths["zarr_csc"]),
            "export_spatialdata": folder_bytes(paths["export"]),
        }  # fmt: skip
        dataset_bytes = results["sizes"]["deltacells_dataset"] - companion
        all_boxes = {}
        for label, fraction in (("1%", 0.01), ("5%", 0.05)):
            boxes = boxes_of(side, fraction, args.boxes, seed=int(fraction * 1000))
            all_boxes[label] = boxes
            rows = {}
            for mode in ("query", "ranged", "whole_tiles"):
                measured = [time_box(paths["deltacells"], b, args.repeats, mode) for b in boxes]
                rows[mode] = {
                    "s": statistics.median(m[0] for m in measured),
                    "bytes": statistics.median(m[1] for m in measured),
                    "cells": statistics.median(m[2] for m in measured),
                }
                rows[mode]["bytes_fraction"] = rows[mode]["bytes"] / dataset_bytes
            h5 = [time_h5ad_box(paths["h5ad_csr"], b, args.repeats) for b in boxes]
            rows["h5ad_obsm_filter_then_rows"] = {"s": statistics.median(h[0] for h in h5),
                                                  "cells": statistics.median(h[1] for h in h5)}
            results.setdefault("boxes", {})[label] = rows
            print(label, json.dumps(rows))
        if not args.no_spatialdata:
            python = side_python(SPATIALDATA_VENV, SPATIALDATA_SPEC)
            if python is not None:
                shapes_path = tmp / "shapes.parquet"
                shapes.to_parquet(shapes_path)
                flat = all_boxes["1%"] + all_boxes["5%"]
                done = subprocess.run(
                    [python, "-c", SPATIALDATA_CHILD, str(shapes_path), str(paths["h5ad_csr"]),
                     str(paths["spatialdata"]), json.dumps(flat), str(args.repeats)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                child = json.loads(done.stdout.strip().splitlines()[-1])
                n = len(all_boxes["1%"])
                for label, part in (("1%", child["boxes"][:n]), ("5%", child["boxes"][n:])):
                    results["boxes"][label]["spatialdata_bounding_box_query"] = {
                        "s": statistics.median(b["s"] for b in part),
                        "cells": statistics.median(b["cells"] for b in part)}  # fmt: skip
                results["spatialdata"] = {"write_s": child["write_s"],
                                          "read_zarr_s": child["read_zarr_s"],
                                          "size": folder_bytes(paths["spatialdata"])}  # fmt: skip
        results["gene_major_build"] = build_rss(adata, shapes, tmp)
        nnz_per_gene = np.diff(adata.X.tocsc().indptr)
        j = int(np.argsort(nnz_per_gene)[len(nnz_per_gene) // 2])  # a median gene
        gene = str(adata.var_names[j])
        results["gene"] = {"name": gene, "cells_expressing": int(nnz_per_gene[j])}
        results["one_gene"] = one_gene(paths, gene, j, args.repeats)
        g = results["one_gene"]
        scan, gm = g["deltacells CSR scan"], g["deltacells gene-major"]
        results["targets"] = {
            "box_1pct_bytes_fraction_ranged": results["boxes"]["1%"]["ranged"]["bytes_fraction"],
            "gene_bytes_vs_csr_scan": gm["bytes"] / scan["bytes"],
            "gene_speedup_vs_csr_scan": scan["s"] / gm["s"],
            "gene_time_vs_anndata_backed_csc": gm["s"] / g["anndata backed CSC h5ad"]["s"],
            "companion_vs_tiles": results["sizes"]["companion_vs_tiles"],
        }  # fmt: skip
        print(json.dumps(results["one_gene"], indent=1))
        print("targets:", json.dumps(results["targets"], indent=1))
    out = HERE / "results" / "spatial.json"
    out.write_text(json.dumps(results, indent=1))
    plot(results)
    table(results)
    picture()


def plot(results: dict) -> None:
    fig, (boxes_ax, gene_ax) = page_figure(2, panel_height=3.0)
    labels = ["query", "ranged", "whole_tiles", "spatialdata_bounding_box_query",
              "h5ad_obsm_filter_then_rows"]  # fmt: skip
    names = {"query": "deltacells query only", "ranged": "deltacells + X (ranged chunks)",
             "whole_tiles": "deltacells + X (whole tiles)",
             "spatialdata_bounding_box_query": "spatialdata bounding_box_query",
             "h5ad_obsm_filter_then_rows": "h5ad: filter obsm, read rows"}  # fmt: skip
    width = 0.38
    for i, size in enumerate(("1%", "5%")):
        row = results["boxes"][size]
        present = [k for k in labels if k in row]
        boxes_ax.barh(np.arange(len(present)) + i * width, [row[k]["s"] * 1e3 for k in present],
                      width, label=f"{size} of the area")  # fmt: skip
    present = [k for k in labels if k in results["boxes"]["1%"]]
    boxes_ax.set_yticks(np.arange(len(present)) + width / 2, [names[k] for k in present])
    boxes_ax.set_xscale("log")
    boxes_ax.set_xlabel("box query, ms (median; log)")
    boxes_ax.legend()
    g = results["one_gene"]
    gene_ax.barh(list(g), [v["s"] * 1e3 for v in g.values()], color="tab:green")
    gene_ax.set_xscale("log")
    gene_ax.set_xlabel(f"one gene for all cells ({results['gene']['name']}), ms (median; log)")
    save_figure(fig, ROOT / "docs" / "_static" / "bench_spatial.png",
                f"Spatial reads, {results['n_cells']:,} cells", results)  # fmt: skip


def table(results: dict) -> None:
    s, t = results["sizes"], results["targets"]
    mb = 1e6
    lines = [
        f"From `{results['command']}` on {results['machine']['cpu']} "
        f"({results['machine']['usable_cpus']} CPUs), {results['n_cells']:,} cells, medians of "
        f"{results['repeats']}.",
        "",
        "| box | deltacells query | + X, ranged chunks | + X, whole tiles | spatialdata "
        "`bounding_box_query` | h5ad (filter obsm, rows) | cells |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, row in results["boxes"].items():
        sdq = row.get("spatialdata_bounding_box_query")
        theirs = f"{sdq['s'] * 1e3:.1f} ms" if sdq else "not run"
        lines.append(
            f"| {size} | {row['query']['s'] * 1e3:.1f} ms, {row['query']['bytes'] / mb:.2f} MB "
            f"| {row['ranged']['s'] * 1e3:.1f} ms, {row['ranged']['bytes'] / mb:.2f} MB "
            f"({row['ranged']['bytes_fraction']:.1%}) "
            f"| {row['whole_tiles']['s'] * 1e3:.1f} ms, {row['whole_tiles']['bytes'] / mb:.2f} "
            f"MB ({row['whole_tiles']['bytes_fraction']:.1%}) "
            f"| {theirs} "
            f"| {row['h5ad_obsm_filter_then_rows']['s'] * 1e3:.1f} ms "
            f"| {row['query']['cells']:.0f} |"
        )
    lines += ["", "| one gene for all cells | ms | bytes read |", "|---|---|---|"]
    for name, v in results["one_gene"].items():
        spent = f"{v['bytes'] / mb:.2f} MB" if "bytes" in v else ""
        lines.append(f"| {name} | {v['s'] * 1e3:.1f} | {spent} |")
    lines += [
        "",
        f"Sizes: deltacells tiles {s['deltacells_tiles'] / mb:.1f} MB, gene-major companion "
        f"{s['deltacells_gene_major'] / mb:.1f} MB ({s['companion_vs_tiles']:.2f}x the tiles), "
        f"spatial part {s['deltacells_spatial'] / mb:.1f} MB; h5ad CSR {s['h5ad_csr'] / mb:.0f} "
        f"MB, zarr CSC {s['zarr_csc'] / mb:.0f} MB, the SpatialData export "
        f"{s['export_spatialdata'] / mb:.0f} MB (export {results['export_s']:.1f} s). "
        f"Chunks of 64 cells ({results['chunking']['n_chunks_default_spatial']} per tile, the "
        f"spatial default) make the tiles {results['chunking']['size_ratio']:.3f}x the size "
        "of 8 chunks per tile. Building the gene-major companion: "
        + ", ".join(f"{int(n):,} cells {v['s']:.1f} s, peak RSS {v['peak_rss_mb']:.0f} MB "
                    f"({v['n_blocks']} blocks of {v['block_cells']:,})"
                    for n, v in results["gene_major_build"].items()) + ".",
        "",
        f"Targets: a 1% box reads {t['box_1pct_bytes_fraction_ranged']:.1%} of the dataset's "
        f"bytes with ranged reads (target <= 3%); one gene reads "
        f"{t['gene_bytes_vs_csr_scan']:.3f}x the bytes of a CSR scan (<= 0.05) and is "
        f"{t['gene_speedup_vs_csr_scan']:.0f}x faster (>= 20x) and "
        f"{t['gene_time_vs_anndata_backed_csc']:.2f}x anndata's backed CSC time (<= 2x); the "
        f"companion is {t['companion_vs_tiles']:.2f}x the tiles (<= 1.2x).",
    ]
    (ROOT / "docs" / "_static" / "bench_spatial.md").write_text("\n".join(lines) + "\n")


def picture() -> None:
    """The docs' picture: the Visium spots of one box, coloured by one gene, from the query."""
    source = ad.read_h5ad(VISIUM)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "visium.dc"
        dc.write_deltacells(source, root, spatial_key="spatial", gene_major=True, progress=False)
        xy = source.obsm["spatial"]
        box = (float(xy[:, 0].min()), float(xy[:, 1].min()),
               float(np.percentile(xy[:, 0], 40)), float(xy[:, 1].max()))  # fmt: skip
        counts = np.asarray((source.X > 0).sum(axis=0)).ravel()
        gene = str(source.var_names[int(np.argsort(counts)[-50])])
        cells = dc.read_deltacells(root, bbox=box)
        values = np.asarray(cells[:, [gene]].X.todense()).ravel()
        fig, (ax,) = page_figure(1, panel_height=4.0)
        points = cells.obsm["spatial"]
        shown = ax.scatter(points[:, 0], points[:, 1], c=values, s=14, cmap="viridis")
        ax.set_aspect("equal")
        ax.set(xlabel="x", ylabel="y")
        fig.colorbar(shown, ax=ax, label=f"{gene} counts")
        save_figure(fig, ROOT / "docs" / "_static" / "spatial_box.png",
                    f"read_deltacells(bbox=...): {cells.n_obs:,} spots coloured by {gene}")


if __name__ == "__main__":
    main()
