"""Constants and structure of the deltacells tile format (FORMAT.md, versions 1 and 2).

This module parses and validates the parts of a tile that are not compressed: the 64-byte
header, the chunk table and the indptr. It does no I/O and does not touch zstd; the Cython
kernels (:mod:`deltacells.codec._decode`) check the frames themselves.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass, replace

import numpy as np

__all__ = [
    "CHUNK_FIELDS",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "FormatError",
    "LimitError",
    "Limits",
    "TileHeader",
    "TileLayout",
    "check_decoded_size",
    "chunk_entry_size",
    "get_limits",
    "pack_header",
    "parse_header",
    "parse_layout",
    "set_limits",
]

if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
    raise ImportError("deltacells tiles are little-endian; big-endian hosts are not supported")

MAGIC = b"DELTACEL"
#: The version this package writes. Readers accept :data:`READABLE_VERSIONS`.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
HEADER_SIZE = 64
#: Field names of a version 2 chunk-table entry (each a little-endian uint64).
CHUNK_FIELDS = (
    "cell_lo", "cell_hi", "nnz_lo", "nnz_hi",
    "gaps_off", "gaps_len", "vals_off", "vals_len",
    "vexc_off", "vexc_len", "gexc_off", "gexc_len",
)  # fmt: skip
#: Column index of each chunk field in the (n_chunks, 12) table.
CELL_LO, CELL_HI, NNZ_LO, NNZ_HI, GAPS_OFF, GAPS_LEN, VALS_OFF, VALS_LEN = range(8)
VEXC_OFF, VEXC_LEN, GEXC_OFF, GEXC_LEN = range(8, 12)
MAX_GENES = 2**31
MAX_GENES_V1 = 65536
MAX_COUNT = 2**31 - 1
STREAM_MAX = 65535
ALIGNMENT = 8

# magic, version, flags, n_cells, nnz, n_genes, n_chunks, indptr_off, total_size, crc32, reserved
_HEADER = struct.Struct("<8sIIQQIIQQII")
assert _HEADER.size == HEADER_SIZE


class FormatError(ValueError):
    """A tile, manifest or dataset file breaks the deltacells format.

    Messages name the object (file, URL or ``"<tile>"``), the place inside it (chunk, cell)
    and the rule that failed.
    """


class LimitError(FormatError):
    """A tile or dataset would need more memory than the reader's :class:`Limits` allow
    for its size on disk (a decompression bomb, or data far more compressible than counts)."""


@dataclass(frozen=True)
class Limits:
    """Reader limits, checked before anything is allocated.

    zstd turns a few bytes into megabytes of repeated values, so a small tile can claim, and
    legitimately hold, billions of nonzeros. Decoding is refused when a tile's decoded output
    (``int32`` indices, values at 8 bytes per nonzero at most, plus the indptr) would exceed
    ``max(decoded_floor, decoded_ratio * compressed size)``. Real count tiles decode to about
    5-10 times their size, so the defaults never get in the way of real data.

    Attributes
    ----------
    decoded_ratio
        Largest decoded size per compressed byte.
    decoded_floor
        Decoded bytes any tile may have whatever its compressed size.
    """

    decoded_ratio: float = 1000.0
    decoded_floor: int = 256 * 2**20

    def decoded_budget(self, compressed_bytes: int) -> float:
        """Most decoded bytes allowed for a tile of ``compressed_bytes``."""
        return max(float(self.decoded_floor), self.decoded_ratio * compressed_bytes)


_limits = Limits()


def get_limits() -> Limits:
    """The reader limits in force (see :class:`Limits`)."""
    return _limits


def set_limits(**changes: float) -> Limits:
    """Change reader limits for this process, e.g. ``set_limits(decoded_ratio=10_000)`` to
    read extremely compressible data; returns the previous :class:`Limits`."""
    global _limits
    previous = _limits
    _limits = replace(_limits, **changes)
    return previous


def decoded_bytes(n_cells: int, nnz: int) -> int:
    """Upper bound of a decoded tile's size: indptr, int32 indices and 8-byte values."""
    return 8 * (n_cells + 1) + 12 * nnz


