/* C helpers of the deltacells kernels (SIMD byte-plane scans, CRC-32, row sorting), shared by
   the codec's Cython modules through _common.pxd. Every function is static inline: each module
   gets its own copy, so nothing here is exported. */
#ifndef DELTACELLS_KERNELS_H
#define DELTACELLS_KERNELS_H
#ifdef _OPENMP
#define DELTACELLS_OPENMP 1
#else
#define DELTACELLS_OPENMP 0
#endif

#include <stdint.h>
#include <string.h>
#include <zlib.h>
#ifdef DELTACELLS_LIBDEFLATE
#include <libdeflate.h>
#define DELTACELLS_CRC_BACKEND "libdeflate"
#else
#define DELTACELLS_CRC_BACKEND "zlib"
#endif

/* CRC-32 (zlib / IEEE) of buf[0:n] continued from crc: libdeflate's when built with it,
   zlib's otherwise (same values). */
static inline uint32_t dc_crc32(uint32_t crc, const uint8_t* buf, int64_t n) {
#ifdef DELTACELLS_LIBDEFLATE
    return libdeflate_crc32(crc, buf, (size_t)n);
#else
    while (n > 0) {  /* zlib takes unsigned int lengths */
        unsigned int step = n > (1 << 30) ? (1u << 30) : (unsigned int)n;
        crc = (uint32_t)crc32(crc, buf, step);
        buf += step;
        n -= step;
    }
    return crc;
#endif
}

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__SSE2__)
/* Inclusive prefix sum of four int32 lanes. */
static inline __m128i dc_scan4(__m128i x) {
    x = _mm_add_epi32(x, _mm_slli_si128(x, 4));
    return _mm_add_epi32(x, _mm_slli_si128(x, 8));
}

/* Inclusive prefix sums of the 16 uint16 values lo/hi[0:16] (byte planes) as four int32
   vectors s[0..3], starting from 0. The block's total comes out through s[3]'s last lane
   in one add of its own, so a running sum carried across blocks is a chain of one add per
   16 values. Returns lo | hi, whose zero bytes mark zero values. */
static inline __m128i dc_scan16(const uint8_t* lo, const uint8_t* hi, __m128i s[4]) {
    const __m128i zero = _mm_setzero_si128();
    __m128i l = _mm_loadu_si128((const __m128i*)lo);
    __m128i h = _mm_loadu_si128((const __m128i*)hi);
    __m128i w0 = _mm_unpacklo_epi8(l, h), w1 = _mm_unpackhi_epi8(l, h);
    s[0] = dc_scan4(_mm_unpacklo_epi16(w0, zero));
    s[1] = dc_scan4(_mm_unpackhi_epi16(w0, zero));
    s[2] = dc_scan4(_mm_unpacklo_epi16(w1, zero));
    s[3] = dc_scan4(_mm_unpackhi_epi16(w1, zero));
    s[1] = _mm_add_epi32(s[1], _mm_shuffle_epi32(s[0], 0xFF));
    s[3] = _mm_add_epi32(s[3], _mm_shuffle_epi32(s[2], 0xFF));
    s[2] = _mm_add_epi32(s[2], _mm_shuffle_epi32(s[1], 0xFF));
    s[3] = _mm_add_epi32(s[3], _mm_shuffle_epi32(s[1], 0xFF));
    return _mm_or_si128(l, h);
}

/* Four int32 to out: non-temporal with stream (out then 16-byte aligned). */
static inline void dc_store_i32x4(int32_t* out, __m128i x, int stream) {
    if (stream) _mm_stream_si128((__m128i*)out, x);
    else _mm_storeu_si128((__m128i*)out, x);
}
#endif

/* out[i] = g + gaps[0] + ... + gaps[i] for the uint16 gaps stored as byte planes lo/hi.
   Returns the last value. The caller guarantees g + 65535 * n < 2^31 (no int32 overflow).
   A prefix sum is a serial chain, so it is done four lanes at a time with SSE2 (baseline
   on x86-64); other targets take the scalar loop, with identical results. */
