"""Sorting one row's columns after renumbering them, shared by the decoder (reads in the
source gene order) and the row kernels (writer gene order, joins, minibatches)."""

from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc

from deltacells.codec._common cimport (
    E_CELL_RANGE,
    E_ZERO_GAP,
    OK,
    dc_bitmap,
    dc_row_sort,
    dc_sort32_fn,
    value_t,
)


cdef struct SortScratch:
    # One thread's scratch for ``row_to_mapped_order``: rows of up to ``capacity`` entries.
    uint64_t* keys
    uint64_t* spare
    double* held  # float64 values wait here (the keys carry their positions); else NULL
    dc_sort32_fn sort32  # numpy's SIMD sort for narrow rows, or NULL (radix sort only)
    # The scratch of the sorts by output column, when bitmap_cols: dc_row_sort_dense16's with
    # sort16 (rows of up to 65,536 columns), else dc_row_sort_bitmap's.
    dc_bitmap bitmap
    bint use_bitmap
    int64_t capacity
    bint ready  # every buffer it needs was allocated


cdef inline SortScratch new_sort_scratch(int64_t capacity, bint hold_values,
                                         dc_sort32_fn sort32,
                                         dc_sort32_fn sort16,
                                         int64_t bitmap_cols,
                                         int vector_level) noexcept nogil:
    """Allocate one thread's sort scratch (check ``.ready``; free with ``free_sort_scratch``).

    ``bitmap_cols`` > 0 (from ``row_sort_bitmap_cols``): rows may also be sorted by output
    column among that many: by numpy's uint16 sort with ``sort16`` (from ``row_sort16``; up
    to 65,536 columns), else by the bitmap of the columns. ``vector_level`` (from
    ``row_sort_vector_level``): at 1 the bitmap's renumbering runs eight entries at a time
    (AVX2), at 2 the uint16 path also reads values back sixteen at a time (AVX-512F)."""
    cdef SortScratch s
    s.capacity = capacity
    s.sort32 = sort32
    s.keys = <uint64_t*>malloc((capacity + 1) * sizeof(uint64_t))
    s.spare = <uint64_t*>malloc((capacity + 1) * sizeof(uint64_t))
    s.held = <double*>malloc((capacity + 1) * sizeof(double)) if hold_values else NULL
    s.use_bitmap = capacity > 0 and bitmap_cols > 0
    s.bitmap.n_cols = <uint32_t>bitmap_cols if s.use_bitmap else 0
    s.bitmap.vector = vector_level >= 1
    s.bitmap.bits = NULL
    s.bitmap.ranks = NULL
    s.bitmap.cols = NULL
    s.bitmap.vals = NULL
    s.bitmap.sort16 = sort16 if s.use_bitmap and bitmap_cols <= 65536 else NULL
    s.bitmap.cols16 = NULL
    s.bitmap.dense = NULL
    s.bitmap.wide = vector_level >= 2
    if s.bitmap.sort16 != NULL:
        s.bitmap.cols16 = <uint16_t*>malloc((capacity + 1) * sizeof(uint16_t))
        s.bitmap.dense = malloc(bitmap_cols * (8 if hold_values else 4))
    elif s.use_bitmap:
        s.bitmap.bits = <uint64_t*>calloc(bitmap_cols // 64 + 1, sizeof(uint64_t))
        s.bitmap.ranks = <uint32_t*>malloc((bitmap_cols // 64 + 1) * sizeof(uint32_t))
        s.bitmap.cols = <uint32_t*>malloc((capacity + 1) * sizeof(uint32_t))
        s.bitmap.vals = malloc((capacity + 1) * (8 if hold_values else 4))
    s.ready = (s.keys != NULL and s.spare != NULL and (s.held != NULL or not hold_values)
               and (not s.use_bitmap
                    or (s.bitmap.sort16 != NULL and s.bitmap.cols16 != NULL
                        and s.bitmap.dense != NULL)
                    or (s.bitmap.bits != NULL and s.bitmap.ranks != NULL
                        and s.bitmap.cols != NULL and s.bitmap.vals != NULL)))
    return s


cdef inline void free_sort_scratch(SortScratch* s) noexcept nogil:
    free(s.keys)
    free(s.spare)
    free(s.held)
    free(s.bitmap.bits)
    free(s.bitmap.ranks)
    free(s.bitmap.cols)
    free(s.bitmap.vals)
    free(s.bitmap.cols16)
    free(s.bitmap.dense)


cdef inline int row_to_mapped_order(const int32_t* idx, const value_t* val, int64_t n,
                                    const int32_t* col_map, uint32_t n_map, SortScratch* s,
                                    int32_t* out_idx, value_t* out_val,
                                    int64_t* kept, bint stream) noexcept nogil:
    """Move one row's columns through ``col_map`` (-1 drops) and write them sorted
    (``dc_row_sort``, in place if ``out_* == idx/val``), in a thread's scratch ``s``
    (made with ``hold_values`` for float64); ``stream`` writes an output that is not the
    input with non-temporal stores (run ``dc_store_fence`` before others read it).

    Returns E_CELL_RANGE for a column outside col_map (row untouched) and E_ZERO_GAP for two
    columns mapped to one (the row may be partly rewritten; callers raise).
    """
    cdef int st
    cdef const dc_bitmap* bitmap = &s.bitmap if s.use_bitmap else NULL
    if value_t is double:
        st = dc_row_sort(idx, NULL, val, n, col_map, n_map, s.keys, s.spare, s.held,
                         s.capacity, s.sort32, bitmap, out_idx, NULL, out_val, kept, stream)
    else:  # int32 and float32 travel as their 32 bits
        st = dc_row_sort(idx, <const uint32_t*>val, NULL, n, col_map, n_map, s.keys, s.spare,
                         NULL, s.capacity, s.sort32, bitmap, out_idx, <uint32_t*>out_val, NULL,
                         kept, stream)
    if st == 1:
        return E_CELL_RANGE
    if st == 2:
        return E_ZERO_GAP
    return OK
