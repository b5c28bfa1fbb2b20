"""Encode count matrices into deltacells tiles and decode them back.

The public entry points are :func:`encode_tile`, :func:`decode_tile` and :class:`Tile`; the hot
loops live in the kernel modules of :mod:`deltacells.codec` (``_decode``, ``_encode``, ``_rows``,
``_checksum``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import scipy.sparse as sp
from numpy.typing import ArrayLike, DTypeLike

from deltacells.codec import _checksum, _decode, _encode, _frames
from deltacells.codec.format import (
    ALIGNMENT,
    CELL_HI,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAX_COUNT,
    MAX_GENES,
    NNZ_HI,
    NNZ_LO,
    FormatError,
    TileLayout,
    chunk_entry_size,
    pack_header,
    parse_header,
    parse_layout,
)
from deltacells.codec.threads import effective_n_threads

__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_N_CHUNKS",
    "VALUE_DTYPES",
    "CountError",
    "Tile",
    "canonical_csr",
    "chunk_bounds",
    "decode_tile",
    "empty_output",
    "encode_tile",
    "exception_limit",
    "gather_tiles_into",
]

#: Default zstd level, chosen from the level table of ``benchmarks/bench_codec.py``: the smallest
#: output whose encoding stays a small fraction of anndata's gzip h5ad write of the same data, so
#: a whole conversion (reading input, obs, var) stays within that budget. Levels 12 and up are
#: smaller still but several times slower to encode; 19 is the archive choice.
DEFAULT_LEVEL = 9
DEFAULT_N_CHUNKS = 8
#: Value dtypes the decoder writes directly.
VALUE_DTYPES = (np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.float64))


def exception_limit(nnz: int | np.ndarray) -> int | np.ndarray:
    """Most exceptions of either kind the writer accepts in a tile of ``nnz`` nonzeros (an
    integer, or an array of them, elementwise)."""
    if np.ndim(nnz):
        return np.maximum(1024, np.asarray(nnz) // 200)
    return max(1024, nnz // 200)


def empty_output(length: int, dtype: DTypeLike) -> np.ndarray:
    """An uninitialized 1-D array for decoded output, from pyarrow's memory pool.

    Decoded arrays are large and short-lived (decode, use, drop, decode the next tile). Memory
    from ``numpy.empty`` that size is mapped fresh from the OS each time, and the kernel zeroing
    those pages costs about a third of the decompression itself; pyarrow's pool (mimalloc or
    jemalloc) hands freed blocks back instead. The array keeps its pyarrow buffer alive.
    """
    dtype = np.dtype(dtype)
    if length == 0:
        return np.empty(0, dtype=dtype)
    return np.frombuffer(pa.allocate_buffer(length * dtype.itemsize), dtype=dtype)


def stable_order(keys: np.ndarray) -> np.ndarray:
    """``numpy.argsort(keys, kind="stable")``, quicker for keys spanning under 65,536 values
    (tiles or chunks of a read): numpy sorts 16-bit keys by radix, wider ones by merging."""
    if len(keys) > 64:
        low = keys.min()
        if keys.max() - low < 65536:
            keys = (keys - low).astype(np.uint16)
    return np.argsort(keys, kind="stable")


def _value_dtype(values_dtype: DTypeLike) -> np.dtype:
    dtype = np.dtype(values_dtype)
    if dtype not in VALUE_DTYPES:
        raise ValueError(f"values_dtype must be int32, float32 or float64, not {dtype}")
    return dtype


class CountError(ValueError):
    """A value that is not a count (negative, non-integral, non-finite or >= 2^31).

    Attributes
    ----------
    problem
        What is wrong, e.g. ``"negative count"``.
    cell, gene
        Row and column of the first offending entry.
    """

    def __init__(self, problem: str, cell: int, gene: int, *, message: str | None = None) -> None:
        super().__init__(message or f"{problem} at cell {cell}, gene {gene}")
        self.problem, self.cell, self.gene = problem, cell, gene


def _raise_first(problem: str, mask: np.ndarray, indptr: np.ndarray, indices: np.ndarray):
    pos = int(np.flatnonzero(mask)[0])
    cell = int(np.searchsorted(indptr, pos, side="right")) - 1
    raise CountError(problem, cell, int(indices[pos]))


def canonical_csr(matrix: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int]]:
    """Check a count matrix and return it as canonical CSR arrays.

    Canonical means: indices sorted and unique within each row (duplicates summed), no stored
    zeros, every value an integer in ``[1, 2^31 - 1]``. The input is never modified.

    Parameters
    ----------
    matrix
        A scipy sparse matrix or array (CSR, CSC, COO, ...) or a dense 2-D array-like, of any
        integer, boolean or floating dtype.

    Returns
    -------
    indptr, indices, data, shape
        ``int64`` indptr, ``int32`` indices, ``int32`` counts and the matrix shape.

    Raises
    ------
    CountError
        For negative, non-integral, non-finite or too-large values, naming the first cell and
        gene that has one.
    """
    if sp.issparse(matrix):
        if matrix.format != "csr" and matrix.dtype.kind in "biu" and matrix.dtype.itemsize < 8:
            # tocsr() sums duplicates in the input dtype; widen first so sums cannot wrap.
            matrix = matrix.astype(np.int64)
        csr = matrix.tocsr()
        # tocsr() returns the input itself for CSR input; never modify the caller's matrix.
        if csr is matrix and not csr.has_canonical_format:
            csr = csr.copy()
    else:
        dense = np.asarray(matrix)
        if dense.ndim != 2:
            raise ValueError(f"expected a 2-D matrix, got an array of shape {dense.shape}")
        if dense.dtype.kind not in "biuf":
            raise ValueError(f"counts must be integers or floats, not {dense.dtype}")
        csr = sp.csr_matrix(dense)
    n_cells, n_genes = csr.shape
    if not 1 <= n_genes <= MAX_GENES:
        raise ValueError(f"a tile needs 1..2^31 genes, the matrix has {n_genes}")
    data = csr.data
    kind = data.dtype.kind
    if kind not in "biuf":
        raise ValueError(f"counts must be integers or floats, not {data.dtype}")
    if not csr.has_canonical_format:
        if kind in "biu":
            # Sum duplicates in int64 so two large counts cannot wrap around.
            csr = sp.csr_matrix((data.astype(np.int64), csr.indices, csr.indptr), shape=csr.shape)
        csr.sum_duplicates()
        data = csr.data
    indptr = np.asarray(csr.indptr, dtype=np.int64)
    indices = csr.indices
    if kind == "f":
        bad = ~np.isfinite(data)
        if bad.any():
            _raise_first("non-finite count (NaN or inf)", bad, indptr, indices)
        bad = data != np.floor(data)
        if bad.any():
            _raise_first("non-integral count", bad, indptr, indices)
    if data.size:
        bad = data < 0
        if bad.any():
            _raise_first("negative count", bad, indptr, indices)
        # Floats compare against 2^31 itself, which every float type holds exactly: against
        # 2^31 - 1 NumPy 2 rounds the bound to the array's float32, and 2^31 would pass.
        bad = data >= data.dtype.type(2**31) if kind == "f" else data > MAX_COUNT
        if bad.any():
            _raise_first("count >= 2^31", bad, indptr, indices)
    zeros = data == 0
    if zeros.any():
        keep = ~zeros
        row_of = np.repeat(np.arange(n_cells, dtype=np.int64), np.diff(indptr))
        indptr = np.zeros(n_cells + 1, dtype=np.int64)
        np.cumsum(np.bincount(row_of[keep], minlength=n_cells), out=indptr[1:])
        indices, data = indices[keep], data[keep]
    return (
        indptr,
        np.ascontiguousarray(indices, dtype=np.int32),
        np.ascontiguousarray(data, dtype=np.int32),
        (int(n_cells), int(n_genes)),
    )


def chunk_bounds(indptr: np.ndarray, n_chunks: int) -> np.ndarray:
    """Cell boundaries of up to ``n_chunks`` chunks holding roughly equal nonzeros.

    Boundaries fall on cells; chunks without cells are dropped, so a tile with fewer cells than
    ``n_chunks`` has fewer chunks. A tile without nonzeros is split by cell count.
    """
    n_cells = len(indptr) - 1
    if n_cells == 0:
        return np.zeros(1, dtype=np.int64)
    nnz = int(indptr[-1])
    k = np.arange(1, n_chunks, dtype=np.int64)
    if nnz == 0:
        inner = (k * n_cells) // n_chunks
    else:
        # First cell whose start reaches the k-th equal share of the nonzeros.
        inner = np.searchsorted(indptr, (k * nnz + n_chunks - 1) // n_chunks, side="left")
    bounds = np.unique(np.concatenate([[0], np.clip(inner, 0, n_cells), [n_cells]]))
    return bounds.astype(np.int64)


def encode_tile(
    matrix: Any,
    *,
    n_chunks: int = DEFAULT_N_CHUNKS,
    level: int = DEFAULT_LEVEL,
    n_threads: int | None = None,
    chunk_rows: int | None = None,
) -> bytes:
    """Encode a count matrix as one version-2 tile.

    Parameters
    ----------
    matrix
        Cells by genes: a scipy sparse matrix (CSR, CSC, COO, ...) or a dense array, integer or
        float, holding non-negative integer counts below 2^31. Duplicate entries are summed and
        explicit zeros dropped.
    n_chunks
        Number of independently decodable chunks (fewer if the tile has fewer cells).
    level
        zstd compression level. Higher levels are smaller and decode as fast, but encode slower.
    n_threads
        Threads compressing chunks in parallel; ``None`` resolves like scikit-learn
        (``OMP_NUM_THREADS``, then the CPUs usable by this process). The output is the same
        for every thread count.
    chunk_rows
        Instead of ``n_chunks`` chunks of equal nonzeros, chunks of this many rows each (the
        last may hold fewer): row ``r`` is then in chunk ``r // chunk_rows``, so a reader can
        fetch one row's chunk by ranged reads without the whole chunk table (the gene-major
        companion does this).

    Returns
    -------
    bytes
        The tile.

    Raises
    ------
    ValueError
        For values that are not counts, or a tile with more than :func:`.exception_limit`
        exceptions of either kind.
    """
    if int(n_chunks) < 1:
        raise ValueError(f"n_chunks must be >= 1, got {n_chunks}")
    lo, hi = _encode.zstd_level_range()
    if not lo <= int(level) <= hi:
        raise ValueError(f"zstd level {level} outside {lo}..{hi}")
    indptr, indices, data, (n_cells, n_genes) = canonical_csr(matrix)
    if chunk_rows is not None:
        if int(chunk_rows) < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        bounds = np.unique(np.append(np.arange(0, n_cells, int(chunk_rows)), n_cells))
        bounds = bounds.astype(np.int64)
    else:
        bounds = chunk_bounds(indptr, int(n_chunks))
    threads = effective_n_threads(n_threads)
    nnz = int(indptr[-1])
    for c in range(len(bounds) - 1):
        if int(indptr[bounds[c + 1]] - indptr[bounds[c]]) >= 2**32:
            raise ValueError(f"chunk {c} would hold >= 2^32 nonzeros; use more chunks")
    frames, exceptions = _encode.encode_chunks(
        indptr, indices, data, bounds, n_genes, int(level), threads
    )
    limit = exception_limit(nnz)
    for kind, column in (("count above 65535", 0), ("gene gap above 65535", 1)):
        total = int(exceptions[:, column].sum()) if len(exceptions) else 0
        if total > limit:
            raise ValueError(
                f"tile has {total} exceptions ({kind}); the writer allows max(1024, nnz/200) = "
                f"{limit}. Exceptions are applied one by one and must stay rare: values this "
                "large are not raw counts, and gaps this large need genes sorted by total counts."
            )
    return _assemble(indptr, bounds, frames, n_cells, n_genes, threads)


def _assemble(indptr, bounds, frames, n_cells: int, n_genes: int, n_threads: int) -> bytes:
    """Lay out header, chunk table, indptr and frames (8-byte aligned) and add the CRC."""
    n_chunks = len(frames)
    entry = chunk_entry_size(FORMAT_VERSION)
    indptr_off = HEADER_SIZE + entry * n_chunks
    pos = indptr_off + 8 * (n_cells + 1)
    table = np.zeros((n_chunks, entry // 8), dtype="<u8")
    placed = []
    for c, chunk_frames in enumerate(frames):
        table[c, :4] = (bounds[c], bounds[c + 1], indptr[bounds[c]], indptr[bounds[c + 1]])
        for f, frame in enumerate(chunk_frames):
            if not frame:
                continue
            pos += -pos % ALIGNMENT
            table[c, 4 + 2 * f] = pos
            table[c, 5 + 2 * f] = len(frame)
            placed.append((pos, frame))
            pos += len(frame)
    out = bytearray(pos)
    out[HEADER_SIZE:indptr_off] = table.tobytes()
    out[indptr_off : indptr_off + 8 * (n_cells + 1)] = indptr.astype("<i8").tobytes()
    for offset, frame in placed:
        out[offset : offset + len(frame)] = frame
    crc = _checksum.crc32_range(out, HEADER_SIZE, n_threads)
    out[:HEADER_SIZE] = pack_header(
        n_cells=n_cells,
        nnz=int(indptr[-1]),
        n_genes=n_genes,
        n_chunks=n_chunks,
        indptr_off=indptr_off,
        total_size=pos,
        crc32=crc,
    )
    return bytes(out)


class Tile:
    """A parsed and validated tile that can be decoded or gathered from many times.

    Construction checks the header, chunk table, indptr and every frame header against the
    object size (and, by default, the CRC), so later decodes only do per-nonzero checks.

    Parameters
    ----------
    blob
        The tile bytes: ``bytes``, ``bytearray``, ``memoryview``, ``mmap`` or a ``uint8`` array.
        It is referenced, not copied, and must not change while the tile is in use.
    name
        Used in error messages (a file name or URL).
    verify_crc
        Check the CRC-32 of the tile. It costs a pass over the compressed bytes (see the codec
        benchmark); turn it off only for data already verified, e.g. by ``deltacells verify``.
    n_threads
        Threads for the CRC; ``None`` resolves like scikit-learn.

    Raises
    ------
    FormatError
        If the tile breaks any rule of FORMAT.md that can be checked without decompressing.
    """

    def __init__(
        self,
        blob: Any,
        *,
        name: str = "<tile>",
        verify_crc: bool = True,
        n_threads: int | None = None,
    ) -> None:
        buf = np.frombuffer(blob, dtype=np.uint8) if not isinstance(blob, np.ndarray) else blob
        if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
            buf = np.ascontiguousarray(buf).view(np.uint8).reshape(-1)
        self.name = name
        self._buf = buf
        header = parse_header(buf, name)
        if verify_crc:
            # Before the structure: damage anywhere is then reported as what it is.
            crc = _checksum.crc32_range(buf, HEADER_SIZE, effective_n_threads(n_threads))
            if crc != header.crc32:
                raise FormatError(
                    f"{name}: CRC-32 mismatch (stored {header.crc32:08x}, computed {crc:08x})"
                )
        self.layout: TileLayout = parse_layout(buf, name, header)
        self._exceptions = _frames.check_frames(
            buf, self.layout.chunks, name, effective_n_threads(n_threads)
        )

    @property
    def shape(self) -> tuple[int, int]:
        """(cells, genes)."""
        return (self.layout.n_cells, self.layout.n_genes)

    @property
    def nnz(self) -> int:
        """Stored nonzeros."""
        return self.layout.nnz

    @property
    def n_chunks(self) -> int:
        """Independently decodable chunks."""
        return self.layout.n_chunks

    @property
    def version(self) -> int:
        """Format version of this tile (1 or 2)."""
        return self.layout.version

    @property
    def nbytes(self) -> int:
        """Size of the tile in bytes."""
        return self.layout.total_size

    @property
    def indptr(self) -> np.ndarray:
        """Row offsets (``int64``, read-only view)."""
        view = self.layout.indptr.view()
        view.flags.writeable = False
        return view

    @property
    def exception_counts(self) -> np.ndarray:
        """``(n_chunks, 2)`` counts of value and gap exceptions per chunk."""
        return self._exceptions.copy()

    def __repr__(self) -> str:
        return (
            f"Tile({self.name!r}, version={self.version}, shape={self.shape}, nnz={self.nnz}, "
            f"n_chunks={self.n_chunks}, nbytes={self.nbytes})"
        )

    def decode_into(
        self,
        indices: np.ndarray,
        values: np.ndarray,
        *,
        n_threads: int | None = None,
        col_map: np.ndarray | None = None,
    ) -> None:
        """Decode all cells into caller-provided buffers (the indptr is :attr:`indptr`).

        Parameters
        ----------
        indices
            ``int32`` array of at least :attr:`nnz` entries.
        values
            ``int32``, ``float32`` or ``float64`` array of at least :attr:`nnz` entries.
        n_threads
            Decoding threads; ``None`` resolves like scikit-learn.
        col_map
            Optional permutation of the columns: column ``j`` is written as ``col_map[j]``
            and each cell sorted again, chunk by chunk while its output is in cache (faster
            than decoding, then permuting).
        """
        _check_buffer("indices", indices, np.dtype(np.int32), self.nnz)
        _check_buffer("values", values, _value_dtype(values.dtype), self.nnz)
        _decode.decode_into(
            self._buf,
            self.layout.chunks,
            self.layout.indptr,
            self._exceptions,
            self.layout.n_genes,
            indices,
            values,
            effective_n_threads(n_threads),
            self.name,
            col_map,
        )

    def decode(
        self,
        values_dtype: DTypeLike = np.float32,
        *,
        n_threads: int | None = None,
        out: Sequence[np.ndarray] | None = None,
        col_map: np.ndarray | None = None,
    ) -> sp.csr_matrix:
        """Decode the whole tile.

        Parameters
        ----------
        values_dtype
            ``int32``, ``float32`` (default, like scanpy) or ``float64``.
        n_threads
            Decoding threads; ``None`` resolves like scikit-learn. Output does not depend on it.
        out
            Optional ``(indices, values)`` buffers to decode into (reused across calls to
            avoid fresh allocations); the result then shares memory with them.
        col_map
            Optional permutation of the columns (see :meth:`decode_into`).

        Returns
        -------
        scipy.sparse.csr_matrix
            Canonical CSR (sorted indices, no duplicates) of shape :attr:`shape`.
        """
        dtype = _value_dtype(values_dtype)
        if out is None:
            indices = empty_output(self.nnz, np.int32)
            values = empty_output(self.nnz, dtype)
        else:
            indices, values = out
            if values.dtype != dtype:
                raise ValueError(f"out values buffer is {values.dtype}, values_dtype is {dtype}")
        self.decode_into(indices, values, n_threads=n_threads, col_map=col_map)
        return _csr(values[: self.nnz], indices[: self.nnz], self.layout.indptr.copy(), self.shape)

    def row_lengths(self, rows: np.ndarray) -> np.ndarray:
        """Nonzeros of each cell in ``rows`` (int64 positions within the tile)."""
        indptr = self.layout.indptr
        return indptr[rows + 1] - indptr[rows]

    def chunk_of(self, rows: np.ndarray) -> np.ndarray:
        """Index of the chunk holding each cell in ``rows`` (int64 positions within the tile)."""
        return np.searchsorted(self.layout.chunks[:, CELL_HI], rows, side="right")

    def gather_into(
        self,
        rows: np.ndarray,
        out_indptr: np.ndarray,
        indices: np.ndarray,
        values: np.ndarray,
        *,
        positions: np.ndarray | None = None,
        n_threads: int | None = None,
        col_map: np.ndarray | None = None,
    ) -> None:
        """Decode cells into given rows of a CSR being assembled (by one or several tiles).

        Parameters
        ----------
        rows
            int64 cell positions within this tile (validated by the caller, non-negative).
        out_indptr
            int64 ``indptr`` of the output, ``len(rows) + 1`` entries; output row ``j`` is
            ``rows[j]`` and must have room for exactly that cell's nonzeros.
        indices, values
            The output's ``int32`` indices and values buffers.
        positions
            Which output rows this tile writes (default: all); the rest are left alone.
        n_threads
            Decoding threads; ``None`` resolves like scikit-learn.
        col_map
            Optional permutation of the columns (see :meth:`decode_into`), applied to each
            written row right after its chunk is decoded.
        """
        chosen = np.arange(len(rows), dtype=np.int64) if positions is None else positions
        gather_tiles_into([self], [chosen], rows, out_indptr, indices, values,
                          n_threads=n_threads, col_map=col_map)  # fmt: skip

    def gather(
        self,
        rows: ArrayLike,
        values_dtype: DTypeLike = np.float32,
        *,
        n_threads: int | None = None,
        col_map: np.ndarray | None = None,
    ) -> sp.csr_matrix:
        """Decode only the given cells, decompressing only the chunks they live in.

        Parameters
        ----------
        rows
            Integer cell indices in any order; repeats are allowed and negative indices count
            from the end.
        values_dtype
            ``int32``, ``float32`` or ``float64``.
        n_threads
            Decoding threads; ``None`` resolves like scikit-learn.
        col_map
            Optional permutation of the columns (see :meth:`decode_into`).

        Returns
        -------
        scipy.sparse.csr_matrix
            ``len(rows)`` by ``n_genes``; row ``j`` is cell ``rows[j]``.
        """
        dtype = _value_dtype(values_dtype)
        rows = np.asarray(rows)
        if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
            raise TypeError("rows must be a 1-D array of integers")
        n_cells = self.layout.n_cells
        rows = rows.astype(np.int64)
        if rows.size and (rows.min() < -n_cells or rows.max() >= n_cells):
            raise IndexError(f"row index out of range for a tile of {n_cells} cells")
        rows = np.where(rows < 0, rows + n_cells, rows)
        out_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(self.row_lengths(rows), out=out_indptr[1:])
        nnz = int(out_indptr[-1])
        indices = empty_output(nnz, np.int32)
        values = empty_output(nnz, dtype)
        self.gather_into(rows, out_indptr, indices, values, n_threads=n_threads, col_map=col_map)
        return _csr(values, indices, out_indptr, (len(rows), self.layout.n_genes))

    def chunk_nnz(self) -> np.ndarray:
        """Nonzeros per chunk."""
        return self.layout.chunks[:, NNZ_HI] - self.layout.chunks[:, NNZ_LO]


def gather_tiles_into(
    tiles: Sequence[Tile],
    groups: Sequence[np.ndarray],
    rows: np.ndarray,
    out_indptr: np.ndarray,
    indices: np.ndarray,
    values: np.ndarray,
    *,
    n_threads: int | None = None,
    col_map: np.ndarray | None = None,
) -> None:
    """Decode cells of several tiles into the rows of one CSR, in one parallel section.

    Parameters
    ----------
    tiles
        The tiles, all with the same number of genes.
    groups
        For each tile, the output rows (positions in ``rows``) it writes; together they may
        cover all output rows or some.
    rows
        int64 cell position within its tile of every output row (validated by the caller,
        non-negative).
    out_indptr
        int64 ``indptr`` of the output, ``len(rows) + 1`` entries; output row ``j`` must have
        room for exactly that cell's nonzeros.
    indices, values
        The output's ``int32`` indices and values buffers.
    n_threads
        Decoding threads; ``None`` resolves like scikit-learn. Output does not depend on it.
    col_map
        Optional permutation of the columns (see :meth:`Tile.decode_into`), applied to each
        written row right after its chunk is decoded.

    Notes
    -----
    Threads take the touched chunks of all tiles from one queue, so none waits at the end of
    a tile for the other's last chunk (one parallel section per tile did).
    """
    if tiles:
        _gather(tiles, groups, rows, out_indptr, indices, values, n_threads, col_map)


def gathered_indptr(tiles: Sequence[Tile], groups: Sequence[np.ndarray],
                    rows: np.ndarray) -> np.ndarray:
    """The int64 ``indptr`` of a gather's output: row ``j`` holds cell ``rows[j]`` of the tile
    whose group holds ``j`` (as :func:`gather_tiles_into` takes them), sized from the tiles'
    own indptr without decoding anything."""
    lengths = np.empty(len(rows), dtype=np.int64)
    for tile, mine in zip(tiles, groups, strict=True):
        lengths[mine] = tile.row_lengths(rows[mine])
    indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=indptr[1:])
    return indptr


def _gather(tiles, groups, rows, out_indptr, indices, values, n_threads, col_map,
            dst_idx=None, dst_val=None) -> None:  # fmt: skip
    """Plan the chunks of :func:`gather_tiles_into` and run the kernel (``dst_*``: output
    rows at addresses, checked by the caller)."""
    n_genes = tiles[0].layout.n_genes
    if any(t.layout.n_genes != n_genes for t in tiles):
        raise ValueError("tiles of different gene counts cannot fill one matrix")
    # Every touched chunk of every tile, then the output rows grouped by (tile, chunk).
    chosen = [np.asarray(g, dtype=np.int64) for g in groups]
    which_tile = np.repeat(np.arange(len(tiles), dtype=np.int64), [len(g) for g in chosen])
    positions = np.concatenate(chosen)
    chunk_ids = np.concatenate([t.chunk_of(rows[g]) for t, g in zip(tiles, chosen, strict=True)])
    most_chunks = max(t.n_chunks for t in tiles) + 1
    key = which_tile * most_chunks + chunk_ids
    by_chunk = stable_order(key)
    keys, group_starts = np.unique(key[by_chunk], return_index=True)
    _decode.gather_into(
        [t._buf for t in tiles],
        [t.layout.chunks for t in tiles],
        [t.layout.indptr for t in tiles],
        [t._exceptions for t in tiles],
        n_genes,
        rows,
        np.ascontiguousarray(positions[by_chunk]),
        keys // most_chunks,
        keys % most_chunks,
        np.append(group_starts, len(positions)).astype(np.int64),
        out_indptr,
        indices,
        values,
        # No more threads than chunks to decode: a team of threads started for one chunk
        # only waits (and, on a busy machine, waits long).
        min(effective_n_threads(n_threads), max(len(keys), 1)),
        [t.name for t in tiles],
        col_map,
        dst_idx,
        dst_val,
    )


def _check_buffer(name: str, array: np.ndarray, dtype: np.dtype, length: int) -> None:
    if not isinstance(array, np.ndarray) or array.dtype != dtype or array.ndim != 1:
        raise ValueError(f"{name} buffer must be a 1-D {dtype} numpy array")
    if not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError(f"{name} buffer must be contiguous and writeable")
    if len(array) < length:
        raise ValueError(f"{name} buffer holds {len(array)} entries, {length} are needed")


def _csr(values, indices, indptr, shape) -> sp.csr_matrix:
    matrix = sp.csr_matrix((values, indices, indptr), shape=shape, copy=False)
    matrix.has_sorted_indices = True
    matrix.has_canonical_format = True
    return matrix


def decode_tile(
    blob: Any,
    *,
    values_dtype: DTypeLike = np.float32,
    n_threads: int | None = None,
    verify_crc: bool = True,
    name: str = "<tile>",
) -> sp.csr_matrix:
    """Validate and decode one tile (version 1 or 2) into a CSR matrix.

    Parameters
    ----------
    blob
        The tile bytes (``bytes``, ``memoryview``, ``mmap``, ``uint8`` array, ...).
    values_dtype
        ``int32``, ``float32`` (default) or ``float64``.
    n_threads
        Decoding threads; ``None`` resolves like scikit-learn. Output does not depend on it.
    verify_crc
        Check the tile's CRC-32 first (default). See :class:`Tile`.
    name
        Used in error messages.

    Returns
    -------
    scipy.sparse.csr_matrix
        The cells of the tile with sorted gene indices.

    Raises
    ------
    FormatError
        If the tile is malformed in any way FORMAT.md defines.
    """
    tile = Tile(blob, name=name, verify_crc=verify_crc, n_threads=n_threads)
    return tile.decode(values_dtype, n_threads=n_threads)
