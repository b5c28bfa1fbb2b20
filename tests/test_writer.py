"""write_deltacells: round trips, inputs of every kind, obs/var, atomicity, bad inputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from conftest import DATA_DIR

import deltacells as dc
from deltacells.store.manifest import obs_fingerprint
from deltacells.write import inputs as inputs_module
from deltacells.write import tiles as tiles_module


def read_back(path, *, source_order: bool = True) -> sp.csr_matrix:
    """All tiles decoded one by one (Tile, not the writer) and stacked, in source gene order."""
    dataset = dc.open_dataset(path)
    parts = [dataset.tile(i).decode(np.int32) for i in range(dataset.manifest.n_tiles)]
    n_genes = dataset.manifest.n_genes
    stored = sp.vstack(parts, format="csr") if parts else sp.csr_matrix((0, n_genes))
    order = dataset.gene_order()
    if source_order and order is not None:
        stored = stored[:, np.argsort(order)]
    return sp.csr_matrix(stored)


def assert_same_matrix(actual, expected) -> None:
    expected = sp.csr_matrix(expected)
    assert actual.shape == expected.shape
    assert (actual != expected.astype(np.int64)).nnz == 0


def small_adata(n_cells: int = 300, n_genes: int = 120, seed: int = 0) -> ad.AnnData:
    rng = np.random.default_rng(seed)
    X = sp.random(n_cells, n_genes, density=0.1, format="csr", random_state=rng)
    X.data = np.ceil(X.data * 30).astype(np.float32)
    obs = pd.DataFrame(
        {
            "cell_type": pd.Categorical(rng.choice(["T", "B", None], n_cells)),
            "batch": rng.choice(["b1", "b2"], n_cells).astype(object),
            "n_counts": np.asarray(X.sum(axis=1)).ravel().astype(np.float64),
            "score": np.where(rng.random(n_cells) < 0.1, np.nan, rng.random(n_cells)),
            "is_doublet": rng.random(n_cells) < 0.05,
            "age": pd.array(
                np.where(rng.random(n_cells) < 0.1, None, rng.integers(0, 90, n_cells)),
                dtype="Int64",
            ),
            "flag": pd.array(
                np.where(rng.random(n_cells) < 0.1, None, rng.random(n_cells) < 0.5),
                dtype="boolean",
            ),
            "barcode": [f"BC{i:06d}" for i in range(n_cells)],
            "small_int": rng.integers(0, 5, n_cells).astype(np.int16),
        },
        index=[f"cell{i}" for i in range(n_cells)],
    )
    var = pd.DataFrame(
        {
            "gene_ids": [f"ENSG{i:08d}" for i in range(n_genes)],
            "feature_types": pd.Categorical(["Gene Expression"] * n_genes),
            "highly_variable": rng.random(n_genes) < 0.3,
            "mean": rng.random(n_genes),
            "n_cells": pd.array(rng.integers(0, 100, n_genes), dtype="Int32"),
        },
        index=pd.Index([f"G{i}" for i in range(n_genes)], name="gene_symbol"),
    )
    return ad.AnnData(X=X, obs=obs, var=var)


def test_real_data_round_trip(real_counts, tmp_path):
    path = DATA_DIR / "liao2020_balf.h5ad"
    manifest = dc.write_deltacells(path, tmp_path / "liao", tile_size=4000, progress=False)
    assert manifest.n_cells == 10_706 and manifest.n_tiles == 3 and manifest.tile_cells[-1] == 2706
    assert_same_matrix(read_back(tmp_path / "liao"), real_counts["liao2020_balf"])
    dataset = dc.open_dataset(tmp_path / "liao")
    dataset.verify()
    stored = read_back(tmp_path / "liao", source_order=False)
    totals = np.asarray(stored.sum(axis=0)).ravel()
    assert np.all(np.diff(totals) <= 0)  # genes by decreasing total counts
    source = ad.read_h5ad(path)
    np.testing.assert_array_equal(dataset.var_names(), source.var_names[dataset.gene_order()])


@pytest.mark.parametrize("name", ["chung2017_smartseq2", "visium_multisample"])
def test_other_real_files(real_counts, tmp_path, name):
    dc.write_deltacells(DATA_DIR / f"{name}.h5ad", tmp_path / name, tile_size=1000, progress=False)
    assert_same_matrix(read_back(tmp_path / name), real_counts[name])


def test_obs_and_var_round_trip(tmp_path):
    adata = small_adata()
    adata.obs["barcode_cat"] = pd.Categorical(adata.obs["barcode"])
    manifest = dc.write_deltacells(
        adata,
        tmp_path / "d",
        tile_size=64,
        obs_tiles_per_file=2,
        max_categories=100,
        progress=False,
    )
    dataset = dc.open_dataset(tmp_path / "d")
    assert manifest.n_obs_shards == 3  # 5 tiles, 2 per shard
    schema = dataset.obs_schema()
    kinds = {c.name: c.kind for c in schema.columns}
    assert kinds == {
        "_index": "string", "cell_type": "category", "batch": "category", "n_counts": "numeric",
        "score": "numeric", "is_doublet": "bool", "age": "numeric", "flag": "bool",
        "barcode": "string", "small_int": "numeric", "barcode_cat": "string",
    }  # fmt: skip
    assert schema["cell_type"].arrow_type == "int8" and schema["small_int"].arrow_type == "int16"
    obs = dataset.read_obs()
    pd.testing.assert_index_equal(pd.Index(obs["_index"]), adata.obs_names, check_names=False)
    expected = adata.obs
    pd.testing.assert_series_equal(
        obs["cell_type"].astype(object),
        expected["cell_type"].astype(object).reset_index(drop=True),
        check_names=False,
    )
    assert obs["cell_type"].isna().sum() == expected["cell_type"].isna().sum() > 0
    assert list(obs["batch"].cat.categories) == ["b1", "b2"]
    np.testing.assert_array_equal(obs["n_counts"], expected["n_counts"])
    np.testing.assert_array_equal(obs["score"].isna(), expected["score"].isna())
    np.testing.assert_array_equal(obs["is_doublet"], expected["is_doublet"])
    assert obs["age"].isna().sum() == expected["age"].isna().sum() > 0
    assert (obs["age"].dropna().astype(int).to_numpy() == expected["age"].dropna().to_numpy()).all()
    assert obs["flag"].isna().sum() == expected["flag"].isna().sum() > 0
    assert list(obs["barcode"]) == list(expected["barcode"])
    # var: stored order, dtypes and index kept
    var = dataset.var()
    order = dataset.gene_order()
    source_var = adata.var.iloc[order]
    pd.testing.assert_frame_equal(var, source_var)


def test_fingerprint_recomputed_from_files(tmp_path):
    manifest = dc.write_deltacells(small_adata(), tmp_path / "d", tile_size=50, progress=False)
    schema_text = (tmp_path / "d" / "obs" / "schema.json").read_text()
    import hashlib

    shards = [
        hashlib.sha256((tmp_path / "d" / "obs" / f"obs_{s:04d}.parquet").read_bytes()).hexdigest()
        for s in range(manifest.n_obs_shards)
    ]
    assert shards == manifest.obs_shard_sha256
    assert obs_fingerprint(schema_text, manifest.tile_cells, shards) == manifest.obs_fingerprint
    canonical = json.dumps(
        {"schema": schema_text, "tile_cells": manifest.tile_cells, "shards": shards},
        sort_keys=True,
        separators=(",", ":"),
    )
    assert hashlib.sha256(canonical.encode()).hexdigest()[:24] == manifest.obs_fingerprint


def test_obs_parquet_layout(tmp_path):
    import pyarrow.parquet as pq

    manifest = dc.write_deltacells(small_adata(), tmp_path / "d", tile_size=70, progress=False)
    meta = pq.ParquetFile(tmp_path / "d" / "obs" / "obs_0000.parquet").metadata
    assert meta.num_row_groups == manifest.n_tiles
    assert [meta.row_group(g).num_rows for g in range(meta.num_row_groups)] == manifest.tile_cells
    column = meta.row_group(0).column(1)
    assert column.compression == "ZSTD" and not column.is_stats_set


def files_of(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in ("manifest.json", "var.parquet")
    }


def test_backed_h5ad_zarr_and_csc_inputs_give_identical_datasets(tmp_path):
    adata = small_adata(n_cells=500)
    adata.X = adata.X.astype(np.int32)
    h5 = tmp_path / "in.h5ad"
    adata.write_h5ad(h5, compression="gzip")
    csc = adata.copy()
    csc.X = sp.csc_matrix(csc.X)
    csc.write_h5ad(tmp_path / "csc.h5ad")
    adata.write_zarr(tmp_path / "in.zarr")
    dense = adata.copy()
    dense.X = dense.X.toarray()
    dense.write_h5ad(tmp_path / "dense.h5ad")
    kwargs = {"tile_size": 128, "progress": False}
    dc.write_deltacells(adata, tmp_path / "mem", **kwargs)
    expected = files_of(tmp_path / "mem")
    inputs = {
        "h5ad": h5,
        "backed": ad.read_h5ad(h5, backed="r"),
        "csc_h5ad": tmp_path / "csc.h5ad",
        "csc_backed_small_blocks": tmp_path / "csc.h5ad",
        "zarr": tmp_path / "in.zarr",
        "dense_h5ad": tmp_path / "dense.h5ad",
        "csc_memory": csc,
    }
    for name, source in inputs.items():
        if name == "csc_backed_small_blocks":
            # A tiny column-block budget: the CSC transpose runs in many blocks.
            original = inputs_module._CscSpillReader.__init__.__defaults__
            inputs_module._CscSpillReader.__init__.__defaults__ = (997,)
            try:
                dc.write_deltacells(source, tmp_path / name, **kwargs)
            finally:
                inputs_module._CscSpillReader.__init__.__defaults__ = original
        else:
            dc.write_deltacells(source, tmp_path / name, **kwargs)
        assert files_of(tmp_path / name) == expected, name
        pd.testing.assert_frame_equal(
            dc.open_dataset(tmp_path / name).var(), dc.open_dataset(tmp_path / "mem").var()
        )


def test_same_bytes_for_threads_and_workers(tmp_path):
    adata = small_adata(n_cells=400)
    dc.write_deltacells(adata, tmp_path / "a", tile_size=100, n_threads=1, progress=False)
    dc.write_deltacells(adata, tmp_path / "b", tile_size=100, n_threads=2, progress=False)
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    pytest.importorskip("distributed")  # n_workers > 1 runs on dask.distributed (an extra)
    dc.write_deltacells(adata, tmp_path / "c", tile_size=100, n_workers=2, progress=False)
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b") == files_of(tmp_path / "c")


@pytest.mark.parametrize("join", ["same", "inner", "outer"])
def test_list_of_files_matches_anndata_concat(tmp_path, join):
    a = small_adata(n_cells=150, seed=1)
    b = small_adata(n_cells=90, seed=2)
    b.obs_names = [f"b{i}" for i in range(b.n_obs)]
    b.obs = b.obs.drop(columns=["score"]).assign(extra=1.5)
    if join == "same":
        b = b[:, b.var_names[::-1]].copy()  # same genes, another order
    else:
        b = b[:, 20:].copy()
        b.var_names = [*b.var_names[:-10], *[f"new{i}" for i in range(10)]]
    a.X, b.X = a.X.astype(np.int32), b.X.astype(np.int32)
    a.write_h5ad(tmp_path / "a.h5ad")
    b.write_h5ad(tmp_path / "b.h5ad")
    dc.write_deltacells([tmp_path / "a.h5ad", tmp_path / "b.h5ad"], tmp_path / "d",
                        join=join, tile_size=64, progress=False)  # fmt: skip
    expected = ad.concat([a, b], join="inner" if join == "same" else join)
    dataset = dc.open_dataset(tmp_path / "d")
    order = dataset.gene_order()
    names = np.asarray(dataset.var_names())[np.argsort(order)]
    actual = read_back(tmp_path / "d")
    expected_x = sp.csr_matrix(expected[:, names].X)
    assert_same_matrix(actual, expected_x)
    obs = dataset.read_obs()
    assert list(obs["source_file"]) == ["a.h5ad"] * 150 + ["b.h5ad"] * 90
    assert obs["score"].isna().sum() >= 90 and obs["extra"].isna().sum() == 150


@pytest.mark.parametrize("join", ["inner", "outer"])
def test_var_table_of_many_files_is_each_genes_first_row(tmp_path, join):
    """The inputs keep their gene names only while the write plans; the var table is each
    output gene's row from the first file that has it, with every file's columns (what one
    concatenation of all the tables gives), read one table at a time."""
    from deltacells.write.inputs import _open_part

    frames = []
    for i in range(3):
        adata = small_adata(n_cells=40, n_genes=30, seed=i)
        adata.var_names = [f"g{(k + 7 * i) % 45}" for k in range(30)]
        adata.var["rank"] = np.arange(30) + 100 * i
        if i == 1:
            adata.var["flag"] = np.arange(30) % 2 == 0
        adata.obs_names = [f"f{i}-{k}" for k in range(40)]
        adata.write_h5ad(tmp_path / f"{i}.h5ad")
        frames.append(adata.var)
    part = _open_part(tmp_path / "1.h5ad", None, False)
    try:
        assert part.var.columns.empty and list(part.full_var().columns) == list(frames[1].columns)
    finally:
        part.close()
    dc.write_deltacells([tmp_path / f"{i}.h5ad" for i in range(3)], tmp_path / "d", join=join,
                        tile_size=64, progress=False)  # fmt: skip
    back = dc.read_deltacells(tmp_path / "d", elements=False).var
    everything = pd.concat(frames)
    expected = everything[~everything.index.duplicated(keep="first")].reindex(back.index)
    # A gene missing from the one file with "flag" is missing in both; an object column
    # stored in parquet reads its missing values back as None where pandas' concatenation
    # put NaN (pandas 3 tells them apart, pandas 2 did not).
    missing = lambda frame: frame.astype(object).where(frame.notna(), None)  # noqa: E731
    pd.testing.assert_frame_equal(missing(back), missing(expected), check_dtype=False)
    assert list(back.dtypes.astype(str)) == list(expected.dtypes.astype(str))


def test_same_join_refuses_different_genes(tmp_path):
    a, b = small_adata(seed=1), small_adata(seed=2)[:, 5:].copy()
    with pytest.raises(ValueError, match="genes differ"):
        dc.write_deltacells([a, b], tmp_path / "d", progress=False)


def test_shuffle_records_the_permutation(tmp_path):
    adata = small_adata(n_cells=250)
    manifest = dc.write_deltacells(adata, tmp_path / "s", shuffle=True, seed=7, tile_size=64,
                                   progress=False)  # fmt: skip
    order = np.load(tmp_path / "s" / "cell_order.npy")
    assert sorted(order) == list(range(250)) and not np.array_equal(order, np.arange(250))
    assert manifest.metadata["shuffle"]["seed"] == 7
    assert_same_matrix(read_back(tmp_path / "s"), adata.X[order])
    obs = dc.open_dataset(tmp_path / "s").read_obs()
    assert list(obs["_index"]) == list(adata.obs_names[order])
    dc.write_deltacells(adata, tmp_path / "s2", shuffle=True, seed=7, tile_size=64, progress=False)
    assert files_of(tmp_path / "s") == files_of(tmp_path / "s2")


def test_gene_order_options(tmp_path):
    adata = small_adata()
    dc.write_deltacells(adata, tmp_path / "none", gene_order="none", progress=False)
    assert dc.open_dataset(tmp_path / "none").gene_order() is None
    assert_same_matrix(read_back(tmp_path / "none"), adata.X)
    perm = np.random.default_rng(3).permutation(adata.n_vars)
    dc.write_deltacells(adata, tmp_path / "perm", gene_order=perm, progress=False)
    np.testing.assert_array_equal(dc.open_dataset(tmp_path / "perm").gene_order(), perm)
    assert_same_matrix(read_back(tmp_path / "perm"), adata.X)
    with pytest.raises(ValueError, match="permutation"):
        dc.write_deltacells(adata, tmp_path / "bad", gene_order=[0, 0, 1], progress=False)


def test_layer_and_raw(tmp_path):
    adata = small_adata()
    adata.layers["counts"] = adata.X.copy()
    adata.layers["counts"].data += 1
    adata.raw = adata.copy()
    adata.X = adata.X * 0.5  # normalised values in X: not counts
    # The message points to what holds counts: a layer first, then raw, else the way to keep them.
    with pytest.raises(dc.CountError, match=r"non-integral count at cell .*"
                                            r"layers \['counts'\] do: pass layer='counts'"):
        dc.write_deltacells(adata, tmp_path / "x", progress=False)
    adata.write_h5ad(tmp_path / "normalised.h5ad")
    with pytest.raises(dc.CountError, match=r"normalised\.h5ad: non-integral .*layer='counts'"):
        dc.write_deltacells(tmp_path / "normalised.h5ad", tmp_path / "x", progress=False)
    only_raw = adata.copy()
    del only_raw.layers["counts"]
    with pytest.raises(dc.CountError, match=r"raw\.X does: pass use_raw=True"):
        dc.write_deltacells(only_raw, tmp_path / "x", progress=False)
    only_raw.raw = None
    with pytest.raises(dc.CountError, match=r"stores raw counts .* adata\.layers\['counts'\] "
                                            r"= adata\.X\.copy\(\) and pass layer='counts'"):
        dc.write_deltacells(only_raw, tmp_path / "x", progress=False)
    dc.write_deltacells(adata, tmp_path / "layer", layer="counts", progress=False)
    assert_same_matrix(read_back(tmp_path / "layer"), adata.layers["counts"])
    dc.write_deltacells(adata, tmp_path / "raw", use_raw=True, progress=False)
    assert_same_matrix(read_back(tmp_path / "raw"), adata.raw.X)


def test_bad_values_name_file_cell_and_gene(tmp_path):
    adata = small_adata()
    X = adata.X.tolil()
    X[17, 3] = -2
    adata.X = X.tocsr()
    adata.write_h5ad(tmp_path / "bad.h5ad")
    with pytest.raises(dc.CountError, match=r"bad\.h5ad: negative count at cell 17 \('cell17'\), "
                                            r"gene 3 \('G3'\)"):  # fmt: skip
        dc.write_deltacells(tmp_path / "bad.h5ad", tmp_path / "out", tile_size=10, progress=False)
    assert not (tmp_path / "out").exists()  # nothing written before every value was checked


def test_unsupported_obs_columns(tmp_path):
    adata = small_adata()
    adata.obs["when"] = pd.Timestamp("2020-01-01")
    with pytest.raises(ValueError, match=r"'when' has unsupported dtype.*obs_exclude"):
        dc.write_deltacells(adata, tmp_path / "d", progress=False)
    adata.obs["mixed"] = [1, "a"] * (adata.n_obs // 2)
    dc.write_deltacells(adata, tmp_path / "d", obs_exclude=["when", "mixed"], progress=False)
    assert "when" not in dc.open_dataset(tmp_path / "d").obs_schema().names
    # One name alone is that column (not its letters); a name no obs has is a typo.
    del adata.obs["when"], adata.obs["mixed"]
    dc.write_deltacells(adata, tmp_path / "one", obs_exclude="barcode", progress=False)
    names = dc.open_dataset(tmp_path / "one").obs_schema().names
    assert "barcode" not in names and "batch" in names
    assert adata.obs.attrs == {} and "barcode" in adata.obs  # the caller's obs untouched
    with pytest.raises(ValueError, match=r"obs_exclude names \['Barcode'\] but no input's obs "
                                         r"has that column; check the spelling"):
        dc.write_deltacells(adata, tmp_path / "typo", obs_exclude=["batch", "Barcode"],
                            progress=False)  # fmt: skip
    assert not (tmp_path / "typo").exists()
    # In a list of inputs, a column that one input has may be left out.
    other = small_adata(seed=5)
    other.obs_names = [f"o{n}" for n in other.obs_names]
    adata.obs["only_here"] = 1.0
    dc.write_deltacells([adata, other], tmp_path / "two", obs_exclude=["only_here"],
                        progress=False)  # fmt: skip
    assert "only_here" not in dc.open_dataset(tmp_path / "two").obs_schema().names


def test_arguments_of_the_wrong_kind_are_named(tmp_path):
    adata = small_adata()
    cases = [
        (TypeError, "tile_size must be an int, not bool", {"tile_size": True}),
        (TypeError, "tile_size must be an int, not float", {"tile_size": 100.5}),
        (TypeError, "zstd_level must be an int, not str", {"zstd_level": "9"}),
        (TypeError, "seed must be an int, not float", {"seed": 1.5}),
        (ValueError, "seed must be >= 0, not -1", {"seed": -1}),
        (ValueError, "max_categories must be >= 0, not -1", {"max_categories": -1}),
        (ValueError, "n_workers must be >= 1, not 0", {"n_workers": 0}),
        (TypeError, "use_raw must be True or False, not 'no'", {"use_raw": "no"}),
        (TypeError, "shuffle must be True or False, not 'yes'", {"shuffle": "yes"}),
        (TypeError, "elements must be True or False, not 'lazy'", {"elements": "lazy"}),
        (TypeError, "progress must be True or False, not 'yes'", {"progress": "yes"}),
    ]  # fmt: skip
    for error, message, kwargs in cases:
        with pytest.raises(error, match=re.escape(message)):
            dc.write_deltacells(adata, tmp_path / "d", **{"progress": False, **kwargs})
        assert not (tmp_path / "d").exists()


def test_overwrite_rules(tmp_path):
    adata = small_adata()
    dc.write_deltacells(adata, tmp_path / "d", progress=False)
    with pytest.raises(FileExistsError, match="not empty"):
        dc.write_deltacells(adata, tmp_path / "d", progress=False)
    dc.write_deltacells(adata[:100], tmp_path / "d", overwrite=True, progress=False)
    assert dc.open_dataset(tmp_path / "d").manifest.n_cells == 100
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    # Not a dataset: overwrite would not help, so it is not offered.
    with pytest.raises(FileExistsError, match=r"is not empty and not a deltacells dataset \(it "
                                              r"holds 'notes.txt'\); write into a new or empty"):
        dc.write_deltacells(adata, tmp_path / "other", progress=False)
    with pytest.raises(FileExistsError, match="not a deltacells dataset"):
        dc.write_deltacells(adata, tmp_path / "other", overwrite=True, progress=False)
    assert (tmp_path / "other" / "notes.txt").exists()
    # An empty path (an unset variable, say) is not the working directory.
    with pytest.raises(ValueError, match="path '' is empty"):
        dc.write_deltacells(adata, "", progress=False)


def fail_third_tile(monkeypatch) -> None:
    """Make the writer's third tile encoding raise ``RuntimeError("disk on fire")``."""
    calls = {"n": 0}
    real_encode = tiles_module.encode_tile

    def failing_encode(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk on fire")
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(tiles_module, "encode_tile", failing_encode)


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    fail_third_tile(monkeypatch)
    with pytest.raises(RuntimeError, match="disk on fire"):
        dc.write_deltacells(small_adata(), tmp_path / "d", tile_size=50, progress=False)
    assert not (tmp_path / "d").exists()  # the write made the folder, and removed it
    # A write killed before its manifest (which no handler can clean up) is named as such,
    # with the way to replace it.
    (tmp_path / "k" / "tiles").mkdir(parents=True)
    (tmp_path / "k" / "tiles" / "tile_000000.dct").write_bytes(b"DELTACEL" + bytes(56))
    with pytest.raises(dc.FormatError, match=r"incomplete dataset.*overwrite=True"):
        dc.open_dataset(tmp_path / "k")


def test_fsspec_target(tmp_path):
    adata = small_adata()
    dc.write_deltacells(adata, "memory://writer-test/d", tile_size=100, progress=False)
    dataset = dc.open_dataset("memory://writer-test/d")
    dataset.verify()
    assert_same_matrix(read_back("memory://writer-test/d"), adata.X)
    dc.write_deltacells(adata, tmp_path / "local", tile_size=100, progress=False)
    local = files_of(tmp_path / "local")
    remote = {name: dataset.store.read_bytes(name) for name in local}
    assert remote == local


def test_zero_cells(tmp_path):
    adata = small_adata()[:0].copy()
    manifest = dc.write_deltacells(adata, tmp_path / "d", progress=False)
    assert manifest.n_cells == 0 and manifest.n_tiles == 0
    dc.open_dataset(tmp_path / "d").verify()


def test_remap_columns_kernel_matches_scipy():
    from deltacells.codec import _rows

    rng = np.random.default_rng(11)
    block = sp.random(200, 500, density=0.05, format="csr", random_state=rng)
    block.data = np.ceil(block.data * 9).astype(np.int32)
    col_map = rng.permutation(700)[:500].astype(np.int64)  # into 700 output columns
    col_map[rng.random(500) < 0.2] = -1  # some columns dropped
    indptr, indices, data = _rows.remap_columns(
        block.indptr.astype(np.int64), block.indices, block.data, col_map, 700
    )
    result = sp.csr_matrix((data, indices, indptr), shape=(200, 700))
    keep = np.flatnonzero(col_map >= 0)
    expected = sp.lil_matrix((200, 700), dtype=np.int32)
    expected[:, col_map[keep]] = block[:, keep]
    assert (result != expected.tocsr()).nnz == 0
    for r in range(200):  # every row sorted, as the tile encoder needs
        row = indices[indptr[r] : indptr[r + 1]]
        assert np.all(np.diff(row) > 0)
    with pytest.raises(ValueError, match="outside col_map"):
        _rows.remap_columns(block.indptr.astype(np.int64), block.indices, block.data,
                               col_map[:10], 700)  # fmt: skip


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_permute_columns_many_wide_rows_of_every_length(dtype):
    # 200k columns take three radix digits, rows of a few entries take the insertion sort,
    # empty rows none; thousands of rows on 2 threads, several times, must agree with scipy
    # every time (per-row scratch and counts are thread-private).
    from deltacells.codec import _rows

    rng = np.random.default_rng(13)
    n_cols = 200_000
    block = sp.vstack([
        sp.random(6000, n_cols, density=5e-4, format="csr", random_state=rng),
        sp.random(3000, n_cols, density=4e-5, format="csr", random_state=rng),
        sp.csr_matrix((500, n_cols)),
    ]).tocsr()  # fmt: skip
    block = block[rng.permutation(block.shape[0])]
    block.data = np.ceil(block.data * 99).astype(dtype)
    block.indices = block.indices.astype(np.int32)
    lengths = np.diff(block.indptr)
    assert lengths.min() == 0 and (lengths[lengths > 0] <= 24).sum() > 1000 and lengths.max() > 24
    col_map = rng.permutation(n_cols).astype(np.int64)
    expected = sp.csr_matrix(
        (block.data.copy(), col_map[block.indices], block.indptr.copy()), shape=block.shape
    )
    expected.sort_indices()
    indptr = block.indptr.astype(np.int64)
    for _ in range(3):
        indices, data = block.indices.copy(), block.data.copy()
        _rows.permute_columns(indptr, indices, data, col_map, 2)
        np.testing.assert_array_equal(indices, expected.indices)
        np.testing.assert_array_equal(data, expected.data)


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.float64])
def test_permute_columns_in_place_matches_scipy_for_any_thread_count(dtype):
    from deltacells.codec import _rows

    rng = np.random.default_rng(12)
    block = sp.random(300, 3000, density=0.03, format="csr", random_state=rng)
    block.data = np.ceil(block.data * 9).astype(dtype)
    block.indices = block.indices.astype(np.int32)
    col_map = rng.permutation(3000).astype(np.int64)
    expected = sp.csr_matrix(
        (block.data.copy(), col_map[block.indices], block.indptr.copy()), shape=block.shape
    )
    expected.sort_indices()
    indptr = block.indptr.astype(np.int64)
    for n_threads in (1, 2, 3):
        indices, data = block.indices.copy(), block.data.copy()
        _rows.permute_columns(indptr, indices, data, col_map, n_threads)
        np.testing.assert_array_equal(indices, expected.indices)
        np.testing.assert_array_equal(data, expected.data)
    not_a_permutation = col_map.copy()
    not_a_permutation[block.indices[1]] = col_map[block.indices[0]]  # row 0 collides
    with pytest.raises(ValueError, match="row 0 to the same place"):
        _rows.permute_columns(indptr, block.indices.copy(), block.data.copy(),
                                 not_a_permutation, 2)  # fmt: skip
    with pytest.raises(ValueError, match="outside col_map"):
        short_map = np.arange(10, dtype=np.int64)[::-1].copy()  # columns >= 10 have no place
        _rows.permute_columns(indptr, block.indices.copy(), block.data.copy(), short_map, 2)
    with pytest.raises(ValueError, match="n_out_cols"):
        _rows.remap_columns(indptr, block.indices, block.data, col_map, 2000)


