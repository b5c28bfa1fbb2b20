# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""zstd decompression contexts and scratch buffers, kept between calls and shared by the
kernel modules that decompress (``_decode`` for decoding, ``_frames`` for zstd alone): the
speed limit the benchmarks quote runs on the same pools as the decoder."""

from libc.stdint cimport int64_t
from libc.stdlib cimport free, malloc

import numpy as np

from deltacells.codec._zstd cimport ZSTD_createDCtx


# Decompression contexts are reused across calls: creating one costs about as much as
# decoding a small tile. A context is used by one thread at a time: contexts are taken from this
# list with the GIL held before a parallel region and given back after it, so concurrent calls
# from several Python threads never share one.
_idle_dctx = []


cdef object take_dctx(int n):
    """Addresses of ``n`` decompression contexts, reused when idle ones exist."""
    cdef size_t address
    taken = np.zeros(n, dtype=np.uintp)
    cdef size_t[::1] taken_v = taken
    for i in range(n):
        if _idle_dctx:
            address = _idle_dctx.pop()
        else:
            address = <size_t>ZSTD_createDCtx()
            if address == 0:
                give_back_dctx(taken[:i])
                raise MemoryError("could not create a zstd decompression context")
        taken_v[i] = address
    return taken


cdef void give_back_dctx(object taken):
    _idle_dctx.extend(int(a) for a in taken)


# Scratch buffers for decompressed planes, kept between calls like the contexts: a fresh
# malloc of a few MiB is a fresh mmap, whose pages fault in one by one on every call.
_idle_scratch = []
_scratch_sizes = {}
_MAX_IDLE_SCRATCH = 8


cdef object take_scratch(int n, int64_t size):
    """Addresses of ``n`` buffers of at least ``size`` bytes, reused when idle ones exist."""
    cdef void* fresh
    taken = np.zeros(n, dtype=np.uintp)
    for i in range(n):
        address = _idle_scratch.pop() if _idle_scratch else 0
        if address and _scratch_sizes[address] < size:
            del _scratch_sizes[address]
            free(<void*><size_t>address)
            address = 0
        if not address:
            fresh = malloc(size)
            if fresh == NULL:
                give_back_scratch(taken[:i])
                raise MemoryError(f"could not allocate {size} bytes of decoding scratch")
            address = <size_t>fresh
            _scratch_sizes[address] = size
        taken[i] = address
    return taken


cdef void give_back_scratch(object taken):
    _idle_scratch.extend(int(a) for a in taken)
    while len(_idle_scratch) > _MAX_IDLE_SCRATCH:
        address = _idle_scratch.pop(0)
        del _scratch_sizes[address]
        free(<void*><size_t>address)
