"""The row sort in use, for every kernel module that renumbers rows (_decode, _rows)."""

from libc.stdint cimport int64_t

from deltacells.codec._common cimport dc_sort32_fn


cdef dc_sort32_fn row_sort32() noexcept nogil
cdef dc_sort32_fn row_sort16() noexcept nogil
cdef dc_sort32_fn numpy_sort(bint wanted, int type_num) noexcept
cdef int64_t row_sort_bitmap_cols(int64_t n_cols) noexcept nogil
cdef int row_sort_vector_level() noexcept nogil
