"""The whole AnnData round trip: layers, raw, obsm, varm, obsp, varp and uns are stored and
read back equal, lazily and in memory, in source and in shuffled cell order."""

from __future__ import annotations

import warnings

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from test_writer import small_adata

import deltacells as dc
from deltacells.store.elements import ElementsWarning
from deltacells.testing import reseal


def assert_equal(actual, expected) -> None:
    """Element-by-element equality of what AnnData holds (arrays, sparse, frames, nested
    dicts, strings and numbers)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (actual, expected)
        for key in expected:
            assert_equal(actual[key], expected[key])
    elif isinstance(expected, pd.DataFrame):
        pd.testing.assert_frame_equal(actual, expected)
    elif sp.issparse(expected):
        assert actual.shape == expected.shape and (sp.csr_matrix(actual) != expected).nnz == 0
    elif isinstance(expected, np.ndarray):
        np.testing.assert_array_equal(np.asarray(actual).astype(expected.dtype), expected)
        assert np.asarray(actual).dtype.kind == expected.dtype.kind or expected.dtype == object
    else:
        assert actual == expected, (actual, expected)


def processed(n_cells: int = 300, seed: int = 0) -> ad.AnnData:
    """What a scanpy user has after preprocessing: counts layer, normalised X-like layer,
    raw, embeddings, spatial coordinates, loadings, graphs and nested uns."""
    rng = np.random.default_rng(seed)
    a = small_adata(n_cells=n_cells, seed=seed)
    # (anndata cannot write nullable Float64 into .h5ad or .zarr, so that one is left out)
    extra = every_obs_dtype(n_cells).drop(columns=[7, 2.5, "barcodes", "nullable_float"])
    extra.index = a.obs_names
    a.obs = a.obs.join(extra)  # every obs dtype anndata writes
    a.layers["counts"] = a.X.copy()
    a.layers["lognorm"] = sp.csr_matrix(np.log1p(a.X.toarray() / 3.0).astype(np.float32))
    a.raw = a.copy()
    a.obsm["X_pca"] = rng.random((n_cells, 10)).astype(np.float32)
    a.obsm["X_umap"] = rng.random((n_cells, 2))
    a.obsm["spatial"] = rng.random((n_cells, 2)) * 1000
    a.obsm["frame"] = pd.DataFrame({"u": rng.random(n_cells)}, index=a.obs_names)
    a.varm["PCs"] = rng.random((a.n_vars, 10))
    a.obsp["connectivities"] = sp.random(n_cells, n_cells, density=0.02, format="csr",
                                         random_state=rng)  # fmt: skip
    a.obsp["distances"] = sp.random(n_cells, n_cells, density=0.02, format="csr",
                                    random_state=rng)  # fmt: skip
    a.varp["corr"] = sp.random(a.n_vars, a.n_vars, density=0.05, format="csr", random_state=rng)
    a.uns["neighbors"] = {"params": {"n_neighbors": 15, "method": "umap"},
                          "connectivities_key": "connectivities"}  # fmt: skip
    a.uns["cell_type_colors"] = np.array(["#1f77b4", "#ff7f0e"], dtype=object)
    a.uns["pca"] = {"variance_ratio": rng.random(10), "variance": rng.random(10)}
    a.uns["title"] = "processed"
    return a


def in_stored_order(source: ad.AnnData, back: ad.AnnData) -> ad.AnnData:
    """``source`` with its cells in ``back``'s order (the order a shuffled dataset stores)."""
    position = pd.Series(np.arange(source.n_obs), index=source.obs_names)
    return source[position[back.obs_names].to_numpy()].copy()


def assert_round_trip(source: ad.AnnData, back: ad.AnnData) -> None:
    expected = in_stored_order(source, back)
    memory = back.to_memory()
    pd.testing.assert_frame_equal(memory.obs, expected.obs)  # every dtype exactly
    pd.testing.assert_frame_equal(memory.var, expected.var)
    assert (sp.csr_matrix(memory.X) != expected.X).nnz == 0
    assert (sp.csr_matrix(memory.layers["counts"]) != expected.layers["counts"]).nnz == 0
    np.testing.assert_array_equal(memory.layers["lognorm"].toarray(),
                                  expected.layers["lognorm"].toarray())  # fmt: skip
    assert (sp.csr_matrix(back.raw.X.to_memory()) != expected.raw.X).nnz == 0
    pd.testing.assert_index_equal(back.raw.var_names, expected.raw.var_names)
    for key in expected.obsm:
        assert_equal(memory.obsm[key], expected.obsm[key])
    for key in expected.obsp:
        assert (memory.obsp[key] != expected.obsp[key]).nnz == 0
    assert_equal(memory.varm["PCs"], expected.varm["PCs"])
    assert (memory.varp["corr"] != expected.varp["corr"]).nnz == 0
    assert_equal(dict(memory.uns), dict(expected.uns))


