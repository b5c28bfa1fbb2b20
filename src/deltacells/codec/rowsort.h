/* The row sorts of the deltacells kernels: renumbering a row's columns (stored gene order to
   source gene order, or a selection) and sorting them again, by numpy's SIMD sorts, a bitmap
   of the output columns or a radix sort (the choice: codec/rowsort.py). Included by kernels.h
   after its SIMD and prefetch helpers; static inline like them. */
#ifndef DELTACELLS_ROWSORT_H
#define DELTACELLS_ROWSORT_H

/* A sort of n uint32 values in place, numpy's signature (PyArray_SortFunc; the third
   argument unused for integers): numpy's quicksort for uint32, which runs x86-simd-sort's
   AVX-512 code where the CPU has it. */
typedef int (*dc_sort32_fn)(void* start, intptr_t n, void* unused);

/* One 32- or 64-bit store, non-temporal with stream where SSE2 has such stores: for rows
   written once and read later by someone else (a minibatch). */
static inline void dc_put32(void* p, uint32_t v, int stream) {
#if defined(__SSE2__) && defined(__x86_64__)
    if (stream) {
        _mm_stream_si32((int*)p, (int)v);
        return;
    }
#endif
    memcpy(p, &v, sizeof v);
}

static inline void dc_put64(void* p, double v, int stream) {
#if defined(__SSE2__) && defined(__x86_64__)
    if (stream) {
        long long bits;
        memcpy(&bits, &v, sizeof bits);
        _mm_stream_si64((long long*)p, bits);
        return;
    }
#endif
    memcpy(p, &v, sizeof v);
}

/* The 32-bit sort keys of one row (of up to 65,536 entries): each entry that col_map keeps
   (-1 drops) becomes its new column above its position in the row. Returns 0 with the keys'
   count in *kept and the OR of their columns in *columns (above 0xFFFF: too wide for these
   keys), 1 for a column >= n_map, or 2 for more kept entries than capacity. */
static inline int dc_row_keys32(const int32_t* idx, int64_t n, const int32_t* col_map,
                                uint32_t n_map, int64_t capacity, uint32_t* keys,
                                int64_t* kept, uint32_t* columns) {
    uint32_t any = 0;
    int64_t o = 0;
    for (int64_t i = 0; i < n; i++) {
        if ((uint32_t)idx[i] >= n_map) return 1;
        int32_t c = col_map[idx[i]];
        if (c < 0) continue;
        if (o >= capacity) return 2;
        any |= (uint32_t)c;
        keys[o++] = ((uint32_t)c << 16) | (uint32_t)i;
    }
    *kept = o;
    *columns = any;
    return 0;
}

/* dc_row_sort's path for rows of up to 65,536 entries whose new columns are below 65,536 (every
   dataset of up to 65,536 genes): each entry becomes a 32-bit key, column above its position
   in the input row, sorted by sort32; values are then read by position (from scratch, spare as
   uint32 or held, when the row is sorted in place). Returns 0 or 2 as
   dc_row_sort does, or 3 when a column is too large for this path (nothing written; the caller
   takes the 64-bit path), or 1 for a column >= n_map, all before writing any output. */
static inline int dc_row_sort_narrow(const int32_t* idx, const uint32_t* val32,
                                     const double* val64, int64_t n, const int32_t* col_map,
                                     uint32_t n_map, uint32_t* keys, uint32_t* spare, double* held,
                                     int64_t capacity, dc_sort32_fn sort32, int32_t* out_idx,
                                     uint32_t* out32, double* out64, int64_t* kept, int stream) {
    uint32_t max_col = 0;
    int64_t o = 0;
    int st = dc_row_keys32(idx, n, col_map, n_map, capacity, keys, &o, &max_col);
    if (st != 0) return st;
    int in_place = held ? out64 == val64 : out32 == val32;
    if (max_col > 0xFFFF || (in_place && n > capacity)) return 3;
    /* Sorting in place overwrites values still to be read: they wait in scratch. */
    if (in_place && held) {
        memcpy(held, val64, (size_t)n * sizeof(double));
        val64 = held;
    } else if (in_place) {
        memcpy(spare, val32, (size_t)n * sizeof(uint32_t));
        val32 = spare;
    }
    if (o > 1) sort32(keys, (intptr_t)o, NULL);
    uint32_t previous = ~(uint32_t)0;
    int streaming = stream && !in_place;
    for (int64_t i = 0; i < o; i++) {
        uint32_t x = keys[i];
        if ((x >> 16) == previous) return 2;
        previous = x >> 16;
        dc_put32(out_idx + i, x >> 16, streaming);
        if (held) dc_put64(out64 + i, val64[x & 0xFFFF], streaming);
        else dc_put32(out32 + i, val32[x & 0xFFFF], streaming);
    }
    *kept = o;
    return 0;
}

