"""Rows of a stored tile by ranged reads: the header, the chunk-table entries, the indptr slice
and the frames of the chunks holding the rows, never the whole tile.

The pieces are laid out again as a small tile of their own (one tile per run of chunks, with a
fresh CRC), so every structural and frame check of :class:`~deltacells.codec.tile.Tile` applies to
them before anything is decoded. The stored tile's CRC covers all of it and cannot be checked
this way; the chunk checksums (:mod:`deltacells.store.integrity`) take its place: given them, every
byte fetched (header, chunk table or entries, indptr slice, frames) is checked against a CRC-32
tied to the manifest before it is decoded.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import numpy as np

from deltacells.codec.format import (
    GAPS_LEN,
    GAPS_OFF,
    HEADER_SIZE,
    FormatError,
    TileHeader,
    chunk_entry_size,
    parse_header,
)
from deltacells.codec.tile import Tile, _assemble
from deltacells.store.integrity import chunk_crc
from deltacells.store.storage import Store

__all__ = ["RangedPlan", "RangedTile"]

#: Bytes read after the header in the first request, so that small chunk tables (a CSR tile's
#: 8 entries, a gene-major block's few hundred) need no request of their own.
TABLE_PREFETCH = 8 * 1024
#: Frame ranges of different runs less than this many bytes apart are read in one request.
#: Small: the point of ranged reads is fetching few bytes; the requests of all runs and tiles
#: are made concurrently instead (see ``DeltacellsCSRDataset``), so they cost one round trip.
MERGE_GAP = 16 * 1024


class RangedTile:
    """One stored tile read piecewise: :meth:`rows_tile` returns its rows ``lo:hi`` as a small
    validated :class:`~deltacells.codec.tile.Tile`.

    Parameters
    ----------
    store, name
        Where the tile is.
    size
        Its size in bytes as the manifest records it (checked against the header).
    chunk_rows
        If the writer made chunks of this many rows (``encode_tile(chunk_rows=...)``), the
        chunk of a row is found without reading the whole chunk table (and checked).
    checksums
        Given the tile's 64-byte header, its checked chunk checksums ``(crc32 of the chunk
        table, per-chunk CRC-32s)`` (see :class:`~deltacells.store.integrity.ChunkSums`); every
        piece read is then checked against them. None: unchecked (older datasets).
    """

    def __init__(self, store: Store, name: str, size: int, chunk_rows: int | None = None,
                 checksums: Callable[[bytes], tuple[int, np.ndarray]] | None = None) -> None:
        self.store, self.name, self.size, self.chunk_rows = store, name, size, chunk_rows
        self.where = store.describe(name)
        # The header and, when it is small, the whole chunk table in one read.
        head = store.read_range(name, 0, min(HEADER_SIZE + TABLE_PREFETCH, size))
        self.header: TileHeader = parse_header(head, self.where, object_size=size)
        if self.header.version != 2:
            raise FormatError(f"{self.where}: ranged reads need a version 2 tile")
        self._sums = None if checksums is None else checksums(bytes(head[:HEADER_SIZE]))
        self.entry = chunk_entry_size(2)
        table_end = HEADER_SIZE + self.entry * self.header.n_chunks
        h = self.header
        if not (table_end <= h.indptr_off <= size and h.indptr_off % 8 == 0
                and h.indptr_off + 8 * (h.n_cells + 1) <= size):  # fmt: skip
            raise FormatError(f"{self.where}: chunk table or indptr beyond the tile's {size} "
                              "bytes")  # fmt: skip
        self.bytes_read = len(head)
        self._table: np.ndarray | None = None
        if table_end <= len(head):
            self._table = self._checked_table(head[HEADER_SIZE:table_end])

    def _checked_table(self, data: bytes) -> np.ndarray:
        """The whole chunk table from its bytes, checked against its checksum if known."""
        if self._sums is not None and zlib.crc32(data) != self._sums[0]:
            raise FormatError(f"{self.where}: the chunk table does not match its CRC-32 in the "
                              "chunk checksums (damaged)")  # fmt: skip
        return np.frombuffer(data, dtype="<u8").reshape(self.header.n_chunks, self.entry // 8)

    def _read(self, start: int, stop: int) -> bytes:
        data = self.store.read_range(self.name, start, stop)
        self.bytes_read += len(data)
        if len(data) != stop - start:
            raise FormatError(f"{self.where}: bytes {start}:{stop} asked, {len(data)} read "
                              f"(the object is shorter than the {self.size} bytes "
                              "recorded)")  # fmt: skip
        return data

    def _entries(self, first: int, stop: int) -> np.ndarray:
        data = self._read(HEADER_SIZE + self.entry * first, HEADER_SIZE + self.entry * stop)
        return np.frombuffer(data, dtype="<u8").reshape(stop - first, self.entry // 8)

    def chunk_table(self) -> np.ndarray:
        """The whole chunk table (``n_chunks x 12``, uint64), read once."""
        if self._table is None:
            n = self.header.n_chunks
            self._table = self._checked_table(self._read(HEADER_SIZE, HEADER_SIZE + self.entry * n))
        return self._table

    def _chunks_for(self, lo: int, hi: int) -> tuple[int, np.ndarray]:
        """First chunk id and the table entries of the chunks holding rows ``lo:hi``."""
        n = self.header.n_chunks
        if self.chunk_rows and self._table is None:
            first, last = lo // self.chunk_rows, (hi - 1) // self.chunk_rows
            if last < n:
                entries = self._entries(first, last + 1)
                if entries[0, 0] <= lo and entries[-1, 1] >= hi:
                    return first, entries
        table = self.chunk_table()
        first = int(np.searchsorted(table[:, 1], lo, side="right"))
        last = int(np.searchsorted(table[:, 1], hi - 1, side="right"))
        if last >= n:
            raise FormatError(f"{self.where}: rows {lo}:{hi} are beyond its chunks")
        return first, table[first : last + 1]

    def rows_tile(self, lo: int, hi: int) -> tuple[Tile, int]:
        """Rows ``lo:hi`` (``0 <= lo < hi <= n_cells``) and whatever else shares their chunks,
        as ``(tile, first_row)``: the tile's row ``i`` is stored row ``first_row + i``."""
        return self.rows_tiles([(lo, hi)])[0]

    def rows_tiles(self, runs: list[tuple[int, int]]) -> list[tuple[Tile, int]]:
        """:meth:`rows_tile` for several runs of rows (increasing, not overlapping) with few
        requests: one for the indptr they span, and one per group of frame ranges less than
        :data:`MERGE_GAP` bytes apart (made one after the other; see :meth:`plan` to make
        them concurrently with other tiles')."""
        plan = self.plan(runs)
        fetched = {key: self._read(start, stop) for key, (start, stop) in plan.requests()}
        return plan.assemble(fetched)

    def plan(self, runs: list[tuple[int, int]]) -> RangedPlan:
        """Read the chunk entries and the indptr of ``runs``; return what is left to fetch
        (:meth:`RangedPlan.requests`) and how to lay it out (:meth:`RangedPlan.assemble`)."""
        h = self.header
        spans = []
        for lo, hi in runs:
            if not 0 <= lo < hi <= h.n_cells:
                raise IndexError(f"rows {lo}:{hi} outside the tile's {h.n_cells}")
            first, entries = self._chunks_for(lo, hi)
            entries = entries.astype(np.int64)
            cell_lo, cell_hi = int(entries[0, 0]), int(entries[-1, 1])
            if (np.diff(entries[:, 0]) <= 0).any() or (entries[1:, 0] != entries[:-1, 1]).any() \
                    or not 0 <= cell_lo <= lo < hi <= cell_hi <= h.n_cells:  # fmt: skip
                raise FormatError(f"{self.where}: chunks {first}.. do not cover rows {lo}:{hi} "
                                  "contiguously")  # fmt: skip
            offsets = entries[:, GAPS_OFF::2][:, :4]
            lengths = entries[:, GAPS_LEN::2][:, :4]
            present = lengths > 0
            if not present.any():
                raise FormatError(f"{self.where}: chunks {first}.. have no frames")
            region = (int(offsets[present].min()), int((offsets + lengths)[present].max()))
            if region[0] < h.indptr_off + 8 * (h.n_cells + 1) or region[1] > self.size:
                raise FormatError(f"{self.where}: frames of chunks {first}.. lie outside the "
                                  "tile")  # fmt: skip
            spans.append((first, entries, offsets, lengths, region))
        # One read for the indptr of every run.
        lo_cell = min(int(e[0, 0]) for _, e, *_ in spans)
        hi_cell = max(int(e[-1, 1]) for _, e, *_ in spans)
        data = self._read(h.indptr_off + 8 * lo_cell, h.indptr_off + 8 * (hi_cell + 1))
        indptr = np.frombuffer(data, dtype="<i8").astype(np.int64)
        return RangedPlan(self, spans, indptr, lo_cell)


