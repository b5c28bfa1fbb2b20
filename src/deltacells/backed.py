"""``read_deltacells``: a dataset as an AnnData whose X decodes only the tiles a slice touches."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp
from anndata.abc import CSRDataset
from numpy.typing import DTypeLike

from deltacells.codec import Tile, _value_dtype, empty_output
from deltacells.dataset import (
    Dataset,
    gather_cells,
    group_by_tile,
    open_dataset,
    reopen_dataset,
)
from deltacells.format import FormatError, LimitError, get_limits
from deltacells.manifest import MANIFEST_NAME, StoredParts, tile_name
from deltacells.obs_dtypes import restore_dtypes
from deltacells.obscache import ObsCache
from deltacells.outofcore import (
    OutOfCoreAnnData,
    dask_array_type,
    join_dispatchers,
    swap_lazy,
)

__all__ = ["DeltacellsCSRDataset", "read_deltacells", "written_values_dtype"]

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
        written (:func:`~deltacells.backed.written_values_dtype`).
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
        self._to_source = None if order is None else order.astype(np.int64)
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

    def _showing(self, rows: np.ndarray | None) -> DeltacellsCSRDataset:
        """This matrix's dataset and options, showing stored ``rows`` (None: every cell)."""
        return DeltacellsCSRDataset(self.dataset, column_order=self.column_order,
                                    values_dtype=self.dtype, n_threads=self.n_threads,
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
        else:  # local reads take a fraction of the validation: threads would only contend
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
        and frames of each run of touched chunks; see :class:`~deltacells.ranged.RangedTile`).
        Every piece is checked against the tiles' chunk checksums; a dataset written before
        them is read by whole tiles instead (their CRC-32 is the only check there is)."""
        from deltacells.ranged import RangedTile

        m = self.dataset.manifest
        store = self.dataset.store
        sums = self.dataset.tile_sums
        if sums is None:
            return self._get_rows_whole(rows)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        tile_of = np.searchsorted(self._limits, ordered, side="right")
        # Tiles where the rows likely touch most chunks are read whole: one request instead
        # of a chain of three (header, indptr, frames) for about the same bytes.
        tiles, rows_per_tile = np.unique(tile_of, return_counts=True)
        chunks = max(m.n_chunks, 1)
        likely_touched = 1.0 - (1.0 - 1.0 / chunks) ** rows_per_tile
        whole = np.isin(tile_of, tiles[likely_touched > 0.5])
        if whole.all():
            return self._get_rows_whole(rows)

        def plan(t: int):
            local = ordered[tile_of == t] - self._starts[t]
            ranged = RangedTile(store, tile_name(t), m.tile_bytes[t], checksums=lambda header:
                                sums.row(t, header, store.read_range, store.describe))  # fmt: skip
            chunk_ends = ranged.chunk_table()[:, 1].astype(np.int64)
            chunk_of = np.searchsorted(chunk_ends, local, side="right")
            # Runs of consecutive touched chunks are read together.
            touched = np.unique(chunk_of)
            breaks = np.flatnonzero(np.diff(touched) > 1) + 1
            selections = [local[(chunk_of >= run[0]) & (chunk_of <= run[-1])]
                          for run in np.split(touched, breaks)]  # fmt: skip
            return ranged.plan([(int(r[0]), int(r[-1]) + 1) for r in selections]), selections

        ranged_tiles = [int(t) for t in np.unique(tile_of[~whole])]
        # Three rounds, each concurrent over every tile on remote stores: header and chunk
        # table, indptr, then all frame ranges; so a read costs about three round trips.
        each = map if store.is_local or len(ranged_tiles) < 2 else _ranged_pool().map
        plans = list(each(plan, ranged_tiles))
        jobs = [(i, key) for i, (p, _) in enumerate(plans) for key, _ in p.requests()]
        blobs = list(each(lambda job: plans[job[0]][0].fetch(job[1]), jobs))
        fetched: list[dict[int, bytes]] = [{} for _ in plans]
        for (i, key), blob in zip(jobs, blobs, strict=True):
            fetched[i][key] = blob
        per_tile = []
        for (p, selections), got in zip(plans, fetched, strict=True):
            pieces_of_tile = p.assemble(got)
            per_tile.append([tile.decode(self.dtype, col_map=self._to_source)[rows - first]
                             for (tile, first), rows in zip(pieces_of_tile, selections,
                                                            strict=True)])  # fmt: skip
        pieces = [piece for part in per_tile for piece in part]
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
            return np.asmatrix(total)
        parts = self._tile_reduce(lambda m: np.asarray(m.sum(axis=1, dtype=out_dtype)).ravel())
        column = np.concatenate(parts) if parts else np.zeros(0, dtype=out_dtype)
        return np.asmatrix(column).T

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
_ranged_executor: tuple[int, Any] | None = None


def _ranged_pool():
    """The thread pool for ranged requests (one per process: forks make their own)."""
    global _ranged_executor
    from concurrent.futures import ThreadPoolExecutor

    if _ranged_executor is None or _ranged_executor[0] != os.getpid():
        _ranged_executor = (os.getpid(), ThreadPoolExecutor(
            RANGED_REQUESTS_IN_FLIGHT, thread_name_prefix="deltacells-ranged"))  # fmt: skip
    return _ranged_executor[1]


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
    **kwargs: Any,
) -> Any:
    """``np.sum`` / ``np.mean`` on a lazy X: the tile-by-tile reductions."""
    if kwargs:
        raise TypeError(_LAZY_ADVICE.format(what=f"a reduction with {sorted(kwargs)} on X"))
    return method(a, axis=axis, dtype=dtype, out=out)


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


def write_lazy_csr(f: Any, key: str, elem: DeltacellsCSRDataset, *, _writer: Any = None,
                   dataset_kwargs: Any = None) -> None:  # fmt: skip
    """Write a lazy X as anndata's ``csr_matrix`` encoding into an h5py or zarr group, tile by
    tile: memory holds one decoded tile, whatever the matrix size."""
    import h5py

    kwargs = dict(dataset_kwargs or {})
    group = f.require_group(key)
    group.attrs["shape"] = elem.shape
    nnz = elem.nnz
    columns = {"data": (nnz, elem.dtype), "indices": (nnz, np.dtype(np.int32)),
               "indptr": (elem.shape[0] + 1, np.dtype(np.int64))}  # fmt: skip
    if isinstance(group, h5py.Group):
        arrays = {name: group.create_dataset(name, shape=(n,), dtype=dtype, **kwargs)
                  for name, (n, dtype) in columns.items()}  # fmt: skip
    else:
        arrays = {name: group.create_array(name, shape=(n,), dtype=dtype, **kwargs)
                  for name, (n, dtype) in columns.items()}  # fmt: skip
    offset, row = 0, 0
    arrays["indptr"][0:1] = np.zeros(1, dtype=np.int64)
    for t in range(elem.n_blocks):
        matrix = elem.block_matrix(t)
        end = offset + matrix.nnz
        if matrix.nnz:
            arrays["data"][offset:end] = matrix.data
            arrays["indices"][offset:end] = matrix.indices
        rows = matrix.shape[0]
        arrays["indptr"][row + 1 : row + rows + 1] = matrix.indptr[1:] + offset
        offset, row = end, row + rows


def _register_with_anndata() -> None:
    """Let anndata materialize and write our X.

    anndata dispatches ``to_memory`` on its own backed classes only (not on
    ``anndata.abc.CSRDataset``), so an AnnData holding our X would keep it lazy, and its IO
    registry has no writer for it. Both are internal to anndata: if they move,
    ``AnnData.to_memory()`` keeps X lazy and ``write_h5ad`` refuses it, while
    ``adata.X.to_memory()`` still works.
    """
    try:
        from anndata._core.file_backing import to_memory
    except ImportError:  # pragma: no cover - anndata internals changed
        pass
    else:
        to_memory.register(DeltacellsCSRDataset)(lambda x, *, copy=False: x.to_memory())
    try:
        import h5py
        import zarr
        from anndata._io.specs.registry import _REGISTRY, IOSpec
    except ImportError:  # pragma: no cover - anndata internals changed
        return
    for group_type in (h5py.Group, zarr.Group):
        _REGISTRY.register_write(group_type, DeltacellsCSRDataset,
                                 IOSpec("csr_matrix", "0.1.0"))(write_lazy_csr)  # fmt: skip
    # The registry looks writers up by exact type: the AnnData we return writes as AnnData.
    for (dest, source, modifiers), writer in list(_REGISTRY.write.items()):
        if source is ad.AnnData:
            _REGISTRY.write[(dest, OutOfCoreAnnData, modifiers)] = writer
    if ad.AnnData in _REGISTRY.write_specs:
        _REGISTRY.write_specs[OutOfCoreAnnData] = _REGISTRY.write_specs[ad.AnnData]


_register_with_anndata()
OutOfCoreAnnData.lazy_matrix_type = DeltacellsCSRDataset


def _axis_sum_lazy(x: Any, /, *, axis: Any = None, dtype: DTypeLike = None) -> Any:
    # 1-D like scanpy's dask version (its callers square the result: no np.matrix here).
    total = x.sum(axis=axis, dtype=dtype)
    return total if axis is None else np.asarray(total).ravel()


def _register_with_fast_array_utils() -> None:
    """scanpy 1.12 computes its statistics with fast_array_utils, which dispatches on the
    array type and raises a bare ``NotImplementedError`` for types it does not know: sums of
    our X are computed tile by tile; anything else says what to do instead. Internal to
    fast_array_utils: if it moves, scanpy's error stays its own."""
    try:
        from fast_array_utils.stats._generic_ops import generic_op
    except ImportError:  # not installed (scanpy < 1.12), or its internals moved
        return

    @generic_op.register(DeltacellsCSRDataset)
    def _generic_op_lazy(x: DeltacellsCSRDataset, /, op: str, *, axis: Any = None,
                         dtype: Any = None, keep_cupy_as_array: bool = False) -> Any:  # fmt: skip
        if op == "sum":
            return _axis_sum_lazy(x, axis=axis, dtype=dtype)
        raise TypeError(_LAZY_ADVICE.format(what=f"the {op} of X"))