static inline int32_t dc_prefix_planes(const uint8_t* lo, const uint8_t* hi, int64_t n,
                                       int32_t g, int32_t* out, int stream) {
    int64_t i = 0;
#if defined(__SSE2__)
    /* With stream, long runs go out with aligned non-temporal stores (see
       dc_planes_to_f32); the caller issues the store fence once per chunk. */
    const int streaming = stream && n >= 256;
    if (streaming) {
        for (; i < n && ((uintptr_t)(out + i) & 15); i++) {
            g += (int32_t)(lo[i] | ((uint32_t)hi[i] << 8));
            out[i] = g;
        }
    }
    __m128i carry = _mm_set1_epi32(g);
    for (; i + 16 <= n; i += 16) {
        __m128i s[4];
        dc_scan16(lo + i, hi + i, s);
        dc_store_i32x4(out + i, _mm_add_epi32(s[0], carry), streaming);
        dc_store_i32x4(out + i + 4, _mm_add_epi32(s[1], carry), streaming);
        dc_store_i32x4(out + i + 8, _mm_add_epi32(s[2], carry), streaming);
        dc_store_i32x4(out + i + 12, _mm_add_epi32(s[3], carry), streaming);
        carry = _mm_add_epi32(carry, _mm_shuffle_epi32(s[3], 0xFF));
    }
    g = _mm_cvtsi128_si32(carry);
#endif
    for (; i < n; i++) {
        g += (int32_t)(lo[i] | ((uint32_t)hi[i] << 8));
        out[i] = g;
    }
    return g;
}

/* out[i] = lo[i] | hi[i] << 8 as float32 for a whole chunk. With stream the stores are
   non-temporal (the output is not read back soon, and skipping the read-for-ownership of
   every output line saves a third of the memory traffic); without, they stay in cache for
   a caller that reads them back at once. Returns whether any value is zero. */
#if defined(__SSE2__)
static inline void dc_store_f32x4(float* out, __m128 x, int stream) {
    if (stream) _mm_stream_ps(out, x);  /* out is 16-byte aligned on this path */
    else _mm_storeu_ps(out, x);
}
#endif

static inline int dc_planes_to_f32(const uint8_t* lo, const uint8_t* hi, int64_t n,
                                   float* out, int stream) {
    int64_t i = 0;
    int found = 0;
#if defined(__SSE2__)
    const __m128i zero = _mm_setzero_si128();
    __m128i acc = zero;
    for (; stream && i < n && ((uintptr_t)(out + i) & 15); i++) {
        uint32_t v = lo[i] | ((uint32_t)hi[i] << 8);
        found |= v == 0;
        out[i] = (float)v;
    }
    for (; i + 16 <= n; i += 16) {
        __m128i l = _mm_loadu_si128((const __m128i*)(lo + i));
        __m128i h = _mm_loadu_si128((const __m128i*)(hi + i));
        acc = _mm_or_si128(acc, _mm_cmpeq_epi8(_mm_or_si128(l, h), zero));
        __m128i w0 = _mm_unpacklo_epi8(l, h);
        __m128i w1 = _mm_unpackhi_epi8(l, h);
        dc_store_f32x4(out + i, _mm_cvtepi32_ps(_mm_unpacklo_epi16(w0, zero)), stream);
        dc_store_f32x4(out + i + 4, _mm_cvtepi32_ps(_mm_unpackhi_epi16(w0, zero)), stream);
        dc_store_f32x4(out + i + 8, _mm_cvtepi32_ps(_mm_unpacklo_epi16(w1, zero)), stream);
        dc_store_f32x4(out + i + 12, _mm_cvtepi32_ps(_mm_unpackhi_epi16(w1, zero)), stream);
    }
    if (stream) _mm_sfence();
    found |= _mm_movemask_epi8(acc) != 0;  /* lane k: both planes zero at element i + k */
#endif
    for (; i < n; i++) {
        uint32_t v = lo[i] | ((uint32_t)hi[i] << 8);
        found |= v == 0;
        out[i] = (float)v;
    }
    return found;
}

/* Ask for every cache line of bytes at p ahead of its use (into L1): the next row of a
   decoded tile while the current one is sorted, so that its lines do not wait for memory
   (rows are taken in random order, which the hardware prefetcher cannot follow). */
static inline void dc_prefetch(const void* p, int64_t bytes) {
    const char* c = (const char*)p;
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 3);
}

/* A sort of n uint32 values in place, numpy's signature (PyArray_SortFunc; the third
   argument unused for integers): numpy's quicksort for uint32, which runs x86-simd-sort's
   AVX-512 code where the CPU has it. */
