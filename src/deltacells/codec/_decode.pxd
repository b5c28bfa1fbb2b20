"""What other kernel modules take from _decode.pyx."""

from deltacells.codec._common cimport dc_sort32_fn


cdef dc_sort32_fn row_sort32() noexcept nogil
cdef dc_sort32_fn numpy_sort32(bint wanted) noexcept
