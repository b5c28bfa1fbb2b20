"""A deltacells dataset on a store: manifest, tiles, gene order, var and obs files.

Opening reads ``manifest.json`` only; everything else is read when asked for.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import scipy.sparse as sp

from deltacells.codec import Tile, empty_output
from deltacells.format import HEADER_SIZE, MAGIC, FormatError
from deltacells.integrity import check_checksum_row
from deltacells.manifest import (
    GENE_ORDER_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    OBS_INDEX_COLUMN,
    OBS_SCHEMA_NAME,
    VAR_NAMES_NAME,
    VAR_TABLE_NAME,
    Manifest,
    ObsColumn,
    ObsSchema,
    StoredParts,
    obs_fingerprint,
    obs_shard_name,
    tile_name,
)
from deltacells.npy import parse_npy_header
from deltacells.storage import Store, open_store

__all__ = [
    "Dataset",
    "arrow_reader",
    "category_from_codes",
    "gather_cells",
    "group_by_tile",
    "open_dataset",
]


class Dataset:
    """An opened dataset (see :func:`open_dataset`).

    Attributes
    ----------
    store
        Where the dataset lives.
    manifest
        The validated manifest.
    manifest_digest
        SHA-256 of the manifest's bytes as read (``None`` if not read from the store); a
        dataset reopened from a pickle must have the same.
    """

    def __init__(self, store: Store, manifest: Manifest,
                 manifest_digest: str | None = None) -> None:  # fmt: skip
        self.store = store
        self.manifest = manifest
        self.manifest_digest = manifest_digest
        self._gene_order: np.ndarray | None = None
        self._spatial: Any = None
        self._gene_major: Any = None
        self.files = manifest.file_table(store.describe(MANIFEST_NAME))
        self._tile_sums = manifest.tile_sums(store.describe(MANIFEST_NAME))

    # -- files read whole ------------------------------------------------------------------------

    def read_file(self, name: str, max_size: int) -> bytes:
        """The whole file ``name``, checked against the manifest's file table (size before
        reading, SHA-256 after). Datasets written before file tables: read unchecked, refused
        above ``max_size`` bytes.

        Raises
        ------
        FormatError
            Naming the file, when it is not what the manifest records.
        """
        return self.files.read(self.store, name, max_size)

    def open_nested(self, location: str) -> Dataset:
        """The count layer or raw stored at ``location`` (a dataset of its own), its manifest
        checked against this one's file table."""
        store = self.store.child(location)
        if not self.files.present:
            return open_dataset(store)
        return _from_manifest_text(
            store, self.read_file(f"{location}/{MANIFEST_NAME}", MAX_MANIFEST_BYTES))

    @property
    def tile_sums(self):
        """The tiles' chunk checksums (:class:`~deltacells.integrity.ChunkSums`; None for
        datasets written before them)."""
        return self._tile_sums

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
        if self._tile_sums is None:
            out.append("ranged reads of tiles (no chunk checksums: read_deltacells(ranged_reads="
                       "True) reads whole tiles instead)")
        if m.tile_crc32 is None:
            out.append("which tile file belongs where (no tile_crc32)")
        companion = self.gene_major()
        if companion is not None and companion.sums is None:
            out.append("gene-major reads (no chunk checksums in the companion: only verify "
                       "checks it)")
        return out

    @property
    def shape(self) -> tuple[int, int]:
        """(cells, genes)."""
        return (self.manifest.n_cells, self.manifest.n_genes)

    def __repr__(self) -> str:
        m = self.manifest
        return f"Dataset({self.store.describe()!r}, shape={self.shape}, tiles={m.n_tiles})"

    # -- tiles ---------------------------------------------------------------------------------

    def tile_blob(self, index: int) -> np.ndarray:
        """The bytes of tile ``index`` (``uint8``), checked against the manifest's size."""
        size = self.manifest.tile_bytes[index]
        return self._checked_blob(index, self.store.read_buffer(tile_name(index), size))

    def _checked_blob(self, index: int, blob: Any) -> Any:
        if len(blob) != self.manifest.tile_bytes[index]:
            raise FormatError(
                f"{self.store.describe(tile_name(index))}: {len(blob)} bytes, the manifest says "
                f"{self.manifest.tile_bytes[index]}"
            )
        return blob

    def tile(
        self,
        index: int,
        *,
        verify_crc: bool = True,
        n_threads: int | None = None,
        blob: bytes | None = None,
    ) -> Tile:
        """Tile ``index`` parsed and validated, checked against the manifest's counts.

        ``blob`` may hold the tile's bytes if they were fetched already (e.g. prefetched).
        """
        if not 0 <= index < self.manifest.n_tiles:
            raise IndexError(f"tile {index} out of range ({self.manifest.n_tiles} tiles)")
        name = self.store.describe(tile_name(index))
        blob = self.tile_blob(index) if blob is None else self._checked_blob(index, blob)
        m = self.manifest
        self._check_tile_version(blob, name)
        tile = Tile(blob, name=name, verify_crc=verify_crc, n_threads=n_threads)
        if tile.shape != (m.tile_cells[index], m.n_genes) or tile.nnz != m.tile_nnz[index]:
            raise FormatError(
                f"{name}: holds {tile.shape[0]} cells x {tile.shape[1]} genes, {tile.nnz} "
                f"nonzeros; the manifest says {m.tile_cells[index]} x {m.n_genes}, "
                f"{m.tile_nnz[index]}"
            )
        if m.tile_crc32 is not None and tile.layout.crc32 != m.tile_crc32[index]:
            raise FormatError(
                f"{name}: CRC-32 {tile.layout.crc32:08x} is not the {m.tile_crc32[index]:08x} "
                f"the manifest records for tile {index} (tiles swapped or replaced)"
            )
        return tile

    def cell_order(self) -> np.ndarray | None:
        """``cell_order[i]`` is the source row of stored row ``i`` (None when cells are stored
        in source order); checked to be a permutation."""
        name = self.manifest.metadata.get("cell_order") or (
            (self.manifest.metadata.get("shuffle") or {}).get("cell_order"))  # fmt: skip
        if name is None:
            return None
        if name != CELL_ORDER_FILE:
            raise FormatError(f"{self.store.describe(MANIFEST_NAME)}: cell_order must name "
                              f"{CELL_ORDER_FILE!r}")  # fmt: skip
        n = self.manifest.n_cells
        order = self.load_npy(CELL_ORDER_FILE, n).astype(np.int64)
        if not np.array_equal(np.sort(order), np.arange(n)):
            raise FormatError(f"{self.store.describe(CELL_ORDER_FILE)}: not a permutation of "
                              f"0..{n - 1}")  # fmt: skip
        return order

    def gene_major(self):
        """The gene-major companion (:class:`~deltacells.genemajor.GeneMajor`), or None if
        the dataset has none (add it with :func:`~deltacells.genemajor.add_gene_major` or
        ``deltacells add-gene-major``)."""
        if self.manifest.metadata.get("gene_major") is None:
            return None
        if self._gene_major is None:
            from deltacells.genemajor import GeneMajor

            self._gene_major = GeneMajor(self)
        return self._gene_major

    def gene(self, gene: str | int, values_dtype: Any = np.float32) -> sp.csc_matrix:
        """One gene for every cell (``ds.gene("CD3E")``): :meth:`genes` of one name or
        source position, a cells x 1 CSC matrix."""
        return self.genes([gene], values_dtype=values_dtype)

    def genes(self, genes: Sequence[str | int] | str | int, values_dtype: Any = np.float32,
              column_order: str = "source") -> sp.csc_matrix:  # fmt: skip
        """Genes for every cell, read from the gene-major companion (a few small ranged reads
        per block of cells, not a scan of the tiles).

        Parameters
        ----------
        genes
            Gene names (var_names), or integer positions in ``column_order``; one or many.
        values_dtype
            dtype of the values.
        column_order
            What integer positions refer to: ``"source"`` (the written order) or
            ``"stored"``.

        Returns
        -------
        scipy.sparse.csc_matrix
            Cells (stored order) by the genes asked, in the order asked.

        Raises
        ------
        ValueError
            When the dataset has no gene-major companion.
        KeyError
            For an unknown gene name.
        """
        companion = self.gene_major()
        if companion is None:
            raise ValueError(f"{self.store.describe()}: no gene-major companion (add it with "
                             "deltacells add-gene-major)")  # fmt: skip
        if column_order not in ("source", "stored"):
            raise ValueError(f"column_order must be 'source' or 'stored', not {column_order!r}")
        asked = [genes] if isinstance(genes, str | int | float | np.number) else list(genes)
        order = self.gene_order()
        source_to_stored = np.argsort(order) if order is not None else None
        names: np.ndarray | None = None
        stored = []
        for g in asked:
            if isinstance(g, str):
                if names is None:
                    names = np.asarray(self.var_names() or [], dtype=object)  # stored order
                hits = np.flatnonzero(names == g)
                if not len(hits):
                    raise KeyError(f"{self.store.describe()}: no gene named {g!r}")
                stored.append(int(hits[0]))
                continue
            if isinstance(g, bool) or not isinstance(g, int | np.integer):
                raise TypeError(f"genes are names or integer positions, not {g!r}")
            p = int(g)
            if not 0 <= p < self.manifest.n_genes:
                raise IndexError(f"gene position {p} outside 0..{self.manifest.n_genes - 1}")
            use_order = column_order == "source" and source_to_stored is not None
            stored.append(int(source_to_stored[p]) if use_order else p)
        return companion.read(stored, values_dtype)

    def spatial_index(self):
        """The dataset's :class:`~deltacells.spatial.SpatialIndex` (None unless it was written
        in spatial order)."""
        from deltacells.spatial import SpatialIndex

        record = self.manifest.metadata.get("spatial_index")
        if record is None:
            return None
        return SpatialIndex.from_json(record, self.store.describe(MANIFEST_NAME),
                                      self.manifest.n_cells)  # fmt: skip

    def spatial(self):
        """The spatial part (:class:`~deltacells.spatial_query.SpatialReader`), read once.

        Raises
        ------
        ValueError
            When the dataset was not written in spatial order.
        """
        if self._spatial is None:
            from deltacells.spatial_query import SpatialReader

            index = self.spatial_index()
            if index is None:
                raise ValueError(f"{self.store.describe()}: not written in spatial order (write "
                                 "it with spatial_key= or shapes=)")  # fmt: skip
            self._spatial = SpatialReader(self, index, self.manifest.n_cells)
        return self._spatial

    def query_bbox(self, bbox: tuple[float, float, float, float], mode: str = "intersects"):
        """The cells in ``bbox`` = (xmin, ymin, xmax, ymax), as a
        :class:`~deltacells.spatial_query.BoxQuery` (stored rows, bytes read).

        ``mode="intersects"`` (default) selects the cells whose shape intersects the box,
        borders included (points: inside or on the edge; circles: within their radius of it;
        polygons: exactly, with shapely). ``mode="centroid"`` selects by centroid. Only the
        grid tiles overlapping the box grown by the margin are read.
        """
        return self.spatial().query(bbox, mode=mode)

    def _check_tile_version(self, blob: Any, name: str) -> None:
        # A dataset's tiles have its manifest's version. The header is outside the CRC, so a
        # damaged version field would otherwise read as "unsupported tile version 3".
        head = memoryview(blob).cast("B")[:HEADER_SIZE]
        if len(head) < 12 or bytes(head[:8]) != MAGIC:
            return  # the tile parser names what is wrong
        version = int.from_bytes(head[8:12], "little")
        if version != self.manifest.version:
            raise FormatError(
                f"{name}: the header says tile version {version}, but the dataset is version "
                f"{self.manifest.version} (its manifest): the tile's header is damaged (the "
                "CRC does not cover it) or the tile comes from another dataset"
            )

    def check_tile_sizes(self, indices: Sequence[int] | None = None) -> None:
        """Check that tiles ``indices`` (default: all) have the sizes the manifest says.

        Done before allocating for what the manifest claims of tiles not yet read (e.g. all
        of them for ``to_memory()``), so the allocation is bounded by bytes that exist.
        """
        m = self.manifest
        chosen = range(m.n_tiles) if indices is None else indices
        names = [tile_name(int(t)) for t in chosen]
        for name, t, size in zip(names, chosen, self.store.sizes(names), strict=True):
            if size != m.tile_bytes[int(t)]:
                raise FormatError(
                    f"{self.store.describe(name)}: {size} bytes, the manifest says "
                    f"{m.tile_bytes[int(t)]}"
                )

    # -- genes ---------------------------------------------------------------------------------

    def gene_order(self) -> np.ndarray | None:
        """``gene_order[j]`` is the source column of stored column ``j`` (None if absent).

        Read and checked once per opened dataset; each call returns a fresh copy."""
        if not self.manifest.has_gene_order:
            return None
        if self._gene_order is None:
            where = self.store.describe(GENE_ORDER_NAME)
            n = self.manifest.n_genes
            order = self.load_npy(GENE_ORDER_NAME, n)
            if not np.array_equal(np.sort(order), np.arange(n)):
                raise FormatError(f"{where}: not a permutation of 0..{n - 1}")
            self._gene_order = order.astype(np.int64)
        return self._gene_order.copy()

    def load_npy(self, name: str, length: int | tuple[int, ...],
                 dtype: str | None = None) -> np.ndarray:  # fmt: skip
        """An integer ``.npy`` file of ``length`` entries (or that shape), its header checked
        against the file's size before anything is allocated (and the whole file against the
        file table). ``dtype``: the one dtype accepted (default: any integer of up to 8 bytes).

        Raises
        ------
        FormatError
            Naming the file, for anything but such an array (empty, truncated, a header
            claiming more entries than the file holds, another dtype or shape).
        """
        where = self.store.describe(name)
        want = (length,) if isinstance(length, int) else tuple(length)
        count = int(np.prod(want, dtype=np.int64))
        # 8 bytes per entry at most, plus the header (numpy caps headers at 10,000 bytes).
        data = self.read_file(name, max_size=16 + 10_000 + 8 * count)
        shape, fortran, got, offset = parse_npy_header(data, where)
        wrong_dtype = got != np.dtype(dtype) if dtype is not None else (
            got.kind not in "iu" or got.itemsize > 8)  # fmt: skip
        if shape != want or wrong_dtype or fortran:
            what = f"{count} integers" if len(want) == 1 else f"integers of shape {want}"
            raise FormatError(f"{where}: expected {what}, got {got} {shape}")
        body = len(data) - offset
        if body != count * got.itemsize:
            raise FormatError(
                f"{where}: holds {body} bytes of data, {count} {got} entries need "
                f"{count * got.itemsize}"
            )
        return np.frombuffer(data, dtype=got, count=count, offset=offset).reshape(want)

    def var_names(self) -> list[str] | None:
        """Gene names in stored order (None if absent)."""
        if not self.manifest.has_var_names:
            return None
        where = self.store.describe(VAR_NAMES_NAME)
        # A name is rarely above 100 bytes: 1 KiB each on average is far more than enough.
        data = self.read_file(VAR_NAMES_NAME, max_size=1024 * self.manifest.n_genes + 1024)
        try:
            names = data.decode("utf-8").split("\n")
        except UnicodeDecodeError as err:
            raise FormatError(f"{where}: not UTF-8 text ({err})") from None
        if names and names[-1] == "":
            names.pop()
        if len(names) != self.manifest.n_genes:
            raise FormatError(
                f"{self.store.describe(VAR_NAMES_NAME)}: {len(names)} names for "
                f"{self.manifest.n_genes} genes"
            )
        return names

    def var(self) -> pd.DataFrame | None:
        """The gene table in stored order, pandas index restored (None if absent)."""
        if not self.manifest.has_var_table:
            return None
        import pyarrow.parquet as pq

        where = self.store.describe(VAR_TABLE_NAME)
        try:
            data = self.read_file(VAR_TABLE_NAME, max_size=MAX_VAR_TABLE_BYTES_PER_GENE
                                  * self.manifest.n_genes + 2**20)  # fmt: skip
            # pandas metadata is JSON inside the file: decoding it can fail too.
            var = pq.read_table(arrow_reader(data)).to_pandas()
        except PARQUET_ERRORS as err:
            raise FormatError(f"{where}: unreadable parquet ({err})") from None
        if len(var) != self.manifest.n_genes:
            raise FormatError(f"{where}: {len(var)} rows for {self.manifest.n_genes} genes")
        return var

    # -- obs -----------------------------------------------------------------------------------

    def obs_schema(self) -> ObsSchema | None:
        """The obs schema (None if the dataset has no obs)."""
        if not self.manifest.has_obs:
            return None
        return ObsSchema.from_json_text(self._schema_text(), self.store.describe(OBS_SCHEMA_NAME))

    def _schema_text(self) -> str:
        data = self.read_file(OBS_SCHEMA_NAME, max_size=MAX_MANIFEST_BYTES)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            where = self.store.describe(OBS_SCHEMA_NAME)
            raise FormatError(f"{where}: not UTF-8 ({err})") from None

    def obs_shard(self, index: int) -> bytes:
        """Obs shard ``index``, checked against the manifest's size and SHA-256."""
        name = obs_shard_name(index)
        m = self.manifest
        data = self.store.read_buffer(name, m.obs_shard_bytes[index]).tobytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != m.obs_shard_sha256[index]:
            raise FormatError(f"{self.store.describe(name)}: SHA-256 {digest} != manifest's")
        return data

    def read_obs(self, columns: list[str] | None = None) -> pd.DataFrame:
        """All obs columns (or ``columns``) read whole from the shards, in cell order.

        Category columns come back as pandas categoricals with their global vocabulary.
        """
        import pyarrow.parquet as pq

        schema = self.obs_schema()
        if schema is None:
            return pd.DataFrame(index=pd.RangeIndex(self.manifest.n_cells))
        names = schema.names if columns is None else list(columns)
        parts = []
        for s in range(self.manifest.n_obs_shards):
            where = self.store.describe(obs_shard_name(s))
            try:
                table = pq.read_table(arrow_reader(self.obs_shard(s)), columns=names)
            except PARQUET_ERRORS as err:
                raise FormatError(f"{where}: unreadable parquet ({err})") from None
            if table.column_names != names:
                raise FormatError(f"{where}: columns {table.column_names}, expected {names}")
            k = self.manifest.obs_tiles_per_file
            cells = sum(self.manifest.tile_cells[s * k : (s + 1) * k])
            if table.num_rows != cells:
                raise FormatError(f"{where}: {table.num_rows} rows, its tiles hold {cells} cells")
            part = table.to_pandas()
            for name in names:
                if schema[name].kind == "category":
                    part[name] = category_from_codes(part[name].to_numpy(), schema[name], where)
            parts.append(part)
        frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=names)
        return frame

    # -- whole-dataset checks ------------------------------------------------------------------

    def iter_tiles(self, *, verify_crc: bool = True) -> Iterator[tuple[int, Tile]]:
        """Every tile in order."""
        for i in range(self.manifest.n_tiles):
            yield i, self.tile(i, verify_crc=verify_crc)

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
            attempt(self._verify_tile, i)
        attempt(self._verify_files)
        attempt(self.gene_order)
        attempt(self.var_names)
        attempt(self.var)
        attempt(self.cell_order)
        if m.has_obs:
            attempt(self._verify_obs)
        if m.metadata.get("spatial_index") is not None:
            attempt(lambda: self.spatial().verify())
        if m.metadata.get("gene_major") is not None:
            attempt(lambda: self.gene_major().verify(progress))
        attempt(self._verify_stored_parts, progress, found)
        return found

    def _verify_tile(self, index: int) -> None:
        """Tile ``index`` whole (CRC, structure, full decode) and its chunk checksum row."""
        blob = self.tile_blob(index)
        self.tile(index, blob=blob).decode(np.int32)
        if self._tile_sums is not None:
            check_checksum_row(self._tile_sums, index, blob, self.store.read_range,
                               self.store.describe)  # fmt: skip

    def _verify_files(self) -> None:
        """Every file of the file table: present, its size and SHA-256."""
        for name in self.files.names():
            data = self.store.read_buffer(name, self.files.size(name))
            self.files.check(name, data, self.store.describe)
        if self._tile_sums is not None:
            size = self.store.size(self._tile_sums.file)
            if size != self._tile_sums.size:
                raise FormatError(f"{self.store.describe(self._tile_sums.file)}: {size} bytes, "
                                  f"{self.manifest.n_tiles} rows need {self._tile_sums.size}")

    def _verify_obs(self) -> None:
        m = self.manifest
        schema_text = self._schema_text()
        schema = ObsSchema.from_json_text(schema_text, self.store.describe(OBS_SCHEMA_NAME))
        for s in range(m.n_obs_shards):
            self._check_obs_shard(s, schema)
        expected = obs_fingerprint(schema_text, m.tile_cells, m.obs_shard_sha256)
        if expected != m.obs_fingerprint:
            raise FormatError(
                f"{self.store.describe(MANIFEST_NAME)}: obs_fingerprint {m.obs_fingerprint} "
                f"!= {expected} computed from the schema and shards"
            )
        self._check_obs_values(schema)

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
            from deltacells.elements import read_elements

            read_elements(self.store, list(parts.elements), files=self.files)

    def obs_index_column(self, schema: ObsSchema | None = None) -> str | None:
        """The obs column holding obs_names (None: there is none), checked to be a string
        column of the schema.

        Raises
        ------
        FormatError
            If the manifest names a column that is missing or not a string column.
        """
        schema = self.obs_schema() if schema is None else schema
        if schema is None:
            return None
        name = self.manifest.metadata.get("obs_index_column", OBS_INDEX_COLUMN)
        where = self.store.describe(MANIFEST_NAME)
        if name is None:
            return None
        if not isinstance(name, str) or name not in schema.names:
            if name == OBS_INDEX_COLUMN and "obs_index_column" not in self.manifest.metadata:
                return None  # a dataset from another writer, without obs_names
            raise FormatError(f"{where}: obs_index_column {name!r} is not an obs column")
        if schema[name].kind != "string":
            raise FormatError(
                f"{where}: obs_index_column {name!r} is a {schema[name].kind} column; obs "
                "names are stored as strings"
            )
        return name

    def _check_obs_values(self, schema: ObsSchema) -> None:
        """Category codes in range in every column; obs names present, and unique where the
        writer recorded that they were."""
        index = self.obs_index_column(schema)
        categories = [c.name for c in schema.columns if c.kind == "category"]
        # One pass over the shards; reading a category column checks its codes.
        frame = self.read_obs(categories + ([index] if index is not None else []))
        if index is None:
            return
        names = frame[index]
        where = self.store.describe(obs_shard_name(0))
        if names.isna().any():
            raise FormatError(f"{where}: obs names column {index!r} has missing values")
        duplicated = names.duplicated()
        if self.manifest.metadata.get("obs_names_unique") and duplicated.any():
            repeated = names[duplicated].iloc[0]
            raise FormatError(
                f"{self.store.describe(MANIFEST_NAME)}: obs names in {index!r} repeat "
                f"({repeated!r}) but the writer recorded them unique (obs_index_column "
                "points at the wrong column?)"
            )

    def _check_obs_shard(self, index: int, schema: ObsSchema) -> None:
        import pyarrow.parquet as pq

        name = self.store.describe(obs_shard_name(index))
        try:
            meta = pq.ParquetFile(arrow_reader(self.obs_shard(index))).metadata
            arrow_schema = meta.schema.to_arrow_schema()
        except PARQUET_ERRORS as err:
            raise FormatError(f"{name}: unreadable parquet ({err})") from None
        m = self.manifest
        k = m.obs_tiles_per_file
        tiles = range(index * k, min((index + 1) * k, m.n_tiles))
        if meta.num_row_groups != len(tiles):
            raise FormatError(f"{name}: {meta.num_row_groups} row groups, expected {len(tiles)}")
        for g, t in enumerate(tiles):
            if meta.row_group(g).num_rows != m.tile_cells[t]:
                raise FormatError(
                    f"{name}: row group {g} has {meta.row_group(g).num_rows} rows, "
                    f"tile {t} has {m.tile_cells[t]} cells"
                )
        if arrow_schema.names != schema.names:
            raise FormatError(f"{name}: columns {arrow_schema.names} != schema {schema.names}")
        for column in schema.columns:
            actual = str(arrow_schema.field(column.name).type)
            if actual != column.arrow_type:
                raise FormatError(
                    f"{name}: column {column.name!r} is {actual}, schema says {column.arrow_type}"
                )

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
            "unchecked": self.unchecked_parts(),
            "manifest_sha256": m.digest,
            "gene_major": None if m.metadata.get("gene_major") is None else {
                k: v for k, v in m.metadata["gene_major"].items()
                if k in ("block_cells", "chunk_genes", "n_blocks")} | {
                "bytes": sum(m.metadata["gene_major"].get("block_bytes") or [])},
        }


