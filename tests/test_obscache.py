"""The local obs cache: per-column, atomic, shared by processes, self-healing."""

from __future__ import annotations

import hashlib
import multiprocessing
from pathlib import Path

import numpy as np
import pytest
from test_writer import small_adata

import deltacells as dc
from deltacells.read.obscache import ObsCache, cache_root


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("obs")
    adata = small_adata(n_cells=500)
    dc.write_deltacells(adata, root / "d", tile_size=64, obs_tiles_per_file=3, progress=False)
    return root / "d", adata


def test_columns_are_fetched_once_then_memory_mapped(written, tmp_path):
    path, adata = written
    cache = ObsCache(dc.open_dataset(path), tmp_path)
    assert cache.localize(["batch", "score"]) == ["batch", "score"]
    assert cache.localize(["batch", "score", "age"]) == ["age"]
    column = cache.column("score")
    assert column.num_chunks == dc.open_dataset(path).manifest.n_tiles
    np.testing.assert_array_equal(cache.series("score").isna(), adata.obs["score"].isna())
    assert cache.series("batch").tolist() == adata.obs["batch"].tolist()
    fingerprint = dc.open_dataset(path).manifest.obs_fingerprint
    assert cache.path("batch") == tmp_path / fingerprint / "obs" / "batch.arrow"
    with pytest.raises(KeyError):
        cache.localize(["nope"])


def test_column_names_are_url_quoted(written, tmp_path):
    path, _ = written
    cache = ObsCache(dc.open_dataset(path), tmp_path)
    assert cache.path("a/b c").name == "a%2Fb%20c.arrow"


def test_corrupt_and_stale_files_are_fetched_again(written, tmp_path):
    path, adata = written
    cache = ObsCache(dc.open_dataset(path), tmp_path)
    cache.localize(["n_counts", "cell_type"])
    target = cache.path("n_counts")
    target.write_bytes(target.read_bytes()[:100])  # truncated
    assert cache.localize(["n_counts"]) == ["n_counts"]
    np.testing.assert_array_equal(cache.series("n_counts"), adata.obs["n_counts"])
    # A file for the wrong tiling (one batch) is stale.
    other = tmp_path / "other"
    dc.write_deltacells(adata, other, tile_size=1000, progress=False)
    stale = ObsCache(dc.open_dataset(other), tmp_path / "c2")
    stale.localize(["cell_type"])
    cache.path("cell_type").write_bytes(stale.path("cell_type").read_bytes())
    assert cache.localize(["cell_type"]) == ["cell_type"]


def _localize_in_process(args):
    path, cache_dir, columns = args
    cache = ObsCache(dc.open_dataset(path), cache_dir)
    fetched = cache.localize(columns)
    digest = hashlib.sha256()
    for column in columns:
        digest.update(cache.series(column).astype(str).str.cat().encode())
    return fetched, digest.hexdigest()


def test_concurrent_processes_fetch_each_column_once(written, tmp_path):
    path, _ = written
    columns = ["batch", "cell_type", "n_counts", "barcode", "age"]
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        results = pool.map(_localize_in_process, [(path, tmp_path, columns)] * 6)
    fetched = [c for f, _ in results for c in f]
    assert sorted(fetched) == sorted(columns)  # each column fetched by exactly one process
    assert len({digest for _, digest in results}) == 1  # and everyone reads the same data


def test_cache_root_order(monkeypatch, tmp_path):
    monkeypatch.setenv("DELTACELLS_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("DELTACELLS_CACHE")
    assert cache_root() == tmp_path / "x" / "deltacells"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "deltacells"


def test_read_deltacells_uses_the_cache(written, tmp_path):
    path, adata = written
    backed = dc.read_deltacells(path, obs=["cell_type", "age"], cache_dir=tmp_path)
    fingerprint = dc.open_dataset(path).manifest.obs_fingerprint
    cached = sorted(p.name for p in (tmp_path / fingerprint / "obs").glob("*.arrow"))
    assert cached == ["_index.arrow", "age.arrow", "cell_type.arrow"]
    assert (
        backed.obs["cell_type"]
        .astype(object)
        .equals(
            adata.obs["cell_type"].astype(object).reset_index(drop=True).set_axis(backed.obs_names)
        )
    )