/* One thread's scratch for the sorts by output column. dc_row_sort_bitmap's: a bit per
   output column (all zero between rows), a count per 64-column word, and the row's kept
   columns and values in input order (capacity + 1 of each; values as uint32_t, or double when
   the row's values are); with vector set (AVX2, gathers not slowed), the renumbering runs
   eight entries at a time. */
typedef struct {
    uint64_t* bits;
    uint32_t* ranks;
    uint32_t* cols;
    void* vals;
    uint32_t n_cols;
    int vector;
    /* dc_row_sort_dense16's scratch, when sort16 != NULL: the row's columns as uint16 and a
       value per output column (n_cols of them, uint32_t or double); with wide set
       (AVX-512F, and gathers not slowed by a microcode mitigation), its last loop runs
       sixteen entries at a time. */
    dc_sort32_fn sort16;
    uint16_t* cols16;
    void* dense;
    int wide;
} dc_bitmap;

/* x86-64's baseline has no popcnt instruction, and the bitmap sort counts bits for every
   entry: it is built for CPUs that have one (every x86-64 CPU since 2008) and chosen only
   where dc_cpu_has_popcnt() says so, elsewhere the radix sort runs. Its renumbering has an
   AVX2 version (gathers from col_map), taken where dc_cpu_has_avx2() says so. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DC_X86_DISPATCH 1
#include <immintrin.h>
#endif
#if defined(DC_X86_DISPATCH) && !defined(__POPCNT__)
#define DC_POPCNT_TARGET __attribute__((target("popcnt")))
static inline int dc_cpu_has_popcnt(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("popcnt") != 0;
}
#else
#define DC_POPCNT_TARGET
static inline int dc_cpu_has_popcnt(void) { return 1; }
#endif

/* Whether the CPU running this has a vector extension (gcc's names), for the sorts' loops. */
#if defined(DC_X86_DISPATCH)
#define DC_CPU_SUPPORTS(feature) (__builtin_cpu_init(), __builtin_cpu_supports(feature) != 0)
#else
#define DC_CPU_SUPPORTS(feature) 0
#endif
static inline int dc_cpu_has_avx2(void) { return DC_CPU_SUPPORTS("avx2"); }
static inline int dc_cpu_has_avx512f(void) { return DC_CPU_SUPPORTS("avx512f"); }

/* The bitmap sort's first step for input entries [i, end): each kept entry's new column goes
   to cols[o], its value to vals, and lo / hi follow the smallest and largest column. Returns
   0, 1 for a column >= n_map, 2 for more kept entries than capacity, 3 for a new column >=
   n_cols (the caller takes another path). */
static inline int dc_bitmap_renumber(const int32_t* idx, const uint32_t* val32,
                                     const double* val64, int64_t i, int64_t end,
                                     const int32_t* col_map, uint32_t n_map,
                                     const dc_bitmap* bm, int64_t capacity, int64_t* o,
                                     uint32_t* lo, uint32_t* hi) {
    uint32_t* vals32 = (uint32_t*)bm->vals;
    double* vals64 = (double*)bm->vals;
    int64_t k = *o;
    uint32_t low = *lo, high = *hi;
    int st = 0;
    for (; i < end; i++) {
        if ((uint32_t)idx[i] >= n_map) { st = 1; break; }
        int32_t c = col_map[idx[i]];
        if (c < 0) continue;
        if ((uint32_t)c >= bm->n_cols) { st = 3; break; }
        if (k >= capacity) { st = 2; break; }
        bm->cols[k] = (uint32_t)c;
        if (val64) vals64[k] = val64[i];
        else vals32[k] = val32[i];
        low = (uint32_t)c < low ? (uint32_t)c : low;
        high = (uint32_t)c > high ? (uint32_t)c : high;
        k++;
    }
    *o = k;
    *lo = low;
    *hi = high;
    return st;
}

