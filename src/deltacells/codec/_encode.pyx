# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Tile encoding: chunks of a canonical CSR matrix to gap and value planes in zstd frames,
compressed in parallel (one zstd context per thread)."""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cython.parallel cimport parallel, prange
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from libc.stdlib cimport free, malloc

import numpy as np

from deltacells.codec._common cimport (
    STREAM_MAX,
    OK,
    E_NOMEM,
    E_ENC_ORDER,
    E_ENC_VALUE,
    E_ENC_COMPRESS,
)
from deltacells.codec._zstd cimport (
    ZSTD_CCtx,
    ZSTD_compressBound,
    ZSTD_compressCCtx,
    ZSTD_createCCtx,
    ZSTD_freeCCtx,
    ZSTD_isError,
    ZSTD_maxCLevel,
    ZSTD_minCLevel,
    ZSTD_versionString,
)
from deltacells.codec._status import raise_status


def zstd_version() -> str:
    """Version of the libzstd these kernels are linked against."""
    return ZSTD_versionString().decode()


def zstd_level_range() -> tuple:
    """(minimum, maximum) compression level of the linked libzstd."""
    return (ZSTD_minCLevel(), ZSTD_maxCLevel())


def encode_chunks(const int64_t[::1] indptr, const int32_t[::1] indices,
                  const int32_t[::1] data, const int64_t[::1] bounds, int64_t n_genes,
                  int level, int n_threads, object where="<matrix>"):
    """Compress each chunk of a canonical CSR (sorted, unique indices; counts >= 1).

    ``bounds`` holds the cell boundaries of the chunks (length ``n_chunks + 1``).

    Returns
    -------
    tuple
        ``(frames, exceptions)``: a list of ``[gaps, vals, vexc, gexc]`` bytes per chunk
        (``b""`` where a chunk has no exceptions of that kind), and an ``int64`` array of
        shape ``(n_chunks, 2)`` with the value and gap exception counts.
    """
    cdef Py_ssize_t n_chunks = bounds.shape[0] - 1
    cdef Py_ssize_t c
    cdef int64_t lo, hi, a, b, n, i, r, kv, kg, gap, prev, s, e
    cdef int f, st
    cdef ZSTD_CCtx* cctx = NULL
    cdef uint8_t* planes
    cdef uint32_t* vexc
    cdef uint32_t* gexc
    cdef size_t cap, got
    cdef const uint8_t* src
    cdef int64_t src_size
    if n_chunks <= 0:
        return [], np.zeros((0, 2), dtype=np.int64)
    out_ptr = np.zeros(4 * n_chunks, dtype=np.uintp)
    out_len = np.zeros(4 * n_chunks, dtype=np.int64)
    exc = np.zeros((n_chunks, 2), dtype=np.int64)
    status = np.zeros(n_chunks, dtype=np.int32)
    detail = np.zeros(n_chunks, dtype=np.int64)
    cdef size_t[::1] out_ptr_v = out_ptr
    cdef int64_t[::1] out_len_v = out_len
    cdef int64_t[:, ::1] exc_v = exc
    cdef int32_t[::1] status_v = status
    cdef int64_t[::1] detail_v = detail
    cdef const int32_t* idx = &indices[0] if indices.shape[0] else NULL
    cdef const int32_t* val = &data[0] if data.shape[0] else NULL
    with nogil, parallel(num_threads=n_threads):
        cctx = ZSTD_createCCtx()
        for c in prange(n_chunks, schedule="dynamic"):
            if cctx == NULL:
                status_v[c] = E_NOMEM
                continue
            lo = bounds[c]
            hi = bounds[c + 1]
            a = indptr[lo]
            b = indptr[hi]
            n = b - a
            # Pass 1: count exceptions, check the canonical form.
            kv = 0
            kg = 0
            st = OK
            for r in range(lo, hi):
                s = indptr[r]
                e = indptr[r + 1]
                prev = -1
                for i in range(s, e):
                    if idx[i] <= prev or idx[i] >= n_genes:
                        st = E_ENC_ORDER
                    gap = idx[i] if i == s else idx[i] - prev
                    kg = kg + (gap > STREAM_MAX)
                    prev = idx[i]
                    kv = kv + (val[i] > STREAM_MAX)
                    if val[i] < 1:
                        st = E_ENC_VALUE
                if st != OK:
                    detail_v[c] = r
                    break
            if st != OK:
                status_v[c] = st
                continue
            planes = <uint8_t*>malloc(4 * n + 8 * (kv + kg) + 8)
            if planes == NULL:
                status_v[c] = E_NOMEM
                continue
            vexc = <uint32_t*>(planes + 4 * n)
            gexc = vexc + 2 * kv
            exc_v[c, 0] = kv
            exc_v[c, 1] = kg
            # Pass 2: byte planes and exception lists (positions, then payloads).
            kv = 0
            kg = 0
            for r in range(lo, hi):
                s = indptr[r]
                e = indptr[r + 1]
                prev = 0
                for i in range(s, e):
                    gap = idx[i] - prev
                    prev = idx[i]
                    if gap > STREAM_MAX:
                        gexc[kg] = <uint32_t>(i - a)
                        gexc[exc_v[c, 1] + kg] = <uint32_t>(gap - STREAM_MAX)
                        kg = kg + 1
                        gap = STREAM_MAX
                    planes[i - a] = gap & 0xFF
                    planes[n + i - a] = gap >> 8
                    gap = val[i]
                    if gap > STREAM_MAX:
                        vexc[kv] = <uint32_t>(i - a)
                        vexc[exc_v[c, 0] + kv] = <uint32_t>gap
                        kv = kv + 1
                        gap = STREAM_MAX
                    planes[2 * n + i - a] = gap & 0xFF
                    planes[3 * n + i - a] = gap >> 8
            for f in range(4):
                if f < 2:
                    src = planes + 2 * n * f
                    src_size = 2 * n
                elif f == 2:
                    src = <const uint8_t*>vexc
                    src_size = 8 * kv
                else:
                    src = <const uint8_t*>gexc
                    src_size = 8 * kg
                if f >= 2 and src_size == 0:
                    continue
                cap = ZSTD_compressBound(<size_t>src_size)
                out_ptr_v[4 * c + f] = <size_t>malloc(cap)
                if out_ptr_v[4 * c + f] == 0:
                    status_v[c] = E_NOMEM
                    break
                got = ZSTD_compressCCtx(cctx, <void*>out_ptr_v[4 * c + f], cap, src,
                                        <size_t>src_size, level)
                if ZSTD_isError(got):
                    status_v[c] = E_ENC_COMPRESS
                    detail_v[c] = f
                    break
                out_len_v[4 * c + f] = <int64_t>got
            free(planes)
        ZSTD_freeCCtx(cctx)
    frames = []
    try:
        raise_status(status, detail, where)
        for c in range(n_chunks):
            frames.append([
                PyBytes_FromStringAndSize(<char*>out_ptr_v[4 * c + f], out_len_v[4 * c + f])
                if out_ptr_v[4 * c + f] else b""
                for f in range(4)
            ])
    finally:
        for c in range(4 * n_chunks):
            free(<void*>out_ptr_v[c])
    return frames, exc
