"""Box queries on a spatially ordered dataset: read the grid tiles a box reaches (grown by the
margin), and from them only the rows' centroids and shapes, by ranged reads; then test each
cell exactly (:func:`deltacells.spatial.grid.select_in_box`)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltacells.codec.format import FormatError
from deltacells.codec.npy import parse_npy_header
from deltacells.spatial.grid import (
    CENTROIDS_NAME,
    GEOMETRY_NAME,
    GEOMETRY_OFFSETS_NAME,
    GRID_SUMS_FILES,
    GRID_SUMS_NAME,
    SHAPES_NAME,
    TILE_OFFSETS_NAME,
    SpatialIndex,
    grid_tiles_overlapping,
    select_in_box,
)
from deltacells.store.storage import Store

__all__ = ["BoxQuery", "SpatialReader"]

#: numpy caps .npy headers at 10,000 bytes (plus magic and length).
_NPY_HEAD = 16 + 10_000


@dataclass(frozen=True)
class BoxQuery:
    """The cells a box selects.

    Attributes
    ----------
    rows
        Stored row numbers of the selected cells, increasing (int64).
    grid_tiles
        Grid tiles read (the box grown by the margin, or not for ``mode="centroid"``).
    candidates
        Cells in those tiles, tested exactly.
    bytes_read
        Bytes fetched for the query (tile offsets once per dataset, then centroids, shape
        records and polygons of the candidate rows).
    """

    rows: np.ndarray
    grid_tiles: np.ndarray
    candidates: int
    bytes_read: int


class _GridSums:
    """The grid checksums of one spatial file: each grid tile's bytes are checked as a query
    reads them (None: a dataset written before them, read unchecked)."""

    def __init__(self, sums: np.ndarray | None, file: str, tile_offsets: np.ndarray,
                 where: str) -> None:  # fmt: skip
        self.row = None if sums is None else sums[GRID_SUMS_FILES.index(file)]
        self.offsets, self.where = tile_offsets, where

    def check(self, start: int, stop: int, data: bytes, locate) -> None:
        """``data`` holds the grid tiles whose rows are ``start:stop``; ``locate(k)`` gives
        grid tile ``k``'s byte range within it."""
        if self.row is None:
            return
        o = self.offsets
        tiles = np.flatnonzero((o[:-1] >= start) & (o[1:] <= stop) & (o[1:] > o[:-1]))
        if int(np.sum(o[tiles + 1] - o[tiles])) != stop - start:
            raise FormatError(f"{self.where}: rows {start}:{stop} are not whole grid tiles")
        view = memoryview(data)
        for k in tiles:
            lo, hi = locate(int(k))
            if zlib.crc32(view[lo:hi]) != int(self.row[1 + k]):
                raise FormatError(f"{self.where}: the rows of grid tile {k} do not match their "
                                  "CRC-32 in the grid checksums (damaged)")  # fmt: skip

    def check_header(self, head: bytes) -> None:
        if self.row is not None and zlib.crc32(head) != int(self.row[0]):
            raise FormatError(f"{self.where}: the .npy header does not match its CRC-32 in the "
                              "grid checksums (damaged)")  # fmt: skip


