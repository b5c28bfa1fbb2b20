"""An opened deltacells dataset: one object per part (matrix, obs, var and gene order,
spatial, stored files), and the functions that open one.

Opening reads ``manifest.json`` only; each part reads its files when asked for.
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from deltacells.codec.format import FormatError
from deltacells.read.matrix_part import CELL_ORDER_FILE, MatrixPart, gather_cells, group_by_tile
from deltacells.read.obs_part import ObsPart, category_from_codes
from deltacells.read.spatial_part import SpatialPart
from deltacells.read.stored import PARQUET_ERRORS, StoredFiles, arrow_reader
from deltacells.read.var_part import VarPart
from deltacells.store.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    Manifest,
    StoredParts,
)
from deltacells.store.storage import Store, open_store

__all__ = [
    "CELL_ORDER_FILE",
    "PARQUET_ERRORS",
    "Dataset",
    "arrow_reader",
    "category_from_codes",
    "gather_cells",
    "group_by_tile",
    "open_dataset",
]


def _forward(part: str, owner: type, name: str) -> Callable:
    """A method of :class:`Dataset` answered by the part ``part`` (same signature and docs)."""

    @functools.wraps(getattr(owner, name))
    def method(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(getattr(self, part), name)(*args, **kwargs)

    return method


class Dataset:
    """An opened dataset (see :func:`open_dataset`).

    Each part of the dataset is an object of its own, reading only its files:
    ``matrix_part`` (:class:`~deltacells.read.matrix_part.MatrixPart`: tiles, cell order),
    ``obs_part`` (:class:`~deltacells.read.obs_part.ObsPart`), ``var_part``
    (:class:`~deltacells.read.var_part.VarPart`: gene order, names, table), ``spatial_part``
    (:class:`~deltacells.read.spatial_part.SpatialPart`: grid index, queries, gene-major
    companion) and ``stored`` (:class:`~deltacells.read.stored.StoredFiles`: the store, the
    manifest and its file table). The methods below answer through them.

    Attributes
    ----------
    manifest_digest
        SHA-256 of the manifest's bytes as read (``None`` if not read from the store); a
        dataset reopened from a pickle must have the same.
    """

    def __init__(self, store: Store, manifest: Manifest,
                 manifest_digest: str | None = None) -> None:  # fmt: skip
        self.manifest_digest = manifest_digest
        self.stored = StoredFiles(store, manifest)
        self.matrix_part = MatrixPart(self.stored)
        self.var_part = VarPart(self.stored)
        self.obs_part = ObsPart(self.stored)
        self.spatial_part = SpatialPart(self.stored, self.var_part, self.matrix_part)

    @property
    def store(self) -> Store:
        """Where the dataset lives."""
        return self.stored.store

    @property
    def manifest(self) -> Manifest:
        """The validated manifest."""
        return self.stored.manifest

    @manifest.setter
    def manifest(self, manifest: Manifest) -> None:
        # A companion added to this dataset: what was read of the old manifest's parts goes.
        self.stored.manifest = manifest
        self.spatial_part.forget()

    @property
    def files(self):
        """The manifest's file table (:class:`~deltacells.store.integrity.FileTable`)."""
        return self.stored.files

    @property
    def tile_sums(self):
        """The tiles' chunk checksums (:class:`~deltacells.store.integrity.ChunkSums`; None for
        datasets written before them)."""
        return self.stored.tile_sums

    @property
    def shape(self) -> tuple[int, int]:
        """(cells, genes)."""
        return (self.manifest.n_cells, self.manifest.n_genes)

    def __repr__(self) -> str:
        m = self.manifest
        return f"Dataset({self.store.describe()!r}, shape={self.shape}, tiles={m.n_tiles})"

    read_file = _forward("stored", StoredFiles, "read_file")
    load_npy = _forward("stored", StoredFiles, "load_npy")
    tile_blob = _forward("matrix_part", MatrixPart, "tile_blob")
    tile = _forward("matrix_part", MatrixPart, "tile")
    iter_tiles = _forward("matrix_part", MatrixPart, "iter_tiles")
    check_tile_sizes = _forward("matrix_part", MatrixPart, "check_tile_sizes")
    cell_order = _forward("matrix_part", MatrixPart, "cell_order")
    gene_order = _forward("var_part", VarPart, "gene_order")
    var_names = _forward("var_part", VarPart, "var_names")
    var = _forward("var_part", VarPart, "var")
    obs_schema = _forward("obs_part", ObsPart, "obs_schema")
    obs_shard = _forward("obs_part", ObsPart, "obs_shard")
    read_obs = _forward("obs_part", ObsPart, "read_obs")
    obs_index_column = _forward("obs_part", ObsPart, "obs_index_column")
    gene_major = _forward("spatial_part", SpatialPart, "gene_major")
    gene = _forward("spatial_part", SpatialPart, "gene")
    genes = _forward("spatial_part", SpatialPart, "genes")
    spatial_index = _forward("spatial_part", SpatialPart, "spatial_index")
    spatial = _forward("spatial_part", SpatialPart, "spatial")
    query_bbox = _forward("spatial_part", SpatialPart, "query_bbox")

    def open_nested(self, location: str) -> Dataset:
        """The count layer or raw stored at ``location`` (a dataset of its own), its manifest
        checked against this one's file table."""
        store = self.store.child(location)
        if not self.files.present:
            return open_dataset(store)
        return _from_manifest_text(
            store, self.read_file(f"{location}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES))

    def unchecked_parts(self) -> list[str]:
        """What this dataset's manifest cannot vouch for (datasets written before the manifest
        digest, the file table or the chunk checksums): empty for a current dataset."""
        m, out = self.manifest, []
        if not m.sealed:
            out.append("the manifest itself (no manifest_sha256: a damaged key or value may go "
                       "unnoticed)")
        if not self.files.present:
            out.append("files read whole (gene order, var tables, obs schema, cell order, "
                       "spatial files, elements): no file table")
        if self.stored.tile_sums is None:
            out.append("ranged reads of tiles (no chunk checksums: read_deltacells(ranged_reads="
                       "True) reads whole tiles instead)")
        if m.tile_crc32 is None:
            out.append("which tile file belongs where (no tile_crc32)")
        companion = self.gene_major()
        if companion is not None and companion.sums is None:
            out.append("gene-major reads (no chunk checksums in the companion: only verify "
                       "checks it)")
        return out

    def verify(self, progress: Callable[[Any], Any] | None = None) -> None:
        """Check everything: every tile's CRC and full decode, obs shards, schema, fingerprint,
        gene order and gene tables against the manifest, every file of the file table, the
        chunk checksums, cell order, spatial files, the gene-major companion, nested datasets
        and elements.

        Raises
        ------
        FormatError
            Naming the first problem found (and how many more there are; :meth:`problems`
            lists them all).
        """
        found = self.problems(progress)
        if len(found) == 1:
            raise FormatError(found[0])
        if found:
            raise FormatError(f"{found[0]} (and {len(found) - 1} more problems; deltacells "
                              "verify --json lists them)")  # fmt: skip

    def problems(self, progress: Callable[[Any], Any] | None = None) -> list[str]:
        """Every problem :meth:`verify` finds, one message each (empty: the dataset is sound).
        A check that fails stops only itself: the others still run."""
        found: list[str] = []

        def attempt(check: Callable, *args: Any) -> None:
            try:
                check(*args)
            except FormatError as err:
                found.append(str(err))

        m = self.manifest
        tiles = range(m.n_tiles)
        for i in progress(tiles) if progress else tiles:
            attempt(self.matrix_part.verify_tile, i)
        attempt(self.stored.verify_files)
        attempt(self.gene_order)
        attempt(self.var_names)
        attempt(self.var)
        attempt(self.cell_order)
        if m.has_obs:
            attempt(self.obs_part.verify)
        if m.metadata.get("spatial_index") is not None:
            attempt(lambda: self.spatial().verify())
        if m.metadata.get("gene_major") is not None:
            attempt(lambda: self.gene_major().verify(progress))
        attempt(self._verify_stored_parts, progress, found)
        return found

    def _verify_stored_parts(self, progress, found: list[str]) -> None:
        """Count layers and raw (datasets of their own) and the anndata elements."""
        parts = StoredParts.from_manifest(self.manifest, self.store.describe(MANIFEST_NAME))
        for location in parts.matrices:
            try:
                sub = self.open_nested(location)
            except FormatError as err:
                found.append(str(err))
                continue
            cells = sub.manifest.n_cells
            if cells != self.manifest.n_cells:
                found.append(f"{sub.store.describe()}: {cells} cells, X has "
                             f"{self.manifest.n_cells}")  # fmt: skip
            found.extend(sub.problems(progress))
        if parts.elements:
            from deltacells.store.elements import read_elements

            read_elements(self.store, list(parts.elements), files=self.files)

    def info(self) -> dict:
        """A summary: cells, genes, tiles, sizes, bytes per nonzero, obs columns and kinds."""
        m = self.manifest
        schema = self.obs_schema()
        parts = StoredParts.from_manifest(m, self.store.describe(MANIFEST_NAME))
        tile_bytes = sum(m.tile_bytes)
        return {
            "location": self.store.describe(),
            "version": m.version,
            "n_cells": m.n_cells,
            "n_genes": m.n_genes,
            "n_tiles": m.n_tiles,
            "tile_size": m.tile_size,
            "nnz": m.nnz,
            "tile_bytes": tile_bytes,
            "bytes_per_nonzero": tile_bytes / m.nnz if m.nnz else 0.0,
            "n_chunks": m.n_chunks,
            "zstd_level": m.zstd_level,
            "gene_order": m.has_gene_order,
            # The obs names column is the index, not a column of obs.
            "obs_columns": {c.name: c.kind for c in schema.columns
                            if c.name != self.obs_index_column(schema)} if schema else {},
            "stored_parts": {"layers": parts.layers, "raw": parts.raw,
                             "elements": list(parts.elements)},
            "spatial_index": m.metadata.get("spatial_index"),
            "cell_order": stored_cell_order(m.metadata),
            "unchecked": self.unchecked_parts(),
            "manifest_sha256": m.digest,
            "gene_major": None if m.metadata.get("gene_major") is None else {
                k: v for k, v in m.metadata["gene_major"].items()
                if k in ("block_cells", "chunk_genes", "n_blocks")} | {
                "bytes": sum(m.metadata["gene_major"].get("block_bytes") or [])},
        }


def stored_cell_order(metadata: dict) -> str | None:
    """How the cells were reordered at write time (None: stored in the input's order)."""
    if not (metadata.get("cell_order") or (metadata.get("shuffle") or {}).get("cell_order")):
        return None
    if metadata.get("spatial_index"):
        return "spatial"
    return "shuffled" if metadata.get("shuffle") else "given"


def _what_file(path: str) -> str:
    """A short description of a file given where a dataset was expected."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix in (".h5ad", ".h5"):
        return "an .h5ad (HDF5) file"
    if suffix == ".loom":
        return "a .loom file"
    if suffix == ".dct":
        return "a single tile (read it with deltacells.Tile)"
    return "a file"


def open_dataset(
    url_or_path: str | os.PathLike | Store,
    *,
    storage_options: dict | None = None,
    timeout: float | None = None,
    deadline: float | None = None,
    follow_external_links: bool = False,
) -> Dataset:
    """Open a dataset: read and validate ``manifest.json`` (nothing else).

    Parameters
    ----------
    url_or_path
        Local directory, fsspec URL, or a :class:`~deltacells.store.storage.Store`.
    storage_options
        fsspec options for URLs (credentials, endpoint, ...).
    timeout, deadline
        Remote stores: seconds one request may take before it is retried, and seconds one
        operation may take in all (see :class:`~deltacells.store.storage.Store`; defaults 20 and
        60, or ``$DELTACELLS_TIMEOUT`` / ``$DELTACELLS_DEADLINE``).
    follow_external_links
        Local directories: read files that are symbolic links leading out of the dataset's
        root (refused by default).

    Returns
    -------
    Dataset
        The opened dataset.

    Raises
    ------
    FormatError
        ``"incomplete dataset"`` when the root exists without a manifest (an interrupted write),
        or for an invalid manifest.
    FileNotFoundError
        When there is nothing at that location.
    """
    store = open_store(url_or_path, storage_options, timeout=timeout, deadline=deadline,
                       follow_external_links=follow_external_links)  # fmt: skip
    if store.is_local and os.path.isfile(store.describe()):
        raise FormatError(f"{store.describe()}: {_what_file(store.describe())}, not a deltacells "
                          "dataset (a folder); convert it with deltacells convert or "
                          "write_deltacells")  # fmt: skip
    if not store.exists(MANIFEST_NAME):
        names = store.list()
        if any(n.startswith("tiles/tile_") for n in names):
            raise FormatError(
                f"{store.describe()}: incomplete dataset (tiles but no {MANIFEST_NAME}); the "
                "write that made it did not finish: write it again with overwrite=True "
                "(deltacells convert --overwrite), which replaces it"
            )
        if names and any(n in (".zgroup", "zarr.json") for n in names) and any(
            n.startswith("X/") for n in names
        ):
            raise FormatError(f"{store.describe()}: an AnnData .zarr store, not a deltacells "
                              "dataset; convert it with deltacells convert or "
                              "write_deltacells")  # fmt: skip
        if names:
            raise FormatError(f"{store.describe()}: not a deltacells dataset (no "
                              f"{MANIFEST_NAME}, no tiles/)")  # fmt: skip
        raise FileNotFoundError(f"{store.describe()}: no deltacells dataset there")
    return _from_manifest_text(store, store.read_bytes(MANIFEST_NAME, max_size=MAX_MANIFEST_BYTES))


def _from_manifest_text(store: Store, text: bytes) -> Dataset:
    """The dataset at ``store`` whose ``manifest.json`` holds ``text``."""
    manifest = Manifest.from_json_text(text, store.describe(MANIFEST_NAME))
    return Dataset(store, manifest, hashlib.sha256(text).hexdigest())


#: Datasets reopened from pickles in this process (most recent last). dask pickles a task to
#: name it, and its workers unpickle every task they run: one manifest fetch per process and
#: dataset serves them all instead of one per task.
_REOPENED: OrderedDict[tuple, Dataset] = OrderedDict()
_REOPENED_LOCK = threading.Lock()
_REOPENED_MAX = 16


def reopen_dataset(store: Store, manifest_digest: str | None) -> Dataset:
    """The dataset at ``store`` for an object unpickled in this process, opened once.

    Raises
    ------
    FormatError
        When the manifest there is not the one the pickled object was made from (the dataset
        was overwritten since): its tiles would no longer match what the object knows.
    """
    key = (store.url, repr(sorted(store.storage_options.items())),
           tuple(sorted(store._options().items())), manifest_digest)  # fmt: skip
    with _REOPENED_LOCK:
        dataset = _REOPENED.get(key)
        if dataset is not None:
            _REOPENED.move_to_end(key)
            return dataset
    dataset = open_dataset(store)
    if manifest_digest is not None and dataset.manifest_digest != manifest_digest:
        raise FormatError(f"{store.describe(MANIFEST_NAME)}: the dataset changed since this "
                          "object was made (another manifest); open it again")  # fmt: skip
    with _REOPENED_LOCK:
        _REOPENED[key] = dataset
        while len(_REOPENED) > _REOPENED_MAX:
            _REOPENED.popitem(last=False)
    return dataset

