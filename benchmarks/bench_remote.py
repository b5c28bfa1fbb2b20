"""Streaming from an emulated object store: moto's S3 server behind a proxy that adds latency
before each response's first byte and caps bandwidth per connection and in total.

    python benchmarks/bench_remote.py [--cells 1000000] [--latency 0.05] [--bandwidth 150e6]

On ``liao2020_balf.h5ad`` stacked with shuffled rows to ``--cells`` cells (written once, then
uploaded to moto), through the proxy, in one run:

* ``Loader`` epochs of 4,096-cell batches (tile order shuffled, cells shuffled within buffers)
  with its defaults (tiles fetched ahead) and with ``prefetch_tiles=0`` (one tile at a time),
  ``--epochs`` each (the settings take turns; the median epoch is reported);
* random 4,096-cell reads by whole tiles and with ``ranged_reads=True`` (only the chunks the
  cells are in), on the default layout (8 chunks per tile) and on ``n_chunks=512``;
* ``to_memory`` of the first 200,000 cells' tiles (a contiguous slice);
* the loader and the servers' uncapped speed again with obstore as the client instead of
  fsspec (s3fs);
* peers through the same proxy, on ``--peer-cells`` cells (200,000: their inputs are 10x
  larger): annbatch (its own virtualenv, as in ``bench_loader.py``) and anndata backed h5ad
  over their first ``--peer-batches`` batches, next to deltacells' loader on the same cells.

Each reports cells/s, bytes and requests through the proxy, next to the **bandwidth bound**
(bandwidth / bytes per cell of the tiles) and the proxy's own throughput without caps (moto
and the proxy are Python servers: their speed is a second bound on this machine). Writes
``benchmarks/results/remote.json`` and ``docs/_static/bench_remote.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import MotoS3, machine, page_figure, peak_rss_mb, save_figure, stacked_adata

import deltacells as dc

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"
sys.path.insert(0, str(ROOT / "tests"))  # the network-emulating proxy lives with the tests
from faultproxy import FaultProxy  # noqa: E402


def median_epoch(rows: list[dict]) -> dict:
    """The median of several epochs' rows (the lower one of an even count), with every
    epoch's cells/s under ``epochs_cells_per_s``."""
    ranked = sorted(rows, key=lambda r: r["cells_per_s"])
    return {**ranked[(len(ranked) - 1) // 2],
            "epochs_cells_per_s": [r["cells_per_s"] for r in rows]}  # fmt: skip


def measure(proxy: FaultProxy, run) -> dict:
    """Wall time, bytes and requests through the proxy of ``run()`` (which returns cells)."""
    bytes0, requests0 = proxy.bytes_sent, proxy.requests
    t = time.perf_counter()
    cells = run()
    elapsed = time.perf_counter() - t
    return {"s": elapsed, "cells": int(cells), "cells_per_s": cells / elapsed,
            "bytes": proxy.bytes_sent - bytes0, "requests": proxy.requests - requests0}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=1_000_000)
    parser.add_argument("--latency", type=float, default=0.05, help="seconds to first byte")
    parser.add_argument("--bandwidth", type=float, default=150e6,
                        help="bytes/s per connection and in total")  # fmt: skip
    parser.add_argument("--epochs", type=int, default=3,
                        help="loader epochs per setting, also in the sweep (the median "
                        "is reported)")
    parser.add_argument("--random-reads", type=int, default=5)
    parser.add_argument("--peer-cells", type=int, default=200_000)
    parser.add_argument("--peer-batches", type=int, default=5)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--annbatch-python")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "remote.json")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--from-json", type=Path, help="only redraw the plot and table")
    parser.add_argument("--sweep-cells", type=int, default=500_000)
    parser.add_argument("--sweep-only", action="store_true",
                        help="add the latency / bandwidth sweep to the --out JSON")  # fmt: skip
    args = parser.parse_args()
    if args.sweep_only:
        saved = json.loads(args.out.read_text())
        saved["sweep"] = sweep(args)
        args.out.write_text(json.dumps(saved, indent=1))
        plot(saved)
        table(saved)
        return
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        plot(saved)
        table(saved)
        return
    results: dict = {"machine": machine(), "n_cells": args.cells, "latency_s": args.latency,
                     "bandwidth_bytes_per_s": args.bandwidth,
                     "command": " ".join(["python", *sys.argv])}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
        local = Path(tmp) / "stacked.dc"
        fine = Path(tmp) / "stacked-512.dc"  # the random-access layout (8 cells per chunk)
        adata = stacked_adata(DATA, args.cells)
        dc.write_deltacells(adata, local, progress=False)
        dc.write_deltacells(adata, fine, n_chunks=512, progress=False)
        del adata
        manifest = dc.open_dataset(local).manifest
        tile_bytes = sum(manifest.tile_bytes)
        bytes_per_cell = tile_bytes / manifest.n_cells
        results["dataset"] = {"tile_bytes": tile_bytes, "n_tiles": manifest.n_tiles,
                              "bytes_per_cell": bytes_per_cell}  # fmt: skip
        results["bandwidth_bound_cells_per_s"] = args.bandwidth / bytes_per_cell
        # The decoding limit of this machine: the same epoch from local disk, no network.
        from bench_loader import run_child

        results["local_loader"] = run_child(sys.executable, "deltacells", str(local), 4096, {})
        results["local_loader"]["vs_bandwidth_bound"] = (
            results["local_loader"]["cells_per_s"] / results["bandwidth_bound_cells_per_s"])
        print("local loader", json.dumps(results["local_loader"]), flush=True)
        with MotoS3() as s3:
            t = time.perf_counter()
            url = s3.upload("stacked.dc", local)
            results["upload_s"] = time.perf_counter() - t
            fine_url = s3.upload("stacked-512.dc", fine)
            upstream = s3.endpoint.removeprefix("http://")
            # The servers' own speed, no caps: whole tiles, 8 at a time.
            with FaultProxy(upstream) as open_proxy:
                options = {**s3.options, "client_kwargs": {"endpoint_url": open_proxy.endpoint}}
                store = dc.open_dataset(url, storage_options=options).store
                names = [f"tiles/tile_{t:06d}.dct" for t in range(min(40, manifest.n_tiles))]
                for key, client in (("uncapped_bytes_per_s", "fsspec"),
                                    ("uncapped_bytes_per_s_obstore", "obstore")):  # fmt: skip
                    store = dc.open_dataset(url, storage_options={**options,
                                                                  "client": client}).store
                    t = time.perf_counter()
                    for future in store.prefetch(names,
                                                 manifest.tile_bytes[: len(names)]).values():
                        future.result()
                    elapsed = time.perf_counter() - t
                    results[key] = sum(manifest.tile_bytes[: len(names)]) / elapsed
            with FaultProxy(upstream, latency=args.latency, per_connection=args.bandwidth,
                            total=args.bandwidth) as proxy:  # fmt: skip
                options = {**s3.options, "client_kwargs": {"endpoint_url": proxy.endpoint}}
                runs = {}
                epochs: dict[str, list] = {}
                # Each epoch in a process of its own, as a trainer's would be: the servers
                # here (moto and the proxy are Python threads of this process) do not share
                # its interpreter lock, and their CPU time is measured apart from the loader's.
                # The settings take turns, --epochs times; each reports its median epoch.
                settings = (("loader_defaults", None, "fsspec"),
                            ("loader_defaults_obstore", None, "obstore"),
                            ("loader_one_tile_at_a_time", 0, "fsspec"))  # fmt: skip
                for _ in range(args.epochs):
                    for label, ahead, client in settings:
                        bytes0, requests0 = proxy.bytes_sent, proxy.requests
                        servers0 = time.process_time()
                        row = run_child(sys.executable, "deltacells", url, 4096, {
                            "storage_options": {**options, "client": client},
                            "prefetch_tiles": ahead})  # fmt: skip
                        row.update(
                            s=row["seconds"], bytes=proxy.bytes_sent - bytes0,
                            requests=proxy.requests - requests0,
                            # the servers' CPU over the child's whole life (start-up included)
                            servers_cpu_s=time.process_time() - servers0,
                            loader_cpu_s=row["cpu_s"],
                            prefetch_tiles=ahead if ahead is not None else "default",
                            vs_bandwidth_bound=row["cells_per_s"]
                            / results["bandwidth_bound_cells_per_s"],
                        )  # fmt: skip
                        epochs.setdefault(label, []).append(row)
                        print(label, json.dumps(row), flush=True)
                runs.update({label: median_epoch(rows) for label, rows in epochs.items()})
                rng = np.random.default_rng(0)
                for label, where, ranged in (
                    ("random_4096_whole_tiles", url, False),
                    ("random_4096_ranged_chunks", url, True),
                    ("random_4096_whole_tiles_512_chunks", fine_url, False),
                    ("random_4096_ranged_chunks_512_chunks", fine_url, True),
                ):  # fmt: skip
                    X = dc.read_deltacells(where, storage_options=options, obs=False,
                                           elements=False, ranged_reads=ranged).X  # fmt: skip
                    picks = [np.sort(rng.choice(manifest.n_cells, 4096, replace=False))
                             for _ in range(args.random_reads)]  # fmt: skip

                    def random_reads(X=X, picks=picks) -> int:
                        for rows in picks:
                            X.copy()[rows]  # a fresh cache each time
                        return 4096 * len(picks)

                    runs[label] = measure(proxy, random_reads)
                    print(label, json.dumps(runs[label]))
                X = dc.read_deltacells(url, storage_options=options, obs=False,
                                       elements=False).X  # fmt: skip
                first = int(manifest.limits[min(len(manifest.limits), 49) - 1])
                runs["slice_first_tiles"] = measure(proxy, lambda: X[:first].shape[0])
                runs["slice_first_tiles"]["vs_bandwidth_bound"] = (
                    runs["slice_first_tiles"]["cells_per_s"]
                    / results["bandwidth_bound_cells_per_s"])
                results["runs"] = runs
        if not args.no_peers:
            results["peers"] = peers(args, Path(tmp))
    results["peak_rss_mb"] = peak_rss_mb()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}, indent=1))
    if not args.no_plot:
        plot(results)
        table(results)


