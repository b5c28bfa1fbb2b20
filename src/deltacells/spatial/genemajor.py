"""The gene-major companion (RFC 4's CSC, as NOTES.md applies it): for each block of
consecutive stored cells, the transposed matrix (genes as rows, the block's cells as columns,
delta-coded cell gaps and counts) in the same version-2 tile codec, so one gene for every cell
is one small ranged read per block instead of a scan of every tile.

Layout: ``genes/block_000000.dct`` ... and the manifest's ``metadata["gene_major"]`` record
(block size, rows per chunk, each block's bytes, nonzeros and CRC-32, and the blocks' chunk
checksums in ``genes/chunk_crc32.bin``, which make every partial read of a block checked).
Rows are genes in the stored gene order; block ``b`` holds stored cells ``b * block_cells`` to
``(b + 1) * block_cells``.
Chunks hold a fixed number of genes, so a gene's chunk is found without the chunk table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import scipy.sparse as sp

from deltacells.codec.format import HEADER_SIZE, FormatError, parse_header
from deltacells.codec.tile import DEFAULT_LEVEL, Tile, encode_tile, exception_limit
from deltacells.store.integrity import (
    CHUNK_SUMS_KEY,
    ChunkSums,
    check_checksum_row,
    chunk_sums_record,
    tile_checksum_row,
)
from deltacells.store.manifest import MANIFEST_NAME
from deltacells.store.ranged import RangedTile

__all__ = [
    "DEFAULT_BLOCK_CELLS",
    "DEFAULT_CHUNK_GENES",
    "GeneMajor",
    "add_gene_major",
    "block_name",
]

#: Most nonzeros a block holds by default. A block is transposed in memory (about 24 bytes
#: per nonzero at the peak), so this bounds the build's memory to about 0.8 GB whatever the
#: dataset's size.
BLOCK_NNZ_BUDGET = 2**25
#: Most cells a block may hold: cell gaps within a block then stay below 65,536, so the gap
#: stream never needs exceptions.
MAX_BLOCK_CELLS = 65_536
#: ``block_cells=None``: the largest power of two of cells (1,024 to 65,536) whose expected
#: nonzeros fit :data:`BLOCK_NNZ_BUDGET`: fewer, larger blocks make one-gene reads cheaper
#: (one small read per block), the budget keeps the build's memory bounded. 10x data
#: (~2,000 genes per cell) gets 16,384 cells, Visium spots (~270) 65,536.
DEFAULT_BLOCK_CELLS = None
#: Genes per chunk: the unit a one-gene read decompresses.
DEFAULT_CHUNK_GENES = 16
RECORD_FORMAT = "deltacells-gene-major"
#: The blocks' chunk checksums (rows as for tiles, see :mod:`deltacells.store.integrity`).
BLOCK_SUMS_NAME = "genes/chunk_crc32.bin"


def block_name(index: int) -> str:
    """File name of gene-major block ``index``."""
    return f"genes/block_{index:06d}.dct"


def _stored_rows(dataset: Any, lo: int, hi: int) -> sp.csr_matrix:
    """Stored cells ``lo:hi`` (int32 counts, stored gene order), decoding only their tiles."""
    limits = dataset.manifest.limits
    starts = np.concatenate([[0], limits[:-1]])
    first = int(np.searchsorted(limits, lo, side="right"))
    parts = []
    t = first
    while t < dataset.manifest.n_tiles and starts[t] < hi:
        matrix = dataset.tile(t).decode(np.int32)
        parts.append(matrix[max(lo - starts[t], 0) : min(hi, limits[t]) - starts[t]])
        t += 1
    if not parts:
        return sp.csr_matrix((0, dataset.manifest.n_genes), dtype=np.int32)
    return sp.vstack(parts, format="csr")


class _TooManyExceptions(Exception):
    """A block would hold more counts above 65535 than a tile may (see
    :func:`~deltacells.codec.tile.exception_limit`): a smaller block is needed."""

    def __init__(self, lo: int, hi: int, count: int, limit: int) -> None:
        super().__init__(f"cells {lo:,}..{hi:,} hold {count:,} counts above 65535, more than "
                         f"the {limit:,} a block of them may hold")  # fmt: skip


def _block_blob(dataset: Any, lo: int, hi: int, chunk_genes: int, level: int,
                n_threads: int | None) -> tuple[bytes, int]:  # fmt: skip
    cells = _stored_rows(dataset, lo, hi).tocsc()
    large = int(np.count_nonzero(cells.data > 65535))
    if large > exception_limit(int(cells.nnz)):
        raise _TooManyExceptions(lo, hi, large, int(exception_limit(int(cells.nnz))))
    # The CSC arrays of (cells x genes) are the CSR arrays of (genes x cells).
    genes_by_cells = sp.csr_matrix((cells.data, cells.indices, cells.indptr),
                                   shape=(dataset.manifest.n_genes, hi - lo))  # fmt: skip
    return encode_tile(genes_by_cells, chunk_rows=chunk_genes, level=level,
                       n_threads=n_threads), int(cells.nnz)  # fmt: skip


def add_gene_major(
    dataset: Any,
    *,
    block_cells: int | None = DEFAULT_BLOCK_CELLS,
    chunk_genes: int = DEFAULT_CHUNK_GENES,
    zstd_level: int | None = None,
    n_threads: int | None = None,
    progress: Callable[[Any], Any] | None = None,
) -> dict:
    """Build the gene-major companion of an opened dataset and record it in its manifest.

    Memory stays bounded by one block whatever the dataset's size: each block's cells are
    decoded from their tiles, transposed and encoded, then dropped. The manifest is rewritten
    last (atomically), so a failed build leaves the dataset as it was.

    Parameters
    ----------
    dataset
        A :class:`~deltacells.Dataset` (writable location).
    block_cells
        Cells per block, 1 to 65,536; ``None`` chooses from the data (see
        :data:`.DEFAULT_BLOCK_CELLS`).
    chunk_genes
        Genes per chunk inside a block.
    zstd_level
        zstd level (default: the dataset's).
    n_threads
        Threads compressing chunks.
    progress
        Wraps the iterable of block numbers (e.g. a tqdm factory).

    Returns
    -------
    dict
        The ``gene_major`` record written into the manifest metadata.
    """
    m = dataset.manifest
    chosen = block_cells is None
    if block_cells is None:
        per_cell = max(m.nnz / max(m.n_cells, 1), 1.0)
        fits = int(np.clip(BLOCK_NNZ_BUDGET / per_cell, 1024, MAX_BLOCK_CELLS))
        block_cells = 1 << (fits.bit_length() - 1)
    if not 1 <= block_cells <= MAX_BLOCK_CELLS:
        raise ValueError(f"block_cells must be 1..{MAX_BLOCK_CELLS}, not {block_cells}")
    if chunk_genes < 1:
        raise ValueError(f"chunk_genes must be >= 1, not {chunk_genes}")
    level = m.zstd_level if zstd_level is None else zstd_level
    level = DEFAULT_LEVEL if level is None else level
    while True:
        try:
            return _write_blocks(dataset, block_cells, chunk_genes, level, n_threads, progress)
        except _TooManyExceptions as err:
            # As the writer does for cell-major tiles: a chosen size shrinks until the rare
            # large counts fit (one cell always does: it holds fewer values than the limit).
            if not chosen or block_cells == 1:
                raise ValueError(f"block_cells={block_cells}: {err}; pass a smaller "
                                 "block_cells, or leave it out to let the size adapt") from None
            block_cells //= 2


def _write_blocks(dataset: Any, block_cells: int, chunk_genes: int, level: int,
                  n_threads: int | None, progress: Callable | None) -> dict:  # fmt: skip
    """Encode and store every block and the manifest record (see :func:`add_gene_major`)."""
    m = dataset.manifest
    n_blocks = -(-m.n_cells // block_cells)
    sizes, nnzs, crcs, headers, rows = [], [], [], [], []
    blocks = range(n_blocks)
    for b in progress(blocks) if progress else blocks:
        lo, hi = b * block_cells, min(m.n_cells, (b + 1) * block_cells)
        blob, nnz = _block_blob(dataset, lo, hi, chunk_genes, level, n_threads)
        dataset.store.write_atomic(block_name(b), blob)
        sizes.append(len(blob))
        nnzs.append(nnz)
        crcs.append(parse_header(blob).crc32)
        headers.append(bytes(blob[:HEADER_SIZE]))
        rows.append(tile_checksum_row(blob))
    sums, sums_data = chunk_sums_record(BLOCK_SUMS_NAME, rows, headers)
    dataset.store.write_atomic(BLOCK_SUMS_NAME, sums_data)
    record = {"format": RECORD_FORMAT, "version": 1, "block_cells": block_cells,
              "chunk_genes": chunk_genes, "n_blocks": n_blocks, "zstd_level": level,
              "block_bytes": sizes, "block_nnz": nnzs, "block_crc32": crcs,
              CHUNK_SUMS_KEY: sums}  # fmt: skip
    if sum(nnzs) != m.nnz:
        raise FormatError(f"{dataset.store.describe()}: gene-major blocks hold {sum(nnzs)} "
                          f"nonzeros, the tiles {m.nnz}")  # fmt: skip
    manifest = dataclasses.replace(m, metadata={**m.metadata, "gene_major": record})
    dataset.store.write_atomic(MANIFEST_NAME, manifest.to_json_text().encode("utf-8"))
    dataset.manifest = manifest  # the dataset forgets the companion it read before
    return record


def _int_list(record: dict, key: str, n: int, where: str, limit: int = 2**62) -> list[int]:
    value = record.get(key)
    if not (isinstance(value, list) and len(value) == n and all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < limit for v in value)):
        raise FormatError(f"{where}: gene_major '{key}' must be {n} integers")  # fmt: skip
    return value


class GeneMajor:
    """The gene-major companion of one opened dataset (see :meth:`deltacells.Dataset.genes`).

    Raises
    ------
    FormatError
        For a malformed ``gene_major`` record.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        m = dataset.manifest
        where = dataset.store.describe(MANIFEST_NAME)
        record = m.metadata.get("gene_major")
        if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT \
                or record.get("version") != 1:  # fmt: skip
            raise FormatError(f"{where}: gene_major is not a {RECORD_FORMAT} version 1 record")
        block_cells, chunk_genes = record.get("block_cells"), record.get("chunk_genes")
        for key, value, top in (("block_cells", block_cells, 65_536),
                                ("chunk_genes", chunk_genes, 2**31)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise FormatError(f"{where}: gene_major '{key}' must be 1..{top}")
        n_blocks = -(-m.n_cells // block_cells)
        if record.get("n_blocks") != n_blocks:
            raise FormatError(f"{where}: gene_major n_blocks must be {n_blocks} for "
                              f"{m.n_cells} cells in blocks of {block_cells}")  # fmt: skip
        self.block_cells, self.chunk_genes, self.n_blocks = block_cells, chunk_genes, n_blocks
        self.block_bytes = _int_list(record, "block_bytes", n_blocks, where)
        self.block_nnz = _int_list(record, "block_nnz", n_blocks, where)
        self.block_crc32 = _int_list(record, "block_crc32", n_blocks, where, 2**32)
        if sum(self.block_nnz) != m.nnz:
            raise FormatError(f"{where}: gene_major blocks hold {sum(self.block_nnz)} nonzeros, "
                              f"the tiles {m.nnz}")  # fmt: skip
        known = {"format", "version", "block_cells", "chunk_genes", "n_blocks", "zstd_level",
                 "block_bytes", "block_nnz", "block_crc32", CHUNK_SUMS_KEY}  # fmt: skip
        unknown = sorted(set(record) - known)
        if unknown:
            raise FormatError(f"{where}: gene_major has unknown keys {unknown}")
        #: The blocks' chunk checksums (None: a companion written before them, whose partial
        #: reads only ``verify`` checks).
        self.sums = None if record.get(CHUNK_SUMS_KEY) is None else ChunkSums(
            record[CHUNK_SUMS_KEY], n_blocks, where, (BLOCK_SUMS_NAME,))  # fmt: skip
        self.bytes_read = 0

    def _checksums(self, b: int):
        """What :class:`~deltacells.store.ranged.RangedTile` checks block ``b``'s pieces with."""
        if self.sums is None:
            return None
        store = self.dataset.store
        return lambda header: self.sums.row(b, header, store.read_range, store.describe)

    def block_cells_of(self, b: int) -> tuple[int, int]:
        """Stored cells ``lo:hi`` of block ``b``."""
        n = self.dataset.manifest.n_cells
        return b * self.block_cells, min(n, (b + 1) * self.block_cells)

    def _check_block_header(self, b: int, tile_header, where: str) -> None:
        lo, hi = self.block_cells_of(b)
        m = self.dataset.manifest
        if (tile_header.n_cells, tile_header.n_genes, tile_header.nnz) != \
                (m.n_genes, hi - lo, self.block_nnz[b]):  # fmt: skip
            raise FormatError(f"{where}: holds {tile_header.n_cells} genes x "
                              f"{tile_header.n_genes} cells, {tile_header.nnz} nonzeros; the "
                              f"manifest says {m.n_genes} x {hi - lo}, {self.block_nnz[b]}")
        if tile_header.crc32 != self.block_crc32[b]:
            raise FormatError(f"{where}: CRC-32 {tile_header.crc32:08x} is not the "
                              f"{self.block_crc32[b]:08x} the manifest records")  # fmt: skip

    def _block_rows(self, b: int, stored_genes: np.ndarray, dtype: np.dtype) -> list:
        """Per requested stored gene (sorted, unique): (cell positions in the dataset,
        values) from block ``b``, by ranged reads of the chunks holding them."""
        store = self.dataset.store
        name = block_name(b)
        ranged = RangedTile(store, name, self.block_bytes[b], chunk_rows=self.chunk_genes,
                            checksums=self._checksums(b))  # fmt: skip
        self._check_block_header(b, ranged.header, store.describe(name))
        lo, _ = self.block_cells_of(b)
        # The genes of each chunk are one run of rows; all runs are read as one small tile.
        chunk_of = stored_genes // self.chunk_genes
        heads = np.flatnonzero(np.diff(chunk_of, prepend=-1) != 0)
        tails = np.append(heads[1:], len(stored_genes)) - 1
        plan = ranged.plan(np.stack([stored_genes[heads], stored_genes[tails] + 1], axis=1))
        tile, shifts = plan.assemble_one(plan.fetch_all())
        rows = tile.decode(dtype)
        at = stored_genes + np.repeat(shifts, np.diff(np.append(heads, len(stored_genes))))
        out = []
        for r in at.tolist():
            start, stop = rows.indptr[r], rows.indptr[r + 1]
            out.append((rows.indices[start:stop].astype(np.int64) + lo, rows.data[start:stop]))
        self.bytes_read += ranged.bytes_read
        return out

    def read(self, stored_genes: Sequence[int], values_dtype: Any = np.float32) -> sp.csc_matrix:
        """Columns ``stored_genes`` (stored gene order) for every cell, as CSC
        (cells x len(stored_genes)) in the order asked."""
        m = self.dataset.manifest
        asked = np.asarray(stored_genes, dtype=np.int64).reshape(-1)
        if len(asked) and (asked.min() < 0 or asked.max() >= m.n_genes):
            raise IndexError(f"gene index out of range 0..{m.n_genes - 1}")
        unique = np.unique(asked)
        dtype = np.dtype(values_dtype)
        store = self.dataset.store
        blocks = range(self.n_blocks)
        if store.is_local or self.n_blocks < 2:
            # Local reads are quick next to the per-block work; threads only add contention
            # for the GIL (measured: 5.8 ms sequential vs 10 ms threaded for 13 blocks).
            per_block = [self._block_rows(b, unique, dtype) for b in blocks]
        else:
            # Remote blocks in parallel, overlapping their requests' latency.
            with ThreadPoolExecutor(max_workers=min(self.n_blocks, store.io_threads)) as pool:
                per_block = list(pool.map(lambda b: self._block_rows(b, unique, dtype), blocks))
        columns = []
        for i in range(len(unique)):
            cells = [per_block[b][i][0] for b in blocks]
            values = [per_block[b][i][1] for b in blocks]
            columns.append((np.concatenate(cells) if cells else np.zeros(0, np.int64),
                            np.concatenate(values) if values else np.zeros(0, dtype)))  # fmt: skip
        where = np.searchsorted(unique, asked)
        lengths = np.array([len(columns[w][0]) for w in where], dtype=np.int64)
        indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        indices = np.concatenate([columns[w][0] for w in where]) if len(where) else \
            np.zeros(0, np.int64)  # fmt: skip
        data = np.concatenate([columns[w][1] for w in where]) if len(where) else \
            np.zeros(0, dtype)  # fmt: skip
        return sp.csc_matrix((data, indices, indptr), shape=(m.n_cells, len(asked)))

    def verify(self, progress: Callable[[Any], Any] | None = None) -> None:
        """Every block, read whole and CRC-checked, equals the transposed CSR tiles."""
        store = self.dataset.store
        blocks = range(self.n_blocks)
        for b in progress(blocks) if progress else blocks:
            name = block_name(b)
            where = store.describe(name)
            blob = store.read_bytes(name, max_size=self.block_bytes[b])
            if len(blob) != self.block_bytes[b]:
                raise FormatError(f"{where}: {len(blob)} bytes, the manifest says "
                                  f"{self.block_bytes[b]}")  # fmt: skip
            tile = Tile(blob, name=where)
            self._check_block_header(b, tile.layout, where)
            if self.sums is not None:
                check_checksum_row(self.sums, b, np.frombuffer(blob, np.uint8), store.read_range,
                                   store.describe)  # fmt: skip
            lo, hi = self.block_cells_of(b)
            expected = _stored_rows(self.dataset, lo, hi).tocsc()
            got = tile.decode(np.int32)
            if not (np.array_equal(got.indptr, expected.indptr)
                    and np.array_equal(got.indices, expected.indices)
                    and np.array_equal(got.data, expected.data)):  # fmt: skip
                raise FormatError(f"{where}: does not match the cell-major tiles of cells "
                                  f"{lo}:{hi}")  # fmt: skip