@pytest.mark.parametrize("shuffle", [False, True])
def test_processed_anndata_round_trips(tmp_path, shuffle):
    source = processed()
    dc.write_deltacells(source, tmp_path / "d", tile_size=64, shuffle=shuffle, progress=False)
    back = dc.read_deltacells(tmp_path / "d", cache_dir=tmp_path / "cache")
    assert isinstance(back.layers["counts"], dc.DeltacellsCSRDataset)
    assert isinstance(back.raw.X, dc.DeltacellsCSRDataset)
    assert_round_trip(source, back)
    dc.open_dataset(tmp_path / "d").verify()


def test_from_an_h5ad_file_and_lazily(tmp_path):
    source = processed(seed=1)
    source.write_h5ad(tmp_path / "in.h5ad")
    dc.write_deltacells(tmp_path / "in.h5ad", tmp_path / "d", tile_size=64, progress=False)
    eager = dc.read_deltacells(tmp_path / "d", cache_dir=tmp_path / "cache")
    # What the file holds: anndata's writer turns string columns into categoricals.
    assert_round_trip(ad.read_h5ad(tmp_path / "in.h5ad"), eager)
    da = pytest.importorskip("dask.array")  # elements="lazy" gives dask arrays (an extra)
    back = dc.read_deltacells(tmp_path / "d", elements="lazy", cache_dir=tmp_path / "cache")
    assert isinstance(back.obsm["X_umap"], da.Array)
    np.testing.assert_array_equal(back.obsm["X_umap"].compute(), source.obsm["X_umap"])
    np.testing.assert_array_equal(np.asarray(back.layers["lognorm"].compute().toarray()),
                                  source.layers["lognorm"].toarray())  # fmt: skip
    assert_equal(dict(back.uns), dict(source.uns))


def test_counts_layer_that_is_x_is_stored_once(tmp_path):
    source = processed(seed=2)
    source.X = source.layers["counts"]  # the same matrix
    dc.write_deltacells(source, tmp_path / "d", layer="counts", progress=False)
    record = dc.open_dataset(tmp_path / "d").manifest.metadata["anndata"]
    assert record["layers"]["counts"] == "." and "X" not in record["elements"]
    back = dc.read_deltacells(tmp_path / "d")
    assert back.layers["counts"] is back.X
    assert (back.X.to_memory() != source.layers["counts"]).nnz == 0


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_normalised_x_is_kept_beside_the_counts_layer(tmp_path, shuffle):
    """layer="counts" stores the counts as tiles; X (log-normalised) is kept and read back
    as X, the counts as the layer (lazy)."""
    source = processed(seed=2)
    source.X = source.layers["lognorm"].copy()
    dc.write_deltacells(source, tmp_path / "d", layer="counts", shuffle=shuffle, progress=False)
    record = dc.open_dataset(tmp_path / "d").manifest.metadata["anndata"]
    assert record["layers"]["counts"] == "." and "X" in record["elements"]
    back = dc.read_deltacells(tmp_path / "d")
    expected = in_stored_order(source, back)
    assert sp.issparse(back.X) and back.X.dtype == expected.X.dtype
    assert (sp.csr_matrix(back.X) != expected.X).nnz == 0
    assert (back.layers["counts"].to_memory() != expected.layers["counts"]).nnz == 0
    pytest.importorskip("dask")  # elements="lazy" gives dask arrays (an optional extra)
    lazy = dc.read_deltacells(tmp_path / "d", elements="lazy")
    np.testing.assert_allclose(sp.csr_matrix(lazy.X.compute()).toarray(),
                               expected.X.toarray())  # fmt: skip


def test_stored_column_order_keeps_varm_with_var(tmp_path):
    source = processed(seed=3)
    dc.write_deltacells(source, tmp_path / "d", progress=False)
    back = dc.read_deltacells(tmp_path / "d", column_order="stored")
    position = pd.Series(np.arange(source.n_vars), index=source.var_names)
    rows = position[back.var_names].to_numpy()
    np.testing.assert_array_equal(back.varm["PCs"], source.varm["PCs"][rows])
    assert (back.varp["corr"] != source.varp["corr"][rows][:, rows]).nnz == 0
    assert (back.layers["counts"].to_memory() != source.layers["counts"][:, rows]).nnz == 0


