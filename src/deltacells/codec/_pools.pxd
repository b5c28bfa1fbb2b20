"""zstd contexts and scratch buffers shared by the kernel modules (_decode, _frames): taken
with the GIL held before a parallel region (one per thread) and given back after it."""

from libc.stdint cimport int64_t


cdef object take_dctx(int n)
cdef void give_back_dctx(object taken)
cdef object take_scratch(int n, int64_t size)
cdef void give_back_scratch(object taken)