def table(results: dict) -> None:
    """The docs' table of this run (``docs/_static/bench_remote.md``)."""
    bound = results["bandwidth_bound_cells_per_s"]
    lines = [
        f"{results['n_cells']:,} cells, {results['dataset']['bytes_per_cell']:.0f} bytes per "
        f"cell: the bandwidth bound is **{bound:,.0f} cells/s**. Uncapped, the servers gave "
        f"{results['uncapped_bytes_per_s'] / 1e6:.0f} MB/s to fsspec (s3fs) and "
        f"{results.get('uncapped_bytes_per_s_obstore', float('nan')) / 1e6:.0f} MB/s to "
        "obstore.",
        "",
        "| run | cells/s | x bound | bytes | requests | CPU s: servers / loader |",
        "|---|---|---|---|---|---|",
    ]
    local = results.get("local_loader")
    if local:
        lines.append(f"| loader from local disk (no network) | {local['cells_per_s']:,.0f} | "
                     f"{local['cells_per_s'] / bound:.2f} | | | |")  # fmt: skip
    for name, row in results["runs"].items():
        cpu = (f"{row['servers_cpu_s']:.0f} / {row['loader_cpu_s']:.0f} (in {row['s']:.0f} s)"
               if "servers_cpu_s" in row else "")  # fmt: skip
        each = row.get("epochs_cells_per_s", [])
        if len(each) > 1:  # the median epoch, and every epoch's ratio to the bound
            name += f" (median of {len(each)}: {', '.join(f'{c / bound:.2f}' for c in each)})"
        lines.append(f"| {name} | {row['cells_per_s']:,.0f} | {row['cells_per_s'] / bound:.2f} | "
                     f"{row['bytes'] / 1e6:,.0f} MB | {row['requests']:,} | {cpu} |")  # fmt: skip
    peers = results.get("peers")
    if peers:
        lines += [
            "",
            f"Peers on {peers['n_cells']:,} cells through the same proxy (annbatch and anndata "
            f"over their first {peers['batches']} batches of 4,096 cells):",
            "",
            "| reader | cells/s | bytes per cell | requests | peak RSS |",
            "|---|---|---|---|---|",
        ]
        for name, row in peers.items():
            if isinstance(row, dict) and "cells_per_s" in row:
                lines.append(f"| {name} | {row['cells_per_s']:,.0f} | "
                             f"{row['bytes_per_cell']:,.0f} | {row['requests']:,} | "
                             f"{row['peak_rss_mb']:,.0f} MB |")  # fmt: skip
    swept = results.get("sweep")
    if swept:
        lines += [
            "",
            f"Loader epochs over {swept['n_cells']:,} cells, one setting changed at a time "
            "(the median epoch of each, and every epoch's ratio to the bound):",
            "",
            "| latency | bandwidth | tiles in flight | cells/s | x bound | epochs |",
            "|---|---|---|---|---|---|",
        ]
        for axis in ("latency", "bandwidth", "prefetch_tiles"):
            for row in swept.get(axis, []):
                bound_here = row["bound_cells_per_s"]
                each = ", ".join(f"{c / bound_here:.2f}"
                                 for c in row.get("epochs_cells_per_s", []))  # fmt: skip
                lines.append(f"| {row['latency_s'] * 1e3:.0f} ms | "
                             f"{row['bandwidth_bytes_per_s'] / 1e6:.0f} MB/s | "
                             f"{row['prefetch_tiles']} | {row['cells_per_s']:,.0f} | "
                             f"{row['cells_per_s'] / bound_here:.2f} | {each} |")  # fmt: skip
    (ROOT / "docs" / "_static" / "bench_remote.md").write_text("\n".join(lines) + "\n")