def test_tile_size_follows_counts_above_65535(tmp_path):
    """A panel with many large counts (like a 28-gene STARmap run): with tile_size unset the
    writer picks tiles that hold them and warns; an explicit size that cannot is refused
    before anything is written, naming the size that would work."""
    rng = np.random.default_rng(0)
    X = sp.random(3000, 28, density=0.5, format="csr", random_state=rng)
    X.data = np.ceil(X.data * 200_000)
    adata = ad.AnnData(X=X)
    with pytest.warns(UserWarning, match="writing tiles of 64 cells instead of 4096"):
        manifest = dc.write_deltacells(adata, tmp_path / "auto", progress=False)
    assert manifest.tile_size == 64
    assert_same_matrix(read_back(tmp_path / "auto"), X)
    with pytest.raises(ValueError, match=r"pass tile_size=64 or smaller"):
        dc.write_deltacells(adata, tmp_path / "fixed", tile_size=4096, progress=False)
    assert not (tmp_path / "fixed").exists()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # chung's few large counts fit the default tiles
        dc.write_deltacells(DATA_DIR / "chung2017_smartseq2.h5ad", tmp_path / "chung",
                            progress=False)  # fmt: skip


def test_atlas_of_more_files_than_the_process_may_open(tmp_path):
    """A file input is open only while its counts are read: 80 inputs convert in a process
    allowed 64 open files (with every input held open, HDF5 fails with 'Too many open
    files'), byte-identical to the same cells written from memory."""
    import subprocess
    import sys
    import textwrap

    N_INPUTS = 80  # more than the 64 files the child may open (was 120: 27 s against 18 s)
    frames = []
    for i in range(N_INPUTS):
        adata = small_adata(n_cells=5, n_genes=12, seed=i)
        adata.X = adata.X.astype(np.int32)
        adata.obs_names = [f"f{i}-{k}" for k in range(5)]
        adata.write_h5ad(tmp_path / f"{i:03d}.h5ad")
        frames.append(adata)
    script = textwrap.dedent(f"""
        import resource, sys
        from pathlib import Path
        import deltacells as dc
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        files = sorted(Path({str(tmp_path)!r}).glob("*.h5ad"))
        for shuffle in (False, True):
            dc.write_deltacells(files, Path({str(tmp_path)!r}) / f"d{{shuffle}}",
                                tile_size=64, shuffle=shuffle, progress=False)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    names = [f"{i:03d}.h5ad" for i in range(N_INPUTS)]
    expected = ad.concat(frames)
    for shuffle in (False, True):
        back = dc.read_deltacells(tmp_path / f"d{shuffle}", elements=False)
        order = np.argsort(dc.open_dataset(tmp_path / f"d{shuffle}").cell_order()) \
            if shuffle else np.arange(5 * N_INPUTS)  # fmt: skip
        assert_same_matrix(back.X[order], sp.csr_matrix(expected.X))
        assert list(back.obs_names[order]) == list(expected.obs_names)
        assert list(back.obs["source_file"].iloc[order]) == [n for n in names for _ in range(5)]


def _atlas_obs_inputs(rng) -> list[ad.AnnData]:
    """Inputs whose obs differ in columns, dtypes, categories and missing values: what an
    outer concatenation must settle (an empty input among them)."""

    def make(n: int, prefix: str, **columns) -> ad.AnnData:
        X = sp.random(n, 12, density=0.3, format="csr", random_state=rng, dtype=np.float32)
        X.data = np.ceil(X.data * 20)
        return ad.AnnData(X=X, obs=pd.DataFrame(columns, index=[f"{prefix}{i}" for i in range(n)]),
                          var=pd.DataFrame(index=[f"g{j}" for j in range(12)]))  # fmt: skip

    return [
        make(50, "a", num=np.arange(50), cat=pd.Categorical(rng.choice(["x", "y"], 50)),
             same=pd.Categorical(rng.choice(["p", "q"], 50), categories=["p", "q", "r"]),
             text=[f"s{i % 7}" for i in range(50)], many=[f"m{i}" for i in range(50)],
             nint=pd.array(np.arange(50), dtype="Int64"),
             fl=np.where(np.arange(50) % 5 == 0, np.nan, 1.5)),
        make(40, "b", cat=pd.Categorical(rng.choice(["y", "z"], 40)),
             same=pd.Categorical(rng.choice(["r", "q"], 40), categories=["p", "q", "r"]),
             text=[f"s{i % 3}" if i % 4 else None for i in range(40)],
             many=[f"n{i}" for i in range(40)], fl=np.ones(40)),
        make(0, "c"),
        make(30, "a", num=np.arange(30) + 0.5, text=[f"s{i % 2}" for i in range(30)]),
    ]  # fmt: skip


@pytest.mark.parametrize("shuffle", [False, True, "small batches"])
def test_atlas_obs_is_the_concatenation_of_the_inputs(tmp_path, shuffle, monkeypatch):
    """obs is planned from each input in turn, never concatenated whole, yet reads back as
    pandas' outer concatenation of all of them (dtypes, categories, missing values), for
    inputs written in order and shuffled (also with the temporary obs file in batches of 7
    rows, so that tiles gather rows across many batches); repeated names are recorded."""
    from deltacells.write import obs as _obs_write

    if shuffle == "small batches":
        monkeypatch.setattr(_obs_write, "SPILL_ROWS", 7)
    shuffle = bool(shuffle)
    inputs = _atlas_obs_inputs(np.random.default_rng(0))
    paths = []
    for i, adata in enumerate(inputs):
        adata.write_h5ad(tmp_path / f"{i}.h5ad")
        paths.append(tmp_path / f"{i}.h5ad")
    dc.write_deltacells(paths, tmp_path / "d", tile_size=16, obs_tiles_per_file=2,
                        max_categories=10, shuffle=shuffle, progress=False)  # fmt: skip
    expected = pd.concat([a.obs.assign(source_file=f"{i}.h5ad") for i, a in enumerate(inputs)],
                         join="outer")  # fmt: skip
    expected["source_file"] = pd.Categorical(expected["source_file"],
                                             categories=[f"{i}.h5ad" for i in range(4)])
    dataset = dc.open_dataset(tmp_path / "d")
    back = dc.read_deltacells(tmp_path / "d", elements=False).obs
    if shuffle:
        back = back.iloc[np.argsort(dataset.cell_order())]
    pd.testing.assert_frame_equal(back, expected, check_index_type=False)
    schema = dataset.obs_schema()
    assert schema["text"].kind == "category" and schema["text"].categories == ["s0", "s1", "s2",
                                                                                "s3", "s4", "s5",
                                                                                "s6"]  # fmt: skip
    assert schema["many"].kind == "string"  # 90 distinct values > max_categories
    assert dataset.manifest.metadata["obs_names_unique"] is False  # "a0".."a29" twice


def test_obs_names_checked_exactly_when_hashes_agree(monkeypatch):
    """Names are compared by 64-bit hashes; where two agree, by the names themselves."""
    from deltacells.write import obs as _obs_write

    def frames(*names):
        readers = [lambda n=n: pd.DataFrame(index=list(n)) for n in names]
        return _obs_write.ObsInputs(readers, [f"{i}.h5ad" for i in range(len(names))], [], False)

    monkeypatch.setattr(_obs_write.pd.util, "hash_array",
                        lambda values: np.zeros(len(values), dtype=np.uint64))  # fmt: skip
    assert _obs_write.plan_obs(frames(["a", "b"], ["c"]), 10).names_unique
    assert not _obs_write.plan_obs(frames(["a", "b"], ["b"]), 10).names_unique
    monkeypatch.undo()
    assert _obs_write.plan_obs(frames(["a", "b"], ["c"]), 10).names_unique
    assert not _obs_write.plan_obs(frames(["a\x00x", "b"], ["a\x00x"]), 10).names_unique
    assert _obs_write.plan_obs(frames(["a\x00x", "b"], ["a\x00y"]), 10).names_unique


@pytest.mark.parametrize("shuffle", [False, True])
def test_converting_more_files_keeps_caller_memory_flat(tmp_path, monkeypatch, shuffle):
    """The caller keeps 8 bytes per cell of obs (a hash per name), not the inputs' obs:
    the peak of Python memory traced while converting 24 files is within 150 bytes per extra
    cell of 4 files' (measured: about 0 in order, where a tile's own peak hides the hashes;
    39 shuffled, adding the cell order and the open inputs' row pointers; holding every
    input's obs and names took about 394). Shuffled, the obs goes through a temporary
    memory-mapped Arrow file, removed after."""
    import tempfile
    import tracemalloc

    spill = tmp_path / "tmp"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))
    rng = np.random.default_rng(1)
    for i in range(24):
        adata = small_adata(n_cells=500, n_genes=20, seed=i)
        adata.X = adata.X.astype(np.int32)
        adata.obs_names = [f"file{i:03d}-{'x' * 60}-{k}" for k in range(500)]
        adata.obs["tag"] = rng.choice(["u", "v"], 500)
        adata.write_h5ad(tmp_path / f"{i:03d}.h5ad")
    files = sorted(tmp_path.glob("*.h5ad"))
    peaks = []
    for n in (4, 24):
        tracemalloc.start()
        dc.write_deltacells(files[:n], tmp_path / f"d{n}", tile_size=1024, cache_bytes=0,
                            shuffle=shuffle, progress=False)  # fmt: skip
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert (peaks[1] - peaks[0]) / 10_000 < 150, peaks
    assert list(spill.iterdir()) == []
    back = dc.read_deltacells(tmp_path / "d24", elements=False)
    order = dc.open_dataset(tmp_path / "d24").cell_order()
    names = back.obs_names if order is None else back.obs_names[np.argsort(order)]
    assert list(names) == [f"file{i:03d}-{'x' * 60}-{k}" for i in range(24) for k in range(500)]


def test_shuffled_atlas_obs_stays_memory_mapped(tmp_path):
    """A shuffled write takes each tile's obs rows from the inputs' memory-mapped batches one
    by one: Arrow's memory peak stays far below the obs's size (a take on the whole chunked
    table copied all of it into memory first)."""
    import subprocess
    import sys
    import textwrap

    for i in range(12):
        adata = small_adata(n_cells=2000, n_genes=10, seed=i)
        adata.X = adata.X.astype(np.int32)
        adata.obs = adata.obs[["batch"]]
        adata.obs_names = [f"file{i:03d}-{'y' * 200}-{k}" for k in range(2000)]
        adata.write_h5ad(tmp_path / f"{i:03d}.h5ad")
    script = textwrap.dedent(f"""
        from pathlib import Path
        import pyarrow as pa
        import deltacells as dc
        files = sorted(Path({str(tmp_path)!r}).glob("*.h5ad"))
        dc.write_deltacells(files, Path({str(tmp_path)!r}) / "d", shuffle=True, tile_size=1024,
                            obs_tiles_per_file=1, progress=False)
        print(pa.default_memory_pool().max_memory())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    peak = int(done.stdout.split()[-1])
    assert peak < 2e6, peak  # the obs names alone are about 5 MB
    assert dc.read_deltacells(tmp_path / "d", elements=False).n_obs == 24_000


def test_names_the_writer_refuses_say_what_to_do(tmp_path):
    repeated = small_adata(n_cells=20)
    repeated.var_names = ["g"] * repeated.n_vars
    with pytest.raises(ValueError, match=r"var_names are not unique \('g' repeats\); make them "
                                         r"unique first \(anndata's adata.var_names_make_unique"):
        dc.write_deltacells(repeated, tmp_path / "a", progress=False)
    reserved = small_adata(n_cells=20)
    reserved.obs["_index"] = "x"
    with pytest.raises(ValueError, match=r"column named '_index', which holds obs_names .* "
                                         r"rename or drop that column first"):
        dc.write_deltacells(reserved, tmp_path / "b", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_home_paths_are_expanded(tmp_path, monkeypatch):
    # "~/..." as pandas and fsspec take it: never a folder named "~" in the working directory.
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    adata = small_adata()
    adata.write_h5ad(home / "in.h5ad")
    dc.write_deltacells("~/in.h5ad", "~/out.dc", progress=False)
    dc.write_deltacells(["~/in.h5ad"], Path("~/list.dc"), progress=False)
    assert (home / "out.dc" / "manifest.json").exists() and (home / "list.dc").exists()
    assert not (cwd / "~").exists()
    back = dc.read_deltacells("~/out.dc", cache_dir="~/cache")
    assert (home / "cache").is_dir()
    assert_same_matrix(back.X.to_memory(), adata.X)
    assert sum(batch.X.shape[0] for batch in dc.Loader("~/list.dc")) == adata.n_obs
    assert dc.open_dataset(Path("~/out.dc")).manifest.n_cells == adata.n_obs
