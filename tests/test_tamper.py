"""Damage every file of a dataset that has every part and read it through every user path:
no path may return a changed result without an error, and ``verify`` must report each damage.

A bounded run (one bit flip per file, a truncation for a quarter of them; about a minute); ``python
tools/fuzz.py --target tamper --seconds 600`` runs longer.
"""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
from test_whole_anndata import processed

import deltacells as dc
from deltacells.tamper import read_every_path, tamper_dataset


def everything(root, n_cells: int = 240) -> None:
    """A processed AnnData with every part a dataset can store: counts as X (``layer=
    "counts"``), another count layer (a nested dataset), a normalised layer, raw (nested),
    obsm/varm/obsp/varp/uns, spatial order and the gene-major companion; several tiles, chunks
    and obs shards."""
    adata = processed(n_cells, seed=5)
    adata.layers["spliced"] = sp.csr_matrix(adata.X, copy=True)
    adata.layers["spliced"].data = adata.layers["spliced"].data * 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dc.write_deltacells(adata, root, layer="counts", spatial_key="spatial", gene_major=True,
                            tile_size=64, n_chunks=4, obs_tiles_per_file=2,
                            progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    root = tmp_path_factory.mktemp("tamper") / "d"
    everything(root)
    return root


def test_the_dataset_has_every_part(full):
    names = {str(p.relative_to(full)) for p in full.rglob("*") if p.is_file()}
    for expected in ("manifest.json", "tiles/chunk_crc32.bin", "genes/chunk_crc32.bin",
                     "spatial/grid_crc32.npy", "cell_order.npy", "raw/manifest.json",
                     "layers/spliced/manifest.json", "obs/obs_0001.parquet",
                     "var.parquet", "raw/var.parquet"):  # fmt: skip
        assert expected in names, expected
    elements = {n.split("/")[1] for n in names if n.startswith("anndata.zarr/")} - {
        ".zattrs", ".zgroup", "zarr.json"}  # fmt: skip
    assert elements == {"obsm", "obsp", "varm", "varp", "uns", "layers"}
    paths = read_every_path(full, full.parent / "cache")
    with_dask = {"dask"} if importlib.util.find_spec("dask") is not None else set()
    assert set(paths) == {"read_deltacells", "to_memory", "ranged_reads", "loader", "query_bbox",
                          "read_deltacells(bbox=)", "genes"} | with_dask  # fmt: skip
    assert dc.open_dataset(full).unchecked_parts() == []


@pytest.mark.first_stack  # ~95 s in one process; see conftest.py
def test_every_damage_is_refused_or_harmless_and_verify_sees_it(full):
    report = tamper_dataset(full, flips_per_file=1, truncate=0.25, seed=20261204, seconds=150,
                            processes=2)  # fmt: skip
    n_files = sum(1 for p in full.rglob("*") if p.is_file())
    assert report.damages >= n_files  # every file was damaged at least once
    assert report.silent == []
    assert report.missed == []
    assert report.crashed == []
    assert report.refused > report.damages  # most damage is seen by several paths


@pytest.mark.first_stack
def test_partial_reads_are_checked_without_verify(full):
    """Ranged reads and gene-major reads check exactly the bytes they fetch."""
    rng = np.random.default_rng(7)
    report = tamper_dataset(full, flips_per_file=6, truncate=0.0, seed=int(rng.integers(99)),
                            only=lambda name: name.startswith(("tiles/", "genes/")),
                            processes=2)  # fmt: skip
    assert report.damages > 40
    assert report.silent == [] and report.missed == [] and report.crashed == []


def test_a_seed_names_the_same_damages_for_any_number_of_processes(full):
    """The damages are drawn in the caller, file by file, and dealt to the processes: the
    processes share them out, none is lost or repeated."""
    from deltacells.tamper import _damages

    first = list(_damages(full, np.random.default_rng(3), 2, 0.5))
    assert first == list(_damages(full, np.random.default_rng(3), 2, 0.5))
    n_files = sum(1 for p in full.rglob("*") if p.is_file() and p.stat().st_size)
    assert {d.name for d in first} == {str(p.relative_to(full)) for p in full.rglob("*")
                                       if p.is_file() and p.stat().st_size}  # fmt: skip
    assert len(first) >= 2 * n_files
    name = first[0].name
    report = tamper_dataset(full, flips_per_file=1, truncate=0.0, seed=3, processes=2,
                            only=lambda n: n == name)  # fmt: skip
    assert report.damages == 1 and report.refused >= 1
    assert report.silent == [] and report.missed == [] and report.crashed == []