def peers(args, workdir: Path) -> dict:
    """annbatch, anndata and deltacells on ``--peer-cells`` cells through one proxy, each in
    its own process (bench_loader's children): cells/s, bytes and requests per cell."""
    from bench_loader import annbatch_python, make_inputs, run_child

    (workdir / "peers").mkdir()
    paths = make_inputs(DATA, args.peer_cells, workdir / "peers")
    python = annbatch_python(args.annbatch_python)
    collection = workdir / "peers" / "annbatch.zarr"
    run_child(python, "annbatch", str(paths["h5ad"]), 4096, {"convert_to": str(collection)})
    out: dict = {"n_cells": args.peer_cells, "batches": args.peer_batches,
                 "input_bytes": {"deltacells tiles": sum(dc.open_dataset(
                     paths["deltacells"]).manifest.tile_bytes),
                     "h5ad": paths["h5ad"].stat().st_size}}  # fmt: skip
    with MotoS3() as s3:
        urls = {"deltacells": s3.upload("peer.dc", paths["deltacells"]),
                "h5ad": s3.upload("peer.h5ad", paths["h5ad"]),
                "annbatch": s3.upload("peer-annbatch.zarr", collection)}  # fmt: skip
        upstream = s3.endpoint.removeprefix("http://")
        with FaultProxy(upstream, latency=args.latency, per_connection=args.bandwidth,
                        total=args.bandwidth) as proxy:  # fmt: skip
            through = {**s3.options, "client_kwargs": {"endpoint_url": proxy.endpoint}}
            few = {"storage_options": through, "max_batches": args.peer_batches}
            runs = {
                "deltacells loader (epoch)": (sys.executable, "deltacells", urls["deltacells"],
                                              {"storage_options": through}),
                "deltacells loader, obstore (epoch)": (
                    sys.executable, "deltacells", urls["deltacells"],
                    {"storage_options": {**through, "client": "obstore"}}),
                f"annbatch ({args.peer_batches} batches)": (python, "annbatch", urls["annbatch"],
                                                            few),
                f"anndata backed h5ad ({args.peer_batches} batches)": (
                    sys.executable, "anndata", urls["h5ad"], few),
            }  # fmt: skip
            for label, (exe, tool, url, options) in runs.items():
                bytes0, requests0 = proxy.bytes_sent, proxy.requests
                row = run_child(exe, tool, url, 4096, options)
                row["bytes_per_cell"] = (proxy.bytes_sent - bytes0) / row["cells"]
                row["requests"] = proxy.requests - requests0
                out[label] = row
                print(label, json.dumps(row), flush=True)
    return out


