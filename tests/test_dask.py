"""read_deltacells(..., dask=True): one scipy-CSR chunk per tile; scanpy runs out of core."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import DATA_DIR

import deltacells as dc

da = pytest.importorskip("dask.array", reason="dask is an optional extra")
sc = pytest.importorskip("scanpy", reason="scanpy is a dev dependency")


@pytest.fixture(scope="module")
def liao_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("dask")
    dc.write_deltacells(DATA_DIR / "liao2020_balf.h5ad", root / "liao", tile_size=2048,
                        progress=False)  # fmt: skip
    return root / "liao"


def test_chunks_are_tiles(liao_paths, real_counts):
    adata = dc.read_deltacells(liao_paths, dask=True)
    X = adata.X
    assert isinstance(X, da.Array)
    assert X.chunks[0] == tuple(dc.open_dataset(liao_paths).manifest.tile_cells)
    assert isinstance(X.blocks[1].compute(), sp.csr_matrix)
    assert (sp.csr_matrix(X.compute()) != real_counts["liao2020_balf"]).nnz == 0


def test_scanpy_pipeline_on_dask_matches_in_memory(liao_paths):
    lazy = dc.read_deltacells(liao_paths, dask=True, obs=["sample"])
    eager = dc.read_deltacells(liao_paths, obs=["sample"]).to_memory()
    for adata in (lazy, eager):
        sc.pp.normalize_total(adata, target_sum=1e4)
        sc.pp.log1p(adata)
        sc.pp.highly_variable_genes(adata, n_top_genes=500)
    assert isinstance(lazy.X, da.Array)  # still lazy after the dask-aware steps
    np.testing.assert_array_equal(lazy.var["highly_variable"], eager.var["highly_variable"])
    np.testing.assert_allclose(lazy.var["means"], eager.var["means"], rtol=1e-4)
    hvg_lazy = lazy[:, lazy.var["highly_variable"]].copy()
    hvg_eager = eager[:, eager.var["highly_variable"]].copy()
    sc.pp.pca(hvg_lazy, n_comps=10, svd_solver="covariance_eigh")
    sc.pp.pca(hvg_eager, n_comps=10, svd_solver="covariance_eigh")
    np.testing.assert_allclose(
        np.abs(np.asarray(hvg_lazy.obsm["X_pca"])), np.abs(hvg_eager.obsm["X_pca"]),
        rtol=1e-2, atol=1e-2,
    )  # fmt: skip


def test_graphs_are_named_by_the_stored_data(liao_paths, tmp_path):
    """The same dataset gives the same dask names (so dask can share results); another
    values dtype or another dataset gives others."""
    first = dc.read_deltacells(liao_paths, dask=True).X
    assert first.name == dc.read_deltacells(liao_paths, dask=True).X.name
    assert first.name != dc.read_deltacells(liao_paths, dask=True, values_dtype="float64").X.name
    other = tmp_path / "other"
    dc.write_deltacells(DATA_DIR / "liao2020_balf.h5ad", other, tile_size=4096, progress=False)
    assert first.name != dc.read_deltacells(other, dask=True).X.name


def test_unpickling_reopens_once_per_process_and_notices_a_rewrite(tmp_path, monkeypatch):
    """dask pickles tasks to name them and its workers unpickle every task: the manifest is
    fetched once per process, and a dataset overwritten since pickling is refused."""
    import pickle

    from test_writer import small_adata

    import deltacells.read.dataset as dataset_module

    root = tmp_path / "d"
    dc.write_deltacells(small_adata(n_cells=300), root, tile_size=100, progress=False)
    blob = pickle.dumps(dc.read_deltacells(root, elements=False).X)
    opened = []
    real_open = dataset_module.open_dataset
    monkeypatch.setattr(dataset_module, "open_dataset",
                        lambda *a, **k: opened.append(1) or real_open(*a, **k))  # fmt: skip
    copies = [pickle.loads(blob) for _ in range(5)]
    assert len(opened) == 1
    assert all((c[:] != copies[0][:]).nnz == 0 for c in copies)
    dc.write_deltacells(small_adata(n_cells=300, seed=9), root, tile_size=100, overwrite=True,
                        progress=False)  # fmt: skip
    dataset_module._REOPENED.clear()
    with pytest.raises(dc.FormatError, match="changed since this object was made"):
        pickle.loads(blob)
