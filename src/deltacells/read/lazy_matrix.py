"""The lazy X of :func:`~deltacells.read_deltacells`: an ``anndata.abc.CSRDataset`` whose
slices decode only the tiles they touch, with tile-by-tile reductions and a dask view."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp
from anndata.abc import CSRDataset
from numpy.typing import DTypeLike

from deltacells.codec._decode import ColumnMap
from deltacells.codec.threads import effective_n_threads
from deltacells.codec.tile import VALUE_DTYPES, Tile, _value_dtype, empty_output
from deltacells.read.dataset import (
    Dataset,
    gather_cells,
    group_by_tile,
    reopen_dataset,
)
from deltacells.read.outofcore import (
    dask_array_type,
    swap_lazy,
)
from deltacells.store.manifest import tile_name

__all__ = ["DeltacellsCSRDataset", "written_values_dtype"]



COLUMN_ORDERS = ("source", "stored")


def _normalize_rows(index: Any, n: int) -> tuple[np.ndarray, bool]:
    """Row index (int, slice, bool mask, integer array-like) as int64 positions.

    Returns the positions and whether the index was a scalar (then the result has one row that
    scipy-style indexing collapses).
    """
    if isinstance(index, slice):
        return np.arange(n, dtype=np.int64)[index], False
    if isinstance(index, int | np.integer):
        i = int(index)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {n} cells")
        return np.array([i % n], dtype=np.int64), True
    array = np.asarray(index)
    if array.dtype == bool:
        if array.shape != (n,):
            raise IndexError(f"boolean row mask of shape {array.shape} for {n} cells")
        return np.flatnonzero(array).astype(np.int64), False
    if array.size == 0:
        return np.zeros(0, dtype=np.int64), False
    if array.dtype.kind not in "iu":
        raise IndexError(f"cannot index rows with {array.dtype} values")
    rows = array.reshape(-1).astype(np.int64)
    if rows.min() < -n or rows.max() >= n:
        raise IndexError(f"row index out of range for {n} cells")
    return np.where(rows < 0, rows + n, rows), False


def _is_sequence(index: Any) -> bool:
    return not isinstance(index, slice | int | np.integer) and np.ndim(index) == 1


def _as_positions(index: Any) -> np.ndarray:
    array = np.asarray(index)
    return np.flatnonzero(array) if array.dtype == bool else array


def written_values_dtype(dataset: Dataset) -> np.dtype:
    """The values dtype a reader decodes into by default: the counts' dtype as written
    (``metadata["values_dtype"]``) where the decoder makes it (int32, float32, float64);
    other integers decode as int32 and other floats as float32, every count exactly (counts
    are below 2^31). float32 for datasets that do not record it."""
    name = dataset.manifest.metadata.get("values_dtype")
    try:
        dtype = np.dtype(name) if name is not None else np.dtype(np.float32)
    except TypeError:
        return np.dtype(np.float32)
    if dtype.kind in "iu":
        return np.dtype(np.int32)
    return dtype if dtype in (np.dtype(np.float32), np.dtype(np.float64)) else \
        np.dtype(np.float32)  # fmt: skip


class DeltacellsCSRDataset(CSRDataset):
    """X of a deltacells dataset: a lazily decoded CSR matrix (an :class:`anndata.abc.CSRDataset`).

    Indexing decodes only the tiles, and within them only the chunks, that the requested rows
    live in. Parsed tiles are kept in a cache bounded in bytes.

    Parameters
    ----------
    dataset
        An opened :class:`~deltacells.Dataset`.
    column_order
        ``"source"`` (the gene order the data was written in, via ``gene_order.npy``) or
        ``"stored"`` (the on-disk order, skipping the column permutation).
    values_dtype
        ``float32``, ``float64`` or ``int32``; ``None`` (default): the counts' dtype as
        written (:func:`~deltacells.read.lazy_matrix.written_values_dtype`).
    n_threads
        Decoding threads; ``None`` resolves like scikit-learn.
    tile_cache_bytes
        Most bytes of tiles kept parsed in memory.
    ranged_reads
        Fetch only the chunks a row selection needs, by ranged reads, instead of whole tiles.
    rows
        The stored rows this matrix shows, in order (int64; ``None``: every cell). Made by
        :meth:`~deltacells.DeltacellsCSRDataset.take_rows`: a box or a reordering read only
        those cells' tiles.
    """

    format = "csr"
    backend = "deltacells"

    def __init__(
        self,
        dataset: Dataset,
        *,
        column_order: str = "source",
        values_dtype: DTypeLike | None = None,
        n_threads: int | None = None,
        tile_cache_bytes: int = 256 * 2**20,
        ranged_reads: bool = False,
        rows: np.ndarray | None = None,
    ) -> None:
        if column_order not in COLUMN_ORDERS:
            raise ValueError(f"column_order must be one of {COLUMN_ORDERS}, not {column_order!r}")
        self.dataset = dataset
        self.column_order = column_order
        self.dtype = _value_dtype(written_values_dtype(dataset) if values_dtype is None
                                  else values_dtype)  # fmt: skip
        self.n_threads = n_threads
        self.tile_cache_bytes = tile_cache_bytes
        #: Fetch only the chunks a row selection needs (no tile CRC check); see
        #: ``read_deltacells(ranged_reads=...)``.
        self.ranged_reads = ranged_reads
        self._rows = None if rows is None else np.asarray(rows, dtype=np.int64)
        if self._rows is not None and self._rows.size and (
                self._rows.min() < 0 or self._rows.max() >= dataset.shape[0]):  # fmt: skip
            raise IndexError(f"rows outside the dataset's {dataset.shape[0]} cells")
        self.shape = dataset.shape if self._rows is None else (len(self._rows), dataset.shape[1])
        self._limits = dataset.manifest.limits
        self._starts = np.concatenate([[0], self._limits[:-1]]).astype(np.int64)
        order = dataset.gene_order() if column_order == "source" else None
        # Checked once as a permutation here, not again for every tile decoded through it.
        self._to_source = (None if order is None or not len(order)
                           else ColumnMap(order, dataset.shape[1]))  # fmt: skip
        self._cache: OrderedDict[int, Tile] = OrderedDict()
        self._cached_bytes = 0
        # One lazy X is shared by the threads of torch's thread loaders and dask's threaded
        # scheduler: the cache's bookkeeping is done under this lock, fetching and decoding
        # outside it.
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        # Pickles as a recipe (location and options): each process reopens the dataset and
        # builds its own tile cache, which also makes it safe across fork and spawn.
        return {
            "store": self.dataset.store,  # pickles as its location and options
            "manifest_digest": self.dataset.manifest_digest,
            "column_order": self.column_order,
            "values_dtype": self.dtype.str,
            "n_threads": self.n_threads,
            "tile_cache_bytes": self.tile_cache_bytes,
            "ranged_reads": self.ranged_reads,
            "rows": self._rows,
        }

    def __setstate__(self, state: dict) -> None:
        dataset = reopen_dataset(state["store"], state.get("manifest_digest"))
        self.__init__(
            dataset,
            column_order=state["column_order"],
            values_dtype=np.dtype(state["values_dtype"]),
            n_threads=state["n_threads"],
            tile_cache_bytes=state["tile_cache_bytes"],
            ranged_reads=state.get("ranged_reads", False),
            rows=state.get("rows"),
        )

    def __dask_tokenize__(self) -> tuple:
        # Without this, dask names a task by pickling it, and unpickling reopens the dataset:
        # a manifest fetch per graph built. The manifest (tile sizes and CRCs) identifies the
        # stored data.
        m = self.dataset.manifest
        return ("deltacells", self.dataset.store.describe(), m.n_cells, m.n_genes,
                tuple(m.tile_bytes), tuple(m.tile_crc32 or ()), self.column_order,
                self.dtype.str, None if self._rows is None else
                hashlib.sha1(self._rows.tobytes()).hexdigest())  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"DeltacellsCSRDataset({self.dataset.store.describe()!r}, shape={self.shape}, "
            f"dtype={self.dtype}, column_order={self.column_order!r})"
        )

    @property
    def nnz(self) -> int:
        """Stored nonzeros (of the rows shown: counted from the tiles' row pointers)."""
        if self._rows is None:
            return self.dataset.manifest.nnz
        touched, groups, local = group_by_tile(self._rows, self._limits)
        total = 0
        for tile, positions in zip(self.tiles(touched.tolist()), groups, strict=True):
            rows = local[positions]
            total += int(np.sum(tile.indptr[rows + 1] - tile.indptr[rows]))
        return total

    def take_rows(self, positions: Any) -> DeltacellsCSRDataset:
        """The lazy matrix of rows ``positions`` of this one (an index as ``X[...]`` takes):
        nothing is read until it is sliced or computed, and then only those cells' tiles."""
        positions, _ = _normalize_rows(positions, self.shape[0])
        return self._showing(positions if self._rows is None else self._rows[positions])

    def _showing(self, rows: np.ndarray | None,
                 values_dtype: np.dtype | None = None) -> DeltacellsCSRDataset:  # fmt: skip
        """This matrix's dataset and options, showing stored ``rows`` (None: every cell), its
        values as ``values_dtype`` (None: as this one's)."""
        dtype = self.dtype if values_dtype is None else values_dtype
        return DeltacellsCSRDataset(self.dataset, column_order=self.column_order,
                                    values_dtype=dtype, n_threads=self.n_threads,
                                    tile_cache_bytes=self.tile_cache_bytes,
                                    ranged_reads=self.ranged_reads, rows=rows)  # fmt: skip

    # -- blocks: the tiles, or runs of a row selection -----------------------------------------

    @property
    def n_blocks(self) -> int:
        """Blocks the matrix is computed in: its tiles, or for a row selection, runs of as
        many rows as a tile holds."""
        if self._rows is None:
            return self.dataset.manifest.n_tiles
        return -(-self.shape[0] // self._block_rows())

    def _block_rows(self) -> int:
        return max(1, int(self.dataset.manifest.tile_size))

    def block_length(self, index: int) -> int:
        """Rows of block ``index``."""
        if self._rows is None:
            return int(self.dataset.manifest.tile_cells[index])
        size = self._block_rows()
        return min(self.shape[0], (index + 1) * size) - index * size

    def block_matrix(self, index: int) -> sp.csr_matrix:
        """Block ``index`` as CSR: tile ``index``, or the ``index``-th run of selected rows."""
        if self._rows is None:
            return self.tile_matrix(index)
        size = self._block_rows()
        return self.get_rows(np.arange(index * size, index * size + self.block_length(index),
                                       dtype=np.int64))  # fmt: skip

    # -- tiles ---------------------------------------------------------------------------------

    def tile(self, index: int) -> Tile:
        """Tile ``index``, parsed and validated once, then served from the cache."""
        return self.tiles([index])[0]

    def tiles(self, indices: Sequence[int]) -> list[Tile]:
        """Several tiles; those not cached are fetched (from remote stores concurrently, in
        background threads) and validated (CRC, structure) as they arrive, each with all
        decoding threads."""
        wanted = [int(t) for t in indices]
        found: dict[int, Tile] = {}
        with self._lock:
            for t in dict.fromkeys(wanted):
                tile = self._cache.get(t)
                if tile is not None:
                    self._cache.move_to_end(t)
                    found[t] = tile
        missing = [t for t in dict.fromkeys(wanted) if t not in found]
        if len(missing) > 1 and not self.dataset.store.is_local:
            sizes = [self.dataset.manifest.tile_bytes[t] for t in missing]
            futures = self.dataset.store.prefetch([tile_name(t) for t in missing], sizes)
            for t, future in zip(missing, futures.values(), strict=True):
                blob = future.result()
                found[t] = self.dataset.tile(t, n_threads=self.n_threads, blob=blob)
                self._remember(t, found[t])
        elif len(missing) > 1 and (threads := effective_n_threads(self.n_threads)) > 1:
            # Local files: a thread per tile reads and checks it (reading is a single-threaded
            # copy from the page cache; side by side they take ~20% less time than in turn
            # with the CRC split over threads).
            loaded = _pool("local", threads).map(
                lambda t: self.dataset.tile(t, n_threads=1), missing)
            for t, tile in zip(missing, loaded, strict=True):
                found[t] = tile
                self._remember(t, tile)
        else:
            for t in missing:
                found[t] = self.dataset.tile(t, n_threads=self.n_threads)
                self._remember(t, found[t])
        # Tiles this call loaded are returned even if the cache already evicted them.
        return [found[t] for t in wanted]

    def _remember(self, index: int, tile: Tile) -> None:
        with self._lock:
            if index in self._cache:  # another thread loaded it meanwhile
                return
            self._cache[index] = tile
            self._cached_bytes += tile.nbytes
            while self._cached_bytes > self.tile_cache_bytes and len(self._cache) > 1:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= old.nbytes

    # -- reading -------------------------------------------------------------------------------

    def get_rows(self, rows: np.ndarray) -> sp.csr_matrix:
        """Cells ``rows`` (int64 positions, any order, repeats allowed) as CSR.

        Every touched tile decodes its rows straight into their places in one output. With
        ``ranged_reads``, only the chunks holding the rows are fetched instead.
        """
        n_genes = self.shape[1]
        if self._rows is not None:
            rows = self._rows[rows]
        if rows.size == 0:
            return sp.csr_matrix((0, n_genes), dtype=self.dtype)
        if self.ranged_reads:
            return self._get_rows_ranged(rows)
        return self._get_rows_whole(rows)

    def _get_rows_whole(self, rows: np.ndarray) -> sp.csr_matrix:
        n_genes = self.shape[1]
        touched, groups, local = group_by_tile(rows, self._limits)
        tiles = self.tiles(touched.tolist())
        return gather_cells(tiles, groups, local, n_genes, self.dtype, self.n_threads,
                            self._to_source)  # fmt: skip

    def _get_rows_ranged(self, rows: np.ndarray) -> sp.csr_matrix:
        """Rows by ranged reads of the chunks holding them (header, chunk table, indptr slice
        and frames of each run of touched chunks; see :class:`~deltacells.store.ranged.RangedTile`).
        Every piece is checked against the tiles' chunk checksums; a dataset written before
        them is read by whole tiles instead (their CRC-32 is the only check there is)."""
        from deltacells.store.ranged import RangedTile

        m = self.dataset.manifest
        store = self.dataset.store
        sums = self.dataset.tile_sums
        if sums is None:
            return self._get_rows_whole(rows)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        tile_of = np.searchsorted(self._limits, ordered, side="right")
        # Tiles where the rows likely touch most chunks are read whole: one request instead
        # of a chain of three (header, indptr, frames) for about the same bytes. Which chunks
        # the rows touch is estimated from their positions (chunks hold about equal shares of
        # a tile's cells), so rows clustered in a few chunks, as a box query's are in spatial
        # order, stay ranged however many they are.
        n_chunks = max(m.n_chunks, 1)
        cells_per_tile = np.maximum(np.asarray(m.tile_cells, dtype=np.int64), 1)
        chunks_per_tile = np.minimum(n_chunks, cells_per_tile)
        near_chunk = ((ordered - self._starts[tile_of]) * chunks_per_tile[tile_of]
                      // cells_per_tile[tile_of])  # fmt: skip
        touched = np.unique(tile_of * n_chunks + near_chunk)  # near_chunk < n_chunks
        touched_per_tile = np.bincount(touched // n_chunks, minlength=len(chunks_per_tile))
        whole = (touched_per_tile > 0.5 * chunks_per_tile)[tile_of]
        if whole.all():
            return self._get_rows_whole(rows)

        def plan(t: int):
            local = ordered[tile_of == t] - self._starts[t]
            ranged = RangedTile(store, tile_name(t), m.tile_bytes[t], checksums=lambda header:
                                sums.row(t, header, store.read_range, store.describe))  # fmt: skip
            chunk_ends = ranged.chunk_table()[:, 1].astype(np.int64)
            chunk_of = np.searchsorted(chunk_ends, local, side="right")
            # Runs of consecutive touched chunks are read together: local is sorted, so each
            # run's rows are one stretch of it.
            heads = np.flatnonzero(np.diff(chunk_of, prepend=-2) > 1)
            tails = np.append(heads[1:], len(local)) - 1
            runs = np.stack([local[heads], local[tails] + 1], axis=1)
            return ranged.plan(runs), np.diff(np.append(heads, len(local))), local

        ranged_tiles = [int(t) for t in np.unique(tile_of[~whole])]
        # Three rounds, each concurrent over every tile on remote stores: header and chunk
        # table, indptr, then all frame ranges; so a read costs about three round trips.
        each = (map if store.is_local or len(ranged_tiles) < 2
                else _pool("ranged", RANGED_REQUESTS_IN_FLIGHT).map)  # fmt: skip
        plans = list(each(plan, ranged_tiles))
        if store.is_local:  # a tile's requests in one call: its file opened once
            fetched = [p.fetch_all() for p, *_ in plans]
        else:
            jobs = [(i, key) for i, (p, *_) in enumerate(plans) for key, _ in p.requests()]
            blobs = list(each(lambda job: plans[job[0]][0].fetch(job[1]), jobs))
            fetched = [{} for _ in plans]
            for (i, key), blob in zip(jobs, blobs, strict=True):
                fetched[i][key] = blob
        # Several tiles: a thread per tile, each assembling and gathering on one thread (a
        # tile's few rows rarely fill more than one chunk; the decoding of one tile, which
        # releases the GIL, overlaps the checks of another).
        threads = effective_n_threads(self.n_threads)
        per_tile = len(plans) > 1 and threads > 1

        def build(item) -> sp.csr_matrix:
            (p, run_sizes, local), got = item
            # The tile's runs as one small tile: one parse and one gather of just the rows.
            mini, shifts = p.assemble_one(got)
            rows = local + np.repeat(shifts, run_sizes)
            return mini.gather(rows, self.dtype, n_threads=1 if per_tile else threads,
                               col_map=self._to_source)  # fmt: skip

        items = zip(plans, fetched, strict=True)
        pieces = list(_pool("local", threads).map(build, items) if per_tile else map(build, items))
        if whole.any():  # rows of whole tiles first, then the ranged ones, each in order
            pieces.insert(0, self._get_rows_whole(ordered[whole]))
            ordered_rank = np.concatenate([np.flatnonzero(whole), np.flatnonzero(~whole)])
            order = order[ordered_rank]
        matrix = sp.vstack(pieces, format="csr") if len(pieces) > 1 else pieces[0]
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return matrix[inverse]

    def __getitem__(self, index: Any) -> sp.csr_matrix | float:
        """Rows and columns the way scipy and anndata index a CSR matrix."""
        if isinstance(index, tuple):
            if len(index) == 1:
                row_index, col_index = index[0], slice(None)
            elif len(index) == 2:
                row_index, col_index = index
            else:
                raise IndexError(f"too many indices ({len(index)}) for a 2-D matrix")
        else:
            row_index, col_index = index, slice(None)
        by_genes = self._through_gene_major(row_index, col_index)
        if by_genes is not None:
            return by_genes
        # anndata views pass np.ix_ grids, (n, 1) rows and (1, m) columns: an outer selection.
        if isinstance(row_index, np.ndarray) and row_index.ndim == 2:
            rows, _ = _normalize_rows(row_index.ravel(), self.shape[0])
            return self.get_rows(rows)[:, _as_positions(np.asarray(col_index).ravel())]
        rows, scalar_row = _normalize_rows(row_index, self.shape[0])
        matrix = self.get_rows(rows)
        if _is_sequence(row_index) and _is_sequence(col_index):
            # Two 1-D index arrays select points, as in scipy (anndata views pass ix_ grids).
            return matrix[np.arange(len(rows)), _as_positions(col_index)]
        if scalar_row:
            return matrix[0, col_index] if not isinstance(col_index, slice) else matrix
        if isinstance(col_index, slice) and col_index == slice(None):
            return matrix
        if not isinstance(col_index, slice | int | np.integer):
            col_index = _as_positions(col_index)
        return matrix[:, col_index]

    #: Most columns read through the gene-major companion; beyond that scanning the tiles
    #: (which hold all genes of a cell) is cheaper.
    GENE_MAJOR_MAX_COLUMNS = 64

    def _through_gene_major(self, row_index: Any, col_index: Any) -> sp.csr_matrix | None:
        """All cells of a few genes from the gene-major companion, when the dataset has one
        (``adata[:, "CD3E"].X``); None when that does not apply."""
        if not (isinstance(row_index, slice) and row_index == slice(None)):
            return None
        if isinstance(col_index, slice) or self.dataset.manifest.metadata.get(
                "gene_major") is None:  # fmt: skip
            return None
        columns = np.asarray(col_index).ravel()
        if columns.dtype == bool:
            if len(columns) != self.shape[1]:
                return None
            columns = np.flatnonzero(columns)
        if columns.dtype.kind not in "iu" or not 0 < len(columns) <= self.GENE_MAJOR_MAX_COLUMNS:
            return None
        columns = np.where(columns < 0, columns + self.shape[1], columns)
        if columns.min() < 0 or columns.max() >= self.shape[1]:
            raise IndexError(f"column index out of range for {self.shape[1]} genes")
        matrix = self.dataset.genes(columns.tolist(), values_dtype=self.dtype,
                                    column_order=self.column_order)  # fmt: skip
        return matrix.tocsr() if self._rows is None else matrix.tocsr()[self._rows]

    def tile_matrix(self, index: int) -> sp.csr_matrix:
        """All cells of tile ``index`` as CSR (columns in the requested order)."""
        tile = self.tile(index)
        return tile.decode(self.dtype, n_threads=self.n_threads, col_map=self._to_source)

    def to_dask(self):
        """A dask array with one chunk per tile, each a scipy CSR matrix (dask is optional).

        scanpy's dask-aware functions (``normalize_total``, ``log1p``,
        ``highly_variable_genes``, ``pca``) then run out of core, tile by tile.
        """
        try:
            import dask
            import dask.array as da
        except ImportError as err:  # pragma: no cover - exercised without the extra
            raise ImportError("to_dask needs dask: pip install 'deltacells[dask]'") from err
        meta = sp.csr_matrix((0, self.shape[1]), dtype=self.dtype)
        # Keys named from the stored data's identity: the same dataset gives the same graph,
        # and dask never pickles this object to name a task (unpickling reopens the dataset).
        token = dask.base.tokenize(self)
        decode = dask.delayed(_decode_tile, name=f"deltacells-decode-{token}", pure=True)
        blocks = [
            da.from_delayed(
                decode(self, t, dask_key_name=f"deltacells-tile-{token}-{t}"),
                shape=(self.block_length(t), self.shape[1]),
                dtype=self.dtype,
                meta=meta,
            )
            for t in range(self.n_blocks)
        ]
        if not blocks:
            return da.from_array(meta, chunks=meta.shape, meta=meta)
        return da.concatenate(blocks, axis=0)

    # -- what AnnData and numpy-style code ask of a matrix -----------------------------------

    ndim = 2

    def copy(self) -> DeltacellsCSRDataset:
        """A lazy copy (``AnnData.copy()`` keeps X lazy): the stored data never changes, so
        the copy shares the opened dataset and starts with an empty tile cache."""
        return self._showing(self._rows)

    def astype(self, dtype: DTypeLike, copy: bool = True) -> Any:
        """X with its values as ``dtype``, still lazy (what ``scanpy.pp.normalize_total`` asks
        of integer counts before it normalises).

        ``int32``, ``float32`` and ``float64`` give a lazy matrix of the same rows that decodes
        straight into that dtype (as ``read_deltacells(values_dtype=...)`` would); other dtypes
        give the dask array over tiles, cast (with the ``dask`` extra). Without ``copy``, a
        matrix already of ``dtype`` is returned itself.
        """
        dtype = np.dtype(dtype)
        if dtype in VALUE_DTYPES:
            return self if dtype == self.dtype and not copy else self._showing(self._rows, dtype)
        return self._as_dask_for(f"X.astype({dtype})").astype(dtype)

    def _tile_reduce(self, per_tile: Callable[[sp.csr_matrix], np.ndarray]) -> list:
        return [per_tile(self.block_matrix(b)) for b in range(self.n_blocks)]

    def count_nonzero(self, axis: int | None = None) -> Any:
        """Stored nonzeros in all, per gene (``axis=0``) or per cell (``1``), tile by tile
        (int64; what scipy's ``getnnz`` gives)."""
        return _count_nonzero_of(self, axis)

    def sum(self, axis: int | None = None, dtype: DTypeLike = None, out: Any = None) -> Any:
        """Sum over all values (``axis=None``), per gene (``0``) or per cell (``1``), computed
        tile by tile in bounded memory. Results are shaped as scipy's ``csr_matrix.sum``:
        a scalar or an ``np.matrix`` of one row or column (written into ``out`` if given, as
        ``numpy.sum`` asks)."""
        return _into(self._sum(axis, dtype), out)

    def _sum(self, axis: int | None, dtype: DTypeLike) -> Any:
        if axis not in (None, 0, 1, -1, -2):
            raise ValueError(f"axis must be None, 0 or 1, not {axis!r}")
        out_dtype = np.dtype(dtype) if dtype is not None else (
            np.dtype(np.int64) if self.dtype.kind == "i" else np.dtype(np.float64))  # fmt: skip
        if axis is None:
            return out_dtype.type(sum(self._tile_reduce(lambda m: m.data.sum(dtype=out_dtype))))
        if axis in (0, -2):
            total = np.zeros(self.shape[1], dtype=out_dtype)
            for part in self._tile_reduce(lambda m: np.asarray(m.sum(axis=0, dtype=out_dtype))):
                total += part.ravel()
            # np.matrix as scipy's sums give it, made as scipy makes it (a view): no
            # PendingDeprecationWarning for np.matrix(...) on each sum.
            return total[np.newaxis, :].view(np.matrix)
        parts = self._tile_reduce(lambda m: np.asarray(m.sum(axis=1, dtype=out_dtype)).ravel())
        column = np.concatenate(parts) if parts else np.zeros(0, dtype=out_dtype)
        return column[:, np.newaxis].view(np.matrix)

    def mean(self, axis: int | None = None, dtype: DTypeLike = None, out: Any = None) -> Any:
        """Mean over all values, per gene (``axis=0``) or per cell (``1``), zeros included,
        shaped as scipy's ``csr_matrix.mean``."""
        total = self._sum(axis, dtype if dtype is not None else np.float64)
        count = {None: self.shape[0] * self.shape[1], 0: self.shape[0], -2: self.shape[0],
                 1: self.shape[1], -1: self.shape[1]}[axis]  # fmt: skip
        return _into(total / max(count, 1), out)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(_LAZY_ADVICE.format(what="converting X to a numpy array"))

    def _as_dask_for(self, what: str) -> Any:
        """The dask array over tiles that answers ``what``, or the advice without dask."""
        if dask_array_type() is None:
            raise TypeError(_LAZY_ADVICE.format(what=what) + _NO_DASK)
        return self.to_dask()

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        # numpy hands its functions to this method when an argument is a lazy X.
        # ``anndata.concat`` joins matrices it does not know with ``np.concatenate``.
        if func is np.concatenate:
            return _concatenate(*args, **kwargs)
        if func is np.sum:
            return _reduce_with(DeltacellsCSRDataset.sum, *args, **kwargs)
        if func is np.mean:
            return _reduce_with(DeltacellsCSRDataset.mean, *args, **kwargs)
        if func is np.nansum or func is np.nanmean:
            return _nan_reduce(func, *args, **kwargs)
        # Anything else (np.count_nonzero, ...) runs on the dask array over tiles.
        self._as_dask_for(f"numpy.{func.__name__} on X")
        return func(*_swap_lazy(args), **_swap_lazy(kwargs))

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        # np.log1p(X), X > 0 written as np.greater(...): lazily, on the dask array. The
        # stored matrix cannot be written to: refuse instead of leaving X unchanged.
        if any(isinstance(o, DeltacellsCSRDataset) for o in kwargs.get("out", ()) or ()):
            raise TypeError(_LAZY_ADVICE.format(what=f"numpy.{ufunc.__name__} into X (out=X)"))
        self._as_dask_for(f"numpy.{ufunc.__name__} on X")
        return getattr(ufunc, method)(*_swap_lazy(inputs), **_swap_lazy(kwargs))

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this class lacks: numpy and scipy methods scanpy and
        # others call on an in-memory X. Say what to do instead of a confusing failure later.
        if name.startswith("__") or name in ("dataset", "_cache", "_lock"):
            raise AttributeError(name)
        raise AttributeError(_LAZY_ADVICE.format(what=f"X.{name}"))

    def to_memory(self) -> sp.csr_matrix:
        """The whole matrix as one CSR, every tile decoded into one set of buffers."""
        if self._rows is not None:
            return self.get_rows(np.arange(self.shape[0], dtype=np.int64))
        m = self.dataset.manifest
        # What is allocated next is what the manifest claims, bounded by the reader's limits
        # per tile byte: make sure those bytes exist before believing the claim.
        self.dataset.check_tile_sizes()
        nnz = m.nnz
        indices = empty_output(nnz, np.int32)
        values = empty_output(nnz, self.dtype)
        indptr = np.zeros(m.n_cells + 1, dtype=np.int64)
        offset = 0
        store = self.dataset.store
        # Remote tiles are fetched a few ahead while the current one decodes; local reads are
        # quick next to decoding and would only contend with it for the cores.
        window = 0 if store.is_local else 4

        def fetch(tiles: range) -> dict:
            return store.prefetch([tile_name(t) for t in tiles], [m.tile_bytes[t] for t in tiles])

        futures = fetch(range(min(window, m.n_tiles)))
        for t in range(m.n_tiles):
            if window and t + window < m.n_tiles:
                futures |= fetch(range(t + window, t + window + 1))
            with self._lock:
                tile = self._cache.get(t)
            if tile is None:
                blob = futures.pop(tile_name(t)).result() if window else None
                tile = self.dataset.tile(t, n_threads=self.n_threads, blob=blob)
            end = offset + tile.nnz
            # Source order: each chunk is renumbered right after it is decoded, while in cache.
            tile.decode_into(indices[offset:end], values[offset:end], n_threads=self.n_threads,
                             col_map=self._to_source)  # fmt: skip
            start = int(self._starts[t])
            indptr[start + 1 : start + tile.shape[0] + 1] = tile.indptr[1:] + offset
            offset += tile.nnz
        matrix = sp.csr_matrix((values, indices, indptr), shape=self.shape, copy=False)
        matrix.has_canonical_format = True
        return matrix


def _operator_through_dask(name: str) -> Callable:
    def operator(self: DeltacellsCSRDataset, *args: Any) -> Any:
        dask_x = self._as_dask_for("arithmetic or comparisons on X")
        return getattr(dask_x, name)(*_swap_lazy(args))

    operator.__name__ = name
    operator.__doc__ = f"``{name}`` on the dask array over tiles (lazy, as dask is)."
    return operator


# Arithmetic and comparisons (``X > 0`` in scanpy's filters) are lazy dask arrays.
for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__pow__", "__matmul__", "__rmatmul__",
              "__gt__", "__ge__", "__lt__", "__le__", "__neg__", "__abs__"):  # fmt: skip
    setattr(DeltacellsCSRDataset, _name, _operator_through_dask(_name))
del _name

#: Small ranged requests in flight at once on remote stores: each is mostly latency, so many
#: overlap (whole-tile reads use the store's own, smaller pool).
RANGED_REQUESTS_IN_FLIGHT = 64
_pools: dict[str, tuple[int, int, Any]] = {}


def _pool(name: str, size: int):
    """The thread pool ``name`` of ``size`` threads: ``"ranged"`` for ranged requests,
    ``"local"`` for reading and checking local tiles side by side (one per process and size:
    forks make their own)."""
    from concurrent.futures import ThreadPoolExecutor

    key = (os.getpid(), size)
    if _pools.get(name, (None, None))[:2] != key:
        _pools[name] = (*key, ThreadPoolExecutor(size, thread_name_prefix=f"deltacells-{name}"))
    return _pools[name][2]


def _decode_tile(matrix: DeltacellsCSRDataset, index: int) -> sp.csr_matrix:
    """One dask task: block ``index`` of ``matrix`` (a plain function, so that dask names the
    task by the matrix's token instead of pickling a bound method)."""
    return matrix.block_matrix(index)


def _concatenate(
    arrays: Sequence[Any], axis: int | None = 0, out: Any = None, **kwargs: Any
) -> Any:
    """``np.concatenate`` with lazy matrices among ``arrays``.

    All lazy (or dask): a lazy dask array, one chunk per tile, so concatenating datasets
    reads nothing until the result is computed. Any operand already in memory: the result
    is in memory too (as anndata does when it mixes dask and in-memory matrices), a CSR
    matrix built tile by tile without a dense copy.
    """
    if out is not None or kwargs or axis not in (0, 1, -1, -2):
        raise TypeError(_LAZY_ADVICE.format(what="numpy.concatenate with these options on X"))
    arrays = list(arrays)
    axis = axis % 2
    try:
        import dask.array as da
    except ImportError:  # pragma: no cover - dask is optional
        da = None
    if da is not None and all(isinstance(a, DeltacellsCSRDataset | da.Array) for a in arrays):
        return da.concatenate([a.to_dask() if isinstance(a, DeltacellsCSRDataset) else a
                               for a in arrays], axis=axis)  # fmt: skip
    parts = []
    for a in arrays:
        if isinstance(a, DeltacellsCSRDataset):
            a = a.to_memory()
        elif da is not None and isinstance(a, da.Array):
            a = a.compute()
        parts.append(a if sp.issparse(a) else sp.csr_matrix(np.asarray(a)))
    return (sp.vstack, sp.hstack)[axis](parts, format="csr")


def _reduce_with(
    method: Callable,
    a: Any,
    axis: int | None = None,
    dtype: DTypeLike = None,
    out: Any = None,
    keepdims: bool = False,
    **kwargs: Any,
) -> Any:
    """``np.sum`` / ``np.mean`` on a lazy X: the tile-by-tile reductions, shaped as scipy's
    (or, with ``keepdims``, as numpy's for a 2-D array: ``(1, 1)``, ``(1, n)`` or
    ``(m, 1)``)."""
    if kwargs:
        raise TypeError(_LAZY_ADVICE.format(what=f"a reduction with {sorted(kwargs)} on X"))
    if not keepdims:
        return method(a, axis=axis, dtype=dtype, out=out)
    kept = np.asarray(method(a, axis=axis, dtype=dtype))  # (1, n) or (m, 1) for an axis
    return _into(kept.reshape(1, 1) if axis is None else kept, out)


def _nan_reduce(func: Callable, a: Any, axis: int | None = None, dtype: DTypeLike = None,
                out: Any = None, keepdims: bool = False, **kwargs: Any) -> Any:
    """``np.nansum`` / ``np.nanmean`` on a lazy X (scanpy's ``score_genes`` takes
    ``np.nanmean`` of any X it does not know): stored counts are never NaN, so these are the
    tile-by-tile sum and mean, shaped as numpy gives them for an array (a scalar, or one
    value per gene or per cell), not as scipy's ``np.matrix``."""
    method = DeltacellsCSRDataset.sum if func is np.nansum else DeltacellsCSRDataset.mean
    result = _reduce_with(method, a, axis=axis, dtype=dtype, keepdims=keepdims, **kwargs)
    if axis is not None and not keepdims:
        result = np.asarray(result).ravel()
    return _into(result, out)


def _into(result: Any, out: Any) -> Any:
    """``result``, or ``out`` holding it when numpy passed an output array."""
    if out is None:
        return result
    out[...] = np.asarray(result).reshape(np.shape(out))
    return out


_LAZY_ADVICE = (
    "deltacells: {what} needs the matrix in memory, but X is read lazily. Use "
    "adata.to_memory() (or adata.X.to_memory()) first, or read_deltacells(..., dask=True) "
    "for scanpy's out-of-core (dask) functions."
)
_NO_DASK = " (scanpy runs this out of core on dask: pip install 'deltacells[dask]')"


def _count_nonzero_of(matrix: Any, axis: int | None) -> Any:
    """``getnnz(axis)`` of a lazy matrix, tile by tile (see :meth:`_tile_reduce`)."""
    if axis not in (None, 0, 1, -1, -2):
        raise ValueError(f"axis must be None, 0 or 1, not {axis!r}")
    if axis is None:
        return int(sum(matrix._tile_reduce(lambda m: m.nnz)))
    if axis in (0, -2):
        total = np.zeros(matrix.shape[1], dtype=np.int64)
        for part in matrix._tile_reduce(lambda m: m.getnnz(axis=0)):
            total += part
        return total
    parts = matrix._tile_reduce(lambda m: m.getnnz(axis=1).astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _swap_lazy(value: Any) -> Any:
    return swap_lazy(value, DeltacellsCSRDataset, DeltacellsCSRDataset.to_dask)
