"""Test helpers: an independent reference encoder and tools to craft malformed tiles.

The reference encoder follows FORMAT.md with numpy and the ``zstandard`` package only, so tiles
it makes check the decoder against code that shares nothing with deltacells' own encoder.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import scipy.sparse as sp
import zstandard

HEADER = struct.Struct("<8sIIQQIIQQII")
HEADER_FIELDS = ("magic", "version", "flags", "n_cells", "nnz", "n_genes", "n_chunks",
                 "indptr_off", "total_size", "crc32", "reserved")  # fmt: skip

MAGIC = b"DELTACEL"


def _frame(payload: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=5, write_content_size=True).compress(payload)


def _planes(values: np.ndarray) -> bytes:
    v = values.astype(np.uint32)
    return np.concatenate([(v & 0xFF).astype(np.uint8), (v >> 8).astype(np.uint8)]).tobytes()


def reference_tile(csr: sp.csr_matrix, bounds: list[int], version: int) -> bytes:
    """Encode ``csr`` with the given chunk boundaries exactly as FORMAT.md describes."""
    n_cells, n_genes = csr.shape
    indptr = csr.indptr.astype(np.int64)
    indices = csr.indices.astype(np.int64)
    data = csr.data.astype(np.int64)
    entry = 64 if version == 1 else 96
    n_chunks = len(bounds) - 1
    indptr_off = 64 + entry * n_chunks
    pos = indptr_off + 8 * (n_cells + 1)
    table, blobs = [], []
    for c in range(n_chunks):
        lo, hi = bounds[c], bounds[c + 1]
        a, b = int(indptr[lo]), int(indptr[hi])
        idx = indices[a:b]
        gaps = idx.copy()
        gaps[1:] -= idx[:-1]
        starts = indptr[lo:hi] - a
        starts = starts[starts < b - a]
        gaps[starts] = idx[starts]  # the first gap of each cell is its first gene
        vals = data[a:b].copy()
        frames = []
        exceptions = []
        for stream, limit_payload in ((vals, lambda x: x), (gaps, lambda x: x - 65535)):
            pos_big = np.flatnonzero(stream > 65535)
            exceptions.append(
                np.concatenate([pos_big, limit_payload(stream[pos_big])]).astype("<u4").tobytes()
                if pos_big.size
                else b""
            )
            stream[pos_big] = 65535
        frames = [_frame(_planes(gaps)), _frame(_planes(vals))]
        vexc, gexc = exceptions
        if version == 1:
            assert not vexc and not gexc, "version 1 has no exceptions"
        else:
            frames += [_frame(vexc) if vexc else b"", _frame(gexc) if gexc else b""]
        fields = [lo, hi, a, b]
        for frame in frames:
            if frame:
                pos += -pos % 8
                fields += [pos, len(frame)]
                blobs.append((pos, frame))
                pos += len(frame)
            else:
                fields += [0, 0]
        table.append(fields)
    out = bytearray(pos)
    for c, fields in enumerate(table):
        struct.pack_into(f"<{len(fields)}Q", out, 64 + entry * c, *fields)
    out[indptr_off : indptr_off + 8 * (n_cells + 1)] = indptr.astype("<i8").tobytes()
    for offset, frame in blobs:
        out[offset : offset + len(frame)] = frame
    crc = zlib.crc32(bytes(out[64:]))
    HEADER.pack_into(
        out,
        0,
        MAGIC,
        version,
        0,
        n_cells,
        int(indptr[-1]),
        n_genes,
        n_chunks,
        indptr_off,
        pos,
        crc,
        0,
    )
    return bytes(out)


def read_header(blob: bytes) -> dict:
    """Header fields of a tile as a dict."""
    return dict(zip(HEADER_FIELDS, HEADER.unpack_from(blob, 0), strict=True))


def read_table(blob: bytes) -> np.ndarray:
    """The chunk table as a writable ``uint64`` array of shape (n_chunks, 8 or 12)."""
    h = read_header(blob)
    width = 8 if h["version"] == 1 else 12
    return np.frombuffer(blob, "<u8", h["n_chunks"] * width, 64).reshape(-1, width).copy()


def with_crc(blob: bytes | bytearray) -> bytes:
    """The tile with its CRC recomputed, so that a later check, not the CRC, sees a change."""
    out = bytearray(blob)
    struct.pack_into("<I", out, 56, zlib.crc32(bytes(out[64:])))
    return bytes(out)


def patch(blob: bytes, *, table: np.ndarray | None = None, fix_crc: bool = True, **header) -> bytes:
    """Rewrite header fields and/or the chunk table, then (by default) fix the CRC."""
    out = bytearray(blob)
    fields = read_header(blob)
    fields.update(header)
    HEADER.pack_into(out, 0, *(fields[name] for name in HEADER_FIELDS))
    if table is not None:
        raw = np.ascontiguousarray(table, dtype="<u8").tobytes()
        out[64 : 64 + len(raw)] = raw
    return with_crc(out) if fix_crc else bytes(out)


def patch_indptr(blob: bytes, cell: int, value: int) -> bytes:
    """Overwrite one indptr entry (CRC fixed)."""
    out = bytearray(blob)
    struct.pack_into("<q", out, read_header(blob)["indptr_off"] + 8 * cell, value)
    return with_crc(out)


def replace_frame(blob: bytes, chunk: int, which: int, frame: bytes) -> bytes:
    """Put ``frame`` in place of frame ``which`` (0 gaps, 1 vals, 2 vexc, 3 gexc) of a chunk.

    The new frame is appended at the end of the tile (8-byte aligned); table, size and CRC are
    updated so only the frame's content is wrong.
    """
    out = bytearray(blob)
    out += bytes(-len(out) % 8)
    offset = len(out)
    out += frame
    table = read_table(blob)
    table[chunk, 4 + 2 * which] = offset
    table[chunk, 5 + 2 * which] = len(frame)
    return patch(bytes(out), table=table, total_size=len(out))


def zframe(payload: bytes, *, content_size: bool = True) -> bytes:
    """A zstd frame of ``payload`` (with its content size unless asked otherwise)."""
    return zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(payload)


def planes(values) -> bytes:
    """uint16 values as byte planes (low bytes, then high bytes)."""
    return _planes(np.asarray(values, dtype=np.int64))


def exception_frame(positions, payloads) -> bytes:
    """An exception frame: uint32 positions followed by uint32 payloads."""
    data = np.concatenate([np.asarray(positions), np.asarray(payloads)]).astype("<u4")
    return zframe(data.tobytes())


def random_counts(
    rng: np.random.Generator, n_cells: int, n_genes: int, density: float
) -> sp.csr_matrix:
    """A random integer count matrix (int64 CSR) with a few large counts."""
    m = sp.random(n_cells, n_genes, density=density, format="csr", random_state=rng)
    m.data = np.ceil(m.data * 20).astype(np.int64)
    return m