def sweep(args) -> dict:
    """Loader epochs (defaults) over ``--sweep-cells`` cells at several latencies (at
    ``--bandwidth``) and bandwidths (at ``--latency``), and with several tiles in flight,
    each in its own process, ``--epochs`` times (the median is kept)."""
    from bench_loader import run_child

    out: dict = {"n_cells": args.sweep_cells, "latency": [], "bandwidth": [],
                 "prefetch_tiles": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-remote-sweep-") as tmp:
        local = Path(tmp) / "sweep.dc"
        dc.write_deltacells(stacked_adata(DATA, args.sweep_cells), local, progress=False)
        manifest = dc.open_dataset(local).manifest
        out["bytes_per_cell"] = sum(manifest.tile_bytes) / manifest.n_cells
        with MotoS3() as s3:
            url = s3.upload("sweep.dc", local)
            upstream = s3.endpoint.removeprefix("http://")
            settings = (
                [("latency", latency, args.bandwidth, None) for latency in SWEEP_LATENCIES]
                + [("bandwidth", args.latency, bw, None) for bw in SWEEP_BANDWIDTHS]
                # how many tiles in flight the default needs (16: see Loader's prefetch_tiles)
                + [("prefetch_tiles", args.latency, args.bandwidth, ahead)
                   for ahead in SWEEP_PREFETCH]
            )  # fmt: skip
            rows: dict[int, list] = {}
            for _ in range(args.epochs):  # the settings take turns; medians reported
                for i, (axis, latency, bandwidth, ahead) in enumerate(settings):
                    with FaultProxy(upstream, latency=latency, per_connection=bandwidth,
                                    total=bandwidth) as proxy:  # fmt: skip
                        options = {**s3.options,
                                   "client_kwargs": {"endpoint_url": proxy.endpoint}}
                        row = run_child(sys.executable, "deltacells", url, 4096,
                                        {"storage_options": options, "prefetch_tiles": ahead})
                    rows.setdefault(i, []).append(row)
                    print("sweep", axis, latency, bandwidth, ahead,
                          f"{row['cells_per_s']:,.0f}", flush=True)  # fmt: skip
            for i, (axis, latency, bandwidth, ahead) in enumerate(settings):
                row = median_epoch(rows[i])
                row.update(latency_s=latency, bandwidth_bytes_per_s=bandwidth,
                           prefetch_tiles=ahead if ahead is not None else "default",
                           bound_cells_per_s=bandwidth / out["bytes_per_cell"])  # fmt: skip
                out[axis].append(row)
    return out


#: The sweep's settings: latencies at the default bandwidth, bandwidths at the default latency.
SWEEP_LATENCIES = (0.005, 0.02, 0.05, 0.1, 0.2)
SWEEP_BANDWIDTHS = (25e6, 50e6, 150e6, 400e6)
SWEEP_PREFETCH = (2, 4, 8, 16, 32)


def plot(results: dict) -> None:
    swept = results.get("sweep")
    fig, axes = page_figure(3 if swept else 1, panel_height=3.0)
    ax = axes[0]
    runs = results["runs"]
    names = list(runs)
    ax.barh(names, [runs[n]["cells_per_s"] for n in names], color="tab:blue")
    ax.axvline(results["bandwidth_bound_cells_per_s"], color="k", linestyle="--",
               label="bandwidth bound")  # fmt: skip
    if "local_loader" in results:
        ax.axvline(results["local_loader"]["cells_per_s"], color="tab:red", linestyle=":",
                   label="loader from local disk")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("cells / s (log)")
    ax.set_title(f"{results['n_cells']:,} cells at {results['latency_s'] * 1e3:.0f} ms, "
                 f"{results['bandwidth_bytes_per_s'] / 1e6:.0f} MB/s", fontsize=9)  # fmt: skip
    ax.legend(fontsize=7)
    if swept:
        for ax, axis, scale, unit in ((axes[1], "latency", 1e3, "latency to first byte (ms)"),
                                      (axes[2], "bandwidth", 1e-6, "bandwidth (MB/s)")):
            rows = swept[axis]
            key = "latency_s" if axis == "latency" else "bandwidth_bytes_per_s"
            xs = [row[key] * scale for row in rows]
            ax.plot(xs, [row["cells_per_s"] for row in rows], marker="o", label="Loader")
            ax.plot(xs, [row["bound_cells_per_s"] for row in rows], "k--",
                    label="bandwidth bound")  # fmt: skip
            ax.set(xscale="log", xlabel=unit, ylabel="cells / s")
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
            ax.minorticks_off()
            ax.legend(fontsize=7)
    save_figure(fig, ROOT / "docs" / "_static" / "bench_remote.png",
                "Loader through S3 (moto) behind an emulated network", results)  # fmt: skip


if __name__ == "__main__":
    main()