def test_elements_can_be_skipped_and_lists_warn(tmp_path):
    source = processed(seed=4)
    dc.write_deltacells(source, tmp_path / "d", progress=False)
    bare = dc.read_deltacells(tmp_path / "d", elements=False)
    assert not bare.obsm and not bare.uns and "counts" in bare.layers
    with pytest.warns(ElementsWarning, match="keeps X, obs and var only; obsm"):
        dc.write_deltacells([source, source], tmp_path / "atlas", progress=False)
    # Files say so too (their groups are listed, not read), naming what any of them has:
    # chung has uns, visium obsm and uns.
    from conftest import DATA_DIR

    files = [DATA_DIR / "chung2017_smartseq2.h5ad", DATA_DIR / "visium_multisample.h5ad"]
    with pytest.warns(ElementsWarning, match="keeps X, obs and var only; obsm, uns are"):
        dc.write_deltacells(files, tmp_path / "files", join="inner", progress=False)
    dc.write_deltacells(source, tmp_path / "plain", elements=False, progress=False)
    assert dc.open_dataset(tmp_path / "plain").manifest.metadata["anndata"] is None


def test_overwrite_accepts_a_dataset_with_stored_parts(tmp_path):
    dc.write_deltacells(processed(seed=5), tmp_path / "d", progress=False)
    newer = processed(n_cells=120, seed=6)
    dc.write_deltacells(newer, tmp_path / "d", overwrite=True, progress=False)
    assert_round_trip(newer, dc.read_deltacells(tmp_path / "d"))


def test_verify_checks_layers_and_elements(tmp_path):
    dc.write_deltacells(processed(seed=7), tmp_path / "d", tile_size=100, progress=False)
    tile = tmp_path / "d" / "layers" / "counts" / "tiles" / "tile_000001.dct"
    data = bytearray(tile.read_bytes())
    data[-5] ^= 0x10
    tile.write_bytes(bytes(data))
    with pytest.raises(dc.FormatError, match=r"layers/counts/tiles/tile_000001\.dct: CRC-32"):
        dc.open_dataset(tmp_path / "d").verify()


def test_a_layer_location_outside_the_dataset_is_refused(tmp_path):
    import json

    dc.write_deltacells(processed(seed=8), tmp_path / "d", progress=False)
    path = tmp_path / "d" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["metadata"]["anndata"]["layers"]["counts"] = "../elsewhere"
    reseal(tmp_path / "d", manifest)
    with pytest.raises(dc.FormatError, match="malformed layer location"):
        dc.read_deltacells(tmp_path / "d")


def test_object_store_round_trip():
    source = processed(seed=9)
    url = "memory://whole/d"
    with warnings.catch_warnings():
        warnings.simplefilter("error", ElementsWarning)
        dc.write_deltacells(source, url, tile_size=64, progress=False)
    assert_round_trip(source, dc.read_deltacells(url))
    dc.open_dataset(url).verify()


def every_obs_dtype(n: int = 200) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    frame = pd.DataFrame(
        {
            "ordered": pd.Categorical(rng.choice(["lo", "mid", "hi"], n),
                                      categories=["lo", "mid", "hi"], ordered=True),
            "plain_cat": pd.Categorical(rng.choice(["a", "b", None], n)),
            "int_cat": pd.Categorical(rng.choice([3, 1, 2], n)),
            "nullable_int": pd.array(np.where(rng.random(n) < 0.2, None,
                                              rng.integers(0, 9, n)), dtype="Int64"),
            "nullable_uint": pd.array(rng.integers(0, 9, n), dtype="UInt8"),
            "nullable_bool": pd.array(np.where(rng.random(n) < 0.2, None, rng.random(n) < 0.5),
                                      dtype="boolean"),
            "nullable_float": pd.array(np.where(rng.random(n) < 0.2, None, rng.random(n)),
                                       dtype="Float64"),
            "string": pd.array(rng.choice(["x", "y", None], n), dtype="string"),
            "object_strings": rng.choice(["u", "v"], n).astype(object),
            "float32": rng.random(n).astype(np.float32),
            "float64_nan": np.where(rng.random(n) < 0.1, np.nan, rng.random(n)),
            "int8": rng.integers(-5, 5, n).astype(np.int8),
            "uint16": rng.integers(0, 5, n).astype(np.uint16),
            "bool": rng.random(n) < 0.5,
            "barcodes": [f"BC{i:05d}" for i in range(n)],
        },
        index=[f"c{i}" for i in range(n)],
    )  # fmt: skip
    frame[7] = rng.random(n)
    frame[2.5] = rng.integers(0, 3, n)
    return frame