typedef int (*dc_sort32_fn)(void* start, intptr_t n, void* unused);

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
#if defined(__SSE2__) && defined(__x86_64__)
    if (stream && !in_place) {
        for (int64_t i = 0; i < o; i++) {
            uint32_t x = keys[i];
            if ((x >> 16) == previous) return 2;
            previous = x >> 16;
            _mm_stream_si32((int*)out_idx + i, (int)(x >> 16));
            if (held) {
                int64_t bits;
                memcpy(&bits, val64 + (x & 0xFFFF), sizeof bits);
                _mm_stream_si64((long long*)out64 + i, bits);
            } else {
                _mm_stream_si32((int*)out32 + i, (int)val32[x & 0xFFFF]);
            }
        }
        *kept = o;
        return 0;
    }
#endif
    for (int64_t i = 0; i < o; i++) {
        uint32_t x = keys[i];
        if ((x >> 16) == previous) return 2;
        previous = x >> 16;
        out_idx[i] = (int32_t)(x >> 16);
        if (held) out64[i] = val64[x & 0xFFFF];
        else out32[i] = val32[x & 0xFFFF];
    }
    *kept = o;
    return 0;
}

/* One thread's scratch for dc_row_sort_bitmap: a bit per output column (all zero between
   rows), a count per 64-column word, and the row's kept columns and values in input order
   (capacity + 1 of each; values as uint32_t, or double when the row's values are); with
   vector set (dc_cpu_has_avx2), the renumbering runs eight entries at a time. */