_register_with_fast_array_utils()


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


class TileMapped:
    """A function of each decoded tile of a lazy X (``X * X`` for a variance), reduced tile
    by tile by the statistics scanpy dispatches (``axis_sum``, ``axis_nnz``) and otherwise
    handed to scanpy as its dask array. Not an AnnData matrix: made only by
    :func:`_register_with_scanpy`'s ``elem_mul``."""

    ndim = 2

    def __init__(self, base: DeltacellsCSRDataset, function: Callable, dtype: Any) -> None:
        self.base, self.function, self.dtype = base, function, np.dtype(dtype)
        self.shape = base.shape

    def _tile_reduce(self, per_tile: Callable[[sp.csr_matrix], Any]) -> list:
        return self.base._tile_reduce(lambda m: per_tile(self.function(m)))

    def sum(self, axis: int | None = None, dtype: DTypeLike = None, out: Any = None) -> Any:
        """Like :meth:`DeltacellsCSRDataset.sum`, of the mapped tiles."""
        return _into(DeltacellsCSRDataset._sum(self, axis, dtype), out)  # type: ignore[arg-type]

    def to_dask(self) -> Any:
        """The mapped tiles as a dask array (one chunk per tile)."""
        return self.base.to_dask().map_blocks(self.function, dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(_LAZY_ADVICE.format(what="converting X to a numpy array"))


def _swap_lazy(value: Any) -> Any:
    return swap_lazy(value, DeltacellsCSRDataset, DeltacellsCSRDataset.to_dask)


def _register_with_scanpy() -> None:
    """Where scanpy has a dask implementation of a dispatched function, our X uses it on
    its dask array over tiles (see :mod:`deltacells.outofcore`). Done once scanpy is
    imported (importing it for this would cost seconds), from :func:`read_deltacells`."""
    _register_tile_statistics()
    join_dispatchers(DeltacellsCSRDataset, DeltacellsCSRDataset.to_dask)
    join_dispatchers(TileMapped, TileMapped.to_dask)


def _register_tile_statistics() -> None:
    """scanpy's own statistics on the lazy X, reduced tile by tile: its dask versions of
    per-gene counts and sums concatenate every chunk first (a whole matrix in memory).
    scanpy 1.11 dispatches these in ``scanpy._utils``; later versions reach them through
    fast_array_utils (registered at import) or the same functions."""
    utils = sys.modules.get("scanpy._utils")
    if utils is None:
        return
    lazy_types = (DeltacellsCSRDataset, TileMapped)
    axis_nnz = getattr(utils, "axis_nnz", None)
    if axis_nnz is not None and hasattr(axis_nnz, "register"):
        for kind in lazy_types:
            if kind not in axis_nnz.registry:
                axis_nnz.register(kind)(lambda x, /, axis: _count_nonzero_of(x, axis))
    axis_sum = getattr(utils, "axis_sum", None)
    if axis_sum is not None and hasattr(axis_sum, "register"):
        for kind in lazy_types:
            if kind not in axis_sum.registry:
                axis_sum.register(kind)(_axis_sum_lazy)
    elem_mul = getattr(utils, "elem_mul", None)
    if elem_mul is not None and hasattr(elem_mul, "register") \
            and DeltacellsCSRDataset not in elem_mul.registry:  # fmt: skip

        @elem_mul.register(DeltacellsCSRDataset)
        def _elem_mul_lazy(x: DeltacellsCSRDataset, y: Any) -> Any:
            if y is x:  # the square of X, for a variance: stays tile by tile
                return TileMapped(x, lambda m: m.multiply(m).tocsr(), x.dtype)
            return elem_mul(x.to_dask(), _swap_lazy(y))


def read_deltacells(
    url_or_path: str | os.PathLike,
    *,
    obs: bool | Sequence[str] = True,
    column_order: str = "source",
    values_dtype: DTypeLike | None = None,
    storage_options: dict | None = None,
    cache_dir: str | os.PathLike | None = None,
    n_threads: int | None = None,
    tile_cache_bytes: int = 256 * 2**20,
    dask: bool = False,
    timeout: float | None = None,
    deadline: float | None = None,
    elements: bool | str = True,
    bbox: tuple[float, float, float, float] | None = None,
    bbox_mode: str = "intersects",
    row_order: str = "stored",
    ranged_reads: bool = False,
) -> ad.AnnData:
    """Open a deltacells dataset as an AnnData with a lazily decoded X.

    Parameters
    ----------
    url_or_path
        Local directory or fsspec URL of the dataset (format version 1 or 2).
    obs
        ``True`` for all obs columns, a list of column names, or ``False`` for obs_names only.
    column_order
        ``"source"`` (default): genes in the order they were written, with ``var`` in that
        order; ``"stored"``: the on-disk order (faster, no column permutation).
    values_dtype
        dtype of decoded values: ``float32``, ``float64`` or ``int32``. Default: the counts'
        dtype as written (int32 counts come back as int32, float32 as float32; see
        :func:`~deltacells.backed.written_values_dtype`), float32 for datasets that do not
        record it.
    storage_options
        fsspec options for URLs.
    cache_dir
        Where obs columns are cached (see :func:`~deltacells.obscache.cache_root`).
    n_threads
        Decoding threads; ``None`` resolves like scikit-learn.
    tile_cache_bytes
        Most bytes of parsed tiles kept in memory.
    dask
        Make X a dask array with one scipy-CSR chunk per tile (see
        :meth:`~deltacells.DeltacellsCSRDataset.to_dask`) instead of the lazy CSR dataset.
    timeout, deadline
        Remote stores: seconds one request may take before it is retried, and seconds one
        read may take in all, retries included (see :func:`~deltacells.open_dataset`).
    elements
        The rest of the AnnData, if the dataset stored it: count layers and raw as lazy
        matrices like X (always); obsm, varm, obsp, varp, uns and other layers read into
        memory (``True``), as dask arrays that read their chunks when computed (``"lazy"``;
        uns is read whole), or not at all (``False``).
    bbox, bbox_mode
        For a dataset written in spatial order: only the cells in the box (xmin, ymin, xmax,
        ymax), selected as :meth:`Dataset.query_bbox` does (``"intersects"``: the cell's
        shape touches the box, borders included; ``"centroid"``: its centroid is in the
        box). The result holds those cells only, in stored (spatial) order: their obs, the
        elements' rows, and X and count layers as lazy matrices of those rows
        (:meth:`~deltacells.DeltacellsCSRDataset.take_rows`) that decode only the tiles the
        cells are in.
    row_order
        ``"stored"`` (default): cells in the order they are stored (shuffled or spatial
        datasets store them in another order than written); ``"source"``: in the order they
        were written, undoing ``cell_order.npy`` (X stays lazy, a lazy matrix of the rows
        in that order, decoding only what a slice touches). The same for datasets stored in
        source order.
    ranged_reads
        Row selections fetch only the chunks holding the rows (the header, chunk table,
        indptr slice and frames of each tile touched) instead of whole tiles: fewer bytes for
        small or clustered selections, such as a box. Every structural and frame check still
        runs; the tile's CRC, which covers the whole tile, cannot (``verify`` checks it).

    Returns
    -------
    anndata.AnnData
        X is a :class:`DeltacellsCSRDataset` (or a dask array); obs and var are in memory.
    """
    _register_with_scanpy()
    dataset = open_dataset(url_or_path, storage_options=storage_options, timeout=timeout,
                           deadline=deadline)  # fmt: skip
    options = {
        "column_order": column_order,
        "values_dtype": values_dtype,
        "n_threads": n_threads,
        "tile_cache_bytes": tile_cache_bytes,
        "dask": dask,
        "ranged_reads": ranged_reads,
    }
    X = _lazy_matrix(dataset, options)
    var = _var(dataset, column_order)
    if row_order not in ("stored", "source"):
        raise ValueError(f"row_order must be 'stored' or 'source', not {row_order!r}")
    rows = None if bbox is None else dataset.query_bbox(bbox, mode=bbox_mode).rows
    cell_order = dataset.cell_order() if row_order == "source" else None
    if cell_order is not None:
        # Source row s is stored row inverse[s]: keep the selected rows, in source order.
        selected = np.arange(dataset.manifest.n_cells) if rows is None else rows
        rows = selected[np.argsort(cell_order[selected], kind="stable")]
    parts = _stored_parts(dataset, X, elements, options)
    # Written with layer=: the tiles hold that layer, and the AnnData's own X is an element.
    X = parts.pop("X", X)
    obs_frame = _obs(dataset, obs, cache_dir, rows)
    if rows is not None:
        # Only the selected cells are built: lazy matrices show those rows, elements are cut.
        X, parts = _take_rows(X, rows), _parts_of_rows(parts, rows)
    return OutOfCoreAnnData(X=X, obs=obs_frame, var=var, **parts)


def _take_rows(value: Any, rows: np.ndarray) -> Any:
    """Rows ``rows`` of a lazy matrix (still lazy), a dask array (still lazy), a DataFrame or
    an in-memory array."""
    if isinstance(value, DeltacellsCSRDataset):
        return value.take_rows(rows)
    if isinstance(value, pd.DataFrame):
        return value.iloc[rows]
    return value[rows]


def _parts_of_rows(parts: dict, rows: np.ndarray) -> dict:
    """:func:`_stored_parts` for the cells ``rows`` only (obsp on both axes)."""
    out = dict(parts)
    if "layers" in parts:
        out["layers"] = {k: _take_rows(v, rows) for k, v in parts["layers"].items()}
    if "raw" in parts:
        out["raw"] = {**parts["raw"], "X": _take_rows(parts["raw"]["X"], rows)}
    if "obsm" in parts:
        out["obsm"] = {k: _take_rows(v, rows) for k, v in parts["obsm"].items()}
    if "obsp" in parts:
        out["obsp"] = {k: _take_rows(_take_rows(v, rows).T, rows).T
                       for k, v in parts["obsp"].items()}  # fmt: skip
    return out


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


def _lazy_matrix(dataset: Dataset, options: dict) -> Any:
    matrix = DeltacellsCSRDataset(
        dataset, column_order=options["column_order"], values_dtype=options["values_dtype"],
        n_threads=options["n_threads"], tile_cache_bytes=options["tile_cache_bytes"],
        ranged_reads=options.get("ranged_reads", False),
    )  # fmt: skip
    return matrix.to_dask() if options["dask"] else matrix


def _stored_parts(dataset: Dataset, X: Any, elements: bool | str, options: dict) -> dict:
    """layers, raw, obsm, varm, obsp, varp and uns as AnnData takes them (see
    :mod:`deltacells.elements`); ``X`` is the AnnData's X, which a layer may be."""
    from deltacells.elements import read_elements

    where = dataset.store.describe(MANIFEST_NAME)
    parts = StoredParts.from_manifest(dataset.manifest, where)
    store = dataset.store
    out: dict[str, Any] = {}
    layers: dict[str, Any] = {}
    for name, location in parts.layers.items():
        if location == ".":
            layers[name] = X
            continue
        sub = dataset.open_nested(location)
        if sub.shape != dataset.shape:
            raise FormatError(f"{where}: layer {name!r} has shape {sub.shape}")
        layers[name] = _lazy_matrix(sub, options)
    if parts.raw == "raw":
        sub = dataset.open_nested(parts.raw)
        if sub.shape[0] != dataset.shape[0]:
            raise FormatError(f"{where}: raw has {sub.shape[0]} cells, X {dataset.shape[0]}")
        out["raw"] = {"X": _lazy_matrix(sub, options), "var": _var(sub, options["column_order"])}
    if elements and parts.elements:
        stored = read_elements(store, list(parts.elements), lazy=elements == "lazy",
                               files=dataset.files)  # fmt: skip
        layers |= stored.pop("layers", {})
        order = dataset.gene_order()
        if options["column_order"] == "stored" and order is not None:
            # varm and varp are stored in source gene order, like var.
            for key in ("varm", "varp"):
                stored[key] = {k: _take_genes(v, order, key == "varp")
                               for k, v in stored.get(key, {}).items()}  # fmt: skip
        out |= stored
    if layers:
        out["layers"] = layers
    return out


def _take_genes(value: Any, order: np.ndarray, both_axes: bool) -> Any:
    if isinstance(value, pd.DataFrame):
        return value.iloc[order]
    value = value[order]
    return value[:, order] if both_axes else value


def _var(dataset: Dataset, column_order: str) -> pd.DataFrame:
    var = dataset.var()
    if var is None:
        names = dataset.var_names()
        var = pd.DataFrame(index=pd.Index(names if names is not None else
                                          _default_var_names(dataset)))  # fmt: skip
    var.index = var.index.astype(str)
    order = dataset.gene_order()
    if column_order == "source" and order is not None:
        var = var.iloc[np.argsort(order)]
    return var


#: What a default gene name costs in memory, about (a short Python string and its pointer).
_NAME_BYTES = 64


def _default_var_names(dataset: Dataset) -> list[str]:
    """``"0" .. "n-1"`` for a dataset without stored gene names, once the tiles show that the
    manifest's gene count is in proportion to the bytes stored: a small manifest claiming 2^31
    genes must not make this build two billion names."""
    m = dataset.manifest
    if m.n_tiles:
        dataset.check_tile_sizes(sorted({0, m.n_tiles - 1}))
    budget = get_limits().decoded_budget(sum(m.tile_bytes))
    if _NAME_BYTES * m.n_genes > budget:
        raise LimitError(
            f"{dataset.store.describe(MANIFEST_NAME)}: {m.n_genes} genes without stored names "
            f"would take about {_NAME_BYTES * m.n_genes} bytes of default names, more than the "
            f"limit of {int(budget)} for {sum(m.tile_bytes)} stored bytes (a damaged n_genes?; "
            "deltacells.set_limits(decoded_ratio=...) raises it)"
        )
    return [str(i) for i in range(m.n_genes)]


def _obs(dataset: Dataset, obs: bool | Sequence[str], cache_dir,
         rows: np.ndarray | None = None) -> pd.DataFrame:  # fmt: skip
    """obs of every cell, or of stored rows ``rows`` only (built for those alone)."""
    schema = dataset.obs_schema()
    n_cells = dataset.shape[0] if rows is None else len(rows)
    if schema is None:
        return pd.DataFrame(index=_default_obs_names(dataset, rows))
    index_column = dataset.obs_index_column(schema)
    if obs is True:
        columns = [c for c in schema.names if c != index_column]
    elif obs is False:
        columns = []
    else:
        columns = list(obs)
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise KeyError(f"obs columns not in the dataset: {missing}")
    cache = ObsCache(dataset, cache_dir)
    cache.localize(([index_column] if index_column is not None else []) + columns)
    def selected(name: str) -> pd.Series:
        series = cache.series(name)
        return series if rows is None else series.iloc[rows].reset_index(drop=True)

    frame = pd.DataFrame({c: selected(c).to_numpy() if schema[c].kind != "category"
                          else selected(c) for c in columns})  # fmt: skip
    if index_column is not None:
        frame.index = pd.Index(selected(index_column).astype(str).to_numpy())
    else:
        frame.index = _default_obs_names(dataset, rows)
    if len(frame) != n_cells:  # no columns asked for: an empty frame of the right length
        frame = pd.DataFrame(index=frame.index)
    record = dataset.manifest.metadata.get("obs_pandas")
    return restore_dtypes(frame, record, dataset.store.describe(MANIFEST_NAME))


def _default_obs_names(dataset: Dataset, rows: np.ndarray | None = None) -> pd.Index:
    """``"0" .. "n-1"`` for a dataset without stored obs names.

    The manifest's cell count is believed only once the tiles that claim the most cells (the
    first, holding ``tile_size``, and the last) are on the store at their stated sizes,
    which hold 8 bytes per cell: a small manifest claiming 2^40 cells must not make this
    build a trillion names.
    """
    m = dataset.manifest
    if m.n_tiles:
        dataset.check_tile_sizes(sorted({0, m.n_tiles - 1}))
    # Arrow makes the strings about 3x faster than numpy's astype(str).astype(object).
    positions = np.arange(m.n_cells, dtype=np.int64) if rows is None else rows
    names = pc.cast(pa.array(positions), pa.string())
    return pd.Index(names.to_numpy(zero_copy_only=False), dtype=object, copy=False)
