"""The lazy AnnData with anndata and scanpy: copy, reductions, writing h5ad/zarr tile by tile,
concat (scanpy on the lazy X: test_scanpy_chain.py)."""

from __future__ import annotations

import re
import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from test_whole_anndata import processed

import deltacells as dc

# A lazy X answers numpy functions with dask arrays: these tests need the dask extra.
da = pytest.importorskip("dask.array", reason="dask is an optional extra")


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    root = tmp_path_factory.mktemp("lazy") / "d"
    source = processed(n_cells=250, seed=21)
    dc.write_deltacells(source, root, tile_size=64, progress=False)
    return root, source


def test_copy_stays_lazy_and_equal(stored):
    root, source = stored
    lazy = dc.read_deltacells(root)
    copied = lazy.copy()
    assert isinstance(copied.X, dc.DeltacellsCSRDataset) and copied.X is not lazy.X
    assert (copied.X.to_memory() != source.X).nnz == 0
    assert (copied.layers["counts"].to_memory() != source.layers["counts"]).nnz == 0


@pytest.mark.parametrize("values_dtype", [np.float32, np.int32])
def test_sum_and_mean_match_scipy(stored, values_dtype):
    root, source = stored
    X = dc.read_deltacells(root, values_dtype=values_dtype, elements=False).X
    expected = sp.csr_matrix(source.X, dtype=values_dtype)
    for axis in (None, 0, 1):
        np.testing.assert_allclose(
            np.asarray(X.sum(axis=axis)), np.asarray(expected.sum(axis=axis)), rtol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(X.mean(axis=axis)), np.asarray(expected.mean(axis=axis)), rtol=1e-6
        )
        assert np.shape(X.sum(axis=axis)) == np.shape(expected.sum(axis=axis))
        # Per gene or cell: np.matrix as scipy makes it, without numpy's warning for
        # np.matrix(...) on every sum.
        with warnings.catch_warnings():
            warnings.simplefilter("error", PendingDeprecationWarning)
            if axis is not None:
                assert type(X.sum(axis=axis)) is np.matrix is type(expected.sum(axis=axis))
                assert type(X.mean(axis=axis)) is np.matrix is type(expected.mean(axis=axis))
    np.testing.assert_allclose(
        np.asarray(np.sum(X, axis=1)),  # numpy passes out=
        np.asarray(expected.sum(axis=1)),
    )
    out = np.zeros((X.shape[0], 1))
    assert X.sum(axis=1, out=out) is out


def test_what_needs_memory_says_so(stored):
    root, _ = stored
    X = dc.read_deltacells(root, elements=False).X
    with pytest.raises(TypeError, match=r"read lazily\. Use adata\.to_memory\(\)"):
        np.asarray(X)
    with pytest.raises(AttributeError, match=r"X\.multiply needs the matrix in memory"):
        X.multiply(2)


@pytest.mark.parametrize("writer", ["write_h5ad", "write_zarr"])
def test_write_h5ad_and_zarr_stream_tile_by_tile(stored, tmp_path, monkeypatch, writer):
    root, source = stored
    lazy = dc.read_deltacells(root)
    expected = lazy.to_memory()

    def no_whole_matrix(self):
        raise AssertionError("the writer materialized the whole matrix")

    monkeypatch.setattr(dc.DeltacellsCSRDataset, "to_memory", no_whole_matrix)
    target = tmp_path / ("out.h5ad" if writer == "write_h5ad" else "out.zarr")
    getattr(lazy, writer)(target)
    back = ad.read_h5ad(target) if writer == "write_h5ad" else ad.read_zarr(target)
    assert (back.X != expected.X).nnz == 0
    assert (back.layers["counts"] != expected.layers["counts"]).nnz == 0
    assert (back.raw.X != source.raw.X).nnz == 0
    np.testing.assert_array_equal(back.obsm["X_umap"], expected.obsm["X_umap"])


def test_concat(stored):
    root, source = stored
    lazy = dc.read_deltacells(root, elements=False)
    expected = sp.vstack([source.X, source.X])
    # lazy + lazy stays lazy: a dask array over the tiles of both, X and the counts layer
    both = ad.concat([lazy, lazy])
    assert isinstance(both.X, da.Array) and isinstance(both.layers["counts"], da.Array)
    assert (sp.csr_matrix(both.X.compute()) != expected).nnz == 0
    assert (sp.csr_matrix(both.layers["counts"].compute())
            != sp.vstack([source.layers["counts"]] * 2)).nnz == 0  # fmt: skip
    # lazy + a dense in-memory X: an in-memory CSR result
    bare = lazy.copy()
    del bare.layers["counts"], bare.raw
    dense = bare.to_memory()
    dense.X = dense.X.toarray()
    mixed = ad.concat([bare, dense])
    assert sp.issparse(mixed.X) and (mixed.X != expected).nnz == 0
    # lazy + in-memory sparse: anndata builds a CSR from X, which a lazy X refuses, saying why
    with pytest.raises(ValueError) as caught:
        ad.concat([bare, bare.to_memory()])
    assert "dask=True" in str(caught.value.__cause__)
    in_memory = ad.concat([lazy.to_memory(), lazy.to_memory()])
    assert (in_memory.X != expected).nnz == 0
    dask = dc.read_deltacells(root, dask=True, elements=False)
    mixed = ad.concat([dask, lazy.to_memory()[:, :50]], join="inner")
    assert (sp.csr_matrix(mixed.X) != sp.vstack([source.X[:, :50]] * 2)).nnz == 0


