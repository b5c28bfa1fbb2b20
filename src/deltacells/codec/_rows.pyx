# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Rows of decoded matrices: column renumbering and sorting (writer gene order and joins,
reader source order), minibatch rows taken from tiles, per-cell normalisation and sums."""

from cython.parallel cimport parallel, prange
from libc.stdint cimport INT64_MAX, int32_t, int64_t, uint8_t, uint32_t
from cython cimport floating
from libc.math cimport log1p as c_log1p
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset

cdef extern from "Python.h":
    # A new compact ASCII string of ``size`` characters, its bytes written in place after.
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    void* PyUnicode_DATA(object unicode)
    object PyUnicode_DecodeUTF8(const char* data, Py_ssize_t size, const char* errors)

cdef extern from "arenas.h":
    size_t dc_arenas_ascii_bytes(Py_ssize_t length) noexcept nogil
    int dc_arenas_open(size_t nbytes, int helper) noexcept
    size_t dc_arenas_close() noexcept

import numpy as np

from deltacells.codec.threads import effective_n_threads

from deltacells.codec._common cimport (
    value_t,
    OK,
    E_NOMEM,
    E_CELL_RANGE,
    E_ZERO_GAP,
    dc_prefetch,
    dc_store_fence,
)
from deltacells.codec._rowsort cimport (
    SortScratch,
    free_sort_scratch,
    new_sort_scratch,
    row_to_mapped_order,
)
from deltacells.codec._sortchoice cimport (
    row_sort16, row_sort32, row_sort_bitmap_cols, row_sort_vector_level,
)


cdef inline int _row_mapped_unsorted(const int32_t* idx, const value_t* val, int64_t n,
                                     const int32_t* col_map, uint32_t n_map, int32_t* out_idx,
                                     value_t* out_val, int64_t room) noexcept nogil:
    """Renumber one row's columns through ``col_map`` (-1 drops) keeping their order; the kept
    entries must fill ``room`` exactly."""
    cdef int64_t i, o = 0
    cdef int32_t c
    for i in range(n):
        if <uint32_t>idx[i] >= n_map:
            return E_CELL_RANGE
        c = col_map[idx[i]]
        if c < 0:
            continue
        if o >= room:
            return E_CELL_RANGE
        out_idx[o] = c
        out_val[o] = val[i]
        o += 1
    return OK if o == room else E_CELL_RANGE


cdef enum:
    ROWS_PER_BLOCK = 256


cdef void _remap_rows(const int64_t* indptr, const int32_t* indices, const value_t* data,
                      const int32_t* col_map, int64_t n_map, int64_t n_cols,
                      int64_t capacity, Py_ssize_t n_rows, const int64_t* out_indptr,
                      int32_t* out_indices, value_t* out_data, int n_threads, int32_t* status,
                      int64_t* bad_row) noexcept nogil:
    """``row_to_mapped_order`` into ``n_cols`` columns over blocks of ``ROWS_PER_BLOCK`` rows
    in parallel, with per-thread scratch of ``capacity`` entries; block ``b`` stops at its
    first bad row and records it in ``status[b]`` / ``bad_row[b]``."""
    cdef Py_ssize_t block, n_blocks = (n_rows + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    cdef int64_t r, kept
    cdef int st
    cdef SortScratch sorting
    with parallel(num_threads=n_threads):
        sorting = new_sort_scratch(capacity, sizeof(value_t) == 8, row_sort32(), row_sort16(),
                                   row_sort_bitmap_cols(n_cols),
                                   row_sort_vector_level())
        for block in prange(n_blocks, schedule="dynamic"):
            if not sorting.ready:
                status[block] = E_NOMEM
                continue
            for r in range(block * ROWS_PER_BLOCK, min(n_rows, (block + 1) * ROWS_PER_BLOCK)):
                kept = 0  # assigned here so that Cython makes it thread-private
                st = row_to_mapped_order(
                    indices + indptr[r], data + indptr[r], indptr[r + 1] - indptr[r], col_map,
                    <uint32_t>n_map, &sorting, out_indices + out_indptr[r],
                    out_data + out_indptr[r], &kept, False)
                if st == OK and kept != out_indptr[r + 1] - out_indptr[r]:
                    st = E_CELL_RANGE
                if st != OK:
                    status[block] = st
                    bad_row[block] = r
                    break
        free_sort_scratch(&sorting)


def _run_remap(const int64_t[::1] indptr, const int32_t[::1] indices, const value_t[::1] data,
               const int64_t[::1] col_map, int64_t n_out_cols, const int64_t[::1] out_indptr,
               int32_t[::1] out_indices, value_t[::1] out_data, int n_threads):
    """Run ``_remap_rows`` and raise for the lowest failing row (thread-count independent)."""
    cdef Py_ssize_t n_rows = indptr.shape[0] - 1
    if n_rows <= 0 or indptr[n_rows] == 0:
        return
    col_map32 = np.asarray(col_map).astype(np.int32)
    if col_map.shape[0] >= 2**31 or (col_map.shape[0] and np.asarray(col_map).max() >= n_out_cols):
        raise ValueError(f"col_map sends a column to n_out_cols = {n_out_cols} or beyond")
    cdef const int32_t[::1] col_map_v = col_map32
    # Scratch for the longest row, or for one entry per output column: a row keeping more
    # entries than that maps two columns to one place.
    cdef int64_t capacity = min(n_out_cols, int(np.diff(np.asarray(indptr)).max()))
    n_blocks = (n_rows + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    status = np.zeros(n_blocks, dtype=np.int32)
    bad_row = np.zeros(n_blocks, dtype=np.int64)
    cdef int32_t[::1] status_v = status
    cdef int64_t[::1] bad_row_v = bad_row
    cdef int32_t* idx_out = &out_indices[0] if out_indices.shape[0] else NULL
    cdef value_t* val_out = &out_data[0] if out_data.shape[0] else NULL
    with nogil:
        _remap_rows(&indptr[0], &indices[0], &data[0], &col_map_v[0], col_map.shape[0],
                    n_out_cols, capacity, n_rows, &out_indptr[0], idx_out, val_out, n_threads,
                    &status_v[0], &bad_row_v[0])
    failed = np.flatnonzero(status)
    if failed.size == 0:
        return
    st, row = status[failed[0]], bad_row[failed[0]]
    if st == E_NOMEM:
        raise MemoryError("no memory for the column permutation scratch")
    if st == E_ZERO_GAP:
        raise ValueError(f"col_map sends two columns of row {row} to the same place")
    raise ValueError(f"row {row} has a column index outside col_map or a dropped column")


def remap_columns(const int64_t[::1] indptr, const int32_t[::1] indices,
                  const value_t[::1] data, const int64_t[::1] col_map, int64_t n_out_cols,
                  int n_threads=1):
    """Move the columns of a canonical CSR block to ``col_map[j]`` (``-1``: drop the column).

    Each row comes out sorted; rows run in parallel on ``n_threads``. The values keep their
    dtype (int32, float32 or float64). ``col_map`` must not send two kept columns to one place.

    Returns
    -------
    tuple
        ``(indptr, indices, data)``: ``int64``, ``int32`` and ``data``'s dtype.
    """
    cdef Py_ssize_t n_rows = indptr.shape[0] - 1
    cdef int64_t nnz = indptr[n_rows] if n_rows >= 0 else 0
    if n_rows < 0 or indices.shape[0] < nnz or data.shape[0] < nnz:
        raise ValueError("indptr does not match indices / data")
    out_indptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(kept_per_row(indptr, indices, col_map, n_threads), out=out_indptr[1:])
    out_indices = np.empty(out_indptr[n_rows], dtype=np.int32)
    out_data = np.empty(out_indptr[n_rows], dtype=np.asarray(data).dtype)
    _run_remap(indptr, indices, data, col_map, n_out_cols, out_indptr, out_indices, out_data,
               n_threads)
    return out_indptr, out_indices, out_data


def permute_columns(const int64_t[::1] indptr, int32_t[::1] indices, value_t[::1] data,
                    const int64_t[::1] col_map, int n_threads=1):
    """Renumber the columns of a canonical CSR matrix in place through the permutation
    ``col_map`` and sort every row again (rows in parallel on ``n_threads``)."""
    cdef Py_ssize_t n_rows = indptr.shape[0] - 1
    if n_rows < 0 or indices.shape[0] < indptr[n_rows] or data.shape[0] < indptr[n_rows]:
        raise ValueError("indptr does not match indices / data")
    _run_remap(indptr, indices, data, col_map, col_map.shape[0], indptr, indices, data,
               n_threads)


# ---------------------------------------------------------------------------------------------
# Minibatches (loader): rows taken from decoded tiles, optional per-cell normalisation


def take_rows_into(const int64_t[::1] indptr, const int32_t[::1] indices,
                   const value_t[::1] data, const int64_t[::1] rows,
                   const int64_t[::1] positions, const int64_t[::1] out_indptr,
                   int32_t[::1] out_indices, value_t[::1] out_data, object col_map=None,
                   int n_threads=1, bint sort=True):
    """Copy rows of a CSR matrix into given rows of another, optionally moving columns.

    Output row ``j = positions[k]`` receives input row ``rows[j]`` at
    ``out_indptr[j]:out_indptr[j + 1]``, which must be exactly as long as what it receives.
    With ``col_map`` (int64, -1 drops a column) every row is renumbered and sorted again as in
    :func:`remap_columns`, or, with ``sort=False``, renumbered in place order (for outputs made
    dense, where order does not matter); rows run in parallel on ``n_threads``.
    """
    cdef Py_ssize_t n_in = indptr.shape[0] - 1, n_pos = positions.shape[0], k
    cdef int64_t j, r, following, length, kept, n_map = 0, n_cols = 0, longest = 0, capacity
    cdef int32_t* idx_out = &out_indices[0] if out_indices.shape[0] else NULL
    cdef value_t* val_out = &out_data[0] if out_data.shape[0] else NULL
    cdef const int32_t* map_p = NULL
    cdef const int32_t[::1] map_v
    if out_indptr.shape[0] != rows.shape[0] + 1:
        raise ValueError("out_indptr must have one entry more than rows")
    for k in range(n_pos):
        j = positions[k]
        if j < 0 or j >= rows.shape[0] or rows[j] < 0 or rows[j] >= n_in:
            raise ValueError(f"positions[{k}] or the row it names is out of range")
        if out_indptr[j] < 0 or out_indptr[j + 1] > out_indices.shape[0]:
            raise ValueError(f"output row {j} lies outside the output buffers")
        length = indptr[rows[j] + 1] - indptr[rows[j]]
        longest = max(longest, length)
        if col_map is None and out_indptr[j + 1] - out_indptr[j] != length:
            raise ValueError(f"output row {j} does not have the length of input row {rows[j]}")
    if out_data.shape[0] < out_indices.shape[0]:
        raise ValueError("out_data is shorter than out_indices")
    if col_map is not None:
        col_map = np.asarray(col_map, dtype=np.int64)
        n_map = col_map.shape[0]
        if n_map == 0:
            raise ValueError("col_map is empty")
        n_cols = int(col_map.max()) + 1
        map_v = col_map.astype(np.int32)
        map_p = &map_v[0]
    status = np.zeros(max(n_pos, 1), dtype=np.int32)
    cdef int32_t[::1] status_v = status
    cdef SortScratch sorting
    capacity = min(n_cols, longest) if map_p != NULL and sort else 0
    if n_pos == 0:
        return
    with nogil, parallel(num_threads=n_threads):
        sorting = new_sort_scratch(capacity, sizeof(value_t) == 8, row_sort32(), row_sort16(),
                                   row_sort_bitmap_cols(n_cols),
                                   row_sort_vector_level())
        for k in prange(n_pos, schedule="dynamic", chunksize=64):
            j = positions[k]
            r = rows[j]
            length = indptr[r + 1] - indptr[r]
            if map_p == NULL:
                memcpy(idx_out + out_indptr[j], &indices[indptr[r]], length * sizeof(int32_t))
                memcpy(val_out + out_indptr[j], &data[indptr[r]], length * sizeof(value_t))
            elif not sort:
                status_v[k] = _row_mapped_unsorted(
                    &indices[indptr[r]], &data[indptr[r]], length, map_p, <uint32_t>n_map,
                    idx_out + out_indptr[j], val_out + out_indptr[j],
                    out_indptr[j + 1] - out_indptr[j])
            elif not sorting.ready:
                status_v[k] = E_NOMEM
            else:
                # The next row's lines load while this one sorts in cache (rows come in
                # random order; streaming copies above gain nothing from this).
                if k + 1 < n_pos:
                    following = rows[positions[k + 1]]
                    dc_prefetch(&indices[indptr[following]],
                                (indptr[following + 1] - indptr[following]) * sizeof(int32_t))
                    dc_prefetch(&data[indptr[following]],
                                (indptr[following + 1] - indptr[following]) * sizeof(value_t))
                kept = 0  # assigned here so that Cython makes it thread-private
                # A minibatch is written once here and read by its consumer: streamed out.
                status_v[k] = row_to_mapped_order(
                    &indices[indptr[r]], &data[indptr[r]], length, map_p, <uint32_t>n_map,
                    &sorting, idx_out + out_indptr[j], val_out + out_indptr[j], &kept, True)
                if status_v[k] == OK and kept != out_indptr[j + 1] - out_indptr[j]:
                    status_v[k] = E_CELL_RANGE
        dc_store_fence()  # the rows streamed out are seen by every thread after the region
        free_sort_scratch(&sorting)
    failed = np.flatnonzero(status)
    if failed.size:
        if status[failed[0]] == E_NOMEM:
            raise MemoryError("no memory for the column scratch")
        raise ValueError(f"row {rows[positions[failed[0]]]}: columns outside col_map, two "
                         "mapped to one place, or an output row of the wrong length")


def normalize_rows(const int64_t[::1] indptr, floating[::1] data, const double[::1] totals,
                   double target_sum, bint log1p, int n_threads=1):
    """In place, per row ``r``: ``x * target_sum / totals[r]`` (rows with a total of 0 are
    left alone, as scanpy's ``normalize_total`` does; ``target_sum <= 0`` scales nothing),
    then ``log1p(x)`` if asked; rows run in parallel. Arithmetic in float64, stored in
    ``data``'s dtype."""
    cdef Py_ssize_t n_rows = indptr.shape[0] - 1, r
    cdef int64_t i
    cdef double scale
    if totals.shape[0] != n_rows or (n_rows > 0 and data.shape[0] < indptr[n_rows]):
        raise ValueError("totals / data do not match indptr")
    with nogil:
        for r in prange(n_rows, num_threads=n_threads, schedule="static"):
            scale = target_sum / totals[r] if totals[r] > 0 and target_sum > 0 else 1.0
            for i in range(indptr[r], indptr[r + 1]):
                if log1p:
                    data[i] = <floating>c_log1p(data[i] * scale)
                else:
                    data[i] = <floating>(data[i] * scale)


def row_sums(const int64_t[::1] indptr, const value_t[::1] data, int n_threads=1):
    """Per-row sums of a CSR matrix's values, in float64 (exact for counts)."""
    cdef Py_ssize_t n_rows = indptr.shape[0] - 1, r
    cdef int64_t i
    cdef double total
    if n_rows < 0 or (n_rows > 0 and data.shape[0] < indptr[n_rows]):
        raise ValueError("data does not match indptr")
    out = np.zeros(max(n_rows, 0), dtype=np.float64)
    cdef double[::1] out_v = out
    with nogil:
        for r in prange(n_rows, num_threads=n_threads, schedule="static"):
            total = 0
            for i in range(indptr[r], indptr[r + 1]):
                total = total + data[i]
            out_v[r] = total
    return out


def sort_rows_only(const int64_t[::1] indptr, const int32_t[::1] indices,
                   const value_t[::1] data, const int64_t[::1] rows, object col_map,
                   int n_threads=1):
    """Renumber and sort the given rows and do nothing else: the limit for the source-order
    row step of :func:`take_rows_into`.

    Each row in ``rows`` (in that order, in parallel on ``n_threads``) goes through the row
    step's own renumbering and sort (``row_to_mapped_order``, whichever of codec/rowsort.py's
    sorts is in use) into a per-thread buffer that stays in cache, so that only the placing of
    rows into fresh minibatch memory is left out. For benchmarks (``bench_loader``'s floor);
    ``col_map`` is int64 and drops nothing (no -1). Returns the sum of each row's middle
    sorted column (mod 2^32), so the work cannot be skipped.
    """
    cdef Py_ssize_t n_in = indptr.shape[0] - 1, n_rows = rows.shape[0], k
    cdef int64_t r, n, kept, longest = 0, n_cols
    cdef uint32_t total = 0
    cdef int32_t* out_idx = NULL
    cdef value_t* out_val = NULL
    map_v = np.ascontiguousarray(col_map, dtype=np.int64)
    if map_v.ndim != 1 or map_v.shape[0] == 0 or map_v.min() < 0 or map_v.max() >= 2**31:
        raise ValueError("col_map must map onto columns >= 0 without dropping any")
    n_cols = int(map_v.max()) + 1
    cdef const int32_t[::1] cmap = map_v.astype(np.int32)
    for k in range(n_rows):
        if rows[k] < 0 or rows[k] >= n_in:
            raise ValueError(f"rows[{k}] is out of range")
        r = rows[k]
        if indptr[r] < 0 or indptr[r + 1] < indptr[r] or indptr[r + 1] > indices.shape[0]:
            raise ValueError(f"row {r} lies outside indices (indptr must rise within it)")
        longest = max(longest, indptr[r + 1] - indptr[r])
    if data.shape[0] < indices.shape[0]:
        raise ValueError("data is shorter than indices")
    status = np.zeros(max(n_rows, 1), dtype=np.int32)
    cdef int32_t[::1] status_v = status
    cdef SortScratch sorting
    if n_rows == 0:
        return 0
    with nogil, parallel(num_threads=n_threads):
        sorting = new_sort_scratch(longest, sizeof(value_t) == 8, row_sort32(), row_sort16(),
                                   row_sort_bitmap_cols(n_cols),
                                   row_sort_vector_level())
        out_idx = <int32_t*>malloc((longest + 1) * sizeof(int32_t))
        out_val = <value_t*>malloc((longest + 1) * sizeof(value_t))
        for k in prange(n_rows, schedule="dynamic", chunksize=64):
            if not sorting.ready or out_idx == NULL or out_val == NULL:
                status_v[k] = E_NOMEM
                continue
            r = rows[k]
            n = indptr[r + 1] - indptr[r]
            kept = 0  # assigned here so that Cython makes it thread-private
            status_v[k] = row_to_mapped_order(
                &indices[indptr[r]], &data[indptr[r]], n, &cmap[0], <uint32_t>cmap.shape[0],
                &sorting, out_idx, out_val, &kept, False)
            if status_v[k] == OK and kept > 0:
                total += <uint32_t>out_idx[kept // 2]
        free(out_idx)
        free(out_val)
        free_sort_scratch(&sorting)
    failed = np.flatnonzero(status)
    if failed.size:
        if status[failed[0]] == E_NOMEM:
            raise MemoryError("no memory for the sort scratch")
        raise ValueError(f"row {rows[failed[0]]}: a column outside col_map, or two mapped "
                         "to one place")
    return int(total)


def kept_per_row(const int64_t[::1] indptr, const int32_t[::1] indices,
                 const int64_t[::1] col_map, int n_threads=1):
    """Per row, how many of its columns ``col_map`` keeps (maps to >= 0)."""
    cdef Py_ssize_t n_rows = indptr.shape[0] - 1, r
    cdef int64_t i, kept, n_map = col_map.shape[0]
    if n_rows < 0 or (n_rows > 0 and indices.shape[0] < indptr[n_rows]):
        raise ValueError("indices do not match indptr")
    for i in range(indptr[n_rows] if n_rows > 0 else 0):
        if indices[i] < 0 or indices[i] >= n_map:
            raise ValueError(f"column index {indices[i]} outside col_map")
    out = np.zeros(max(n_rows, 0), dtype=np.int64)
    cdef int64_t[::1] out_v = out
    with nogil:
        for r in prange(n_rows, num_threads=n_threads, schedule="static"):
            kept = 0
            for i in range(indptr[r], indptr[r + 1]):
                kept = kept + (col_map[indices[i]] >= 0)
            out_v[r] = kept
    return out


cdef inline int64_t _n_digits(int64_t value) noexcept nogil:
    # Comparisons, not divisions: this runs once per name. ``bound`` stops at 10^18 (the
    # next power of ten overflows int64); a value at or above it has 19 digits.
    cdef int64_t n = 1, bound = 10
    while value >= bound:
        n += 1
        if n == 19:
            break
        bound *= 10
    return n


# "00" .. "99": two digits per division.
cdef const char* _PAIRS = (
    b"0001020304050607080910111213141516171819202122232425262728293031323334353637383940414243"
    b"4445464748495051525354555657585960616263646566676869707172737475767778798081828384858687"
    b"888990919293949596979899"
)


cdef inline void _write_decimal(int64_t value, uint8_t* end) noexcept nogil:
    """The digits of ``value`` >= 0, ending just before ``end``, two at a time."""
    cdef int64_t pair
    while value >= 100:
        pair = (value % 100) * 2
        value //= 100
        end -= 2
        end[0] = _PAIRS[pair]
        end[1] = _PAIRS[pair + 1]
    if value >= 10:
        end -= 2
        end[0] = _PAIRS[value * 2]
        end[1] = _PAIRS[value * 2 + 1]
    else:
        end -= 1
        end[0] = <uint8_t>(48 + value)


cdef object _position_source(object positions, const int64_t** pos, int64_t* start,
                             Py_ssize_t* n, str kernel):
    """Where ``positions`` come from: an int64 array (``pos``), or a ``range`` of step 1
    (``pos`` NULL, ``start`` its first): ``range(n_cells)`` names every cell without an array
    of 8 bytes per cell, whose fresh pages alone took 0.25 s at 10M cells on the AMD machine.
    Returns what keeps the array alive."""
    cdef const int64_t[::1] view
    pos[0], start[0] = NULL, 0
    if isinstance(positions, range):
        if positions.step != 1:
            raise ValueError(f"{kernel}: a range of positions must have step 1")
        n[0] = len(positions)
        if n[0] and positions.start < 0:
            raise ValueError(f"{kernel}: negative position")
        if n[0] and positions[-1] > INT64_MAX:
            raise ValueError(f"{kernel}: a position past 2^63 - 1")
        start[0] = positions.start
        return positions
    view = positions
    n[0] = view.shape[0]
    if n[0]:
        if np.min(positions) < 0:
            raise ValueError(f"{kernel}: negative position")
        pos[0] = &view[0]
    return view


cdef inline int64_t _position(const int64_t* pos, int64_t start, Py_ssize_t i) noexcept nogil:
    return pos[i] if pos != NULL else start + i


def decimal_names(positions):
    """The decimal strings of ``positions`` (``"0"``, ``"17"``, ...) as Arrow large-string
    buffers: int64 offsets (``len + 1``) and UTF-8 bytes, with no Python string per name.
    ``positions``: an int64 array, or a ``range`` of step 1.

    Default obs names of an atlas are ten or a hundred million of these; built here they
    cost about 6 ns each, where an int-to-string cast allocates through a memory pool. Serial:
    two threads measured slower (the pass is bound by first touches of fresh pages).
    """
    cdef const int64_t* pos
    cdef int64_t start
    cdef Py_ssize_t n, i
    cdef uint8_t* out
    _source = _position_source(positions, &pos, &start, &n, "decimal_names")
    offsets = np.empty(n + 1, dtype=np.int64)
    cdef int64_t[::1] off = offsets
    off[0] = 0
    with nogil:
        for i in range(n):
            off[i + 1] = off[i] + _n_digits(_position(pos, start, i))
    data = np.empty(off[n], dtype=np.uint8)
    cdef uint8_t[::1] data_v = data
    if off[n] == 0:
        return offsets, data
    out = &data_v[0]
    with nogil:
        for i in range(n):
            _write_decimal(_position(pos, start, i), out + off[i + 1])
    return offsets, data


cdef size_t _window_bytes = 0


cdef bint _open_window(size_t nbytes, object n_threads):
    """A window of arenas for strings of ``nbytes`` (``arenas.h``), its helper thread on when
    ``n_threads`` resolves to two or more; whether it opened."""
    return dc_arenas_open(nbytes, effective_n_threads(n_threads) > 1)


cdef void _close_window(bint window):
    global _window_bytes
    if window:
        _window_bytes = dc_arenas_close()


cdef object _name_objects(positions, bint digits, str caller, n_threads):
    """One Python string per position, of its decimal length: its digits, or ``"0"`` repeated
    when ``digits`` is false. One loop for both, so the benchmark's limit times exactly the
    loop the reader runs, less the digits.

    Millions of them take their arenas from a window (``arenas.h``) whose fresh pages a helper
    thread faults in ahead, when ``n_threads`` resolves to two or more."""
    cdef const int64_t* pos
    cdef int64_t start, length, value
    cdef Py_ssize_t n, i
    cdef size_t nbytes = 0
    _source = _position_source(positions, &pos, &start, &n, caller)
    out = np.empty(n, dtype=object)
    cdef object[::1] view = out
    with nogil:
        for i in range(n):
            nbytes += dc_arenas_ascii_bytes(_n_digits(_position(pos, start, i)))
    cdef bint window = _open_window(nbytes, n_threads)
    try:
        for i in range(n):
            value = _position(pos, start, i)
            length = _n_digits(value)
            name = PyUnicode_New(length, 127)
            if digits:
                _write_decimal(value, <uint8_t*>PyUnicode_DATA(name) + length)
            else:
                memset(PyUnicode_DATA(name), 48, length)
            view[i] = name
    finally:
        _close_window(window)
    return out


def _last_window_bytes():
    """Bytes of arenas the last window handed out, for names or stored strings (tests check
    that it opened)."""
    return _window_bytes


cdef inline bint _ascii(const uint8_t* data, int64_t n) noexcept nogil:
    cdef int64_t i
    cdef uint8_t any_high = 0
    for i in range(n):
        any_high |= data[i]
    return any_high < 128


def string_objects(chunks, n_threads=None):
    """Python strings from Arrow string buffers, in one object array: what a pandas 2 index of
    stored obs names holds, without pyarrow's ``to_pandas`` (which hashes every string to
    share repeats: 4 s for 10M unique barcodes, against 0.2-0.4 s here).

    ``chunks``: a list of ``(offsets, data)``, int64 offsets (``len + 1``, from 0 into that
    chunk's ``data``, checked here) and uint8 UTF-8 bytes. ASCII strings are copied in place;
    others decoded strictly (``UnicodeDecodeError`` for bytes that are not UTF-8). Millions
    of strings take their arenas from a window whose pages a helper thread faults in ahead,
    as for :func:`decimal_name_objects`.
    """
    cdef Py_ssize_t n = 0, at = 0, i, k
    cdef size_t nbytes = 0
    cdef const int64_t* off
    cdef const uint8_t* data
    cdef int64_t length, size
    cdef int64_t[::1] off_v
    cdef const uint8_t[::1] data_v
    views = []
    for offsets, data_array in chunks:
        off_v = np.ascontiguousarray(offsets, dtype=np.int64)
        data_v = np.ascontiguousarray(data_array, dtype=np.uint8)
        if off_v.shape[0] < 1 or off_v[0] != 0:
            raise ValueError("string_objects: offsets must start at 0")
        size = data_v.shape[0]
        for i in range(off_v.shape[0] - 1):
            if off_v[i + 1] < off_v[i] or off_v[i + 1] > size:
                raise ValueError(f"string_objects: offset {off_v[i + 1]} outside 0 .. {size}")
            nbytes += dc_arenas_ascii_bytes(off_v[i + 1] - off_v[i])
        n += off_v.shape[0] - 1
        views.append((off_v, data_v))
    out = np.empty(n, dtype=object)
    cdef object[::1] view = out
    cdef bint window = _open_window(nbytes, n_threads)
    try:
        for off_v, data_v in views:
            k = off_v.shape[0] - 1
            if k == 0:
                continue
            off = &off_v[0]
            data = &data_v[0] if data_v.shape[0] else <const uint8_t*>b""
            for i in range(k):
                length = off[i + 1] - off[i]
                if _ascii(data + off[i], length):
                    name = PyUnicode_New(length, 127)
                    memcpy(PyUnicode_DATA(name), data + off[i], length)
                else:
                    name = PyUnicode_DecodeUTF8(<const char*>(data + off[i]), length, "strict")
                view[at + i] = name
            at += k
    finally:
        _close_window(window)
    return out


def decimal_name_objects(positions, n_threads=None):
    """The decimal strings of ``positions`` as an object array of Python strings (what a
    pandas 2 index holds), each made from its digits without a round trip through Arrow.
    ``positions``: an int64 array, or a ``range`` of step 1. ``n_threads``: as everywhere
    (``None``: ``OMP_NUM_THREADS``, else the usable CPUs); from two, a helper thread faults
    in the strings' fresh pages ahead of them."""
    return _name_objects(positions, True, "decimal_name_objects", n_threads)


def name_objects_only(positions, n_threads=None):
    """Python strings of the lengths of ``decimal_name_objects(positions)``, filled with ``"0"``
    instead of their digits, in an object array: what making the strings alone costs, the
    least any pandas 2 index of these names takes. For benchmarks (``bench_scale``'s limit)."""
    return _name_objects(positions, False, "name_objects_only", n_threads)
