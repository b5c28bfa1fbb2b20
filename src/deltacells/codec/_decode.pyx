# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Hot loops of the deltacells tile codec: libzstd called directly, the GIL released.

Chunks are the unit of parallelism: every parallel loop runs over chunks (or, when a whole
tile is decoded, over each chunk's two streams) under ``prange``, with one zstd context and one
scratch buffer per thread. Nothing inside a parallel region touches a Python object; failures
are written to per-job status slots and raised once the region is over, for the lowest failing
job, so the error (like the output) does not depend on the thread count.

The structure handed to these functions (chunk table, indptr) must come from
:func:`deltacells.codec.format.parse_layout`; the kernels check what they index anyway, so bad input
gives an error rather than a stray memory access.
"""

from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t
from libc.stdlib cimport free, malloc

import numpy as np

from deltacells.codec._common cimport (
    value_t,
    CELL_LO,
    CELL_HI,
    NNZ_LO,
    NNZ_HI,
    STREAM_MAX,
    MAX_COUNT,
    OK,
    E_NOMEM,
    E_DECOMPRESS,
    E_CELL_RANGE,
    E_ZERO_GAP,
    E_GENE_RANGE,
    E_EXC_ORDER,
    E_VEXC_PAYLOAD,
    E_GEXC_PAYLOAD,
    E_EXC_STORED,
    E_ZERO_COUNT,
    E_COL_MAP,
    DELTACELLS_OPENMP,
    dc_prefix_planes,
    dc_any_zero_planes,
    dc_planes_to_f32,
    dc_store_fence,
    dc_chunk_gaps,
)
from deltacells.codec._sortchoice cimport (
    row_sort16, row_sort32, row_sort_bitmap_cols, row_sort_vector_level,
)
from deltacells.codec._rowsort cimport (
    SortScratch,
    free_sort_scratch,
    new_sort_scratch,
    row_to_mapped_order,
)
from deltacells.codec._pools cimport (
    give_back_dctx,
    give_back_scratch,
    take_dctx,
    take_scratch,
)
from deltacells.codec._zstd cimport (
    ZSTD_DCtx,
    ZSTD_decompressDCtx,
    ZSTD_isError,
)
from deltacells.codec._status import raise_status


def openmp_enabled() -> bool:
    """Whether this build runs parallel loops with OpenMP (else serially, same output)."""
    return bool(DELTACELLS_OPENMP)


cdef struct Chunk:
    # One chunk being decoded: its exception lists and one stream's byte planes at a time
    # (gaps, then values), so the scratch a thread touches stays small enough for its cache.
    const uint8_t* lo
    const uint8_t* hi
    const uint32_t* vpos
    const uint32_t* vpay
    const uint32_t* gpos
    const uint32_t* gpay
    int64_t n
    int64_t kv
    int64_t kg
    int stream  # non-temporal stores for long runs (off when the output is re-read at once)


# ---------------------------------------------------------------------------------------------
# Decoding


cdef inline int64_t _scratch_bytes(int64_t n, int64_t kv, int64_t kg) noexcept nogil:
    # Exception lists first (uint32 aligned), then one stream's planes.
    return 8 * kv + 8 * kg + 2 * n + 8


cdef int _load_exception_frame(ZSTD_DCtx* dctx, const uint8_t* blob, const int64_t* entry,
                               int which, int64_t k, int64_t n, uint8_t* dst,
                               int64_t lowest, int64_t highest, int bad_payload,
                               int64_t* detail) noexcept nogil:
    """Decompress exception frame ``which`` (2 vexc, 3 gexc) of a chunk into ``dst`` and check
    that its ``k`` positions strictly increase below ``n`` and its payloads lie in range."""
    cdef const uint32_t* pos = <const uint32_t*>dst
    cdef const uint32_t* pay = pos + k
    cdef int64_t i
    cdef size_t got
    if k == 0:
        if entry[5 + 2 * which] == 0:
            return OK  # absent: the usual case
        # A present frame holding k = 0 exceptions is valid (docs/format.md) but must really
        # decompress to nothing, whatever blocks follow its header.
        got = ZSTD_decompressDCtx(dctx, dst, 0, blob + entry[4 + 2 * which],
                                  <size_t>entry[5 + 2 * which])
        if ZSTD_isError(got) or got != 0:
            detail[0] = which
            return E_DECOMPRESS
        return OK
    got = ZSTD_decompressDCtx(dctx, dst, <size_t>(8 * k), blob + entry[4 + 2 * which],
                              <size_t>entry[5 + 2 * which])
    if ZSTD_isError(got) or got != <size_t>(8 * k):
        detail[0] = which
        return E_DECOMPRESS
    for i in range(k):
        if pos[i] >= n or (i > 0 and pos[i] <= pos[i - 1]):
            detail[0] = i
            return E_EXC_ORDER
        if pay[i] < lowest or pay[i] > highest:
            detail[0] = i
            return bad_payload
    return OK


cdef int _load_exceptions(ZSTD_DCtx* dctx, const uint8_t* blob, const int64_t* entry,
                          int64_t kv, int64_t kg, int64_t n_genes, uint8_t* scratch,
                          Chunk* p, int64_t* detail) noexcept nogil:
    """Decompress a chunk's exception frames and check positions and payload ranges."""
    cdef int st
    p.n = entry[NNZ_HI] - entry[NNZ_LO]
    p.kv = kv
    p.kg = kg
    p.vpos = <const uint32_t*>scratch
    p.vpay = p.vpos + kv
    p.gpos = p.vpay + kv
    p.gpay = p.gpos + kg
    st = _load_exception_frame(dctx, blob, entry, 2, kv, p.n, scratch, 65536, MAX_COUNT,
                               E_VEXC_PAYLOAD, detail)
    if st == OK:
        st = _load_exception_frame(dctx, blob, entry, 3, kg, p.n, scratch + 8 * kv, 1,
                                   n_genes - 1, E_GEXC_PAYLOAD, detail)
    return st


cdef int _load_planes(ZSTD_DCtx* dctx, const uint8_t* blob, const int64_t* entry, int which,
                      uint8_t* scratch, Chunk* p, int64_t* detail) noexcept nogil:
    """Decompress stream ``which`` (0 gaps, 1 values) of a chunk into the scratch planes.

    Also checks that this stream's exceptions sit on a stored 65535.
    """
    cdef int64_t i, k = p.kg if which == 0 else p.kv
    cdef const uint32_t* pos = p.gpos if which == 0 else p.vpos
    cdef uint8_t* dst = scratch + 8 * (p.kv + p.kg)
    cdef size_t got = ZSTD_decompressDCtx(dctx, dst, <size_t>(2 * p.n), blob + entry[4 + 2 * which],
                                          <size_t>entry[5 + 2 * which])
    if ZSTD_isError(got) or got != <size_t>(2 * p.n):
        detail[0] = which
        return E_DECOMPRESS
    p.lo = dst
    p.hi = dst + p.n
    for i in range(k):
        if (p.lo[pos[i]] | (p.hi[pos[i]] << 8)) != STREAM_MAX:
            detail[0] = pos[i]
            return E_EXC_STORED
    return OK


cdef inline int64_t _lower_bound(const uint32_t* a, int64_t k, int64_t x) noexcept nogil:
    """First index i in sorted a[0:k] with a[i] >= x."""
    cdef int64_t lo = 0, hi = k, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if <int64_t>a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef int _decode_cell(const Chunk* p, int64_t s, int64_t e, int64_t n_genes,
                      int32_t* out, int64_t* xcursor) noexcept nogil:
    """Gene indices of the nonzeros s..e of a chunk (one cell) into out[0 : e - s].

    The gaps planes must be loaded. ``xcursor`` indexes the first gap exception at or after
    ``s``; it is advanced past ``e``.
    """
    # Local copies: the compiler cannot assume stores to out leave p's fields alone.
    cdef const uint8_t* glo = p.lo
    cdef const uint8_t* ghi = p.hi
    cdef const uint32_t* gpos = p.gpos
    cdef int64_t kg = p.kg
    cdef int64_t g = 0, i, q, x = xcursor[0]
    cdef int64_t start = s
    cdef int32_t* dst = out - s
    if s == e:
        return OK
    # The first gap of a cell is its first gene and may be 0; any later zero is a duplicate.
    if dc_any_zero_planes(glo + s + 1, ghi + s + 1, e - s - 1):
        return E_ZERO_GAP
    while start < e:
        if x < kg and gpos[x] == start:
            g += p.gpay[x]
            x += 1
        if g >= n_genes:  # indices only grow, so this cell is already out of range
            return E_GENE_RANGE
        q = e
        if x < kg and gpos[x] < e:
            q = gpos[x]
        if g + <int64_t>STREAM_MAX * (q - start) < MAX_COUNT:
            g = dc_prefix_planes(glo + start, ghi + start, q - start, <int32_t>g, dst + start,
                                 p.stream)
        else:  # a very long segment could pass 2^31 in int32: add up in int64 instead
            for i in range(start, q):
                g += glo[i] | (<uint32_t>ghi[i] << 8)
                dst[i] = <int32_t>g
                if g >= n_genes:
                    return E_GENE_RANGE
        start = q
    xcursor[0] = x
    if g >= n_genes:  # indices increase within a cell, so the last one is the largest
        return E_GENE_RANGE
    return OK


cdef int _decode_values(const Chunk* p, int64_t s, int64_t e, value_t* out,
                        int64_t* xcursor) noexcept nogil:
    """Counts of the nonzeros s..e of a chunk into out[0 : e - s], exceptions applied.

    The values planes must be loaded. Returns E_ZERO_COUNT if a stored count is 0.
    """
    cdef const uint8_t* vlo = p.lo
    cdef const uint8_t* vhi = p.hi
    cdef value_t* dst = out - s
    cdef int64_t i, x = xcursor[0]
    cdef uint8_t any_zero = 0
    if value_t is float and e - s >= 4096:
        any_zero = dc_planes_to_f32(vlo + s, vhi + s, e - s, out, p.stream)
    else:
        # Written so that the compiler vectorizes it with baseline SSE2: byte compares for the
        # zero check and a signed int32 -> float conversion (stored counts are at most 65535).
        for i in range(s, e):
            any_zero |= (vlo[i] | vhi[i]) == 0
            dst[i] = <value_t>(<int32_t>(vlo[i] | (<int32_t>vhi[i] << 8)))
    while x < p.kv and p.vpos[x] < e:
        dst[p.vpos[x]] = <value_t>p.vpay[x]
        x += 1
    xcursor[0] = x
    if any_zero:
        for i in range(s, e):
            if vlo[i] == 0 and vhi[i] == 0:
                return E_ZERO_COUNT
    return OK


cdef inline int _selected_row(const int64_t* entry, const int64_t* indptr, const int64_t* rows,
                              const int64_t* order, const int64_t* out_indptr, int64_t k,
                              int64_t n, int64_t* cell, int64_t* s, int64_t* e,
                              int64_t* o) noexcept nogil:
    """Output row ``order[k]`` of a chunk's selected rows: its ``cell``, its entries ``s..e``
    of the chunk and where it goes (``o``, from ``out_indptr``); E_CELL_RANGE unless the
    cell lies in the chunk and the output row has room for exactly its ``n``-bounded entries."""
    cdef int64_t j = order[k], a = entry[NNZ_LO]
    cell[0] = rows[j]
    o[0] = out_indptr[j]
    if cell[0] < entry[CELL_LO] or cell[0] >= entry[CELL_HI]:
        return E_CELL_RANGE
    s[0] = indptr[cell[0]] - a
    e[0] = indptr[cell[0] + 1] - a
    if s[0] < 0 or e[0] < s[0] or e[0] > n or out_indptr[j + 1] - o[0] != e[0] - s[0]:
        return E_CELL_RANGE
    return OK


cdef int _decode_chunk(ZSTD_DCtx* dctx, const uint8_t* blob, const int64_t* entry,
                       int64_t kv, int64_t kg, int64_t n_genes, const int64_t* indptr,
                       const int64_t* rows, const int64_t* order, int64_t k_lo, int64_t k_hi,
                       const int64_t* out_indptr, int32_t* idx_out, value_t* val_out,
                       uint8_t* scratch, Chunk* p, int streams, int64_t* detail) noexcept nogil:
    """Decode one chunk: all its cells in place, or the requested rows to their output rows.

    ``streams`` says what to decode: 1 the gene indices, 2 the values, 3 both.

    With ``rows == NULL`` every cell goes to its own place (outputs indexed by tile nonzero).
    Otherwise output row ``j = order[k]`` for ``k`` in ``k_lo..k_hi`` is cell ``rows[j]``,
    written at ``out_indptr[j]``. Gaps are decoded first, then values into the same scratch.
    """
    cdef int64_t a = entry[NNZ_LO], k, r, s, e, o, x
    cdef int which, st
    st = _load_exceptions(dctx, blob, entry, kv, kg, n_genes, scratch, p, detail)
    if st != OK:
        return st
    for which in range(2):
        if not (streams >> which) & 1:
            continue
        st = _load_planes(dctx, blob, entry, which, scratch, p, detail)
        if st != OK:
            return st
        if rows == NULL and which == 0 and p.kg == 0:
            st = dc_chunk_gaps(p.lo, p.hi, p.n, indptr, entry[CELL_LO], entry[CELL_HI], a,
                               n_genes, idx_out + a, p.stream)
            dc_store_fence()
            if st == 0:
                continue  # else the cell-by-cell loop below decodes again and names the error
        if rows == NULL and which == 1:
            # Values of the whole chunk are contiguous in the output: one pass.
            x = 0
            st = _decode_values(p, 0, p.n, val_out + a, &x)
            if st != OK:
                detail[0] = entry[CELL_LO]
                return st
            continue
        x = 0
        k = k_lo
        r = entry[CELL_LO]
        while (rows == NULL and r < entry[CELL_HI]) or (rows != NULL and k < k_hi):
            if rows == NULL:
                o = indptr[r]
                s = indptr[r] - a
                e = indptr[r + 1] - a
                st = OK if 0 <= s <= e <= p.n else E_CELL_RANGE
            else:
                st = _selected_row(entry, indptr, rows, order, out_indptr, k, p.n, &r, &s, &e,
                                   &o)
            if st != OK:
                detail[0] = r
                return st
            if which == 0:
                if rows != NULL:
                    x = _lower_bound(p.gpos, p.kg, s)
                st = _decode_cell(p, s, e, n_genes, idx_out + o, &x)
            else:
                x = _lower_bound(p.vpos, p.kv, s)
                st = _decode_values(p, s, e, val_out + o, &x)
            if st != OK:
                detail[0] = r
                return st
            r += 1
            k += 1
        dc_store_fence()  # order the gaps pass's non-temporal stores before anything else
    return OK


cdef int _gather_chunk_mapped(ZSTD_DCtx* dctx, const uint8_t* blob, const int64_t* entry,
                              int64_t kv, int64_t kg, int64_t n_genes, const int64_t* indptr,
                              const int64_t* rows, const int64_t* order, int64_t k_lo,
                              int64_t k_hi, const int64_t* out_indptr, int32_t* idx_out,
                              value_t* val_out, const size_t* dst_idx, const size_t* dst_val,
                              uint8_t* scratch, Chunk* pg, Chunk* pv, int32_t* row_idx,
                              value_t* row_val, const int32_t* col_map, SortScratch* sorting,
                              int64_t* detail) noexcept nogil:
    """``_decode_chunk``'s selected rows through ``col_map``: both streams' planes loaded at
    once, each row decoded into the thread's row buffers (in L1), then renumbered, sorted and
    streamed to its output row, so that only the output leaves the cache.

    Output row ``j`` is ``idx_out + out_indptr[j]`` (``val_out`` likewise), or, with
    ``dst_idx``, the addresses ``dst_idx[j]`` and ``dst_val[j]``; it holds
    ``out_indptr[j + 1] - out_indptr[j]`` entries either way."""
    cdef int64_t k, j, r, s, e, o, xg, xv, kept
    cdef int32_t* out_i
    cdef value_t* out_v
    cdef int st = _load_exceptions(dctx, blob, entry, kv, kg, n_genes, scratch, pg, detail)
    if st != OK:
        return st
    pv[0] = pg[0]
    st = _load_planes(dctx, blob, entry, 0, scratch, pg, detail)
    if st == OK:
        st = _load_planes(dctx, blob, entry, 1, scratch + 2 * pg.n, pv, detail)
    if st != OK:
        return st
    pg.stream = 0
    pv.stream = 0
    for k in range(k_lo, k_hi):
        j = order[k]
        st = _selected_row(entry, indptr, rows, order, out_indptr, k, pg.n, &r, &s, &e, &o)
        if st != OK or e - s > sorting.capacity:
            detail[0] = r
            return E_CELL_RANGE
        xg = _lower_bound(pg.gpos, pg.kg, s)
        st = _decode_cell(pg, s, e, n_genes, row_idx, &xg)
        if st == OK:
            xv = _lower_bound(pv.vpos, pv.kv, s)
            st = _decode_values(pv, s, e, row_val, &xv)
        if st != OK:
            detail[0] = r
            return st
        if dst_idx != NULL:
            out_i = <int32_t*>dst_idx[j]
            out_v = <value_t*>dst_val[j]
        else:
            out_i = idx_out + o
            out_v = val_out + o
        kept = 0
        st = row_to_mapped_order(row_idx, row_val, e - s, col_map, <uint32_t>n_genes, sorting,
                                 out_i, out_v, &kept, True)
        if st != OK:
            detail[0] = r
            return E_COL_MAP
    return OK


cdef struct TileRef:
    # One tile's parsed structure as the parallel region reads it (addresses of arrays the
    # caller keeps alive): its bytes, chunk table (CHUNK_COLS int64 per chunk), exception
    # counts (2 int64 per chunk, from check_frames) and indptr.
    const uint8_t* blob
    const int64_t* chunks
    const int64_t* exc
    const int64_t* indptr


cdef enum:
    CHUNK_COLS = 12


cdef object _tile_refs(list blobs, list chunk_tables, list indptrs, list excs):
    """A ``(n_tiles, 4)`` uintp array laid out as ``TileRef``s, and each tile's chunk count,
    after checking the tables' shapes (the arrays must outlive the kernel call)."""
    cdef Py_ssize_t t, n_tiles = len(blobs)
    cdef const uint8_t[::1] blob
    cdef const int64_t[:, ::1] chunks
    cdef const int64_t[:, ::1] exc
    cdef const int64_t[::1] indptr
    if not (len(chunk_tables) == len(indptrs) == len(excs) == n_tiles):
        raise ValueError("blobs, chunk tables, indptrs and exception counts differ in number")
    refs = np.zeros((n_tiles, 4), dtype=np.uintp)
    n_chunks = np.zeros(n_tiles, dtype=np.int64)
    cdef size_t[:, ::1] refs_v = refs
    for t in range(n_tiles):
        blob, chunks, exc, indptr = blobs[t], chunk_tables[t], excs[t], indptrs[t]
        if (chunks.shape[1] != CHUNK_COLS or exc.shape[0] != chunks.shape[0]
                or exc.shape[1] != 2 or indptr.shape[0] == 0 or blob.shape[0] == 0):
            raise ValueError(f"tile {t}: chunk table, exception counts or indptr malformed")
        refs_v[t, 0] = <size_t>&blob[0]
        refs_v[t, 1] = <size_t>&chunks[0, 0] if chunks.shape[0] else 0
        refs_v[t, 2] = <size_t>&exc[0, 0] if exc.shape[0] else 0
        refs_v[t, 3] = <size_t>&indptr[0]
        n_chunks[t] = chunks.shape[0]
    return refs, n_chunks


cdef int64_t _max_scratch(const int64_t[:, ::1] chunks, const int64_t[:, ::1] exc, object ids):
    cdef int64_t best = 8, size
    for c in ids:
        size = _scratch_bytes(chunks[c, NNZ_HI] - chunks[c, NNZ_LO], exc[c, 0], exc[c, 1])
        if size > best:
            best = size
    return best


cdef void _decode_jobs(const TileRef* tiles, const int64_t* job_tiles, int64_t n_genes,
                       const int64_t* rows, const int64_t* order, const int64_t* job_chunks,
                       const int64_t* job_starts, Py_ssize_t n_jobs, bint split_streams,
                       const int64_t* out_indptr, int32_t* idx_out, value_t* val_out,
                       const size_t* scratches, int n_threads,
                       const size_t* contexts, const int32_t* col_map, int64_t capacity,
                       const size_t* dst_idx, const size_t* dst_val,
                       int32_t* status, int64_t* detail) noexcept nogil:
    """Run ``_decode_chunk`` for every job in parallel (a job is a chunk or one of its streams).

    Job ``g`` reads tile ``job_tiles[g]`` (``tiles[0]`` without ``job_tiles``): one parallel
    section for the chunks of many tiles, so that threads do not wait at the end of each
    tile. Without ``rows`` job ``g`` is chunk ``g``; with them it is chunk ``job_chunks[g]``
    and its rows ``order[job_starts[g]:job_starts[g + 1]]`` (positions within that tile). With
    ``split_streams`` (whole chunks, no ``col_map``) job ``g`` is one stream of chunk
    ``g // 2``: its gene indices when ``g`` is even, its values when odd: twice as many,
    smaller jobs leave less idle time at the end. With ``col_map`` (a permutation of the
    ``n_genes`` columns) and whole chunks, each chunk's cells are then renumbered and sorted
    in place by the same thread while they are still in cache (so they are written with
    regular stores), with sort scratch of ``capacity`` entries; selected rows go through
    ``_gather_chunk_mapped`` instead (to ``dst_idx`` / ``dst_val`` when given), decoded one at
    a time into the thread's row buffers and streamed to their place.
    """
    cdef Py_ssize_t g
    cdef int64_t c, k, o, length, kept
    cdef int st
    cdef const TileRef* tile = NULL
    cdef const int64_t* entry = NULL
    cdef const int64_t* indptr = NULL
    cdef ZSTD_DCtx* dctx = NULL  # set per thread; initialized so the firstprivate copy is defined
    cdef uint8_t* scratch = NULL
    cdef Chunk* chunk = NULL
    cdef int32_t* row_idx = NULL
    cdef value_t* row_val = NULL
    cdef SortScratch sorting
    # Selected rows through a col_map are decoded a row at a time into L1 row buffers.
    cdef bint by_row = rows != NULL and col_map != NULL
    with parallel(num_threads=n_threads):
        dctx = <ZSTD_DCtx*>contexts[threadid()]
        scratch = <uint8_t*>scratches[threadid()]
        chunk = <Chunk*>malloc(2 * sizeof(Chunk))
        sorting = new_sort_scratch(capacity if col_map != NULL else 0, sizeof(value_t) == 8,
                                   row_sort32(), row_sort16(), row_sort_bitmap_cols(n_genes),
                                   row_sort_vector_level())
        row_idx = <int32_t*>malloc((capacity + 1) * sizeof(int32_t)) if by_row else NULL
        row_val = <value_t*>malloc((capacity + 1) * sizeof(value_t)) if by_row else NULL
        for g in prange(n_jobs, schedule="dynamic"):
            if (dctx == NULL or scratch == NULL or chunk == NULL
                    or (col_map != NULL and not sorting.ready)
                    or (by_row and (row_idx == NULL or row_val == NULL))):
                status[g] = E_NOMEM
                continue
            tile = tiles + (0 if job_tiles == NULL else job_tiles[g])
            indptr = tile.indptr
            c = (g >> 1 if split_streams else g) if rows == NULL else job_chunks[g]
            entry = tile.chunks + c * CHUNK_COLS
            if by_row:
                status[g] = _gather_chunk_mapped(
                    dctx, tile.blob, entry, tile.exc[2 * c], tile.exc[2 * c + 1], n_genes,
                    indptr, rows, order, job_starts[g], job_starts[g + 1], out_indptr, idx_out,
                    val_out, dst_idx, dst_val, scratch, chunk, chunk + 1, row_idx, row_val,
                    col_map, &sorting, &detail[g])
                continue
            chunk.stream = col_map == NULL
            st = _decode_chunk(
                dctx, tile.blob, entry, tile.exc[2 * c], tile.exc[2 * c + 1], n_genes, indptr,
                rows, order, 0 if rows == NULL else job_starts[g],
                0 if rows == NULL else job_starts[g + 1], out_indptr, idx_out, val_out,
                scratch, chunk, 1 << (g & 1) if split_streams else 3, &detail[g])
            if st == OK and col_map != NULL:  # a whole chunk: its cells sorted in place
                for k in range(entry[CELL_LO], entry[CELL_HI]):
                    o = indptr[k]
                    length = indptr[k + 1] - o
                    kept = 0  # assigned here so that Cython makes it thread-private
                    st = row_to_mapped_order(
                        idx_out + o, val_out + o, length, col_map, <uint32_t>n_genes, &sorting,
                        idx_out + o, val_out + o, &kept, False)
                    if st != OK:
                        detail[g] = k
                        st = E_COL_MAP
                        break
            status[g] = st
        dc_store_fence()  # the streamed rows, before the region ends
        free(chunk)
        free(row_idx)
        free(row_val)
        free_sort_scratch(&sorting)


cdef class ColumnMap:
    """A permutation of ``n_genes`` columns, checked once and kept as read-only int32, for
    decoding many tiles through it (checking an array again costs ~50 us a tile).

    Pass it wherever a kernel takes ``col_map``; a plain array is checked on every call.
    """

    cdef readonly object array
    cdef readonly int64_t n_genes

    def __init__(self, col_map, int64_t n_genes):
        col_map = np.asarray(col_map)
        if (col_map.shape != (n_genes,) or n_genes == 0 or col_map.dtype.kind not in "iu"
                or col_map.min() < 0 or np.bincount(col_map, minlength=n_genes).max() != 1):
            raise ValueError(f"col_map must be a permutation of the tile's {n_genes} columns")
        array = col_map.astype(np.int32)
        array.flags.writeable = False
        self.array = array
        self.n_genes = n_genes


def _permutation_scratch(object col_map, int64_t n_genes, const int64_t[::1] indptr):
    """``col_map`` checked to be a permutation of ``n_genes`` columns, as int32, and the sort
    scratch a cell needs (its longest row, at most ``n_genes``)."""
    if not isinstance(col_map, ColumnMap) or (<ColumnMap>col_map).n_genes != n_genes:
        col_map = ColumnMap(col_map, n_genes)
    return (<ColumnMap>col_map).array, min(n_genes, int(np.diff(np.asarray(indptr)).max()))


def decode_into(const uint8_t[::1] blob, const int64_t[:, ::1] chunks,
                const int64_t[::1] indptr, const int64_t[:, ::1] exc, int64_t n_genes,
                int32_t[::1] indices, value_t[::1] values, int n_threads, object where,
                object col_map=None):
    """Decode every chunk of a tile into ``indices`` and ``values`` (length >= nnz).

    ``exc`` is the output of ``_frames.check_frames``. The caller owns ``indptr``. With
    ``col_map``, a permutation of the ``n_genes`` columns, column ``j`` comes out as
    ``col_map[j]`` and every cell sorted again (as :func:`permute_columns` would do after).
    """
    cdef Py_ssize_t n_chunks = chunks.shape[0]
    cdef int64_t nnz = indptr[indptr.shape[0] - 1]
    cdef const int32_t* map_p = NULL
    cdef const int32_t[::1] map_v
    cdef int64_t capacity = 0
    if indices.shape[0] < nnz or values.shape[0] < nnz:
        raise ValueError(f"output buffers hold {indices.shape[0]} / {values.shape[0]} entries, "
                         f"the tile has {nnz} nonzeros")
    if n_chunks == 0:
        return
    refs, _ = _tile_refs([blob], [chunks], [indptr], [exc])
    if col_map is not None:
        map_v, capacity = _permutation_scratch(col_map, n_genes, indptr)
        map_p = &map_v[0]
    cdef const size_t[:, ::1] refs_v = refs
    cdef bint split_streams = col_map is None
    cdef Py_ssize_t n_jobs = 2 * n_chunks if split_streams else n_chunks
    status = np.zeros(n_jobs, dtype=np.int32)
    detail = np.zeros(n_jobs, dtype=np.int64)
    cdef int32_t[::1] status_v = status
    cdef int64_t[::1] detail_v = detail
    cdef int64_t scratch_size = _max_scratch(chunks, exc, range(n_chunks))
    cdef int32_t* idx_out = &indices[0] if indices.shape[0] else NULL
    cdef value_t* val_out = &values[0] if values.shape[0] else NULL
    contexts = take_dctx(n_threads)
    scratches = take_scratch(n_threads, scratch_size)
    cdef const size_t[::1] contexts_v = contexts
    cdef const size_t[::1] scratches_v = scratches
    try:
        with nogil:
            _decode_jobs(<const TileRef*>&refs_v[0, 0], NULL, n_genes, NULL, NULL, NULL, NULL,
                         n_jobs, split_streams, NULL, idx_out, val_out, &scratches_v[0],
                         n_threads, &contexts_v[0], map_p, capacity, NULL, NULL, &status_v[0],
                         &detail_v[0])
    finally:
        give_back_dctx(contexts)
        give_back_scratch(scratches)
    raise_status(status, detail, where, np.arange(n_jobs) >> 1 if split_streams else None)


def gather_into(list blobs, list chunk_tables, list indptrs, list excs, int64_t n_genes,
                const int64_t[::1] rows, const int64_t[::1] order,
                const int64_t[::1] group_tiles, const int64_t[::1] group_chunks,
                const int64_t[::1] group_starts, const int64_t[::1] out_indptr,
                int32_t[::1] indices, value_t[::1] values, int n_threads, list names,
                object col_map=None, const size_t[::1] dst_idx=None,
                const size_t[::1] dst_val=None):
    """Decode the cells ``rows`` (any order, repeats allowed) of one or more tiles into one
    CSR, in one parallel section.

    Tile ``t`` is ``blobs[t]``, its chunk table, indptr and exception counts
    (``_frames.check_frames``) at ``t`` in the other lists, named ``names[t]`` in errors. Only
    the chunks listed are decompressed, and only the output rows ``order`` lists are written
    (all or some positions of ``rows``, grouped by chunk): group ``g`` is
    ``order[group_starts[g]:group_starts[g + 1]]``, all in chunk ``group_chunks[g]`` of tile
    ``group_tiles[g]``, and ``rows`` holds positions within their tiles. Output row ``j`` goes
    to ``out_indptr[j]:out_indptr[j + 1]``. With ``col_map`` (a permutation of the columns)
    every written row is renumbered and sorted again.

    With ``dst_idx`` and ``dst_val`` (only with ``col_map``), output row ``j`` goes to the
    addresses ``dst_idx[j]`` and ``dst_val[j]`` instead (``indices`` and ``values`` are then
    not written): the caller guarantees that each has room for the row's
    ``out_indptr[j + 1] - out_indptr[j]`` entries of the output dtypes.
    """
    cdef Py_ssize_t n_groups = group_chunks.shape[0]
    cdef int64_t n_out = out_indptr[out_indptr.shape[0] - 1]
    cdef const int32_t* map_p = NULL
    cdef const int32_t[::1] map_v
    cdef int64_t capacity = 0, scratch_size = 8
    cdef Py_ssize_t k, g
    cdef int64_t t
    if dst_idx is None and (indices.shape[0] < n_out or values.shape[0] < n_out):
        raise ValueError("output buffers are shorter than the gathered nonzeros")
    if (group_starts.shape[0] != n_groups + 1 or group_tiles.shape[0] != n_groups
            or order.shape[0] > rows.shape[0] or out_indptr.shape[0] != rows.shape[0] + 1
            or len(names) != len(blobs)):
        raise ValueError("group_tiles / group_starts / order / out_indptr / names do not match "
                         "group_chunks / rows / blobs")
    for k in range(order.shape[0]):
        if order[k] < 0 or order[k] >= rows.shape[0]:
            raise ValueError(f"order[{k}] = {order[k]} is not a position in rows")
    if n_groups == 0:
        return
    refs, n_chunks = _tile_refs(blobs, chunk_tables, indptrs, excs)
    cdef const int64_t[::1] n_chunks_v = n_chunks
    cdef const size_t[:, ::1] refs_v = refs
    cdef const TileRef* tile
    cdef const int64_t* entry
    for g in range(n_groups):
        t = group_tiles[g]
        if t < 0 or t >= n_chunks_v.shape[0] or not 0 <= group_chunks[g] < n_chunks_v[t]:
            raise ValueError(f"group {g}: chunk {group_chunks[g]} of tile {t} does not exist")
        if group_starts[g] > group_starts[g + 1] or group_starts[g] < 0:
            raise ValueError("group_starts must increase")
        tile = <const TileRef*>&refs_v[t, 0]
        entry = tile.chunks + group_chunks[g] * CHUNK_COLS
        scratch_size = max(scratch_size, _scratch_bytes(
            entry[NNZ_HI] - entry[NNZ_LO], tile.exc[2 * group_chunks[g]],
            tile.exc[2 * group_chunks[g] + 1])
            # Through a col_map both streams' planes are held at once.
            + (2 * (entry[NNZ_HI] - entry[NNZ_LO]) if col_map is not None else 0))
    if group_starts[n_groups] > order.shape[0]:
        raise ValueError("group_starts run past order")
    cdef const size_t* dst_idx_p = NULL
    cdef const size_t* dst_val_p = NULL
    if dst_idx is not None or dst_val is not None:
        if (col_map is None or dst_idx is None or dst_val is None
                or dst_idx.shape[0] != rows.shape[0] or dst_val.shape[0] != rows.shape[0]):
            raise ValueError("dst_idx and dst_val go together, one per row, with col_map")
        if rows.shape[0]:
            dst_idx_p = &dst_idx[0]
            dst_val_p = &dst_val[0]
    if col_map is not None:
        # Sort scratch for the longest output row: each is checked to be exactly as long as
        # the cell written into it before it is sorted.
        map_v, capacity = _permutation_scratch(col_map, n_genes, out_indptr)
        map_p = &map_v[0]
    status = np.zeros(n_groups, dtype=np.int32)
    detail = np.zeros(n_groups, dtype=np.int64)
    cdef int32_t[::1] status_v = status
    cdef int64_t[::1] detail_v = detail
    cdef int32_t* idx_out = &indices[0] if indices.shape[0] else NULL
    cdef value_t* val_out = &values[0] if values.shape[0] else NULL
    contexts = take_dctx(n_threads)
    scratches = take_scratch(n_threads, scratch_size)
    cdef const size_t[::1] contexts_v = contexts
    cdef const size_t[::1] scratches_v = scratches
    try:
        with nogil:
            _decode_jobs(<const TileRef*>&refs_v[0, 0], &group_tiles[0], n_genes, &rows[0],
                         &order[0], &group_chunks[0], &group_starts[0], n_groups, False,
                         &out_indptr[0], idx_out, val_out, &scratches_v[0], n_threads,
                         &contexts_v[0], map_p, capacity, dst_idx_p, dst_val_p, &status_v[0],
                         &detail_v[0])
    finally:
        give_back_dctx(contexts)
        give_back_scratch(scratches)
    failed = np.flatnonzero(status)
    if len(failed):
        first = int(failed[0])
        t = group_tiles[first]
        mine = np.flatnonzero(np.asarray(group_tiles) == t)
        raise_status(status[mine], detail[mine], names[t], np.asarray(group_chunks)[mine])
