"""scanpy on dask from S3: the threaded scheduler against a dask.distributed cluster.

    python benchmarks/bench_dask.py [--cells 200000] [--repeats 3]

``liao2020_balf.h5ad`` stacked with shuffled rows to ``--cells`` cells, written as deltacells
and uploaded to moto's S3 server (in a process of its own). ``read_deltacells(url,
dask=True)`` then runs ``normalize_total``, ``log1p``, ``highly_variable_genes`` (2,000 genes)
and ``pca`` (50 components), computed by:

* dask's threaded scheduler (one process);
* a ``LocalCluster`` of 2 worker processes (one thread each), each worker reopening the
  dataset from its pickled recipe and fetching its own tiles.

Reports medians of ``--repeats`` wall times and whether both give the same genes and PCA
(up to sign). Writes ``benchmarks/results/dask.json`` and the docs' table
``docs/_static/bench_dask.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import machine, stacked_adata

import deltacells as dc

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"

SERVER = """
import sys, time
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]))
server.start()
print("ready", flush=True)
sys.stdin.read()  # until the parent closes it
server.stop()
"""


def pipeline(url: str, options: dict, scheduler) -> tuple[float, list, np.ndarray]:
    import dask
    import scanpy as sc

    t = time.perf_counter()
    with dask.config.set(scheduler=scheduler):
        adata = dc.read_deltacells(url, dask=True, storage_options=options, elements=False)
        sc.pp.normalize_total(adata, target_sum=1e4)
        sc.pp.log1p(adata)
        sc.pp.highly_variable_genes(adata, n_top_genes=2000)
        adata = adata[:, adata.var["highly_variable"]].copy()
        sc.pp.pca(adata, n_comps=50, svd_solver="covariance_eigh")
        pca = np.asarray(adata.obsm["X_pca"])
    return time.perf_counter() - t, adata.var_names.tolist(), pca


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "dask.json")
    parser.add_argument("--no-table", action="store_true")
    args = parser.parse_args()
    import socket

    import boto3
    from distributed import Client, LocalCluster

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    results: dict = {"machine": machine(), "command": " ".join(["python", *sys.argv]),
                     "n_cells": args.cells, "repeats": args.repeats}  # fmt: skip
    try:
        while (line := server.stdout.readline()) and line.strip() != "ready":
            pass  # moto announces itself first
        endpoint = f"http://127.0.0.1:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="x", aws_secret_access_key="x")  # fmt: skip
        s3.create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory(prefix="bench-dask-") as tmp:
            local = Path(tmp) / "x.dc"
            dc.write_deltacells(stacked_adata(DATA, args.cells), local, progress=False)
            for path in local.rglob("*"):
                if path.is_file():
                    s3.upload_file(str(path), "bench", f"x.dc/{path.relative_to(local)}")
        options = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": endpoint}}
        url = "s3://bench/x.dc"
        runs = {"threaded scheduler": [], "LocalCluster, 2 workers": []}
        outputs = {}
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                               dashboard_address=None)  # fmt: skip
        with cluster, Client(cluster) as client:
            for _ in range(args.repeats):  # alternating, so drift hits both alike
                for name, scheduler in (("threaded scheduler", "threads"),
                                        ("LocalCluster, 2 workers", client)):  # fmt: skip
                    seconds, genes, pca = pipeline(url, options, scheduler)
                    runs[name].append(seconds)
                    outputs[name] = (genes, pca)
                    print(name, f"{seconds:.2f} s", flush=True)
        (genes_a, pca_a), (genes_b, pca_b) = outputs.values()
        results["same_result"] = bool(genes_a == genes_b and np.allclose(
            np.abs(pca_a), np.abs(pca_b), rtol=1e-3, atol=1e-3))  # fmt: skip
        results["runs"] = {name: {"median_s": statistics.median(times), "seconds": times,
                                  "cells_per_s": args.cells / statistics.median(times)}
                           for name, times in runs.items()}  # fmt: skip
    finally:
        server.stdin.close()
        server.wait(timeout=30)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results["runs"], indent=1), "same result:", results["same_result"])
    if not args.no_table:
        lines = ["| scheduler | median wall time | cells/s |", "|---|---|---|"]
        lines += [f"| {name} | {row['median_s']:.1f} s | {row['cells_per_s']:,.0f} |"
                  for name, row in results["runs"].items()]  # fmt: skip
        lines += ["", f"{args.cells:,} cells, medians of {args.repeats}; the two give the same "
                  f"genes and PCA: {'yes' if results['same_result'] else 'NO'}."]  # fmt: skip
        (ROOT / "docs" / "_static" / "bench_dask.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