#if defined(DC_X86_DISPATCH)
/* dc_bitmap_renumber for a whole row, eight entries at a time: a block whose columns are all
   below n_map and whose new columns are all kept and below n_cols is gathered from col_map
   and stored whole; any other block goes through dc_bitmap_renumber, which keeps, drops or
   refuses each entry (the same result). 1.2x as fast as the scalar loop over the whole sort
   (rows of ~790 entries of 33,539 columns, Zen 3). */
__attribute__((target("avx2")))
static int dc_bitmap_renumber_avx2(const int32_t* idx, const uint32_t* val32,
                                   const double* val64, int64_t n, const int32_t* col_map,
                                   uint32_t n_map, const dc_bitmap* bm, int64_t capacity,
                                   int64_t* o, uint32_t* lo, uint32_t* hi) {
    int64_t i = 0, k = 0;
    uint32_t low = ~(uint32_t)0, high = 0;
    if (n_map == 0) return dc_bitmap_renumber(idx, val32, val64, 0, n, col_map, n_map, bm,
                                              capacity, o, lo, hi);
    const __m256i map_last = _mm256_set1_epi32((int)(n_map - 1));
    const __m256i col_last = _mm256_set1_epi32((int)(bm->n_cols - 1));
    __m256i lows = _mm256_set1_epi32(-1), highs = _mm256_setzero_si256();
    while (i < n) {
        for (; i + 8 <= n && k + 8 <= capacity; i += 8, k += 8) {
            __m256i at = _mm256_loadu_si256((const __m256i*)(idx + i));
            /* unsigned x <= last as min(x, last) == x: negative entries fail too */
            __m256i inside = _mm256_cmpeq_epi32(_mm256_min_epu32(at, map_last), at);
            if (_mm256_movemask_epi8(inside) != -1) break;
            __m256i c = _mm256_i32gather_epi32(col_map, at, 4);
            __m256i kept = _mm256_cmpeq_epi32(_mm256_min_epu32(c, col_last), c);
            if (_mm256_movemask_epi8(kept) != -1) break;  /* a drop (-1) or past n_cols */
            _mm256_storeu_si256((__m256i*)(bm->cols + k), c);
            if (val64) {
                double* to = (double*)bm->vals + k;
                _mm256_storeu_pd(to, _mm256_loadu_pd(val64 + i));
                _mm256_storeu_pd(to + 4, _mm256_loadu_pd(val64 + i + 4));
            } else {
                _mm256_storeu_si256((__m256i*)((uint32_t*)bm->vals + k),
                                    _mm256_loadu_si256((const __m256i*)(val32 + i)));
            }
            lows = _mm256_min_epu32(lows, c);
            highs = _mm256_max_epu32(highs, c);
        }
        if (i >= n) break;
        int64_t end = i + 8 < n ? i + 8 : n;
        int st = dc_bitmap_renumber(idx, val32, val64, i, end, col_map, n_map, bm, capacity,
                                    &k, &low, &high);
        if (st != 0) return st;
        i = end;
    }
    uint32_t l[8], h[8];
    _mm256_storeu_si256((__m256i*)l, lows);
    _mm256_storeu_si256((__m256i*)h, highs);
    for (int j = 0; j < 8; j++) {
        low = l[j] < low ? l[j] : low;
        high = h[j] > high ? h[j] : high;
    }
    *o = k;
    *lo = low;
    *hi = high;
    return 0;
}
#endif

/* dc_row_sort without comparisons: each kept entry sets its new column's bit; a pass over the
   words from the lowest set bit to the highest counts the bits before each word; then every
   entry goes straight to its place, the count before its word plus the bits below it in its
   word. Everything it touches but col_map stays in L1 (the first version kept each value at
   its column in a dense array of every column, whose misses cost 1.3x more). About 4 ns an
   entry against 9 for the radix sort at ~790 entries of 33,539 columns (AVX2 Zen 3), and
   still even with it at 50 entries: dc_row_sort takes it for rows of more than 24 entries and
   at least one for every eight words (n >= n_cols / 512).
   Two entries sent to one column set one bit: the bits counted fall short of the entries.
   The same returns as dc_row_sort, all before writing any output, and 3 when a column is
   >= bm->n_cols (the caller takes another path); the bits are left clear whatever it returns.
   Every entry is read before any is written, so out may be the input. The output is written
   with regular stores even when dc_row_sort is asked to stream: entries land in random order
   within the row, and sorting into scratch to stream the row out after measured slower in
   the loader (writing the sorted scratch out with memcpy measured the same). */