def check_decoded_size(n_cells: int, nnz: int, compressed: int, where: str) -> None:
    """Raise :class:`LimitError` if a tile of ``compressed`` bytes decodes past the limits."""
    need = decoded_bytes(n_cells, nnz)
    budget = _limits.decoded_budget(compressed)
    if need > budget:
        raise LimitError(
            f"{where}: {nnz} nonzeros would decode to {need} bytes from {compressed}, more "
            f"than the limit of {int(budget)} (deltacells.set_limits(decoded_ratio=...) "
            "raises it for data this compressible)"
        )


def chunk_entry_size(version: int) -> int:
    """Bytes per chunk-table entry: 64 in version 1 (eight fields), 96 in version 2."""
    return 64 if version == 1 else 96


def pack_header(
    *,
    n_cells: int,
    nnz: int,
    n_genes: int,
    n_chunks: int,
    indptr_off: int,
    total_size: int,
    crc32: int,
    version: int = FORMAT_VERSION,
) -> bytes:
    """Return the 64-byte tile header for the given fields (flags and reserved are zero)."""
    return _HEADER.pack(
        MAGIC, version, 0, n_cells, nnz, n_genes, n_chunks, indptr_off, total_size, crc32, 0
    )


def _fail(where: str, message: str) -> FormatError:
    return FormatError(f"{where}: {message}")


@dataclass(frozen=True)
class TileHeader:
    """The 64-byte header of a tile, checked on its own (see :func:`parse_header`)."""

    version: int
    n_cells: int
    nnz: int
    n_genes: int
    n_chunks: int
    indptr_off: int
    total_size: int
    crc32: int


@dataclass(frozen=True)
class TileLayout(TileHeader):
    """The validated, uncompressed structure of one tile: the header fields plus

    Attributes
    ----------
    chunks
        ``int64`` array of shape ``(n_chunks, 12)`` with the fields of :data:`.CHUNK_FIELDS`
        (version 1 tables are widened with zero-length exception frames).
    indptr
        ``int64`` array of ``n_cells + 1`` row offsets (a copy, owned by this object).
    """

    chunks: np.ndarray
    indptr: np.ndarray