@pytest.mark.parametrize("max_categories", [20_000, 10])
def test_every_obs_dtype_and_name_round_trips(tmp_path, max_categories):
    obs = every_obs_dtype()
    X = sp.random(len(obs), 30, density=0.2, format="csr", random_state=0)
    X.data = np.ceil(X.data * 10)
    source = ad.AnnData(X=X, obs=obs)
    dc.write_deltacells(source, tmp_path / "d", max_categories=max_categories, progress=False)
    back = dc.read_deltacells(tmp_path / "d", cache_dir=tmp_path / "cache")
    assert list(back.obs.columns) == list(obs.columns)
    for column in obs.columns:
        pd.testing.assert_series_equal(back.obs[column], obs[column], check_names=False)
    subset = dc.read_deltacells(tmp_path / "d", obs=["ordered", "nullable_int"],
                                cache_dir=tmp_path / "cache")  # fmt: skip
    assert subset.obs["ordered"].cat.ordered
    assert str(subset.obs["nullable_int"].dtype) == "Int64"


def test_hostile_dtype_records_are_refused(tmp_path):
    import json

    source = ad.AnnData(X=sp.csr_matrix(np.ones((4, 3))), obs=every_obs_dtype(4))
    dc.write_deltacells(source, tmp_path / "d", progress=False)
    path = tmp_path / "d" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["metadata"]["obs_pandas"]["bool"] = {"dtype": "datetime64[ns]"}
    reseal(tmp_path / "d", manifest)
    with pytest.raises(dc.FormatError, match="recorded dtype 'datetime64"):
        dc.read_deltacells(tmp_path / "d", cache_dir=tmp_path / "cache")


def test_convert_says_what_it_kept(tmp_path, capsys):
    from deltacells.cli import main

    processed(seed=12).write_h5ad(tmp_path / "in.h5ad")
    assert main(["convert", str(tmp_path / "in.h5ad"), str(tmp_path / "d"), "--quiet"]) == 0
    assert main(["convert", str(tmp_path / "in.h5ad"), str(tmp_path / "d"), "--overwrite"]) == 0
    out = capsys.readouterr().out
    assert "layers stored as count matrices: counts" in out
    assert "raw: stored as a count matrix" in out
    assert "obsm: stored with anndata's element IO" in out
    assert "layers that are not counts: stored" in out


@pytest.mark.parametrize("shuffle", [False, True])
def test_processed_with_counts_layer_keeps_everything(tmp_path, shuffle):
    """What a scanpy user has after preprocessing: log-normalised X and raw, counts in a layer.
    With layer="counts" the counts are the tiles, and X and raw (not counts) are kept too:
    every element reads back equal, nothing is dropped and nothing is warned about."""
    import warnings

    source = processed(seed=11)
    source.X = source.layers["lognorm"].copy()
    source.raw = source.copy()  # log-normalised, as scanpy leaves it
    with warnings.catch_warnings():
        warnings.simplefilter("error", ElementsWarning)
        dc.write_deltacells(source, tmp_path / "d", layer="counts", tile_size=64,
                            shuffle=shuffle, progress=False)  # fmt: skip
    back = dc.read_deltacells(tmp_path / "d", cache_dir=tmp_path / "cache")
    expected = in_stored_order(source, back)
    assert isinstance(back.layers["counts"], dc.DeltacellsCSRDataset)
    np.testing.assert_array_equal(sp.csr_matrix(back.X).toarray(), expected.X.toarray())
    assert (back.layers["counts"].to_memory() != expected.layers["counts"]).nnz == 0
    np.testing.assert_array_equal(back.layers["lognorm"].toarray(),
                                  expected.layers["lognorm"].toarray())  # fmt: skip
    np.testing.assert_array_equal(sp.csr_matrix(back.raw.X).toarray(),
                                  sp.csr_matrix(expected.raw.X).toarray())  # fmt: skip
    pd.testing.assert_frame_equal(back.raw.var, expected.raw.var)
    pd.testing.assert_frame_equal(back.obs, expected.obs)
    for key in expected.obsm:
        assert_equal(back.obsm[key], expected.obsm[key])
    for key in expected.obsp:
        assert (back.obsp[key] != expected.obsp[key]).nnz == 0
    assert_equal(dict(back.uns), dict(expected.uns))