DC_POPCNT_TARGET
static int dc_row_sort_bitmap(const int32_t* idx, const uint32_t* val32, const double* val64,
                              int64_t n, const int32_t* col_map, uint32_t n_map,
                              const dc_bitmap* bm, int64_t capacity, int32_t* out_idx,
                              uint32_t* out32, double* out64, int64_t* kept) {
    uint64_t* bits = bm->bits;
    const uint32_t* cols = bm->cols;
    const uint32_t* vals32 = (const uint32_t*)bm->vals;
    const double* vals64 = (const double*)bm->vals;
    uint32_t lo = ~(uint32_t)0, hi = 0;
    int64_t o = 0;
    int st;
#if defined(DC_X86_DISPATCH)
    if (bm->vector)
        st = dc_bitmap_renumber_avx2(idx, val32, val64, n, col_map, n_map, bm, capacity, &o,
                                     &lo, &hi);
    else
#endif
        st = dc_bitmap_renumber(idx, val32, val64, 0, n, col_map, n_map, bm, capacity, &o,
                                &lo, &hi);
    if (st != 0) return st;  /* no bit set yet */
    *kept = 0;
    if (o == 0) return 0;
    lo >>= 6;
    hi >>= 6;
    /* The bits from the list, after the renumbering: each bit's read-modify-write then waits
       on an L1 load, not on col_map's (loader epochs and to_memory 2-3% faster, in
       alternating rounds; the fastest rounds 6-11%). */
    for (int64_t i = 0; i < o; i++) bits[cols[i] >> 6] |= (uint64_t)1 << (cols[i] & 63);
    uint32_t* ranks = bm->ranks;
    uint32_t before = 0;
    for (uint32_t w = lo; w <= hi; w++) {
        ranks[w] = before;
        before += (uint32_t)__builtin_popcountll(bits[w]);
    }
    if (before != (uint64_t)o) {  /* two columns mapped to one place */
        memset(bits + lo, 0, (size_t)(hi - lo + 1) * sizeof(uint64_t));
        return 2;
    }
    *kept = o;
    for (int64_t i = 0; i < o; i++) {
        uint32_t c = cols[i], w = c >> 6;
        uint64_t below = bits[w] & (((uint64_t)1 << (c & 63)) - 1);
        uint32_t at = ranks[w] + (uint32_t)__builtin_popcountll(below);
        out_idx[at] = (int32_t)c;
        if (val64) out64[at] = vals64[i];
        else out32[at] = vals32[i];
    }
    memset(bits + lo, 0, (size_t)(hi - lo + 1) * sizeof(uint64_t));
    return 0;
}

#if defined(DC_X86_DISPATCH)
/* dc_row_sort_dense16's last step for 32-bit values, sixteen entries at a time (AVX-512F):
   the sorted columns widened and stored, their values gathered from dense. With stream the
   stores are non-temporal, for outputs whose index and value rows sit at the same offset
   within a cache line (numpy's buffers do; otherwise nothing is written here): up to the
   first whole line one entry at a time, then whole lines. Returns how many entries it wrote,
   or -1 for two equal neighbours; *previous is the last column written. */
