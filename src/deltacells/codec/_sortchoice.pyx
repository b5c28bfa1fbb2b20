# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Which sort the kernels use for renumbered rows (see codec/rowsort.py), held in one place
for every kernel module that renumbers rows: numpy's SIMD sorts of 32-bit keys and of 16-bit
columns (or NULL), whether long rows may be sorted by a bitmap of their columns, and whether
those sorts' loops may use AVX2 / AVX-512F. Tests and benchmarks switch between them."""

from libc.stdint cimport int64_t

cimport numpy as cnp

from deltacells.codec._common cimport (
    dc_cpu_has_avx2,
    dc_cpu_has_avx512f,
    dc_cpu_has_popcnt,
    dc_sort32_fn,
)
from deltacells.codec.rowsort import ROW_SORTS, gathers_slowed, row_sort_wanted


cdef extern from "numpy/arrayobject.h":
    ctypedef struct PyArray_ArrFuncs:
        void* sort[3]  # NPY_QUICKSORT first
    PyArray_ArrFuncs* PyDataType_GetArrFuncs(cnp.dtype descr)


cnp.import_array()


cdef dc_sort32_fn numpy_sort(bint wanted, int type_num) noexcept:
    """numpy's quicksort of ``type_num`` (uint32 or uint16; x86-simd-sort's AVX-512 code where
    the CPU has it, AVX512-VBMI2 for uint16) when ``wanted``, else NULL."""
    if not wanted:
        return NULL
    return <dc_sort32_fn>PyDataType_GetArrFuncs(cnp.PyArray_DescrFromType(type_num)).sort[0]


# The sort for renumbered rows (see codec/rowsort.py): numpy's SIMD sorts (or NULL), and
# whether long rows may be sorted by their output columns instead; set by _use_row_sort.
cdef str _row_sort = ""
cdef dc_sort32_fn _sort32 = NULL
cdef dc_sort32_fn _sort16 = NULL
cdef bint _bitmap_rows = False
# The bitmap sort counts bits with popcnt: without it (x86-64 CPUs before 2008) the radix
# sort runs instead.
cdef bint _has_popcnt = dc_cpu_has_popcnt() != 0
# The sorts' vector loops gather from memory: the bitmap's renumbering eight entries at a time
# (AVX2), "simd16"'s reading back sixteen at a time (AVX-512F). Where Linux reports a
# microcode mitigation that slows gathers, they run one entry at a time (same output).
cdef bint _has_avx512f = dc_cpu_has_avx512f() != 0
cdef bint _vector_loops = dc_cpu_has_avx2() != 0 and not gathers_slowed()

cdef enum:
    # The widest bitmap sort: its scratch is 12 bytes per 64 columns per thread (48 KB here).
    BITMAP_MAX_COLS = 1 << 18


cdef dc_sort32_fn row_sort32() noexcept nogil:
    """The sort for renumbered rows, for every kernel module (see codec/rowsort.py)."""
    return _sort32


cdef dc_sort32_fn row_sort16() noexcept nogil:
    """numpy's uint16 sort for rows of up to 65,536 output columns (``"simd16"``), or NULL."""
    return _sort16


cdef int64_t row_sort_bitmap_cols(int64_t n_cols) noexcept nogil:
    """``n_cols`` when rows renumbered into that many columns may take the bitmap sort or
    (``"simd16"``) numpy's uint16 sort of their columns (the ``bitmap_cols`` of
    ``new_sort_scratch``), else 0."""
    return n_cols if _bitmap_rows and _has_popcnt and 0 < n_cols <= BITMAP_MAX_COLS else 0


cdef int row_sort_vector_level() noexcept nogil:
    """How the sorts' loops may run (the ``vector_level`` of ``new_sort_scratch``): 0 one
    entry at a time, 1 the bitmap's renumbering eight at a time (AVX2), 2 that and the
    ``"simd16"`` sort's reading back sixteen at a time (AVX-512F gathers)."""
    if not _vector_loops:
        return 0
    return 2 if _has_avx512f else 1


def _use_vector_loops(wanted=None):
    """Let the bitmap sort renumber rows with AVX2 and the ``"simd16"`` sort read values back
    with AVX-512F (True, where the CPU has them, gathers slowed or not) or run both one entry
    at a time (False) from now on, or keep the choice (None); tests compare the two.
    Returns the previous choice."""
    global _vector_loops
    previous = bool(_vector_loops)
    if wanted is not None:
        _vector_loops = bool(wanted) and dc_cpu_has_avx2() != 0
    return previous


def _use_row_sort(name=None):
    """Sort renumbered rows with ``"simd16"`` or ``"simd"`` (numpy's quicksort of 16- or
    32-bit keys), ``"bitmap"`` or ``"radix"`` from now on, in every kernel module, or keep the
    choice (None); tests and benchmarks compare them. Returns the previous choice."""
    global _row_sort, _sort32, _sort16, _bitmap_rows
    previous = _row_sort
    if name is not None:
        if name not in ROW_SORTS:
            raise ValueError(f"row sort {name!r} is not one of {', '.join(ROW_SORTS)}")
        _row_sort = name
        _sort32 = numpy_sort(name in ("simd", "simd16"), cnp.NPY_UINT32)
        _sort16 = numpy_sort(name == "simd16", cnp.NPY_UINT16)
        _bitmap_rows = name in ("bitmap", "simd16")
    return previous


_use_row_sort(row_sort_wanted())