def test_the_error_for_normalised_x_names_the_counts_layer(tmp_path, capsys):
    from deltacells.cli import main

    source = processed(seed=12)
    source.X = source.layers["lognorm"].copy()
    with pytest.raises(ValueError, match=r"layers \['counts'\] do: pass layer='counts'"):
        dc.write_deltacells(source, tmp_path / "a", progress=False)
    source.write_h5ad(tmp_path / "x.h5ad")
    assert main(["convert", str(tmp_path / "x.h5ad"), str(tmp_path / "b"), "--quiet"]) == 1
    assert "layers ['counts'] do: pass --layer counts" in capsys.readouterr().err
    only_raw = ad.AnnData(X=source.X, raw=ad.AnnData(X=source.layers["counts"]))
    with pytest.raises(ValueError, match=r"raw\.X does: pass use_raw=True"):
        dc.write_deltacells(only_raw, tmp_path / "c", progress=False)


def test_a_missing_x_names_what_to_store_instead(tmp_path, capsys):
    from deltacells.cli import main

    source = processed(seed=14)
    no_x = ad.AnnData(obs=source.obs, var=source.var, layers={"counts": source.layers["counts"]})
    fix = r"has no X: pass layer='counts' \(deltacells convert --layer counts\) to store one"
    with pytest.raises(ValueError, match=fix):
        dc.write_deltacells(no_x, tmp_path / "a", progress=False)
    for suffix, write in ((".h5ad", no_x.write_h5ad), (".zarr", no_x.write_zarr)):
        write(tmp_path / f"x{suffix}")
        with pytest.raises(ValueError, match=rf"x\{suffix}: the file " + fix):
            dc.write_deltacells(tmp_path / f"x{suffix}", tmp_path / "b", progress=False)
    assert main(["convert", str(tmp_path / "x.h5ad"), str(tmp_path / "c"), "--quiet"]) == 1
    assert "has no X: pass --layer counts to store one of its layers" in capsys.readouterr().err
    with pytest.raises(KeyError, match=r"layer 'count' not found \(layers: \['counts'\]\)"):
        dc.write_deltacells(tmp_path / "x.h5ad", tmp_path / "d", layer="count", progress=False)
    only_raw = ad.AnnData(obs=source.obs, var=source.var)
    only_raw.raw = ad.AnnData(X=source.layers["counts"], obs=source.obs, var=source.var)
    with pytest.raises(ValueError, match=r"has no X: pass use_raw=True \(deltacells convert"):
        dc.write_deltacells(only_raw, tmp_path / "e", progress=False)
    bare = ad.AnnData(obs=source.obs, var=source.var)
    with pytest.raises(ValueError, match="has no X: set X to the counts"):
        dc.write_deltacells(bare, tmp_path / "f", progress=False)


@pytest.mark.parametrize(("written", "read"), [(np.int32, np.int32), (np.float32, np.float32),
                                               (np.float64, np.float64), (np.int64, np.int32),
                                               (np.uint16, np.int32)])
def test_counts_come_back_in_the_dtype_written(tmp_path, written, read):
    source = processed(seed=13)
    source.X = sp.csr_matrix(source.layers["counts"]).astype(written)
    source.layers["counts"] = source.X.copy()  # each matrix comes back in its own dtype
    dc.write_deltacells(source, tmp_path / "d", progress=False)
    back = dc.read_deltacells(tmp_path / "d")
    assert back.X.dtype == read and back.X.to_memory().dtype == read
    assert back.layers["counts"].dtype == back.X.dtype
    assert (back.X.to_memory() != sp.csr_matrix(source.X).astype(read)).nnz == 0
    chosen = dc.read_deltacells(tmp_path / "d", values_dtype=np.float64)
    assert chosen.X.dtype == np.float64 and chosen.X[:3].dtype == np.float64


def test_an_element_anndata_cannot_write_costs_only_its_own_keys(tmp_path):
    """One entry of uns (or obsm) that anndata's element IO cannot write is left out, named
    in its own warning; the element's other keys are stored and read back."""
    source = processed(n_cells=40, seed=7)
    source.uns[1] = "an int key"
    source.uns["opaque"] = object()
    with pytest.warns(ElementsWarning) as caught:
        dc.write_deltacells(source, tmp_path / "d", progress=False)
    messages = [str(w.message) for w in caught]
    assert any("uns[1] is left out" in m and "string keys only" in m for m in messages)
    assert any("uns['opaque'] could not be stored" in m for m in messages)
    assert not any(m.startswith("uns could not be stored") for m in messages)
    back = dc.read_deltacells(tmp_path / "d")
    expected = {k: v for k, v in source.uns.items() if k not in (1, "opaque")}
    assert_equal(dict(back.uns), expected)
