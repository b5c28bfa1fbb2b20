/* C helpers of the deltacells kernels (SIMD byte-plane scans, CRC-32, and the row sorts of
   rowsort.h), shared by the codec's Cython modules through _common.pxd. Every function is
   static inline: each module gets its own copy, so nothing here is exported. */
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

#include "rowsort.h"

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