__attribute__((target("avx512f")))
static int64_t dc_dense16_out_avx512(const uint16_t* cols, int64_t o, const uint32_t* dense,
                                     int32_t* out_idx, uint32_t* out32, int32_t* previous,
                                     int stream) {
    int64_t i = 0;
    int32_t last = *previous;
    if (stream) {
        if ((((uintptr_t)out_idx ^ (uintptr_t)out32) & 63) != 0) return 0;
        for (; i < o && ((uintptr_t)(out_idx + i) & 63) != 0; i++) {
            int32_t c = cols[i];
            if (c == last) return -1;
            last = c;
            dc_put32(out_idx + i, (uint32_t)c, 1);
            dc_put32(out32 + i, dense[c], 1);
        }
    }
    __m512i before = _mm512_set1_epi32(last);
    for (; i + 16 <= o; i += 16) {
        __m512i c = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(cols + i)));
        /* each lane's left neighbour: the last lane of the previous block, then c's own */
        if (_mm512_cmpeq_epi32_mask(c, _mm512_alignr_epi32(c, before, 15)) != 0) return -1;
        before = c;
        __m512i v = _mm512_i32gather_epi32(c, dense, 4);
        if (stream) {
            _mm512_stream_si512((void*)(out_idx + i), c);
            _mm512_stream_si512((void*)(out32 + i), v);
        } else {
            _mm512_storeu_si512((void*)(out_idx + i), c);
            _mm512_storeu_si512((void*)(out32 + i), v);
        }
    }
    *previous = i > 0 ? (int32_t)cols[i - 1] : last;
    return i;
}
#endif

/* dc_row_sort for rows whose new columns fit in 16 bits (datasets of up to 65,536 genes),
   where numpy sorts uint16 with AVX-512 (x86-simd-sort, AVX512-VBMI2): each kept entry parks
   its value at its column in bm->dense and its column in bm->cols16; sort16 sorts the
   columns, and the values are read back in that order. The same returns as dc_row_sort, and
   3 when a column is >= bm->n_cols (nothing written). Two entries of one column are found
   as equal neighbours while writing (the row may then be partly written; callers raise).
   Every entry is read before any is written, so out may be the input. */
static int dc_row_sort_dense16(const int32_t* idx, const uint32_t* val32, const double* val64,
                               int64_t n, const int32_t* col_map, uint32_t n_map,
                               const dc_bitmap* bm, int64_t capacity, int32_t* out_idx,
                               uint32_t* out32, double* out64, int64_t* kept, int stream) {
    uint16_t* cols = bm->cols16;
    uint32_t* dense32 = (uint32_t*)bm->dense;
    double* dense64 = (double*)bm->dense;
    uint32_t n_cols = bm->n_cols;
    int64_t o = 0, i;
    /* One entry at a time: sixteen at a time with AVX-512 gathers measured the same here. */
    for (i = 0; i < n; i++) {
        if ((uint32_t)idx[i] >= n_map) return 1;
        int32_t c = col_map[idx[i]];
        if (c < 0) continue;
        if ((uint32_t)c >= n_cols) return 3;
        if (o >= capacity) return 2;
        cols[o++] = (uint16_t)c;
        if (val64) dense64[c] = val64[i];
        else dense32[c] = val32[i];
    }
    if (o > 1) bm->sort16(cols, (intptr_t)o, NULL);
    int32_t previous = -1;
    int streaming = stream && out_idx != idx;
    i = 0;
#if defined(DC_X86_DISPATCH)
    if (!val64 && bm->wide) {
        i = dc_dense16_out_avx512(cols, o, dense32, out_idx, out32, &previous, streaming);
        if (i < 0) return 2;
    }
#endif
    for (; i < o; i++) {
        int32_t c = cols[i];
        if (c == previous) return 2;
        previous = c;
        dc_put32(out_idx + i, (uint32_t)c, streaming);
        if (val64) dc_put64(out64 + i, dense64[c], streaming);
        else dc_put32(out32 + i, dense32[c], streaming);
    }
    *kept = o;
    return 0;
}

/* One row's columns through col_map (-1 drops), sorted, with their 32-bit values (the
   bits of an int32 or float32) or, with held != NULL, their float64 values. With bm and its
   sort16, rows of more than 24 entries are sorted by dc_row_sort_dense16 (numpy's uint16
   sort of the columns alone); with bm without sort16, rows of more than 24 entries and at
   least one for every eight words of the bitmap are sorted by dc_row_sort_bitmap. With sort32 (see dc_row_sort_narrow) rows of more than 24 entries of
   narrow columns take 32-bit keys sorted by it: 2.3 ns an entry against 3.4 for the radix
   sort below (rows of ~760 entries, AVX-512), the same output. Otherwise each kept
   entry becomes a 64-bit key, new column above payload (the value's bits, or its index in
   held), sorted by a byte-wise LSD radix sort over the column's nonzero bytes (the two low
   bytes' counts are taken while the keys are made), or an insertion sort for short rows.
   Rows of a few hundred entries sort in L1 this way at a few ns per entry, faster than the
   bitmap when they leave most of its words empty.
   Works in place (out == in): everything is read before anything is written. Returns 0,
   1 for a column >= n_map (before writing anything), 2 for two columns mapped to one place
   (equal neighbours once sorted, found while writing, or more kept entries than capacity
   when that is the number of output columns). With stream, the narrow and dense16 paths
   write a row that is not sorted in place with non-temporal stores: for outputs written once
   and read later by someone else (a minibatch), which then skip the cache and its read for
   ownership (callers run dc_store_fence before other threads read them). */