class _NpyRows:
    """Row ranges of a 2-D (or 1-D) little-endian ``.npy`` file, by ranged reads, each grid
    tile checked against its grid checksum when the dataset has them."""

    def __init__(self, store: Store, name: str, dtype: str, shape: tuple[int, ...],
                 sums: _GridSums | None = None, extra: int = 0,
                 size: int | None = None) -> None:  # fmt: skip
        self.store, self.name = store, name
        where = store.describe(name)
        size = store.size(name) if size is None else size
        head = store.read_range(name, 0, min(size, _NPY_HEAD))
        got_shape, fortran, got_dtype, self.offset = parse_npy_header(head, where)
        if got_shape != shape or fortran or got_dtype != np.dtype(dtype):
            raise FormatError(f"{where}: expected {np.dtype(dtype)} {shape}, got {got_dtype} "
                              f"{got_shape}{' (Fortran order)' if fortran else ''}")  # fmt: skip
        self.dtype = np.dtype(dtype)
        self.row_bytes = self.dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
        self.shape = shape
        if size != self.offset + self.row_bytes * shape[0]:
            raise FormatError(f"{where}: {size} bytes, a {self.dtype} {shape} array needs "
                              f"{self.offset + self.row_bytes * shape[0]}")  # fmt: skip
        self.sums, self.extra = sums, extra
        if sums is not None:
            sums.check_header(bytes(head[: self.offset]))
        self.bytes_read = len(head)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` (plus :attr:`extra` rows after them, e.g. an offsets' end):
        whole grid tiles, checked."""
        stop_row = stop + self.extra
        data = self.store.read_range(self.name, self.offset + start * self.row_bytes,
                                     self.offset + stop_row * self.row_bytes)  # fmt: skip
        self.bytes_read += len(data)
        if len(data) != (stop_row - start) * self.row_bytes:
            raise FormatError(f"{self.store.describe(self.name)}: shorter than its header says")
        if self.sums is not None:
            o, b = self.sums.offsets, self.row_bytes
            self.sums.check(start, stop, data, lambda k: (
                (int(o[k]) - start) * b, (int(o[k + 1]) + self.extra - start) * b))
        return np.frombuffer(data, dtype=self.dtype).reshape((stop_row - start, *self.shape[1:]))

    def whole(self) -> np.ndarray:
        return self.rows(0, self.shape[0] - self.extra)


class SpatialReader:
    """The spatial part of one opened dataset (made by :meth:`deltacells.Dataset.spatial`)."""

    def __init__(self, dataset: Any, index: SpatialIndex, n_cells: int) -> None:
        store = dataset.store
        self.store, self.index, self.n_cells = store, index, n_cells
        files = dataset.files
        n_tiles = index.n_grid_tiles
        # Read whole: checked against the manifest's file table.
        offsets = dataset.load_npy(TILE_OFFSETS_NAME, n_tiles + 1, dtype="<i8").astype(np.int64)
        where = store.describe(TILE_OFFSETS_NAME)
        if offsets[0] != 0 or offsets[-1] != n_cells or (np.diff(offsets) < 0).any():
            raise FormatError(f"{where}: tile offsets must rise from 0 to the {n_cells} cells")
        self.tile_offsets = offsets
        self.bytes_read = 8 * (n_tiles + 1)
        sums = None
        if files.present:
            sums = dataset.load_npy(GRID_SUMS_NAME, (len(GRID_SUMS_FILES), n_tiles + 1),
                                    dtype="<u4")  # fmt: skip

        def part(name: str, dtype: str, shape: tuple, extra: int = 0) -> _NpyRows | None:
            # With a file table, it says which files exist (and their sizes): no listing.
            if files.present:
                if name not in files:
                    return None
                size = files.size(name)
            elif not store.exists(name):
                return None
            else:
                size = None
            grid = _GridSums(sums, name, offsets, store.describe(name)) \
                if sums is not None else None  # fmt: skip
            return _NpyRows(store, name, dtype, shape, grid, extra, size)

        self._centroids = part(CENTROIDS_NAME, "<f8", (n_cells, 2))
        if self._centroids is None:
            raise FormatError(f"{store.describe(CENTROIDS_NAME)}: missing")
        self._records = part(SHAPES_NAME, "<f8", (n_cells, 5))
        self._geometry = part(GEOMETRY_OFFSETS_NAME, "<i8", (n_cells + 1,), extra=1)
        self._wkb_sums = _GridSums(sums, GEOMETRY_NAME, offsets, store.describe(GEOMETRY_NAME)) \
            if sums is not None else None  # fmt: skip
        if files.present and self._geometry is not None:
            self._wkb_size = files.require(GEOMETRY_NAME, store.describe)

    def verify(self) -> None:
        """Check every stored centroid lies in the grid tile its row range says, and the
        shape records' kinds (reads the whole spatial part)."""
        from deltacells.spatial.grid import tile_ids

        centroids = self._centroids.whole()
        where = self.store.describe(CENTROIDS_NAME)
        if not np.isfinite(centroids).all():
            raise FormatError(f"{where}: a centroid is NaN or infinite")
        expected = np.repeat(np.arange(self.index.n_grid_tiles), np.diff(self.tile_offsets))
        bad = np.flatnonzero(tile_ids(centroids, self.index) != expected)
        if len(bad):
            raise FormatError(f"{where}: row {bad[0]} lies outside the grid tile "
                              f"{expected[bad[0]]} that tile_offsets puts it in")  # fmt: skip
        if self._records is not None:
            records = self._records.whole()
            if not np.isin(records[:, 0], (0.0, 1.0, 2.0)).all():
                raise FormatError(f"{self.store.describe(SHAPES_NAME)}: unknown shape kind")

    def row_ranges(self, grid_tiles: np.ndarray) -> list[tuple[int, int]]:
        """Stored row ranges of ``grid_tiles``, adjacent ones merged."""
        ranges: list[tuple[int, int]] = []
        for k in grid_tiles:
            start, stop = int(self.tile_offsets[k]), int(self.tile_offsets[k + 1])
            if start == stop:
                continue
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], stop)
            else:
                ranges.append((start, stop))
        return ranges

    def query(self, box, mode: str = "intersects") -> BoxQuery:
        """The cells ``box`` selects (see :func:`deltacells.spatial.grid.select_in_box`)."""
        files = [f for f in (self._centroids, self._records, self._geometry) if f is not None]
        before = sum(f.bytes_read for f in files)
        tiles = grid_tiles_overlapping(self.index, box, grow=mode != "centroid")
        selected, candidates = [], 0
        for start, stop in self.row_ranges(tiles):
            centroids = self._centroids.rows(start, stop)
            records = geometries = None
            if mode != "centroid" and self._records is not None:
                records = self._records.rows(start, stop)
                geometries = self._polygons(start, stop, records)
            hit = select_in_box(box, centroids, records, mode=mode, geometries=geometries)
            selected.append(start + np.flatnonzero(hit))
            candidates += stop - start
        rows = np.concatenate(selected).astype(np.int64) if selected else np.zeros(0, np.int64)
        spent = sum(f.bytes_read for f in files) - before
        return BoxQuery(rows=rows, grid_tiles=tiles, candidates=candidates, bytes_read=spent)

    def _polygons(self, start: int, stop: int, records: np.ndarray):
        """Shapely geometries of the polygon rows ``start:stop`` (None where not a polygon),
        or None when the dataset stores no polygons."""
        if self._geometry is None or not (records[:, 0] == 2.0).any():
            return None
        import shapely

        bounds = self._geometry.rows(start, stop)
        where = self.store.describe(GEOMETRY_NAME)
        if (np.diff(bounds) < 0).any():
            raise FormatError(f"{self.store.describe(GEOMETRY_OFFSETS_NAME)}: offsets decrease")
        data = self.store.read_range(GEOMETRY_NAME, int(bounds[0]), int(bounds[-1]))
        self._geometry.bytes_read += len(data)
        if len(data) != bounds[-1] - bounds[0]:
            raise FormatError(f"{where}: shorter than its offsets say")
        if self._wkb_sums is not None:
            first = int(bounds[0])
            self._wkb_sums.check(start, stop, data, lambda k: (
                int(bounds[self.tile_offsets[k] - start]) - first,
                int(bounds[self.tile_offsets[k + 1] - start]) - first))
        out = np.empty(stop - start, dtype=object)
        base = int(bounds[0])
        for i in np.flatnonzero(records[:, 0] == 2.0):
            blob = data[int(bounds[i]) - base : int(bounds[i + 1]) - base]
            try:
                out[i] = shapely.from_wkb(blob)
            except Exception as err:  # shapely raises its own GEOSException
                raise FormatError(f"{where}: row {start + i} is not a WKB geometry ({err})") \
                    from None  # fmt: skip
        return out