#: Most bytes per gene a var table may have when no file table bounds it (older datasets).
MAX_VAR_TABLE_BYTES_PER_GENE = 64 * 1024

#: Where the writer records the cell order (stored row -> source row).
CELL_ORDER_FILE = "cell_order.npy"

#: What pyarrow raises for damaged parquet (ArrowInvalid is a ValueError, ArrowNotImplemented
#: a NotImplementedError; all are ArrowException).
PARQUET_ERRORS = (OSError, ValueError, KeyError, IndexError, NotImplementedError,
                  pa.ArrowException)  # fmt: skip


def arrow_reader(data: bytes) -> pa.BufferReader:
    """A pyarrow reader over a copy of ``data`` in memory pyarrow owns.

    Never hand pyarrow Python objects (file objects, or ``bytes`` it would wrap): its thread
    pools may drop the last reference in one of their threads after the call returned, which
    then needs the GIL, and during interpreter exit that aborted the process ("terminate
    called without an active exception", 3 of 120 ``deltacells verify`` runs).
    """
    buffer = pa.allocate_buffer(len(data))
    if len(data):
        np.frombuffer(buffer, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
    return pa.BufferReader(buffer)


def category_from_codes(codes: np.ndarray, column: ObsColumn, where: str) -> pd.Categorical:
    """Stored category codes as a categorical; codes outside ``-1 .. n - 1`` are a
    :class:`FormatError` naming ``where`` and the column."""
    codes = np.asarray(codes)
    n = len(column.categories or [])
    if codes.dtype.kind not in "iu":
        raise FormatError(f"{where}: column {column.name!r} codes are {codes.dtype}")
    if codes.size and (int(codes.min()) < -1 or int(codes.max()) >= n):
        raise FormatError(
            f"{where}: column {column.name!r} has category codes outside -1..{n - 1}"
        )
    try:
        return pd.Categorical.from_codes(codes.astype(np.int64), categories=column.categories)
    except (ValueError, TypeError) as err:  # e.g. repeated categories
        raise FormatError(f"{where}: column {column.name!r}: {err}") from None


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
        Local directory, fsspec URL, or a :class:`~deltacells.storage.Store`.
    storage_options
        fsspec options for URLs (credentials, endpoint, ...).
    timeout, deadline
        Remote stores: seconds one request may take before it is retried, and seconds one
        operation may take in all (see :class:`~deltacells.storage.Store`; defaults 20 and
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


def group_by_tile(
    cells: np.ndarray, tile_limits: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """Split cell positions by the tile they live in.

    ``tile_limits[t]`` is one past tile ``t``'s last cell. Returns the touched tiles
    (increasing), for each the positions in ``cells`` that fall in it, and every cell's
    position within its tile.
    """
    which = np.searchsorted(tile_limits, cells, side="right")
    starts = np.concatenate([[0], tile_limits[:-1]]).astype(np.int64)
    by_tile = np.argsort(which, kind="stable")
    touched, first = np.unique(which[by_tile], return_index=True)
    return touched, np.split(by_tile, first[1:]), cells - starts[which]


def gather_cells(
    tiles: list[Tile],
    groups: list[np.ndarray],
    local: np.ndarray,
    n_genes: int,
    values_dtype: np.dtype,
    n_threads: int | None,
    col_map: np.ndarray | None = None,
) -> sp.csr_matrix:
    """One CSR of the cells ``local`` (positions within their tiles), row ``j`` decoded by the
    tile whose group holds ``j``, straight into its place; only touched chunks are read. With
    ``col_map`` (a column permutation) each row is renumbered and sorted as it is decoded."""
    lengths = np.empty(len(local), dtype=np.int64)
    for tile, mine in zip(tiles, groups, strict=True):
        lengths[mine] = tile.row_lengths(local[mine])
    indptr = np.zeros(len(local) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    indices = empty_output(int(indptr[-1]), np.int32)
    values = empty_output(int(indptr[-1]), values_dtype)
    for tile, mine in zip(tiles, groups, strict=True):
        tile.gather_into(local, indptr, indices, values, positions=mine, n_threads=n_threads,
                         col_map=col_map)  # fmt: skip
    matrix = sp.csr_matrix((values, indices, indptr), shape=(len(local), n_genes), copy=False)
    matrix.has_canonical_format = True
    return matrix
