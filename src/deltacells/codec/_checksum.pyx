# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""CRC-32 of stored bytes, in parallel pieces combined with zlib's ``crc32_combine``."""

from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint8_t, uint32_t

import numpy as np

from deltacells.codec._common cimport (
    DELTACELLS_CRC_BACKEND,
    dc_crc32,
)


cdef extern from "zlib.h" nogil:
    unsigned long crc32_combine(unsigned long crc1, unsigned long crc2, long length2)


def crc_backend() -> str:
    """The library computing CRC-32s: ``"libdeflate"`` when built with it, else ``"zlib"``."""
    return DELTACELLS_CRC_BACKEND.decode()


def crc32_range(const uint8_t[::1] blob, int64_t start, int n_threads) -> int:
    """zlib CRC-32 of ``blob[start:]``, computed in parallel pieces and combined."""
    cdef int64_t size = blob.shape[0] - start
    cdef int64_t n_parts = 1, part, lo, hi
    cdef Py_ssize_t i
    cdef unsigned long result
    cdef const uint8_t* base
    if size <= 0:
        return 0
    base = &blob[start]
    # Pieces of at least 1 MiB: below that, threads cost more than they save.
    n_parts = max(1, min(n_threads, size // (1 << 20)))
    part = (size + n_parts - 1) // n_parts
    crcs = np.zeros(n_parts, dtype=np.uint64)
    cdef unsigned long long[::1] crcs_v = crcs
    with nogil:
        for i in prange(n_parts, num_threads=n_threads, schedule="static"):
            lo = i * part
            hi = min(size, lo + part)
            crcs_v[i] = dc_crc32(0, base + lo, hi - lo)
    result = <unsigned long>crcs_v[0]
    for i in range(1, n_parts):
        lo = i * part
        hi = min(size, lo + part)
        result = crc32_combine(result, <unsigned long>crcs_v[i], <long>(hi - lo))
    return int(result)


def chunk_crcs(const uint8_t[:, ::1] entries, const uint8_t[::1] indptr,
               const int64_t[::1] indptr_start, const int64_t[::1] indptr_stop,
               const uint8_t[::1] data, const int64_t[:, ::1] frame_pos,
               const int64_t[:, ::1] frame_len):
    """CRC-32 of each chunk ``c`` as the chunk checksums define it: its table entry
    (``entries[c]``), its indptr slice (``indptr[indptr_start[c]:indptr_stop[c]]``, bytes) and
    its frames in order (``data[frame_pos[c, f]:][:frame_len[c, f]]``, empty ones skipped).
    One call for many chunks: per-chunk calls from Python cost more than the CRCs of small
    chunks. Returns uint32 CRCs; ValueError if a range lies outside its buffer."""
    cdef Py_ssize_t m = entries.shape[0], c, f
    cdef Py_ssize_t n_frames = frame_pos.shape[1]
    if not (indptr_start.shape[0] == indptr_stop.shape[0] == frame_pos.shape[0]
            == frame_len.shape[0] == m) or frame_len.shape[1] != n_frames:
        raise ValueError("chunk_crcs: arrays of different lengths")
    for c in range(m):
        if not 0 <= indptr_start[c] <= indptr_stop[c] <= indptr.shape[0]:
            raise ValueError(f"chunk_crcs: indptr range of chunk {c} outside the buffer")
        for f in range(n_frames):
            if frame_len[c, f] and not (0 <= frame_pos[c, f] and frame_len[c, f] >= 0
                                        and frame_pos[c, f] + frame_len[c, f] <= data.shape[0]):
                raise ValueError(f"chunk_crcs: frame {f} of chunk {c} outside the data")
    out = np.zeros(m, dtype=np.uint32)
    cdef uint32_t[::1] out_v = out
    cdef uint32_t crc
    cdef const uint8_t* empty = <const uint8_t*>""
    with nogil:
        for c in range(m):
            crc = dc_crc32(0, &entries[c, 0] if entries.shape[1] else empty, entries.shape[1])
            if indptr_stop[c] > indptr_start[c]:
                crc = dc_crc32(crc, &indptr[indptr_start[c]], indptr_stop[c] - indptr_start[c])
            for f in range(n_frames):
                if frame_len[c, f] > 0:
                    crc = dc_crc32(crc, &data[frame_pos[c, f]], frame_len[c, f])
            out_v[c] = crc
    return out