def parse_header(buf, where: str = "<tile>", object_size: int | None = None) -> TileHeader:
    """Parse and check the header alone: magic, version, flags, object size, n_genes.

    These are the checks that must pass before the CRC (which covers everything after the
    header) can even be computed; :func:`parse_layout` does the rest. ``object_size`` is the
    size of the whole tile when ``buf`` holds only its first bytes (ranged reads).
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise _fail(where, f"truncated: {view.nbytes} bytes is shorter than the {HEADER_SIZE}-byte "
                           "header")  # fmt: skip
    size = view.nbytes if object_size is None else object_size
    (
        magic,
        version,
        flags,
        n_cells,
        nnz,
        n_genes,
        n_chunks,
        indptr_off,
        total_size,
        crc,
        reserved,
    ) = _HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise _fail(where, f"bad magic {magic!r} (expected {MAGIC!r}); not a deltacells tile")
    if version not in READABLE_VERSIONS:
        raise _fail(where, f"unsupported tile version {version} (this reader knows 1 and 2): "
                           "written by a newer deltacells, or the header is damaged")  # fmt: skip
    if flags != 0:
        raise _fail(where, f"unknown flags 0x{flags:08x} (must be 0)")
    if reserved != 0:
        raise _fail(where, f"reserved header field is {reserved} (must be 0)")
    if total_size != size:
        raise _fail(
            where, f"header total_size {total_size} != object size {size} (truncated or padded)"
        )
    max_genes = MAX_GENES_V1 if version == 1 else MAX_GENES
    if not 1 <= n_genes <= max_genes:
        raise _fail(where, f"n_genes {n_genes} outside 1..{max_genes} for version {version}")
    return TileHeader(version, n_cells, nnz, n_genes, n_chunks, indptr_off, total_size, crc)


def parse_layout(buf, where: str = "<tile>", header: TileHeader | None = None) -> TileLayout:
    """Parse and validate a tile's header, chunk table and indptr.

    Every size read from the header is checked against the length of ``buf`` before
    anything of that size is allocated. Frame contents are not looked at here.

    Parameters
    ----------
    buf
        The whole tile (any object supporting the buffer protocol).
    where
        Name of the tile used in error messages (a path or URL).
    header
        The result of :func:`parse_header` on ``buf``, if already computed.

    Raises
    ------
    FormatError
        If any structural rule of FORMAT.md is broken.
    """
    view = memoryview(buf).cast("B")
    size = view.nbytes
    h = header if header is not None else parse_header(view, where)
    version, n_cells, nnz, n_genes = h.version, h.n_cells, h.nnz, h.n_genes
    n_chunks, indptr_off = h.n_chunks, h.indptr_off
    entry = chunk_entry_size(version)
    table_end = HEADER_SIZE + entry * n_chunks
    if table_end > size:
        raise _fail(
            where, f"chunk table of {n_chunks} entries runs past the end ({table_end} > {size})"
        )
    if indptr_off % ALIGNMENT or indptr_off < table_end:
        raise _fail(
            where,
            f"indptr_off {indptr_off} is unaligned or inside the chunk table (ends at {table_end})",
        )
    indptr_end = indptr_off + 8 * (n_cells + 1)
    if indptr_end > size:
        raise _fail(where, f"indptr of {n_cells} cells runs past the end ({indptr_end} > {size})")
    if (n_cells == 0) != (n_chunks == 0):
        raise _fail(
            where, f"{n_cells} cells in {n_chunks} chunks (a tile has chunks iff it has cells)"
        )

    indptr = np.frombuffer(view, dtype="<i8", count=n_cells + 1, offset=indptr_off).astype(np.int64)
    if indptr[0] != 0:
        raise _fail(where, f"indptr[0] is {indptr[0]} (must be 0)")
    if indptr[-1] != nnz:
        raise _fail(where, f"indptr[n_cells] is {indptr[-1]} but header nnz is {nnz}")
    if n_cells:
        lengths = np.diff(indptr)
        bad = np.flatnonzero((lengths < 0) | (lengths > n_genes))
        if bad.size:
            c = int(bad[0])
            raise _fail(
                where,
                f"indptr: cell {c} has {int(lengths[c])} nonzeros "
                f"(must be 0..n_genes={n_genes}; indptr must be non-decreasing)",
            )

    raw = np.frombuffer(view, dtype="<u8", count=n_chunks * entry // 8, offset=HEADER_SIZE)
    raw = raw.reshape(n_chunks, entry // 8)
    chunks = np.zeros((n_chunks, 12), dtype=np.int64)
    if n_chunks:
        _check_coverage(raw, indptr, n_cells, nnz, where)
        _check_frame_locations(raw, indptr_end, size, where)
        # Every field is now known to be at most nnz or the object size, so int64 is safe.
        chunks[:, : raw.shape[1]] = raw.astype(np.int64)
        if raw.shape[1] == 12:
            absent = chunks[:, [VEXC_LEN, GEXC_LEN]] == 0
            chunks[:, [VEXC_OFF, GEXC_OFF]] = np.where(absent, 0, chunks[:, [VEXC_OFF, GEXC_OFF]])
    # Structure is sound; refuse what would decode past the limits before any decode allocates.
    check_decoded_size(n_cells, nnz, size, where)
    return TileLayout(**vars(h), chunks=chunks, indptr=indptr)


def _first_suspect(bad: np.ndarray) -> int | None:
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def _check_coverage(raw, indptr, n_cells, nnz, where) -> None:
    """Chunks must cover the cells and nonzeros contiguously and agree with indptr.

    Checked for all chunks at once with numpy (tiles may have hundreds of chunks); the first
    suspect chunk is then checked alone to name the rule it breaks.
    """
    cell_lo, cell_hi = raw[:, CELL_LO], raw[:, CELL_HI]
    nnz_lo, nnz_hi = raw[:, NNZ_LO], raw[:, NNZ_HI]
    zero = np.zeros(1, dtype=np.uint64)
    bad = (cell_lo != np.concatenate([zero, cell_hi[:-1]])) | (
        nnz_lo != np.concatenate([zero, nnz_hi[:-1]])
    )
    bad |= (cell_hi < cell_lo) | (cell_hi > np.uint64(n_cells)) | (nnz_hi < nnz_lo)
    in_range = ~bad
    lo = np.where(in_range, cell_lo, 0).astype(np.int64)
    hi = np.where(in_range, cell_hi, 0).astype(np.int64)
    bad |= in_range & (
        (indptr[lo] != nnz_lo.astype(np.int64)) | (indptr[hi] != nnz_hi.astype(np.int64))
    )
    bad |= in_range & (nnz_hi - nnz_lo >= np.uint64(2**32))
    suspect = _first_suspect(bad)
    if suspect is not None:
        _check_chunk_coverage(raw, indptr, n_cells, suspect, where)
    if int(cell_hi[-1]) != n_cells or int(nnz_hi[-1]) != nnz:
        raise _fail(
            where,
            f"last chunk ends at cell {int(cell_hi[-1])} / nonzero {int(nnz_hi[-1])}, "
            f"expected {n_cells} / {nnz}",
        )


def _check_chunk_coverage(raw, indptr, n_cells, c, where) -> None:
    """The coverage rules for chunk ``c`` alone, raising with the rule it breaks."""
    lo, hi = int(raw[c, CELL_LO]), int(raw[c, CELL_HI])
    a, b = int(raw[c, NNZ_LO]), int(raw[c, NNZ_HI])
    expect_lo = 0 if c == 0 else int(raw[c - 1, CELL_HI])
    expect_a = 0 if c == 0 else int(raw[c - 1, NNZ_HI])
    if lo != expect_lo or a != expect_a:
        raise _fail(
            where,
            f"chunk {c}: starts at cell {lo} / nonzero {a}, expected {expect_lo} / {expect_a} "
            "(chunks must cover the tile contiguously)",
        )
    if hi < lo or hi > n_cells or b < a:
        raise _fail(where, f"chunk {c}: cells {lo}..{hi} / nonzeros {a}..{b} out of order or range")
    if int(indptr[lo]) != a or int(indptr[hi]) != b:
        raise _fail(
            where, f"chunk {c}: nnz range {a}..{b} disagrees with indptr at cells {lo}, {hi}"
        )
    if b - a >= 2**32:
        raise _fail(where, f"chunk {c}: {b - a} nonzeros (a chunk holds fewer than 2^32)")


def _check_frame_locations(raw, streams_start, size, where) -> None:
    """Every frame lies inside the stream area, 8-byte aligned; gaps and vals always exist."""
    n_frames = (raw.shape[1] - 4) // 2
    offsets = raw[:, 4::2][:, :n_frames]
    lengths = raw[:, 5::2][:, :n_frames]
    present = lengths > 0
    present[:, :2] = True  # gaps and vals frames must exist (a zero length is an error)
    size_u = np.uint64(size)
    outside = (
        (offsets < np.uint64(streams_start))
        | (offsets > size_u)
        | (lengths > size_u - np.minimum(offsets, size_u))
    )
    bad = present & ((lengths == 0) | outside | (offsets % np.uint64(ALIGNMENT) != 0))
    suspect = _first_suspect(bad.any(axis=1))
    if suspect is not None:
        _check_chunk_frames(raw, streams_start, size, suspect, where)


def _check_chunk_frames(raw, streams_start, size, c, where) -> None:
    """The frame-location rules for chunk ``c`` alone, raising with the rule it breaks."""
    names = ("gaps", "vals", "vexc", "gexc")[: (raw.shape[1] - 4) // 2]
    for f, name in enumerate(names):
        off, length = int(raw[c, 4 + 2 * f]), int(raw[c, 5 + 2 * f])
        if f >= 2 and length == 0:
            continue  # no exceptions of this kind; the offset is ignored
        if length == 0:
            raise _fail(where, f"chunk {c}: {name} frame has length 0 (every chunk has one)")
        if off < streams_start or off + length > size:
            raise _fail(
                where,
                f"chunk {c}: {name} frame [{off}, {off + length}) lies outside the stream area "
                f"[{streams_start}, {size})",
            )
        if off % ALIGNMENT:
            raise _fail(where, f"chunk {c}: {name} frame offset {off} is not 8-byte aligned")