static inline int dc_row_sort(const int32_t* idx, const uint32_t* val32, const double* val64,
                              int64_t n, const int32_t* col_map, uint32_t n_map,
                              uint64_t* keys, uint64_t* spare, double* held,
                              int64_t capacity, dc_sort32_fn sort32, const dc_bitmap* bm,
                              int32_t* out_idx, uint32_t* out32, double* out64, int64_t* kept,
                              int stream) {
    if (bm != NULL && bm->sort16 != NULL && n > 24) {
        int st = dc_row_sort_dense16(idx, val32, val64, n, col_map, n_map, bm, capacity,
                                     out_idx, out32, out64, kept, stream);
        if (st != 3) return st;
    } else if (bm != NULL && n > 24 && (int64_t)(bm->n_cols >> 6) <= 8 * n) {
        int st = dc_row_sort_bitmap(idx, val32, val64, n, col_map, n_map, bm, capacity, out_idx,
                                    out32, out64, kept);
        if (st != 3) return st;
    }
    if (sort32 != NULL && n > 24 && n <= 65536) {
        int st = dc_row_sort_narrow(idx, val32, val64, n, col_map, n_map, (uint32_t*)keys,
                                    (uint32_t*)spare, held, capacity, sort32, out_idx, out32,
                                    out64, kept, stream);
        if (st != 3) return st;
    }
    uint32_t max_col = 0;
    uint32_t count0[256], count1[256];
    uint64_t previous = ~(uint64_t)0;
    int64_t o = 0;
    memset(count0, 0, sizeof count0);
    memset(count1, 0, sizeof count1);
    for (int64_t i = 0; i < n; i++) {
        if ((uint32_t)idx[i] >= n_map) return 1;
        int32_t c = col_map[idx[i]];
        if (c < 0) continue;
        if (o >= capacity) return 2;
        max_col |= (uint32_t)c;
        count0[c & 255]++;
        count1[(c >> 8) & 255]++;
        if (held) {
            held[o] = val64[i];
            keys[o] = ((uint64_t)c << 32) | (uint64_t)o;
        } else {
            keys[o] = ((uint64_t)c << 32) | val32[i];
        }
        o++;
    }
    if (o <= 24) {
        for (int64_t i = 1; i < o; i++) {
            uint64_t x = keys[i];
            int64_t j = i;
            while (j > 0 && keys[j - 1] > x) {
                keys[j] = keys[j - 1];
                j--;
            }
            keys[j] = x;
        }
    } else {
        uint32_t* count = count0;
        for (int shift = 32; shift < 64 && (max_col >> (shift - 32)) != 0; shift += 8) {
            if (shift == 40) count = count1;
            else if (shift > 40) {
                count = count0;
                memset(count, 0, sizeof count0);
                for (int64_t i = 0; i < o; i++) count[(keys[i] >> shift) & 255]++;
            }
            if (count[(keys[0] >> shift) & 255] == (uint32_t)o) continue;  /* none move */
            uint32_t sum = 0;
            for (int k = 0; k < 256; k++) {
                uint32_t c = count[k];
                count[k] = sum;
                sum += c;
            }
            for (int64_t i = 0; i < o; i++) {
                uint64_t x = keys[i];
                spare[count[(x >> shift) & 255]++] = x;
            }
            uint64_t* t = keys;
            keys = spare;
            spare = t;
        }
    }
    for (int64_t i = 0; i < o; i++) {
        uint64_t x = keys[i];
        if ((x >> 32) == previous) return 2;
        previous = x >> 32;
        out_idx[i] = (int32_t)(x >> 32);
        if (held) out64[i] = held[(uint32_t)x];
        else out32[i] = (uint32_t)x;
    }
    *kept = o;
    return 0;
}

#endif
