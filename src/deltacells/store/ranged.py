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

from deltacells.codec import _checksum
from deltacells.codec.format import (
    ALIGNMENT,
    GAPS_LEN,
    GAPS_OFF,
    HEADER_SIZE,
    FormatError,
    TileHeader,
    chunk_entry_size,
    pack_header,
    parse_header,
)
from deltacells.codec.tile import Tile
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
        self._read_bytes = store.range_reader(name)  # a local file: opened once, here
        # The header and, when it is small, the whole chunk table in one read.
        head = self._read_bytes(0, min(HEADER_SIZE + TABLE_PREFETCH, size))
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
        data = self._read_bytes(start, stop)
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
        plan = self.plan([(lo, hi)])
        tile, shifts = plan.assemble_one(plan.fetch_all())
        return tile, int(-shifts[0])

    def plan(self, runs: list[tuple[int, int]]) -> RangedPlan:
        """Read the chunk entries and the indptr of ``runs`` (rows ``lo:hi``, increasing, not
        overlapping); return what is left to fetch (:meth:`RangedPlan.requests`) and how to
        lay it out (:meth:`RangedPlan.assemble_one`). All runs are checked at once: a tile
        read for many random rows has hundreds of runs."""
        h = self.header
        bounds = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
        if not len(bounds):
            raise ValueError("no rows to read")
        lo, hi = bounds[:, 0], bounds[:, 1]
        bad = np.flatnonzero((lo < 0) | (lo >= hi) | (hi > h.n_cells))
        if bad.size:
            i = bad[0]
            raise IndexError(f"rows {lo[i]}:{hi[i]} outside the tile's {h.n_cells}")
        if self.chunk_rows and self._table is None:  # a few runs: their entries alone
            pieces = [self._chunks_for(int(a), int(b)) for a, b in bounds]
            counts = np.array([len(e) for _, e in pieces], dtype=np.int64)
            ids = np.concatenate([first + np.arange(len(e)) for first, e in pieces])
            raw = np.concatenate([e for _, e in pieces])
        else:
            table = self.chunk_table()
            first = np.searchsorted(table[:, 1], lo, side="right")
            last = np.searchsorted(table[:, 1], hi - 1, side="right")
            beyond = np.flatnonzero(last >= h.n_chunks)
            if beyond.size:
                i = beyond[0]
                raise FormatError(f"{self.where}: rows {lo[i]}:{hi[i]} are beyond its chunks")
            counts = (last - first + 1).astype(np.int64)
            ids = np.repeat(first, counts) + _ranks(counts)
            raw = table[ids]
        starts = np.concatenate([[0], np.cumsum(counts)])
        entries = raw.astype(np.int64)
        cell_lo, cell_hi = entries[starts[:-1], 0], entries[starts[1:] - 1, 1]
        # Within a run each chunk starts where the one before ends, later than it began.
        broken = (entries[1:, 0] <= entries[:-1, 0]) | (entries[1:, 0] != entries[:-1, 1])
        broken[starts[1:-1] - 1] = False  # pairs across two runs
        bad_run = np.zeros(len(bounds), dtype=bool)
        bad_run[np.searchsorted(starts, np.flatnonzero(broken), side="right") - 1] = True
        bad_run |= (cell_lo < 0) | (cell_lo > lo) | (hi > cell_hi) | (cell_hi > h.n_cells)
        if bad_run.any():
            i = int(np.flatnonzero(bad_run)[0])
            raise FormatError(f"{self.where}: chunks {ids[starts[i]]}.. do not cover rows "
                              f"{lo[i]}:{hi[i]} contiguously")  # fmt: skip
        offsets = entries[:, GAPS_OFF::2][:, :4]
        lengths = entries[:, GAPS_LEN::2][:, :4]
        present = lengths > 0
        framed = np.logical_or.reduceat(present.any(axis=1), starts[:-1])
        streams_start = h.indptr_off + 8 * (h.n_cells + 1)
        outside = present & ((offsets < streams_start) | (lengths > self.size)
                             | (offsets > self.size - lengths))  # fmt: skip
        bad_run = ~framed
        outside_chunks = np.flatnonzero(outside.any(axis=1))
        bad_run[np.searchsorted(starts, outside_chunks, side="right") - 1] = True
        if bad_run.any():
            i = int(np.flatnonzero(bad_run)[0])
            why = "lie outside the tile" if framed[i] else "have no frames"
            raise FormatError(f"{self.where}: frames of chunks {ids[starts[i]]}.. {why}")
        chunk_lo = np.where(present, offsets, np.iinfo(np.int64).max).min(axis=1)
        chunk_hi = np.where(present, offsets + lengths, 0).max(axis=1)
        regions = np.stack([np.minimum.reduceat(chunk_lo, starts[:-1]),
                            np.maximum.reduceat(chunk_hi, starts[:-1])], axis=1)  # fmt: skip
        # One read for the indptr of every run.
        lo_cell, hi_cell = int(cell_lo.min()), int(cell_hi.max())
        data = self._read(h.indptr_off + 8 * lo_cell, h.indptr_off + 8 * (hi_cell + 1))
        return RangedPlan(self, ids, raw, entries, starts, regions, data, lo_cell)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """``0, 1, ..., counts[0] - 1, 0, 1, ..., counts[1] - 1, ...``."""
    total = int(counts.sum())
    return np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)