class RangedPlan:
    """The frames still to fetch for some runs of one tile's rows, and their layout as tiles
    (made by :meth:`RangedTile.plan`)."""

    def _check_chunks(self, first: int, entries: np.ndarray, frames: list) -> None:
        """Each fetched chunk (entry, indptr slice, frames) against its CRC-32."""
        tile = self.tile
        expected = tile._sums[1]
        for j, entry in enumerate(entries):
            lo, hi = int(entry[0]), int(entry[1])
            indptr = self.indptr[lo - self.lo_cell : hi - self.lo_cell + 1]
            crc = chunk_crc(entry.astype("<u8").tobytes(), indptr.astype("<i8").tobytes(),
                            frames[j])  # fmt: skip
            if first + j >= len(expected) or crc != expected[first + j]:
                raise FormatError(f"{tile.where}: chunk {first + j} (its table entry, indptr or "
                                  "frames) does not match its CRC-32 in the chunk checksums "
                                  "(damaged)")  # fmt: skip

    def __init__(self, tile: RangedTile, spans: list, indptr: np.ndarray, lo_cell: int) -> None:
        self.tile, self.spans, self.indptr, self.lo_cell = tile, spans, indptr, lo_cell
        # Frame ranges close together are fetched together.
        order = sorted(range(len(spans)), key=lambda i: spans[i][4][0])
        self.groups: list[list[int]] = []
        for i in order:
            if self.groups and spans[i][4][0] - spans[self.groups[-1][-1]][4][1] <= MERGE_GAP:
                self.groups[-1].append(i)
            else:
                self.groups.append([i])
        self._ranges = [(min(spans[j][4][0] for j in group), max(spans[j][4][1] for j in group))
                        for group in self.groups]  # fmt: skip

    def requests(self) -> list[tuple[int, tuple[int, int]]]:
        """``(key, (start, stop))`` byte ranges of the tile to fetch."""
        return list(enumerate(self._ranges))

    def fetch(self, key: int) -> bytes:
        """Request ``key`` (for callers running the requests of many tiles concurrently)."""
        return self.tile._read(*self._ranges[key])

    def _frames_of(self, fetched: dict[int, bytes]) -> list[list[list[bytes]]]:
        """Per run, per chunk, its four frames cut from the fetched requests."""
        where: dict[int, tuple[int, bytes]] = {}
        for k, ((start, _), group) in enumerate(zip(self._ranges, self.groups, strict=True)):
            for j in group:
                where[j] = (start, fetched[k])
        out = []
        for i, (_, _, offsets, lengths, _) in enumerate(self.spans):
            base, blob = where[i]
            out.append([[blob[int(o) - base : int(o + n) - base] if n else b""
                         for o, n in zip(row_off, row_len, strict=True)]
                        for row_off, row_len in zip(offsets, lengths, strict=True)])  # fmt: skip
        return out

    def _run_indptr(self, i: int) -> np.ndarray:
        """The indptr of run ``i``'s cells (absolute nonzero positions), checked against its
        chunks' entries."""
        first, entries, *_ = self.spans[i]
        cell_lo, cell_hi = int(entries[0, 0]), int(entries[-1, 1])
        nnz_lo, nnz_hi = int(entries[0, 2]), int(entries[-1, 3])
        indptr = self.indptr[cell_lo - self.lo_cell : cell_hi - self.lo_cell + 1]
        if indptr[0] != nnz_lo or indptr[-1] != nnz_hi:
            raise FormatError(f"{self.tile.where}: indptr does not match chunks {first}.. "
                              f"({indptr[0]}..{indptr[-1]} vs {nnz_lo}..{nnz_hi})")  # fmt: skip
        return indptr

    def assemble_one(self, fetched: dict[int, bytes]) -> tuple[Tile, np.ndarray]:
        """Every run as one small validated tile, their chunks one after the other (a tile is
        any sequence of self-contained chunks), and each run's shift: stored row ``r`` of run
        ``i`` is row ``r + shifts[i]`` of that tile. One tile to parse and decode per tile
        read, instead of one per run."""
        tile = self.tile
        frames_of_runs = self._frames_of(fetched)
        bounds, indptr_parts, frames = [0], [np.zeros(1, dtype=np.int64)], []
        shifts = np.zeros(len(self.spans), dtype=np.int64)
        n_rows = nnz = 0
        for i, (first, entries, _, _, _) in enumerate(self.spans):
            indptr = self._run_indptr(i)
            if tile._sums is not None:
                self._check_chunks(first, entries, frames_of_runs[i])
            cell_lo, cell_hi = int(entries[0, 0]), int(entries[-1, 1])
            shifts[i] = n_rows - cell_lo
            bounds.extend((entries[:, 1] + shifts[i]).tolist())
            indptr_parts.append(indptr[1:] - indptr[0] + nnz)
            frames.extend(frames_of_runs[i])
            n_rows += cell_hi - cell_lo
            nnz += int(indptr[-1] - indptr[0])
        blob = _assemble(np.concatenate(indptr_parts), np.asarray(bounds, dtype=np.int64),
                         frames, n_rows, tile.header.n_genes, 1)  # fmt: skip
        name = f"{tile.where} ({len(self.spans)} runs of rows, ranged read)"
        return Tile(blob, name=name, n_threads=1), shifts

    def assemble(self, fetched: dict[int, bytes]) -> list[tuple[Tile, int]]:
        """The runs as small validated tiles, ``(tile, first_row)`` each, from the fetched
        requests."""
        tile = self.tile
        h = tile.header
        out = []
        for i, frames in enumerate(self._frames_of(fetched)):
            first, entries, *_ = self.spans[i]
            indptr = self._run_indptr(i)
            if tile._sums is not None:
                self._check_chunks(first, entries, frames)
            cell_lo, cell_hi = int(entries[0, 0]), int(entries[-1, 1])
            bounds = np.append(entries[:, 0], cell_hi) - cell_lo
            tile_blob = _assemble(indptr - indptr[0], bounds, frames, cell_hi - cell_lo,
                                  h.n_genes, 1)  # fmt: skip
            name = f"{tile.where} (rows {cell_lo}:{cell_hi}, ranged read)"
            out.append((Tile(tile_blob, name=name, n_threads=1), cell_lo))
        return out
