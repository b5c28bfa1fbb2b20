# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Checks of a tile's zstd frames before anything is decompressed: each frame's header,
declared content size and stored length (headers only; run in parallel over the chunks);
and the frames decompressed alone, the speed limit the decoder is measured against."""

from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int32_t, int64_t, uint8_t

import numpy as np

from deltacells.codec._common cimport (
    NNZ_LO,
    NNZ_HI,
    OK,
    E_FRAME_HEADER,
    E_FRAME_SIZE,
    E_FRAME_LENGTH,
    E_EXC_SIZE,
)
from deltacells.codec._pools cimport (
    give_back_dctx,
    give_back_scratch,
    take_dctx,
    take_scratch,
)
from deltacells.codec._zstd cimport (
    ZSTD_CONTENTSIZE_ERROR,
    ZSTD_DCtx,
    ZSTD_decompressDCtx,
    ZSTD_CONTENTSIZE_UNKNOWN,
    ZSTD_findFrameCompressedSize,
    ZSTD_getFrameContentSize,
    ZSTD_isError,
)
from deltacells.codec.format import FormatError
from deltacells.codec._status import raise_status


def check_frames(const uint8_t[::1] blob, const int64_t[:, ::1] chunks, object where,
                 int n_threads=1):
    """Check every frame's header and length; return the exception counts per chunk.

    Each stream must be exactly one zstd frame that fills its stored length and declares its
    content size: ``2 * n`` bytes for gaps and values, ``8 * k`` with ``k <= n`` for exception
    frames. Chunks are checked in parallel on ``n_threads`` (tiles of many small chunks have
    thousands of frames); the lowest failing chunk is reported whatever the thread count.

    Returns
    -------
    numpy.ndarray
        ``int64`` array of shape ``(n_chunks, 2)``: value and gap exception counts.
    """
    cdef Py_ssize_t n_chunks = chunks.shape[0]
    cdef Py_ssize_t c
    cdef int f
    cdef int64_t n, off, length
    cdef unsigned long long content
    cdef size_t frame_size
    counts = np.zeros((n_chunks, 2), dtype=np.int64)
    cdef int64_t[:, ::1] counts_v = counts
    status = np.zeros(n_chunks, dtype=np.int32)
    detail = np.zeros(n_chunks, dtype=np.int64)
    cdef int32_t[::1] status_v = status
    cdef int64_t[::1] detail_v = detail
    cdef const uint8_t* base = &blob[0]
    with nogil:
        for c in prange(n_chunks, num_threads=n_threads if n_chunks >= 64 else 1,
                        schedule="static"):
            n = chunks[c, NNZ_HI] - chunks[c, NNZ_LO]
            for f in range(4):
                off = chunks[c, 4 + 2 * f]
                length = chunks[c, 5 + 2 * f]
                if length == 0:
                    continue  # exception frames may be absent; parse_layout checked the streams
                content = ZSTD_getFrameContentSize(base + off, <size_t>length)
                if content == ZSTD_CONTENTSIZE_ERROR or content == ZSTD_CONTENTSIZE_UNKNOWN:
                    status_v[c] = E_FRAME_HEADER
                elif f < 2 and content != <unsigned long long>(2 * n):
                    status_v[c] = E_FRAME_SIZE
                elif f >= 2 and (content % 8 != 0 or content // 8 > <unsigned long long>n):
                    status_v[c] = E_EXC_SIZE
                else:
                    frame_size = ZSTD_findFrameCompressedSize(base + off, <size_t>length)
                    if ZSTD_isError(frame_size) or frame_size != <size_t>length:
                        status_v[c] = E_FRAME_LENGTH
                    elif f >= 2:
                        counts_v[c, f - 2] = <int64_t>(content // 8)
                if status_v[c] != OK:
                    detail_v[c] = f
                    break
    raise_status(status, detail, where)
    return counts


def decompress_only(const uint8_t[::1] blob, const int64_t[:, ::1] chunks, int n_threads):
    """Decompress the gaps and values frames of every chunk and do nothing else.

    The speed limit for ``_decode.decode_into``: the same frames through the same libzstd into
    per-thread buffers from the same pool, as the same jobs (one per frame), with no
    post-processing. Returns the decompressed byte count.
    """
    cdef Py_ssize_t n_chunks = chunks.shape[0]
    cdef Py_ssize_t c, g
    cdef int which
    cdef int64_t n, total = 0, largest = 8
    cdef size_t got
    cdef int failed = 0
    cdef ZSTD_DCtx* dctx = NULL  # set per thread; initialized so the firstprivate copy is defined
    cdef uint8_t* scratch = NULL
    cdef const uint8_t* base = &blob[0]
    for c in range(n_chunks):
        largest = max(largest, 2 * (chunks[c, NNZ_HI] - chunks[c, NNZ_LO]))
    contexts = take_dctx(n_threads)
    scratches = take_scratch(n_threads, largest)
    cdef const size_t[::1] contexts_v = contexts
    cdef const size_t[::1] scratches_v = scratches
    with nogil, parallel(num_threads=n_threads):
        dctx = <ZSTD_DCtx*>contexts_v[threadid()]
        scratch = <uint8_t*>scratches_v[threadid()]
        for g in prange(2 * n_chunks, schedule="dynamic"):
            c = g >> 1
            which = g & 1
            n = chunks[c, NNZ_HI] - chunks[c, NNZ_LO]
            got = ZSTD_decompressDCtx(dctx, scratch, 2 * n, base + chunks[c, 4 + 2 * which],
                                      chunks[c, 5 + 2 * which])
            if ZSTD_isError(got):
                failed += 1
            total += 2 * n
    give_back_dctx(contexts)
    give_back_scratch(scratches)
    if failed:
        raise FormatError("zstd decompression failed")
    return total