typedef struct {
    uint64_t* bits;
    uint32_t* ranks;
    uint32_t* cols;
    void* vals;
    uint32_t n_cols;
    int vector;
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

static inline int dc_cpu_has_avx2(void) {
#if defined(DC_X86_DISPATCH)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
#else
    return 0;
#endif
}

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

/* One row's columns through col_map (-1 drops), sorted, with their 32-bit values (the
   bits of an int32 or float32) or, with held != NULL, their float64 values. With bm, rows of
   more than 24 entries and at least one for every eight words of the bitmap are sorted by
   dc_row_sort_bitmap. With sort32 (see dc_row_sort_narrow) rows of more than 24 entries of
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
   when that is the number of output columns). With stream, the narrow path writes a row
   that is not sorted in place with non-temporal stores: for outputs written once and read
   later by someone else (a minibatch), which then skip the cache and its read for ownership
   (callers run dc_store_fence before other threads read them). */
static inline int dc_row_sort(const int32_t* idx, const uint32_t* val32, const double* val64,
                              int64_t n, const int32_t* col_map, uint32_t n_map,
                              uint64_t* keys, uint64_t* spare, double* held,
                              int64_t capacity, dc_sort32_fn sort32, const dc_bitmap* bm,
                              int32_t* out_idx, uint32_t* out32, double* out64, int64_t* kept,
                              int stream) {
    if (bm != NULL && n > 24 && (int64_t)(bm->n_cols >> 6) <= 8 * n) {
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

/* Gene indices of every cell of a chunk without gap exceptions, in one pass over the
   chunk instead of one per cell: per-cell passes mix non-temporal and regular stores in
   the cache line at every cell boundary, which cost more than the prefix sums here.
   A running prefix of all gaps (uint32, wrapping) minus its value before the cell's start
   gives each index; exact because no cell is longer than DC_FAST_CELL (so a cell's sum
   stays below 2^31). 16 values at a time when they lie inside one cell, away from its
   ends; otherwise element by element into a small aligned buffer, so the output is still
   written by whole vectors. Returns 0, or 1 when the caller must decode the chunk cell by
   cell instead: a cell too long, a zero gap inside a cell or an index >= n_genes (the
   per-cell path then finds and reports the error). Cells are indptr[cell_lo..cell_hi],
   minus a (the chunk's first nonzero); out is the chunk's output. */
#define DC_FAST_CELL 32768
typedef struct {
    int64_t cell, start, end;  /* current non-empty cell and its nonzeros (chunk-relative) */
    uint32_t prefix, base;     /* gaps summed so far, and that sum before the cell began */
} dc_gap_cursor;

static inline int dc_next_cell(dc_gap_cursor* c, const int64_t* indptr, int64_t cell_hi,
                               int64_t a) {
    while (c->cell < cell_hi && indptr[c->cell + 1] == indptr[c->cell]) c->cell++;
    if (c->cell >= cell_hi) {
        c->start = c->end = INT64_MAX;
        return 0;
    }
    c->start = indptr[c->cell] - a;
    c->end = indptr[c->cell + 1] - a;
    return c->end - c->start >= DC_FAST_CELL;
}

/* Positions j0..j1 one by one into dst[0 : j1 - j0]. */
static inline int dc_gaps_scalar(const uint8_t* lo, const uint8_t* hi, int64_t j0,
                                 int64_t j1, dc_gap_cursor* c, const int64_t* indptr,
                                 int64_t cell_hi, int64_t a, int64_t n_genes,
                                 int32_t* dst) {
    for (int64_t j = j0; j < j1; j++) {
        uint32_t gap = lo[j] | ((uint32_t)hi[j] << 8);
        if (j == c->start) c->base = c->prefix;
        else if (gap == 0) return 1;
        c->prefix += gap;
        uint32_t gene = c->prefix - c->base;
        dst[j - j0] = (int32_t)gene;
        if (j == c->end - 1) {
            if ((int64_t)gene >= n_genes) return 1;
            c->cell++;
            if (dc_next_cell(c, indptr, cell_hi, a)) return 1;
        }
    }
    return 0;
}

static inline int dc_chunk_gaps(const uint8_t* lo, const uint8_t* hi, int64_t n,
                                const int64_t* indptr, int64_t cell_lo, int64_t cell_hi,
                                int64_t a, int64_t n_genes, int32_t* out, int stream) {
    dc_gap_cursor c = {cell_lo, 0, 0, 0, 0};
    int64_t i = 0;
    if (dc_next_cell(&c, indptr, cell_hi, a)) return 1;
#if defined(__SSE2__)
    /* Up to the first 16-byte aligned output, element by element. */
    int64_t head = (int64_t)(((16 - ((uintptr_t)out & 15)) & 15) / sizeof(int32_t));
    if (((uintptr_t)out & 3) || head > n) head = n;
    if (dc_gaps_scalar(lo, hi, 0, head, &c, indptr, cell_hi, a, n_genes, out)) return 1;
    i = head;
    const __m128i zero = _mm_setzero_si128();
    __m128i zeros = zero;
    int32_t buffer[16] __attribute__((aligned(16)));
    for (; i + 16 <= n; i += 16) {
        __m128i r[4];
        if (c.start < i && c.end > i + 16) {
            __m128i both = dc_scan16(lo + i, hi + i, r);
            zeros = _mm_or_si128(zeros, _mm_cmpeq_epi8(both, zero));
            __m128i shift = _mm_set1_epi32((int32_t)(c.prefix - c.base));
            c.prefix += (uint32_t)_mm_cvtsi128_si32(_mm_shuffle_epi32(r[3], 0xFF));
            for (int k = 0; k < 4; k++) r[k] = _mm_add_epi32(r[k], shift);
        } else {
            if (dc_gaps_scalar(lo, hi, i, i + 16, &c, indptr, cell_hi, a, n_genes, buffer))
                return 1;
            for (int k = 0; k < 4; k++) r[k] = _mm_load_si128((const __m128i*)(buffer + 4 * k));
        }
        for (int k = 0; k < 4; k++) dc_store_i32x4(out + i + 4 * k, r[k], stream);
    }
    if (_mm_movemask_epi8(zeros)) return 1;
#endif
    return dc_gaps_scalar(lo, hi, i, n, &c, indptr, cell_hi, a, n_genes, out + i);
}

static inline void dc_store_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* Whether any of the n uint16 values stored as byte planes lo/hi is zero. */
static inline int dc_any_zero_planes(const uint8_t* lo, const uint8_t* hi, int64_t n) {
    int64_t i = 0;
    int found = 0;
#if defined(__SSE2__)
    const __m128i zero = _mm_setzero_si128();
    __m128i acc = zero;
    for (; i + 16 <= n; i += 16) {
        __m128i both = _mm_or_si128(_mm_loadu_si128((const __m128i*)(lo + i)),
                                    _mm_loadu_si128((const __m128i*)(hi + i)));
        acc = _mm_or_si128(acc, _mm_cmpeq_epi8(both, zero));
    }
    found = _mm_movemask_epi8(acc) != 0;
#endif
    for (; i < n; i++) {
        found |= (lo[i] | hi[i]) == 0;
    }
    return found;
}

#endif
