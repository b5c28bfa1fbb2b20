# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""CRC-32 of stored bytes, in parallel pieces combined with zlib's ``crc32_combine``."""

from cython.parallel cimport prange
from libc.stdint cimport int64_t, uint8_t

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