def test_numpy_functions_on_lazy_x(stored):
    root, source = stored
    X = dc.read_deltacells(root, elements=False).X
    np.testing.assert_allclose(np.asarray(np.sum(X, axis=0)), np.asarray(source.X.sum(axis=0)))
    np.testing.assert_allclose(
        np.asarray(np.mean(X, axis=1)), np.asarray(source.X.mean(axis=1)), rtol=1e-6
    )
    # Other numpy functions, ufuncs and operators: lazy dask arrays over the tiles.
    dense = source.X.toarray()
    np.testing.assert_allclose(np.log1p(X).compute().toarray(), np.log1p(dense), rtol=1e-6)
    assert ((X > 1).compute() != (source.X > 1)).nnz == 0
    np.testing.assert_allclose((X * 2).compute().toarray(), dense * 2)




def _count_duplicate_checks(monkeypatch) -> list[int]:
    """Lengths of every pandas index anndata hashes for duplicates from now on."""

    seen: list[int] = []
    original = pd.Index.has_duplicates.fget

    def counted(index):
        seen.append(len(index))
        return original(index)

    monkeypatch.setattr(pd.Index, "has_duplicates", property(counted))
    return seen


@pytest.mark.parametrize("stored_names", [True, False])
def test_known_unique_obs_names_are_not_hashed_again(tmp_path, monkeypatch, stored_names):
    # Hashing every obs name was most of the opening time at 10M cells: names "0".."n-1"
    # and names the writer recorded unique are not checked again; var names still are.
    source = processed(n_cells=150, seed=5)  # 150 cells x 120 genes
    if not stored_names:
        source.obs_names = [str(i) for i in range(source.n_obs)]
    root = tmp_path / "d"
    dc.write_deltacells(source, root, tile_size=64, progress=False, obs=stored_names)
    seen = _count_duplicate_checks(monkeypatch)
    adata = dc.read_deltacells(root)
    assert source.n_obs not in seen and source.n_vars in seen
    assert list(adata.obs_names) == list(source.obs_names)
    # A mask keeps each cell once: still known unique.
    seen.clear()
    adata._inplace_subset_obs(np.arange(adata.n_obs) % 2 == 0)
    assert adata.n_obs not in seen
    # Positions may repeat a cell: anndata's check runs again and warns.
    seen.clear()
    with pytest.warns(UserWarning, match="not unique"):
        adata._inplace_subset_obs(np.array([0, 0, 1]))
    assert 3 in seen


def test_obs_names_set_anew_are_checked_again(tmp_path, monkeypatch):
    source = processed(n_cells=80, seed=6)
    root = tmp_path / "d"
    dc.write_deltacells(source, root, tile_size=64, progress=False)
    adata = dc.read_deltacells(root)
    adata.obs_names = ["same"] * adata.n_obs
    seen = _count_duplicate_checks(monkeypatch)
    with pytest.warns(UserWarning, match="not unique"):
        adata._inplace_subset_obs(np.arange(adata.n_obs) < 10)
    assert 10 in seen


def test_names_recorded_repeated_are_checked(tmp_path, monkeypatch):
    source = processed(n_cells=80, seed=7)
    source.obs_names = ["a", "b"] * 40
    root = tmp_path / "d"
    dc.write_deltacells(source, root, tile_size=64, progress=False)
    seen = _count_duplicate_checks(monkeypatch)
    with pytest.warns(UserWarning, match="not unique"):
        adata = dc.read_deltacells(root)
    assert source.n_obs in seen and list(adata.obs_names) == list(source.obs_names)


