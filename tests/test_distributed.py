"""Conversion on dask.distributed: a LocalCluster of 2 worker processes writes the same bytes
as the single-process writer, from files (opened by the workers) and from in-memory AnnData."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_writer import small_adata

import deltacells as dc
from deltacells.cli import main

distributed = pytest.importorskip("distributed", reason="the dask extra")


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:  # fmt: skip
        with distributed.Client(cluster) as c:
            yield c


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("atlas")
    paths = []
    for i in range(3):
        adata = small_adata(n_cells=700 + 100 * i, n_genes=90, seed=20 + i)
        adata.obs_names = [f"f{i}-{n}" for n in adata.obs_names]
        path = root / f"part{i}.h5ad"
        adata.write_h5ad(path)
        paths.append(path)
    return paths


def same_files(a: Path, b: Path) -> None:
    names_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert names_a == names_b
    for name in names_a:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("shuffle", [False, True])
def test_files_on_a_cluster_are_byte_identical(client, inputs, tmp_path, shuffle, monkeypatch):
    """Same bytes as one process; the plan every worker receives holds no per-cell array
    (each task gets its own tiles' rows of a shuffled write instead)."""
    from deltacells.write import plan

    options = {"tile_size": 250, "join": "same", "shuffle": shuffle, "progress": False}
    dc.write_deltacells(inputs, tmp_path / "here", **options)
    scattered = []
    scatter = client.scatter
    monkeypatch.setattr(client, "scatter", lambda data, **kw: (scattered.append(data),
                                                               scatter(data, **kw))[1])
    dc.write_deltacells(inputs, tmp_path / "cluster", client=client, **options)
    same_files(tmp_path / "here", tmp_path / "cluster")
    plans = [d for d in scattered if isinstance(d, plan._Plan)]
    assert len(plans) == 1 and plans[0].cell_order is None and len(plans[0].var) == 0
    assert dc.open_dataset(tmp_path / "cluster").manifest.n_tiles == 10
    dc.open_dataset(tmp_path / "cluster").verify()


def test_pass_one_runs_as_tasks_on_the_cluster(client, inputs, tmp_path, monkeypatch):
    """Checking counts and adding up gene totals runs as tasks of a few blocks per input
    (here one block each), on the workers, and so does summarising each input's obs: the
    same bytes, also with counts above 65535 (chung: the tile size their exceptions allow is
    found by the tasks)."""
    from conftest import DATA_DIR

    from deltacells.write import plan

    monkeypatch.setattr(plan, "CHECK_BLOCKS_PER_TASK", 1)
    for name, sources in (("atlas", inputs), ("chung", [DATA_DIR / "chung2017_smartseq2.h5ad"])):
        options = {"tile_size": 250 if name == "atlas" else None, "progress": False}
        dc.write_deltacells(sources, tmp_path / f"{name}-here", **options)
        with distributed.get_task_stream(client) as stream:
            dc.write_deltacells(sources, tmp_path / f"{name}-cluster", client=client, **options)
        same_files(tmp_path / f"{name}-here", tmp_path / f"{name}-cluster")
        checks = [t for t in stream.data if str(t["key"]).startswith("_check_task")]
        # obs is summarised for planning by a task per input too
        summaries = [t for t in stream.data if str(t["key"]).startswith("_obs_summary_task")]
        assert len(summaries) == len(sources)
        n_obs = [dc.open_dataset(tmp_path / f"{name}-here").shape[0]] if name == "chung" \
            else [700, 800, 900]  # fmt: skip
        block = 250 if name == "atlas" else dc.open_dataset(tmp_path / "chung-here").manifest \
            .tile_size  # fmt: skip
        assert len(checks) >= sum(-(-n // block) for n in n_obs)


def test_obs_exclude_on_the_cluster(client, inputs, tmp_path):
    # The workers read each file's obs; a name no file has is refused there as here.
    options = {"tile_size": 250, "obs_exclude": "barcode", "progress": False}
    dc.write_deltacells(inputs, tmp_path / "here", **options)
    dc.write_deltacells(inputs, tmp_path / "cluster", client=client, **options)
    same_files(tmp_path / "here", tmp_path / "cluster")
    assert "barcode" not in dc.open_dataset(tmp_path / "cluster").obs_schema().names
    with pytest.raises(ValueError, match=r"obs_exclude names \['Barcode'\] but no input"):
        dc.write_deltacells(inputs, tmp_path / "typo", client=client, obs_exclude=["Barcode"],
                            progress=False)  # fmt: skip


def test_pass_one_on_the_cluster_names_the_first_bad_value(client, inputs, tmp_path):
    import anndata as ad

    bad = ad.read_h5ad(inputs[1])
    counts = bad.X.tolil()
    counts[450, 7] = -3
    counts[600, 2] = -1
    bad.X = counts.tocsr()
    path = tmp_path / "bad.h5ad"
    bad.write_h5ad(path)
    sources = [inputs[0], path, inputs[2]]
    with pytest.raises(dc.CountError) as here:
        dc.write_deltacells(sources, tmp_path / "here", tile_size=100, progress=False)
    with pytest.raises(dc.CountError) as there:
        dc.write_deltacells(sources, tmp_path / "there", tile_size=100, client=client,
                            progress=False)  # fmt: skip
    assert str(there.value) == str(here.value)
    assert "bad.h5ad" in str(there.value) and "cell 450" in str(there.value)


def test_in_memory_anndata_on_a_cluster(client, tmp_path):
    adata = small_adata(n_cells=900, seed=5)
    adata.layers["counts"] = adata.X.copy()
    dc.write_deltacells(adata, tmp_path / "here", tile_size=200, progress=False)
    dc.write_deltacells(adata, tmp_path / "cluster", tile_size=200, client=client,
                        progress=False)  # fmt: skip
    same_files(tmp_path / "here", tmp_path / "cluster")


def test_cli_scheduler_and_local_workers(client, inputs, tmp_path):
    here, there, local = tmp_path / "here.dc", tmp_path / "there.dc", tmp_path / "local.dc"
    assert main(["convert", *map(str, inputs), str(here), "--tile-size", "300", "--quiet"]) == 0
    assert main(["convert", *map(str, inputs), str(there), "--tile-size", "300", "--quiet",
                 "--scheduler", client.scheduler.address]) == 0  # fmt: skip
    same_files(here, there)
    assert main(["convert", *map(str, inputs), str(local), "--tile-size", "300", "--quiet",
                 "--workers", "2"]) == 0  # fmt: skip
    same_files(here, local)
    back = dc.read_deltacells(local)
    assert back.n_obs == 700 + 800 + 900 and np.isfinite(back.X[:10].toarray()).all()


def test_scanpy_dask_pipeline_from_s3_on_a_cluster(client, tmp_path, monkeypatch):
    """read_deltacells(url, dask=True) under a distributed Client: each worker reopens the
    dataset from its pickled recipe (once per process) and fetches its own tiles from S3
    (moto); normalize_total, log1p, highly_variable_genes and pca give what the threaded
    scheduler gives."""
    import boto3
    import dask
    from test_s3 import free_port

    sc = pytest.importorskip("scanpy")
    moto_server = pytest.importorskip("moto.server")
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id="t", aws_secret_access_key="t")  # fmt: skip
        s3.create_bucket(Bucket="cells")
        adata = small_adata(n_cells=1500, n_genes=200, seed=8)
        local = tmp_path / "d"
        dc.write_deltacells(adata, local, tile_size=256, progress=False)
        for path in local.rglob("*"):
            if path.is_file():
                s3.upload_file(str(path), "cells", f"d/{path.relative_to(local)}")
        options = {"key": "t", "secret": "t", "client_kwargs": {"endpoint_url": endpoint},
                   "skip_instance_cache": True}  # fmt: skip

        def pipeline(scheduler):
            with dask.config.set(scheduler=scheduler):
                a = dc.read_deltacells("s3://cells/d", dask=True, storage_options=options,
                                       elements=False)  # fmt: skip
                sc.pp.normalize_total(a, target_sum=1e4)
                sc.pp.log1p(a)
                sc.pp.highly_variable_genes(a, n_top_genes=50)
                a = a[:, a.var["highly_variable"]].copy()
                sc.pp.pca(a, n_comps=5, svd_solver="covariance_eigh")
                return a.var_names.tolist(), np.asarray(a.obsm["X_pca"])

        genes_threads, pca_threads = pipeline("threads")
        genes_cluster, pca_cluster = pipeline(client)  # a Client is a dask scheduler
        assert genes_cluster == genes_threads
        np.testing.assert_allclose(np.abs(pca_cluster), np.abs(pca_threads), rtol=1e-4,
                                   atol=1e-5)  # fmt: skip
        # the workers ran the tile tasks: each opened the dataset at most once
        opened = client.run(lambda: len(__import__("deltacells.read.dataset")
                                        .dataset._REOPENED))  # fmt: skip
        assert sum(opened.values()) >= 1 and all(v <= 1 for v in opened.values())
    finally:
        server.stop()