class RangedPlan:
    """The frames still to fetch for some runs of one tile's rows, and their layout as one
    small tile (made by :meth:`RangedTile.plan`). Chunk arrays hold the runs' chunks one run
    after the other: run ``i`` has chunks ``starts[i]:starts[i + 1]``."""

    def __init__(self, tile: RangedTile, ids: np.ndarray, raw: np.ndarray, entries: np.ndarray,
                 starts: np.ndarray, regions: np.ndarray, indptr: bytes, lo_cell: int) -> None:
        self.tile, self.ids, self.raw, self.entries = tile, ids, raw, entries
        self.starts, self.regions, self.lo_cell = starts, regions, lo_cell
        self.indptr_bytes = np.frombuffer(indptr, dtype=np.uint8)
        self.indptr = np.frombuffer(indptr, dtype="<i8").astype(np.int64)
        # Frame ranges close together are fetched together.
        order = np.argsort(regions[:, 0], kind="stable")
        begin, end = regions[order, 0], regions[order, 1]
        fresh = np.ones(len(order), dtype=bool)
        fresh[1:] = begin[1:] - np.maximum.accumulate(end)[:-1] > MERGE_GAP
        self.request_of_run = np.empty(len(order), dtype=np.int64)
        self.request_of_run[order] = np.cumsum(fresh) - 1
        heads = np.flatnonzero(fresh)
        ends = np.maximum.reduceat(end, heads)
        self._ranges = [(int(a), int(b)) for a, b in zip(begin[heads], ends, strict=True)]

    def requests(self) -> list[tuple[int, tuple[int, int]]]:
        """``(key, (start, stop))`` byte ranges of the tile to fetch."""
        return list(enumerate(self._ranges))

    def fetch(self, key: int) -> bytes:
        """Request ``key`` (for callers running the requests of many tiles concurrently)."""
        return self.tile._read(*self._ranges[key])

    def fetch_all(self) -> dict[int, bytes]:
        """Every request, one after the other (for local files; see :meth:`fetch`)."""
        return {key: self.tile._read(start, stop) for key, (start, stop) in self.requests()}

    def assemble_one(self, fetched: dict[int, bytes]) -> tuple[Tile, np.ndarray]:
        """Every run as one small validated tile, their chunks one after the other (a tile is
        any sequence of self-contained chunks), and each run's shift: stored row ``r`` of run
        ``i`` is row ``r + shifts[i]`` of that tile. Each run's frames are copied as the one
        block they were fetched in, every chunk (entry, indptr slice, frames) checked against
        its CRC-32 first when the tile has chunk checksums."""
        tile, entries, starts = self.tile, self.entries, self.starts
        blobs = [fetched[k] for k in range(len(self._ranges))]
        data = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        request_at = np.concatenate([[0], np.cumsum([len(b) for b in blobs])])[:-1]
        request_start = np.array([a for a, _ in self._ranges], dtype=np.int64)
        first_in_run = starts[:-1]
        run_of_chunk = np.repeat(np.arange(len(first_in_run)), np.diff(starts))
        region_lo = self.regions[:, 0]
        # Where each run's region starts in data, and each chunk's frames there.
        run_at = region_lo - request_start[self.request_of_run] + request_at[self.request_of_run]
        offsets = entries[:, GAPS_OFF::2][:, :4]
        lengths = np.maximum(entries[:, GAPS_LEN::2][:, :4], 0)
        present = lengths > 0
        moved = (run_at - region_lo)[run_of_chunk][:, None]
        frame_pos = np.ascontiguousarray(np.where(present, offsets + moved, 0))
        frame_len = np.ascontiguousarray(np.where(present, lengths, 0))
        # The indptr of every run's cells against its chunks' entries.
        cell_lo, cell_hi = entries[first_in_run, 0], entries[starts[1:] - 1, 1]
        at_lo, at_hi = self.indptr[cell_lo - self.lo_cell], self.indptr[cell_hi - self.lo_cell]
        bad = np.flatnonzero((at_lo != entries[first_in_run, 2])
                             | (at_hi != entries[starts[1:] - 1, 3]))  # fmt: skip
        if bad.size:
            i = bad[0]
            raise FormatError(f"{tile.where}: indptr does not match chunks {self.ids[starts[i]]}.. "
                              f"({at_lo[i]}..{at_hi[i]} vs {entries[starts[i], 2]}.."
                              f"{entries[starts[i + 1] - 1, 3]})")  # fmt: skip
        if tile._sums is not None:
            self._check_chunks(data, frame_pos, frame_len)
        # The small tile: its chunk table, indptr, then each run's block of frames, placed at
        # the block's alignment so that every frame stays 8-byte aligned.
        n_rows_run = cell_hi - cell_lo
        row_at = np.concatenate([[0], np.cumsum(n_rows_run)])
        shifts = row_at[:-1] - cell_lo
        nnz_run = at_hi - at_lo
        nnz_at = np.concatenate([[0], np.cumsum(nnz_run)])
        cells = np.repeat(cell_lo - self.lo_cell + 1, n_rows_run) + _ranks(n_rows_run)
        indptr = np.concatenate([[0], self.indptr[cells] - np.repeat(at_lo - nnz_at[:-1],
                                                                    n_rows_run)])  # fmt: skip
        n_rows, n_chunks = int(row_at[-1]), len(entries)
        entry = chunk_entry_size(2)
        indptr_off = HEADER_SIZE + entry * n_chunks
        pos = indptr_off + 8 * (n_rows + 1)
        block_at = np.empty(len(first_in_run), dtype=np.int64)
        for i, (a, b) in enumerate(self.regions.tolist()):
            pos += (a - pos) % ALIGNMENT
            block_at[i] = pos
            pos += b - a
        table = np.zeros((n_chunks, entry // 8), dtype="<u8")
        new_lo = entries[:, 0] + shifts[run_of_chunk]
        new_hi = entries[:, 1] + shifts[run_of_chunk]
        table[:, 0], table[:, 1] = new_lo, new_hi
        table[:, 2], table[:, 3] = indptr[new_lo], indptr[new_hi]
        placed = (block_at - region_lo)[run_of_chunk][:, None]
        table[:, GAPS_OFF::2] = np.where(present, offsets + placed, 0)
        table[:, GAPS_LEN::2] = frame_len
        out = np.zeros(pos, dtype=np.uint8)
        out[HEADER_SIZE:indptr_off] = table.view(np.uint8).reshape(-1)
        out[indptr_off : indptr_off + 8 * (n_rows + 1)] = indptr.astype("<i8").view(np.uint8)
        for i, (a, b) in enumerate(self.regions.tolist()):
            at = int(run_at[i])
            out[block_at[i] : block_at[i] + b - a] = data[at : at + b - a]
        crc = _checksum.crc32_range(out, HEADER_SIZE, 1)
        out[:HEADER_SIZE] = np.frombuffer(pack_header(
            n_cells=n_rows, nnz=int(indptr[-1]), n_genes=tile.header.n_genes, n_chunks=n_chunks,
            indptr_off=indptr_off, total_size=pos, crc32=crc), dtype=np.uint8)  # fmt: skip
        name = f"{tile.where} ({len(first_in_run)} runs of rows, ranged read)"
        # Its CRC was just computed from these bytes; its pieces were checked above.
        return Tile(out, name=name, verify_crc=False, n_threads=1), shifts

    def _check_chunks(self, data: np.ndarray, frame_pos: np.ndarray,
                      frame_len: np.ndarray) -> None:
        """Each fetched chunk (entry, indptr slice, frames) against its CRC-32."""
        tile, entries = self.tile, self.entries
        crcs = _checksum.chunk_crcs(
            np.ascontiguousarray(self.raw, dtype="<u8").view(np.uint8).reshape(len(entries), -1),
            self.indptr_bytes, 8 * (entries[:, 0] - self.lo_cell),
            8 * (entries[:, 1] - self.lo_cell + 1), data, frame_pos, frame_len)  # fmt: skip
        expected = tile._sums[1]
        known = self.ids < len(expected)
        bad = np.flatnonzero(~known | (crcs != expected[np.where(known, self.ids, 0)]))
        if bad.size:
            raise FormatError(f"{tile.where}: chunk {self.ids[bad[0]]} (its table entry, indptr "
                              "or frames) does not match its CRC-32 in the chunk checksums "
                              "(damaged)")  # fmt: skip
