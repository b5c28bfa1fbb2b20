"""Opening datasets: manifest checks and files that disagree with it."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import scipy.sparse as sp
from test_writer import small_adata

import deltacells as dc
from deltacells.store.manifest import Manifest
from deltacells.testing import reseal


@pytest.fixture
def dataset_dir(tmp_path):
    dc.write_deltacells(small_adata(), tmp_path / "d", tile_size=64, progress=False)
    return tmp_path / "d"


def edit_manifest(root, **changes):
    """Change manifest values and seal it anew (as a deliberate edit would), so the checks
    behind the manifest's digest are reached."""
    path = root / "manifest.json"
    obj = json.loads(path.read_text())
    obj.update(changes)
    reseal(root, obj)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"format": "something-else"}, "format is"),
        ({"version": 3}, "unsupported dataset version 3"),
        ({"n_cells": 301}, "tile_cells add up to 300"),
        ({"tile_size": 50}, "every tile but the last holds tile_size=50"),
        ({"tile_nnz": [1, 2]}, "'tile_nnz' has 2 entries"),
        ({"tile_bytes": "many"}, "'tile_bytes' must be a list of integers"),
        ({"obs_shard_sha256": ["zz"]}, "malformed SHA-256"),
        ({"obs_fingerprint": "abc"}, "24 lowercase hex"),
        ({"has_obs": "yes"}, "'has_obs' must be true or false"),
    ],
)
def test_inconsistent_manifests_are_rejected(dataset_dir, changes, match):
    edit_manifest(dataset_dir, **changes)
    with pytest.raises(dc.FormatError, match=match):
        dc.open_dataset(dataset_dir)


def test_manifest_that_is_not_json(dataset_dir):
    (dataset_dir / "manifest.json").write_text("{not json")
    with pytest.raises(dc.FormatError, match="not valid JSON"):
        dc.open_dataset(dataset_dir)


def test_tile_size_must_match_manifest(dataset_dir):
    tile = dataset_dir / "tiles" / "tile_000001.dct"
    tile.write_bytes(tile.read_bytes() + bytes(8))
    dataset = dc.open_dataset(dataset_dir)
    with pytest.raises(dc.FormatError, match=r"tile_000001\.dct: \d+ bytes, the manifest says"):
        dataset.tile(1)


def test_oversized_files_are_refused_before_allocating(dataset_dir, monkeypatch):
    # A tile or obs shard claiming 64 GiB (a sparse file) must fail on its size, before any
    # buffer that large is asked for.
    import deltacells.store.storage as storage

    real_allocate = storage.pa.allocate_buffer

    def small_only(size, *args, **kwargs):
        assert size < 1 << 30, f"asked to allocate {size} bytes"
        return real_allocate(size, *args, **kwargs)

    monkeypatch.setattr(storage.pa, "allocate_buffer", small_only)
    os.truncate(dataset_dir / "tiles" / "tile_000001.dct", 1 << 36)
    os.truncate(dataset_dir / "obs" / "obs_0000.parquet", 1 << 36)
    dataset = dc.open_dataset(dataset_dir)
    with pytest.raises(dc.FormatError, match=r"tile_000001\.dct: 68719476736 bytes, the manifest"):
        dataset.tile(1)
    with pytest.raises(dc.FormatError, match=r"obs_0000\.parquet: 68719476736 bytes, the manif"):
        dataset.read_obs()


def test_obs_shard_size_must_match_manifest(dataset_dir):
    shard = dataset_dir / "obs" / "obs_0000.parquet"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(dc.FormatError, match=r"obs_0000\.parquet: \d+ bytes, the manifest says"):
        dc.open_dataset(dataset_dir).read_obs()


def test_tile_counts_must_match_manifest(dataset_dir):
    obj = json.loads((dataset_dir / "manifest.json").read_text())
    obj["tile_nnz"][0] += 1
    reseal(dataset_dir, obj)
    with pytest.raises(dc.FormatError, match="the manifest says"):
        dc.open_dataset(dataset_dir).tile(0)


def test_tile_index_is_checked(dataset_dir):
    ds = dc.open_dataset(dataset_dir)
    n = ds.manifest.n_tiles
    for bad in (-1, n):
        with pytest.raises(IndexError, match=f"tile {bad} out of range \\({n} tiles\\)"):
            ds.tile(bad)
    with pytest.raises(TypeError, match="index must be an int, not str"):
        ds.tile("0")
    assert ds.tile(np.int64(0)).indptr[0] == 0  # numpy ints are ints


def test_a_location_that_is_not_a_path_is_named():
    for where, error, match in ((None, TypeError, "not NoneType"), (123, TypeError, "not int"),
                                ("", ValueError, "path '' is empty"),
                                (b"/tmp", TypeError, "not bytes")):  # fmt: skip
        with pytest.raises(error, match=match):
            dc.read_deltacells(where)
    with pytest.raises(ValueError, match="path '  ' is empty"):
        dc.Loader("  ")


def test_missing_tile_and_wrong_shard_hash(dataset_dir):
    (dataset_dir / "tiles" / "tile_000002.dct").unlink()
    dataset = dc.open_dataset(dataset_dir)
    with pytest.raises(dc.FormatError, match=r"tile_000002\.dct: missing"):
        dataset.tile(2)
    shard = dataset_dir / "obs" / "obs_0000.parquet"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(dc.FormatError, match="SHA-256"):
        dataset.read_obs()


def test_gene_order_file_must_be_a_permutation(dataset_dir):
    np.save(dataset_dir / "gene_order.npy", np.zeros(120, dtype=np.int32))
    with pytest.raises(dc.FormatError, match=r"gene_order\.npy: SHA-256 .* file table"):
        dc.open_dataset(dataset_dir).gene_order()
    reseal(dataset_dir)  # a deliberate edit recorded anew: the permutation check stands
    with pytest.raises(dc.FormatError, match="not a permutation"):
        dc.open_dataset(dataset_dir).gene_order()


def test_fingerprint_mismatch_fails_verify(dataset_dir):
    edit_manifest(dataset_dir, obs_fingerprint="0" * 24)
    with pytest.raises(dc.FormatError, match="obs_fingerprint"):
        dc.open_dataset(dataset_dir).verify()


def test_manifest_round_trip():
    manifest = Manifest(
        version=2, n_cells=5, n_genes=3, tile_size=4, tile_cells=[4, 1], tile_nnz=[2, 0],
        tile_bytes=[300, 200], n_chunks=8, zstd_level=9, has_gene_order=False,
        has_var_names=False, has_var_table=False, has_obs=False, metadata={"a": 1},
    )  # fmt: skip
    assert Manifest.from_json_text(manifest.to_json_text()) == manifest
    np.testing.assert_array_equal(manifest.limits, [4, 5])


def test_opening_reads_only_the_manifest(dataset_dir, monkeypatch):
    from deltacells.store.storage import Store

    read = []
    original = Store.read_bytes

    def spy(self, name, **kwargs):
        read.append(name)
        return original(self, name, **kwargs)

    monkeypatch.setattr(Store, "read_bytes", spy)
    dataset = dc.open_dataset(dataset_dir)
    assert read == ["manifest.json"]
    assert dataset.shape == (300, 120)
    assert sp.issparse(dataset.tile(0).decode())