def test_positions_open_without_a_name_per_cell(stored, tmp_path, monkeypatch):
    # obs_names="positions": a RangeIndex (constant memory at 100M cells); everything else
    # as the named read, and copies name their cells by position, as anndata does.
    root, source = stored
    named = dc.read_deltacells(root)
    got = dc.read_deltacells(root, obs_names="positions", cache_dir=tmp_path / "cache")
    assert isinstance(got.obs_names, pd.RangeIndex) and len(got.obs_names) == source.n_obs
    # the stored names are not read (not even cached), the other columns are
    cached = {p.name for p in (tmp_path / "cache").rglob("*.arrow")}
    assert cached and not any(n.startswith("_index") or "obs_names" in n for n in cached)
    pd.testing.assert_frame_equal(got.obs.set_axis(named.obs_names), named.obs)
    pd.testing.assert_frame_equal(got.obsm["frame"].set_axis(named.obs_names),
                                  named.obsm["frame"])  # fmt: skip
    view = got[10:20, :5]
    assert list(view.obs_names) == list(range(10, 20))
    np.testing.assert_array_equal(view.X.toarray(), named[10:20, :5].X.toarray())
    # anndata stringifies the copy's obs names but not the index of a DataFrame in obsm, and
    # then refuses the mismatch (documented with obs_names="positions").
    del got.obsm["frame"]
    with pytest.warns(ad.ImplicitModificationWarning, match="str index"):
        copy = got[[3, 7]].to_memory()
    assert list(copy.obs_names) == ["3", "7"]
    seen = _count_duplicate_checks(monkeypatch)
    with warnings.catch_warnings():  # the in-place filter names by position without a word
        warnings.simplefilter("error", ad.ImplicitModificationWarning)
        got._inplace_subset_obs(np.arange(got.n_obs) % 3 == 0)
    assert got.n_obs not in seen
    assert list(got.obs_names) == [str(i) for i in range(0, source.n_obs, 3)]


def test_positions_of_a_selection_are_its_stored_rows(tmp_path):
    source = processed(n_cells=300, seed=23)
    root = tmp_path / "spatial.dc"
    dc.write_deltacells(source, root, spatial_key="spatial", tile_size=64, progress=False)
    box = (100.0, 200.0, 600.0, 700.0)
    rows = dc.open_dataset(root).query_bbox(box).rows
    got = dc.read_deltacells(root, bbox=box, obs_names="positions")
    assert got.obs_names.dtype == np.int64 and list(got.obs_names) == list(rows)
    named = dc.read_deltacells(root, bbox=box)
    np.testing.assert_array_equal(got.X.to_memory().toarray(), named.X.to_memory().toarray())


def test_obs_names_mode_is_checked(stored):
    with pytest.raises(ValueError, match="obs_names must be 'names' or 'positions'"):
        dc.read_deltacells(stored[0], obs_names="index")


def test_a_bad_thread_count_is_named_as_the_callers(stored):
    # Not a FormatError naming the obs cache file (where the names kernel first met it).
    for mode in ("names", "positions"):
        with pytest.raises(ValueError, match="n_threads=0 is not allowed") as caught:
            dc.read_deltacells(stored[0], n_threads=0, obs_names=mode)
        assert not isinstance(caught.value, dc.FormatError)


def test_elements_and_dask_options_are_checked(stored, monkeypatch):
    with pytest.raises(ValueError, match="elements must be True, False or 'lazy', not 'Lazy'"):
        dc.read_deltacells(stored[0], elements="Lazy")
    # Without dask the flag that needs it is named, not reported as a damaged file.
    from deltacells.read import assemble

    monkeypatch.setattr(assemble, "dask_array_type", lambda: None)
    for flag, kwargs in (("elements='lazy'", {"elements": "lazy"}), ("dask=True", {"dask": True})):
        with pytest.raises(ImportError, match=re.escape(f"{flag} needs dask: pip install")):
            dc.read_deltacells(stored[0], **kwargs)


def test_mistaken_arguments_are_named_before_reading(stored):
    # A truthy string would have meant True; a bad mode was only checked inside a box query.
    cases = [
        (TypeError, "ranged_reads must be True or False, not 'no'", {"ranged_reads": "no"}),
        (TypeError, "dask must be True or False, not 'yes'", {"dask": "yes"}),
        (TypeError, "obs must be True, False or a list of obs column names, not NoneType",
         {"obs": None}),
        (TypeError, "tile_cache_bytes must be an int, not float", {"tile_cache_bytes": 1.5}),
        (ValueError, "tile_cache_bytes must be >= 0, not -5", {"tile_cache_bytes": -5}),
        (ValueError, "bbox_mode must be one of ('intersects', 'centroid'), not 'within'",
         {"bbox_mode": "within"}),
        (TypeError, "cache_dir must be a path or None, not int", {"cache_dir": 123}),
        (TypeError, "storage_options must be a dict of fsspec options", {"storage_options": "x"}),
        (TypeError, "timeout must be a number of seconds or None, not str", {"timeout": "5"}),
    ]  # fmt: skip
    for error, message, kwargs in cases:
        with pytest.raises(error, match=re.escape(message)):
            dc.read_deltacells(stored[0], **kwargs)
    # One obs column may be named alone (as the Loader takes it), not spelled out.
    root, source = stored
    column = source.obs.columns[0]
    assert list(dc.read_deltacells(root, obs=column).obs.columns) == [column]
    with pytest.raises(KeyError, match=re.escape("obs columns not in the dataset: ['nope']")):
        dc.read_deltacells(root, obs="nope")


