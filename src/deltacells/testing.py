"""Helpers for testing deltacells and code built on it: tile mutation fuzzing.

:func:`fuzz_tiles` feeds mutated tiles to the decoder and checks the one promise a reader makes
about hostile input: it either raises :class:`~deltacells.FormatError` or returns a well-formed
matrix of the declared shape; it never crashes, hangs or allocates absurd memory.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

from deltacells.codec import Tile
from deltacells.format import HEADER_SIZE, FormatError

__all__ = ["FuzzReport", "check_rejects_or_decodes", "fuzz_tiles", "mutate_tile"]

_BOUNDARY_U64 = (0, 1, 7, 8, 63, 64, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1,
                 2**64 - 1)  # fmt: skip


def _fix_crc(blob: bytearray) -> None:
    if len(blob) >= HEADER_SIZE:
        struct.pack_into("<I", blob, 56, zlib.crc32(bytes(blob[HEADER_SIZE:])))


def mutate_tile(blob: bytes, rng: np.random.Generator) -> bytes:
    """Return a randomly damaged copy of a tile.

    Mutations: bit flips, random bytes, a 64-bit header or chunk-table field set to a boundary
    value, truncation, extension, and a copied byte range. Half of the mutants get a corrected
    CRC so that checks behind the CRC are exercised too.
    """
    out = bytearray(blob)
    kind = int(rng.integers(6))
    if kind == 0:
        for _ in range(int(rng.integers(1, 4))):
            pos = int(rng.integers(len(out)))
            out[pos] ^= 1 << int(rng.integers(8))
    elif kind == 1:
        pos = int(rng.integers(len(out)))
        n = int(rng.integers(1, 9))
        out[pos : pos + n] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    elif kind == 2:
        # A field of the header or chunk table, 8-byte aligned, set to a boundary value.
        table_end = min(len(out), HEADER_SIZE + 96 * 16)
        pos = 8 * int(rng.integers(table_end // 8))
        value = int(rng.choice(len(_BOUNDARY_U64)))
        value = _BOUNDARY_U64[value] if rng.random() < 0.7 else int(rng.integers(0, len(out) * 2))
        struct.pack_into("<Q", out, pos, value & (2**64 - 1))
    elif kind == 3:
        del out[int(rng.integers(len(out))) :]
    elif kind == 4:
        out += rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    else:
        a, b = sorted(int(x) for x in rng.integers(0, len(out), 2))
        dest = int(rng.integers(len(out)))
        out[dest : dest + (b - a)] = out[a:b]
        del out[len(blob) :]
    if rng.random() < 0.5:
        _fix_crc(out)
    return bytes(out)


def check_rejects_or_decodes(blob: bytes, *, verify_crc: bool = True) -> str:
    """Decode ``blob`` fully and by gathering; return ``"rejected"`` or ``"decoded"``.

    Raises
    ------
    AssertionError
        If the decoder returns a malformed matrix (indices unsorted, out of range, or a shape
        other than the header's), or raises anything but :class:`FormatError`.
    """
    try:
        tile = Tile(blob, verify_crc=verify_crc, n_threads=2)
        matrix = tile.decode(np.int32, n_threads=2)
        rows = np.arange(tile.shape[0])[::-1]
        gathered = tile.gather(rows, np.int32, n_threads=2)
    except FormatError:
        return "rejected"
    _assert_well_formed(matrix, tile.shape)
    _assert_well_formed(gathered, (len(rows), tile.shape[1]))
    assert (gathered != matrix[rows]).nnz == 0, "gather disagrees with decode"
    return "decoded"


def _assert_well_formed(matrix: sp.csr_matrix, shape: tuple[int, int]) -> None:
    assert matrix.shape == shape, f"shape {matrix.shape} != {shape}"
    indptr, indices, data = matrix.indptr, matrix.indices, matrix.data
    assert indptr[0] == 0 and np.all(np.diff(indptr) >= 0)
    if indices.size:
        assert indices.min() >= 0 and indices.max() < shape[1], "gene index out of range"
        assert data.min() >= 1, "a stored count below 1"
        within = np.diff(indices.astype(np.int64))
        starts = indptr[1:-1]
        mask = np.ones(within.size, dtype=bool)
        mask[starts[(starts > 0) & (starts <= within.size)] - 1] = False
        assert np.all(within[mask] > 0), "gene indices not strictly increasing within a cell"


@dataclass
class FuzzReport:
    """Counts of a fuzz run: how many mutants were rejected and how many decoded."""

    rejected: int = 0
    decoded: int = 0

    @property
    def total(self) -> int:
        """Mutants tried."""
        return self.rejected + self.decoded


def fuzz_tiles(seeds: Iterable[bytes], n_mutants: int, *, seed: int = 0) -> FuzzReport:
    """Run :func:`check_rejects_or_decodes` on ``n_mutants`` mutants of the seed tiles.

    Half of the mutants are checked without the CRC, so that damage the CRC would catch still
    reaches the structural and per-frame checks.
    """
    rng = np.random.default_rng(seed)
    corpus = list(seeds)
    report = FuzzReport()
    for i in range(n_mutants):
        mutant = mutate_tile(corpus[i % len(corpus)], rng)
        outcome = check_rejects_or_decodes(mutant, verify_crc=bool(i % 2))
        if outcome == "rejected":
            report.rejected += 1
        else:
            report.decoded += 1
    return report