def test_read_obs_names_names_a_selection(stored, tmp_path):
    # The way back from positions to the names read_deltacells gives, for a selection only.
    root, source = stored
    got = dc.read_deltacells(root, obs_names="positions", cache_dir=tmp_path)
    mask = np.arange(got.n_obs) % 7 == 3
    rows = got.obs_names[mask]
    names = dc.read_obs_names(root, rows, cache_dir=tmp_path)
    assert list(names) == list(dc.read_deltacells(root).obs_names[mask])
    assert list(names) == list(source.obs_names[mask])  # stored in source order here
    del got.obsm["frame"]  # anndata cannot copy it with integer obs names (see above)
    with pytest.warns(ad.ImplicitModificationWarning, match="str index"):
        sub = got[mask].to_memory()
    sub.obs_names = names
    assert sub.obs_names.is_unique and sub.n_obs == int(mask.sum())
    assert len(dc.read_obs_names(root, np.array([], dtype=np.int64))) == 0
    with pytest.raises(IndexError, match=r"0 \.\. 249"):
        dc.read_obs_names(root, [0, source.n_obs])
    with pytest.raises(TypeError, match="positions must be integers"):
        dc.read_obs_names(root, ["3", "7"])


def test_read_obs_names_without_stored_names(tmp_path):
    source = processed(n_cells=90, seed=9)
    root = tmp_path / "d"
    dc.write_deltacells(source, root, tile_size=64, progress=False, obs=False)
    assert list(dc.read_obs_names(dc.open_dataset(root), [5, 80, 0])) == ["5", "80", "0"]


def test_every_lazy_type_joins_scanpys_dask_dispatchers(stored):
    """Both lazy types scanpy can meet (the lazy X, and the tile-wise square scanpy's
    variance makes of it) join scanpy's dispatchers that have a dask version; each type
    scans the modules on its own (a scan shared between them left the second type out)."""
    pytest.importorskip("scanpy")
    from deltacells.read import outofcore
    from deltacells.read.integrations import TileMapped

    path, _ = stored
    dc.read_deltacells(path)
    joined = {kind for _, kind in outofcore._registered}
    assert {dc.DeltacellsCSRDataset, TileMapped} <= joined
    assert outofcore.join_dispatchers(TileMapped, TileMapped.to_dask) == 0  # nothing new


def test_astype_stays_lazy_and_casts_like_scipy(stored):
    root, source = stored
    lazy = dc.read_deltacells(root, values_dtype=np.int32)
    rows = np.random.default_rng(7).choice(lazy.n_obs, 40, replace=False)
    for dtype in (np.float32, np.float64, np.int32):
        cast = lazy.X.astype(dtype)
        assert isinstance(cast, dc.DeltacellsCSRDataset) and cast.dtype == dtype
        assert cast is not lazy.X and cast.shape == lazy.X.shape
        got = cast[rows]
        assert got.dtype == dtype and (got != source.X[rows].astype(dtype)).nnz == 0
    assert lazy.X.astype(np.int32, copy=False) is lazy.X
    # A row selection stays one: the cast shows the same rows.
    view = lazy.X.take_rows(rows).astype(np.float64)
    assert (view.to_memory() != source.X[rows].astype(np.float64)).nnz == 0
    # Other dtypes: the dask array over tiles, cast.
    other = lazy.X.astype(np.int16)
    assert isinstance(other, da.Array) and other.dtype == np.int16
    assert (sp.csr_matrix(other.compute()) != source.X.astype(np.int16)).nnz == 0


def test_normalize_total_on_a_fresh_read_of_counts(stored):
    # scanpy casts integer counts with X.astype(np.float32) before it normalises; the lazy X
    # once refused that, so the first step of the usual chain failed on a default read.
    sc = pytest.importorskip("scanpy")
    root, source = stored
    lazy = dc.read_deltacells(root, values_dtype=np.int32)
    sc.pp.normalize_total(lazy, target_sum=1e4)
    expected = ad.AnnData(source.X.astype(np.int32))
    sc.pp.normalize_total(expected, target_sum=1e4)
    got = lazy.X.compute() if isinstance(lazy.X, da.Array) else lazy.X.to_memory()
    np.testing.assert_allclose(sp.csr_matrix(got).toarray(), expected.X.toarray(), rtol=1e-5)
