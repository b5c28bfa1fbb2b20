# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Hot loops of the deltacells tile codec: libzstd called directly, the GIL released.

Chunks are the unit of parallelism: every parallel loop runs over chunks (or, when a whole
tile is decoded, over each chunk's two streams) under ``prange``, with one zstd context and one
scratch buffer per thread. Nothing inside a parallel region touches a Python object; failures
are written to per-job status slots and raised once the region is over, for the lowest failing
job, so the error (like the output) does not depend on the thread count.

The structure handed to these functions (chunk table, indptr) must come from
:func:`deltacells.format.parse_layout`; the kernels check what they index anyway, so bad input
gives an error rather than a stray memory access.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cython.parallel cimport parallel, prange, threadid
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from cython cimport floating
from libc.math cimport log1p as c_log1p
from libc.string cimport memcpy

import numpy as np

from deltacells._zstd cimport (
    ZSTD_CCtx,
    ZSTD_compressBound,
    ZSTD_compressCCtx,
    ZSTD_CONTENTSIZE_ERROR,
    ZSTD_CONTENTSIZE_UNKNOWN,
    ZSTD_createCCtx,
    ZSTD_createDCtx,
    ZSTD_DCtx,
    ZSTD_decompressDCtx,
    ZSTD_findFrameCompressedSize,
    ZSTD_freeCCtx,
    ZSTD_getFrameContentSize,
    ZSTD_isError,
    ZSTD_maxCLevel,
    ZSTD_minCLevel,
    ZSTD_versionString,
)
from deltacells.format import FormatError

cdef extern from "zlib.h" nogil:
    unsigned long crc32_combine(unsigned long crc1, unsigned long crc2, long length2)

cdef extern from *:
    """
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

    /* One row's columns through col_map (-1 drops), sorted, with their 32-bit values (the
       bits of an int32 or float32) or, with held != NULL, their float64 values. Each kept
       entry becomes a 64-bit key, new column above payload (the value's bits, or its index in
       held), sorted by a byte-wise LSD radix sort over the column's nonzero bytes (the two low
       bytes' counts are taken while the keys are made), or an insertion sort for short rows.
       Rows of a few hundred entries sort in L1 this way at a few ns per entry, faster than a bitmap
       of all columns, whose scan costs a word per 64 columns whatever the row.
       Works in place (out == in): everything is read before anything is written. Returns 0,
       1 for a column >= n_map (before writing anything), 2 for two columns mapped to one place
       (equal neighbours once sorted, found while writing, or more kept entries than capacity
       when that is the number of output columns). */
    static inline int dc_row_sort(const int32_t* idx, const uint32_t* val32, const double* val64,
                                  int64_t n, const int32_t* col_map, uint32_t n_map,
                                  uint64_t* keys, uint64_t* spare, double* held,
                                  int64_t capacity, int32_t* out_idx, uint32_t* out32,
                                  double* out64, int64_t* kept) {
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
    """
    int DELTACELLS_OPENMP
    const char* DELTACELLS_CRC_BACKEND
    uint32_t dc_crc32(uint32_t crc, const uint8_t* buf, int64_t n) noexcept nogil
    int32_t dc_prefix_planes(const uint8_t* lo, const uint8_t* hi, int64_t n, int32_t g,
                             int32_t* out, int stream) noexcept nogil
    int dc_any_zero_planes(const uint8_t* lo, const uint8_t* hi, int64_t n) noexcept nogil
    int dc_planes_to_f32(const uint8_t* lo, const uint8_t* hi, int64_t n, float* out,
                         int stream) noexcept nogil
    void dc_store_fence() noexcept nogil
    int dc_chunk_gaps(const uint8_t* lo, const uint8_t* hi, int64_t n, const int64_t* indptr,
                      int64_t cell_lo, int64_t cell_hi, int64_t a, int64_t n_genes,
                      int32_t* out, int stream) noexcept nogil
    int dc_row_sort(const int32_t* idx, const uint32_t* val32, const double* val64, int64_t n,
                    const int32_t* col_map, uint32_t n_map, uint64_t* keys, uint64_t* spare,
                    double* held, int64_t capacity, int32_t* out_idx, uint32_t* out32,
                    double* out64, int64_t* kept) noexcept nogil

ctypedef fused value_t:
    int32_t
    float
    double

# Chunk-table columns (same order as deltacells.format.CHUNK_FIELDS).
cdef enum:
    CELL_LO = 0
    CELL_HI = 1
    NNZ_LO = 2
    NNZ_HI = 3
    STREAM_MAX = 65535
    MAX_COUNT = 2147483647

# Status codes written by the parallel regions; messages below.
cdef enum Status:
    OK = 0
    E_NOMEM
    E_FRAME_HEADER
    E_FRAME_SIZE
    E_FRAME_LENGTH
    E_DECOMPRESS
    E_CELL_RANGE
    E_ZERO_GAP
    E_GENE_RANGE
    E_EXC_SIZE
    E_EXC_ORDER
    E_VEXC_PAYLOAD
    E_GEXC_PAYLOAD
    E_EXC_STORED
    E_ZERO_COUNT
    E_ENC_ORDER
    E_ENC_VALUE
    E_ENC_COMPRESS
    E_COL_MAP

_MESSAGES = {
    E_NOMEM: "out of memory for scratch buffers or zstd contexts",
    E_FRAME_HEADER: "zstd frame header unreadable or without content size (at frame {})",
    E_FRAME_SIZE: "zstd frame content size lies (frame {} declares a size the chunk cannot hold)",
    E_FRAME_LENGTH: "zstd frame {} does not fill its stored length exactly (truncated or padded)",
    E_DECOMPRESS: "zstd decompression failed or gave the wrong size (frame {})",
    E_CELL_RANGE: "indptr of cell {} points outside its chunk",
    E_ZERO_GAP: "zero gap inside cell {} (duplicate gene index)",
    E_GENE_RANGE: "gene index >= n_genes in cell {}",
    E_EXC_SIZE: "exception frame {} is not 8*k bytes with k <= chunk nonzeros",
    E_EXC_ORDER: "exception positions not strictly increasing or >= chunk nonzeros (index {})",
    E_VEXC_PAYLOAD: "value exception payload out of 65536..2^31-1 (index {})",
    E_GEXC_PAYLOAD: "gap exception payload out of 1..n_genes-1 (index {})",
    E_EXC_STORED: "exception at chunk position {} where the stored value is not 65535",
    E_ZERO_COUNT: "stored count of 0 at or after cell {} (zeros are never stored)",
    E_ENC_ORDER: "gene indices not strictly increasing or out of range in cell {}",
    E_ENC_VALUE: "count outside 1..2^31-1 in cell {}",
    E_ENC_COMPRESS: "zstd compression failed (stream {})",
    E_COL_MAP: "cell {} could not be renumbered through col_map",
}
_FRAME_NAMES = ("gaps", "vals", "vexc", "gexc")


def crc_backend() -> str:
    """The library computing CRC-32s: ``"libdeflate"`` when built with it, else ``"zlib"``."""
    return DELTACELLS_CRC_BACKEND.decode()


def openmp_enabled() -> bool:
    """Whether this build runs parallel loops with OpenMP (else serially, same output)."""
    return bool(DELTACELLS_OPENMP)


def zstd_version() -> str:
    """Version of the libzstd these kernels are linked against."""
    return ZSTD_versionString().decode()


def zstd_level_range() -> tuple:
    """(minimum, maximum) compression level of the linked libzstd."""
    return (ZSTD_minCLevel(), ZSTD_maxCLevel())


# Decompression contexts are reused across calls: creating one costs about as much as
# decoding a small tile. A context is used by one thread at a time: contexts are taken from this
# list with the GIL held before a parallel region and given back after it, so concurrent calls
# from several Python threads never share one.
_idle_dctx = []


cdef object _take_dctx(int n):
    """Addresses of ``n`` decompression contexts, reused when idle ones exist."""
    cdef size_t address
    taken = np.zeros(n, dtype=np.uintp)
    cdef size_t[::1] taken_v = taken
    for i in range(n):
        if _idle_dctx:
            address = _idle_dctx.pop()
        else:
            address = <size_t>ZSTD_createDCtx()
            if address == 0:
                _give_back_dctx(taken[:i])
                raise MemoryError("could not create a zstd decompression context")
        taken_v[i] = address
    return taken


cdef void _give_back_dctx(object taken):
    _idle_dctx.extend(int(a) for a in taken)


# Scratch buffers for decompressed planes, kept between calls like the contexts: a fresh
# malloc of a few MiB is a fresh mmap, whose pages fault in one by one on every call.
_idle_scratch = []
_scratch_sizes = {}
_MAX_IDLE_SCRATCH = 8


cdef object _take_scratch(int n, int64_t size):
    """Addresses of ``n`` buffers of at least ``size`` bytes, reused when idle ones exist."""
    cdef void* fresh
    taken = np.zeros(n, dtype=np.uintp)
    for i in range(n):
        address = _idle_scratch.pop() if _idle_scratch else 0
        if address and _scratch_sizes[address] < size:
            del _scratch_sizes[address]
            free(<void*><size_t>address)
            address = 0
        if not address:
            fresh = malloc(size)
            if fresh == NULL:
                _give_back_scratch(taken[:i])
                raise MemoryError(f"could not allocate {size} bytes of decoding scratch")
            address = <size_t>fresh
            _scratch_sizes[address] = size
        taken[i] = address
    return taken


cdef void _give_back_scratch(object taken):
    _idle_scratch.extend(int(a) for a in taken)
    while len(_idle_scratch) > _MAX_IDLE_SCRATCH:
        address = _idle_scratch.pop(0)
        del _scratch_sizes[address]
        free(<void*><size_t>address)


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


def _raise_status(int32_t[::1] status, int64_t[::1] detail, object where, object chunk_ids=None):
    """Raise FormatError for the lowest failing slot, if any (called with the GIL held)."""
    cdef Py_ssize_t i
    for i in range(status.shape[0]):
        if status[i] != OK:
            code = status[i]
            what = detail[i]
            if code in (E_FRAME_HEADER, E_FRAME_SIZE, E_FRAME_LENGTH, E_DECOMPRESS, E_EXC_SIZE,
                        E_ENC_COMPRESS):
                what = _FRAME_NAMES[what]
            chunk = i if chunk_ids is None else chunk_ids[i]
            message = f"{where}: chunk {chunk}: " + _MESSAGES[code].format(what)
            if code == E_NOMEM:
                raise MemoryError(message)
            if code in (E_ENC_ORDER, E_ENC_VALUE, E_ENC_COMPRESS, E_COL_MAP):
                raise ValueError(message)
            raise FormatError(message)


# ---------------------------------------------------------------------------------------------
# Frame checks (serial; header reads only, nothing is decompressed)


def check_frames(const uint8_t[::1] blob, const int64_t[:, ::1] chunks, object where,
                 int n_threads=1):
    """Check every frame's header and length; return the exception counts per chunk.

    Each stream must be exactly one zstd frame that fills its stored length and declares its
    content size: ``2 * n`` bytes for gaps and values, ``8 * k`` with ``k <= n`` for exception
    frames. Chunks are checked in parallel on ``n_threads`` (tiles of many small chunks have
    thousands of frames); the lowest failing chunk is reported whatever the thread count.

    Returns
    -------
    numpy.ndarray
        ``int64`` array of shape ``(n_chunks, 2)``: value and gap exception counts.
    """
    cdef Py_ssize_t n_chunks = chunks.shape[0]
    cdef Py_ssize_t c
    cdef int f
    cdef int64_t n, off, length
    cdef unsigned long long content
    cdef size_t frame_size
    counts = np.zeros((n_chunks, 2), dtype=np.int64)
    cdef int64_t[:, ::1] counts_v = counts
    status = np.zeros(n_chunks, dtype=np.int32)
    detail = np.zeros(n_chunks, dtype=np.int64)
    cdef int32_t[::1] status_v = status
    cdef int64_t[::1] detail_v = detail
    cdef const uint8_t* base = &blob[0]
    with nogil:
        for c in prange(n_chunks, num_threads=n_threads if n_chunks >= 64 else 1,
                        schedule="static"):
            n = chunks[c, NNZ_HI] - chunks[c, NNZ_LO]
            for f in range(4):
                off = chunks[c, 4 + 2 * f]
                length = chunks[c, 5 + 2 * f]
                if length == 0:
                    continue  # exception frames may be absent; parse_layout checked the streams
                content = ZSTD_getFrameContentSize(base + off, <size_t>length)
                if content == ZSTD_CONTENTSIZE_ERROR or content == ZSTD_CONTENTSIZE_UNKNOWN:
                    status_v[c] = E_FRAME_HEADER
                elif f < 2 and content != <unsigned long long>(2 * n):
                    status_v[c] = E_FRAME_SIZE
                elif f >= 2 and (content % 8 != 0 or content // 8 > <unsigned long long>n):
                    status_v[c] = E_EXC_SIZE
                else:
                    frame_size = ZSTD_findFrameCompressedSize(base + off, <size_t>length)
                    if ZSTD_isError(frame_size) or frame_size != <size_t>length:
                        status_v[c] = E_FRAME_LENGTH
                    elif f >= 2:
                        counts_v[c, f - 2] = <int64_t>(content // 8)
                if status_v[c] != OK:
                    detail_v[c] = f
                    break
    _raise_status(status, detail, where)
    return counts


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
    cdef int64_t a = entry[NNZ_LO], k, j = 0, r, s, e, o, x
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
            else:
                j = order[k]
                r = rows[j]
                o = out_indptr[j]
                if r < entry[CELL_LO] or r >= entry[CELL_HI]:
                    detail[0] = r
                    return E_CELL_RANGE
            s = indptr[r] - a
            e = indptr[r + 1] - a
            if s < 0 or e < s or e > p.n or (rows != NULL and out_indptr[j + 1] - o != e - s):
                detail[0] = r
                return E_CELL_RANGE
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


cdef int64_t _max_scratch(const int64_t[:, ::1] chunks, const int64_t[:, ::1] exc, object ids):
    cdef int64_t best = 8, size
    for c in ids:
        size = _scratch_bytes(chunks[c, NNZ_HI] - chunks[c, NNZ_LO], exc[c, 0], exc[c, 1])
        if size > best:
            best = size
    return best


cdef void _decode_jobs(const uint8_t* blob, const int64_t[:, ::1] chunks,
                       const int64_t[:, ::1] exc, int64_t n_genes, const int64_t* indptr,
                       const int64_t* rows, const int64_t* order, const int64_t* job_chunks,
                       const int64_t* job_starts, Py_ssize_t n_jobs, bint split_streams,
                       const int64_t* out_indptr, int32_t* idx_out, value_t* val_out,
                       const size_t* scratches, int n_threads,
                       const size_t* contexts, const int32_t* col_map, int64_t capacity,
                       int32_t* status, int64_t* detail) noexcept nogil:
    """Run ``_decode_chunk`` for every job in parallel (a job is a chunk or one of its streams).

    Without ``rows`` job ``g`` is chunk ``g``; with them it is chunk ``job_chunks[g]`` and its
    rows ``order[job_starts[g]:job_starts[g + 1]]``. With ``split_streams`` (whole chunks, no
    ``col_map``) job ``g`` is one stream of chunk ``g // 2``: its gene indices when ``g`` is even,
    its values when odd: twice as many, smaller jobs leave less idle time at the end. With
    ``col_map`` (a permutation of the ``n_genes`` columns) each job's output rows are then
    renumbered and sorted in place by the same thread while they are still in cache (so they
    are written with regular stores), with sort scratch of ``capacity`` entries.
    """
    cdef Py_ssize_t g
    cdef int64_t c, k, o, length, kept
    cdef int st
    cdef ZSTD_DCtx* dctx = NULL  # set per thread; initialized so the firstprivate copy is defined
    cdef uint8_t* scratch = NULL
    cdef Chunk* chunk = NULL
    cdef SortScratch sorting
    with parallel(num_threads=n_threads):
        dctx = <ZSTD_DCtx*>contexts[threadid()]
        scratch = <uint8_t*>scratches[threadid()]
        chunk = <Chunk*>malloc(sizeof(Chunk))
        sorting = _new_sort_scratch(capacity if col_map != NULL else 0, sizeof(value_t) == 8)
        for g in prange(n_jobs, schedule="dynamic"):
            if (dctx == NULL or scratch == NULL or chunk == NULL
                    or (col_map != NULL and not sorting.ready)):
                status[g] = E_NOMEM
                continue
            c = (g >> 1 if split_streams else g) if rows == NULL else job_chunks[g]
            chunk.stream = col_map == NULL
            st = _decode_chunk(
                dctx, blob, &chunks[c, 0], exc[c, 0], exc[c, 1], n_genes, indptr, rows, order,
                0 if rows == NULL else job_starts[g], 0 if rows == NULL else job_starts[g + 1],
                out_indptr, idx_out, val_out, scratch, chunk,
                1 << (g & 1) if split_streams else 3, &detail[g])
            if st == OK and col_map != NULL:
                # Whole chunk: its cells in place; selected rows: the output rows of this job.
                for k in range(chunks[c, CELL_LO] if rows == NULL else job_starts[g],
                               chunks[c, CELL_HI] if rows == NULL else job_starts[g + 1]):
                    o = indptr[k] if rows == NULL else out_indptr[order[k]]
                    length = (indptr[k + 1] if rows == NULL else out_indptr[order[k] + 1]) - o
                    kept = 0  # assigned here so that Cython makes it thread-private
                    st = _row_to_mapped_order(
                        idx_out + o, val_out + o, length, col_map, <uint32_t>n_genes, &sorting,
                        idx_out + o, val_out + o, &kept)
                    if st != OK:
                        detail[g] = k if rows == NULL else rows[order[k]]
                        st = E_COL_MAP
                        break
            status[g] = st
        free(chunk)
        _free_sort_scratch(&sorting)


def _permutation_scratch(object col_map, int64_t n_genes, const int64_t[::1] indptr):
    """``col_map`` checked to be a permutation of ``n_genes`` columns, as int32, and the sort
    scratch a cell needs (its longest row, at most ``n_genes``)."""
    col_map = np.asarray(col_map)
    if (col_map.shape != (n_genes,) or n_genes == 0 or col_map.dtype.kind not in "iu"
            or col_map.min() < 0 or np.bincount(col_map, minlength=n_genes).max() != 1):
        raise ValueError(f"col_map must be a permutation of the tile's {n_genes} columns")
    return col_map.astype(np.int32), min(n_genes, int(np.diff(np.asarray(indptr)).max()))


def decode_into(const uint8_t[::1] blob, const int64_t[:, ::1] chunks,
                const int64_t[::1] indptr, const int64_t[:, ::1] exc, int64_t n_genes,
                int32_t[::1] indices, value_t[::1] values, int n_threads, object where,
                object col_map=None):
    """Decode every chunk of a tile into ``indices`` and ``values`` (length >= nnz).

    ``exc`` is the output of :func:`check_frames`. The caller owns ``indptr``. With
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
    if col_map is not None:
        map_v, capacity = _permutation_scratch(col_map, n_genes, indptr)
        map_p = &map_v[0]
    cdef bint split_streams = col_map is None
    cdef Py_ssize_t n_jobs = 2 * n_chunks if split_streams else n_chunks
    status = np.zeros(n_jobs, dtype=np.int32)
    detail = np.zeros(n_jobs, dtype=np.int64)
    cdef int32_t[::1] status_v = status
    cdef int64_t[::1] detail_v = detail
    cdef int64_t scratch_size = _max_scratch(chunks, exc, range(n_chunks))
    cdef int32_t* idx_out = &indices[0] if indices.shape[0] else NULL
    cdef value_t* val_out = &values[0] if values.shape[0] else NULL
    contexts = _take_dctx(n_threads)
    scratches = _take_scratch(n_threads, scratch_size)
    cdef const size_t[::1] contexts_v = contexts
    cdef const size_t[::1] scratches_v = scratches
    try:
        with nogil:
            _decode_jobs(&blob[0], chunks, exc, n_genes, &indptr[0], NULL, NULL, NULL, NULL,
                         n_jobs, split_streams, NULL, idx_out, val_out, &scratches_v[0],
                         n_threads, &contexts_v[0], map_p, capacity, &status_v[0],
                         &detail_v[0])
    finally:
        _give_back_dctx(contexts)
        _give_back_scratch(scratches)
    _raise_status(status, detail, where, np.arange(n_jobs) >> 1 if split_streams else None)


def gather_into(const uint8_t[::1] blob, const int64_t[:, ::1] chunks,
                const int64_t[::1] indptr, const int64_t[:, ::1] exc, int64_t n_genes,
                const int64_t[::1] rows, const int64_t[::1] order,
                const int64_t[::1] group_chunks, const int64_t[::1] group_starts,
                const int64_t[::1] out_indptr, int32_t[::1] indices, value_t[::1] values,
                int n_threads, object where, object col_map=None):
    """Decode the cells ``rows`` (any order, repeats allowed) into one CSR.

    Only the chunks listed in ``group_chunks`` are decompressed, and only the output rows
    ``order`` lists are written (all or some positions of ``rows``, grouped by chunk): group
    ``g`` is ``order[group_starts[g]:group_starts[g + 1]]``, all in chunk ``group_chunks[g]``.
    Output row ``j`` goes to ``out_indptr[j]:out_indptr[j + 1]``. With ``col_map`` (a
    permutation of the columns) every written row is renumbered and sorted again.
    """
    cdef Py_ssize_t n_groups = group_chunks.shape[0]
    cdef int64_t n_out = out_indptr[out_indptr.shape[0] - 1]
    cdef const int32_t* map_p = NULL
    cdef const int32_t[::1] map_v
    cdef int64_t capacity = 0
    if indices.shape[0] < n_out or values.shape[0] < n_out:
        raise ValueError("output buffers are shorter than the gathered nonzeros")
    cdef Py_ssize_t k
    if (group_starts.shape[0] != n_groups + 1 or order.shape[0] > rows.shape[0]
            or out_indptr.shape[0] != rows.shape[0] + 1):
        raise ValueError("group_starts / order / out_indptr do not match group_chunks / rows")
    for k in range(order.shape[0]):
        if order[k] < 0 or order[k] >= rows.shape[0]:
            raise ValueError(f"order[{k}] = {order[k]} is not a position in rows")
    if n_groups == 0:
        return
    if col_map is not None:
        map_v, capacity = _permutation_scratch(col_map, n_genes, indptr)
        map_p = &map_v[0]
    status = np.zeros(n_groups, dtype=np.int32)
    detail = np.zeros(n_groups, dtype=np.int64)
    cdef int32_t[::1] status_v = status
    cdef int64_t[::1] detail_v = detail
    cdef int64_t scratch_size = _max_scratch(chunks, exc, group_chunks)
    cdef int32_t* idx_out = &indices[0] if indices.shape[0] else NULL
    cdef value_t* val_out = &values[0] if values.shape[0] else NULL
    contexts = _take_dctx(n_threads)
    scratches = _take_scratch(n_threads, scratch_size)
    cdef const size_t[::1] contexts_v = contexts
    cdef const size_t[::1] scratches_v = scratches
    try:
        with nogil:
            _decode_jobs(&blob[0], chunks, exc, n_genes, &indptr[0], &rows[0], &order[0],
                         &group_chunks[0], &group_starts[0], n_groups, False, &out_indptr[0],
                         idx_out, val_out, &scratches_v[0], n_threads, &contexts_v[0], map_p,
                         capacity, &status_v[0], &detail_v[0])
    finally:
        _give_back_dctx(contexts)
        _give_back_scratch(scratches)
    _raise_status(status, detail, where, np.asarray(group_chunks))


def decompress_only(const uint8_t[::1] blob, const int64_t[:, ::1] chunks, int n_threads):
    """Decompress the gaps and values frames of every chunk and do nothing else.

    The speed limit for :func:`decode_into`: the same frames through the same libzstd into
    per-thread buffers from the same pool, as the same jobs (one per frame), with no
    post-processing. Returns the decompressed byte count.
    """
    cdef Py_ssize_t n_chunks = chunks.shape[0]
    cdef Py_ssize_t c, g
    cdef int which
    cdef int64_t n, total = 0, largest = 8
    cdef size_t got
    cdef int failed = 0
    cdef ZSTD_DCtx* dctx = NULL  # set per thread; initialized so the firstprivate copy is defined
    cdef uint8_t* scratch = NULL
    cdef const uint8_t* base = &blob[0]
    for c in range(n_chunks):
        largest = max(largest, 2 * (chunks[c, NNZ_HI] - chunks[c, NNZ_LO]))
    contexts = _take_dctx(n_threads)
    scratches = _take_scratch(n_threads, largest)
    cdef const size_t[::1] contexts_v = contexts
    cdef const size_t[::1] scratches_v = scratches
    with nogil, parallel(num_threads=n_threads):
        dctx = <ZSTD_DCtx*>contexts_v[threadid()]
        scratch = <uint8_t*>scratches_v[threadid()]
        for g in prange(2 * n_chunks, schedule="dynamic"):
            c = g >> 1
            which = g & 1
            n = chunks[c, NNZ_HI] - chunks[c, NNZ_LO]
            got = ZSTD_decompressDCtx(dctx, scratch, 2 * n, base + chunks[c, 4 + 2 * which],
                                      chunks[c, 5 + 2 * which])
            if ZSTD_isError(got):
                failed += 1
            total += 2 * n
    _give_back_dctx(contexts)
    _give_back_scratch(scratches)
    if failed:
        raise FormatError("zstd decompression failed")
    return total


# ---------------------------------------------------------------------------------------------
# CRC-32


def crc32_range(const uint8_t[::1] blob, int64_t start, int n_threads) -> int:
    """zlib CRC-32 of ``blob[start:]``, computed in parallel pieces and combined."""
    cdef int64_t size = blob.shape[0] - start
    cdef int64_t n_parts = 1, part, lo, hi
    cdef Py_ssize_t i
    cdef unsigned long result
    cdef const uint8_t* base
    if size <= 0:
        return 0
    base = &blob[start]
    # Pieces of at least 1 MiB: below that, threads cost more than they save.
    n_parts = max(1, min(n_threads, size // (1 << 20)))
    part = (size + n_parts - 1) // n_parts
    crcs = np.zeros(n_parts, dtype=np.uint64)
    cdef unsigned long long[::1] crcs_v = crcs
    with nogil:
        for i in prange(n_parts, num_threads=n_threads, schedule="static"):
            lo = i * part
            hi = min(size, lo + part)
            crcs_v[i] = dc_crc32(0, base + lo, hi - lo)
    result = <unsigned long>crcs_v[0]
    for i in range(1, n_parts):
        lo = i * part
        hi = min(size, lo + part)
        result = crc32_combine(result, <unsigned long>crcs_v[i], <long>(hi - lo))
    return int(result)


# ---------------------------------------------------------------------------------------------
# Encoding


def encode_chunks(const int64_t[::1] indptr, const int32_t[::1] indices,
                  const int32_t[::1] data, const int64_t[::1] bounds, int64_t n_genes,
                  int level, int n_threads, object where="<matrix>"):
    """Compress each chunk of a canonical CSR (sorted, unique indices; counts >= 1).

    ``bounds`` holds the cell boundaries of the chunks (length ``n_chunks + 1``).

    Returns
    -------
    tuple
        ``(frames, exceptions)``: a list of ``[gaps, vals, vexc, gexc]`` bytes per chunk
        (``b""`` where a chunk has no exceptions of that kind), and an ``int64`` array of
        shape ``(n_chunks, 2)`` with the value and gap exception counts.
    """
    cdef Py_ssize_t n_chunks = bounds.shape[0] - 1
    cdef Py_ssize_t c
    cdef int64_t lo, hi, a, b, n, i, r, kv, kg, gap, prev, s, e
    cdef int f, st
    cdef ZSTD_CCtx* cctx = NULL
    cdef uint8_t* planes
    cdef uint32_t* vexc
    cdef uint32_t* gexc
    cdef size_t cap, got
    cdef const uint8_t* src
    cdef int64_t src_size
    if n_chunks <= 0:
        return [], np.zeros((0, 2), dtype=np.int64)
    out_ptr = np.zeros(4 * n_chunks, dtype=np.uintp)
    out_len = np.zeros(4 * n_chunks, dtype=np.int64)
    exc = np.zeros((n_chunks, 2), dtype=np.int64)
    status = np.zeros(n_chunks, dtype=np.int32)
    detail = np.zeros(n_chunks, dtype=np.int64)
    cdef size_t[::1] out_ptr_v = out_ptr
    cdef int64_t[::1] out_len_v = out_len
    cdef int64_t[:, ::1] exc_v = exc
    cdef int32_t[::1] status_v = status
    cdef int64_t[::1] detail_v = detail
    cdef const int32_t* idx = &indices[0] if indices.shape[0] else NULL
    cdef const int32_t* val = &data[0] if data.shape[0] else NULL
    with nogil, parallel(num_threads=n_threads):
        cctx = ZSTD_createCCtx()
        for c in prange(n_chunks, schedule="dynamic"):
            if cctx == NULL:
                status_v[c] = E_NOMEM
                continue
            lo = bounds[c]
            hi = bounds[c + 1]
            a = indptr[lo]
            b = indptr[hi]
            n = b - a
            # Pass 1: count exceptions, check the canonical form.
            kv = 0
            kg = 0
            st = OK
            for r in range(lo, hi):
                s = indptr[r]
                e = indptr[r + 1]
                prev = -1
                for i in range(s, e):
                    if idx[i] <= prev or idx[i] >= n_genes:
                        st = E_ENC_ORDER
                    gap = idx[i] if i == s else idx[i] - prev
                    kg = kg + (gap > STREAM_MAX)
                    prev = idx[i]
                    kv = kv + (val[i] > STREAM_MAX)
                    if val[i] < 1:
                        st = E_ENC_VALUE
                if st != OK:
                    detail_v[c] = r
                    break
            if st != OK:
                status_v[c] = st
                continue
            planes = <uint8_t*>malloc(4 * n + 8 * (kv + kg) + 8)
            if planes == NULL:
                status_v[c] = E_NOMEM
                continue
            vexc = <uint32_t*>(planes + 4 * n)
            gexc = vexc + 2 * kv
            exc_v[c, 0] = kv
            exc_v[c, 1] = kg
            # Pass 2: byte planes and exception lists (positions, then payloads).
            kv = 0
            kg = 0
            for r in range(lo, hi):
                s = indptr[r]
                e = indptr[r + 1]
                prev = 0
                for i in range(s, e):
                    gap = idx[i] - prev
                    prev = idx[i]
                    if gap > STREAM_MAX:
                        gexc[kg] = <uint32_t>(i - a)
                        gexc[exc_v[c, 1] + kg] = <uint32_t>(gap - STREAM_MAX)
                        kg = kg + 1
                        gap = STREAM_MAX
                    planes[i - a] = gap & 0xFF
                    planes[n + i - a] = gap >> 8
                    gap = val[i]
                    if gap > STREAM_MAX:
                        vexc[kv] = <uint32_t>(i - a)
                        vexc[exc_v[c, 0] + kv] = <uint32_t>gap
                        kv = kv + 1
                        gap = STREAM_MAX
                    planes[2 * n + i - a] = gap & 0xFF
                    planes[3 * n + i - a] = gap >> 8
            for f in range(4):
                if f < 2:
                    src = planes + 2 * n * f
                    src_size = 2 * n
                elif f == 2:
                    src = <const uint8_t*>vexc
                    src_size = 8 * kv
                else:
                    src = <const uint8_t*>gexc
                    src_size = 8 * kg
                if f >= 2 and src_size == 0:
                    continue
                cap = ZSTD_compressBound(<size_t>src_size)
                out_ptr_v[4 * c + f] = <size_t>malloc(cap)
                if out_ptr_v[4 * c + f] == 0:
                    status_v[c] = E_NOMEM
                    break
                got = ZSTD_compressCCtx(cctx, <void*>out_ptr_v[4 * c + f], cap, src,
                                        <size_t>src_size, level)
                if ZSTD_isError(got):
                    status_v[c] = E_ENC_COMPRESS
                    detail_v[c] = f
                    break
                out_len_v[4 * c + f] = <int64_t>got
            free(planes)
        ZSTD_freeCCtx(cctx)
    frames = []
    try:
        _raise_status(status, detail, where)
        for c in range(n_chunks):
            frames.append([
                PyBytes_FromStringAndSize(<char*>out_ptr_v[4 * c + f], out_len_v[4 * c + f])
                if out_ptr_v[4 * c + f] else b""
                for f in range(4)
            ])
    finally:
        for c in range(4 * n_chunks):
            free(<void*>out_ptr_v[c])
    return frames, exc


# ---------------------------------------------------------------------------------------------
# Column permutation (writer: gene order and joins; reader: back to the source gene order)


cdef struct SortScratch:
    # One thread's scratch for ``_row_to_mapped_order``: rows of up to ``capacity`` entries.
    uint64_t* keys
    uint64_t* spare
    double* held  # float64 values wait here (the keys carry their positions); else NULL
    int64_t capacity
    bint ready  # every buffer it needs was allocated


cdef inline SortScratch _new_sort_scratch(int64_t capacity, bint hold_values) noexcept nogil:
    """Allocate one thread's sort scratch (check ``.ready``; free with ``_free_sort_scratch``)."""
    cdef SortScratch s
    s.capacity = capacity
    s.keys = <uint64_t*>malloc((capacity + 1) * sizeof(uint64_t))
    s.spare = <uint64_t*>malloc((capacity + 1) * sizeof(uint64_t))
    s.held = <double*>malloc((capacity + 1) * sizeof(double)) if hold_values else NULL
    s.ready = s.keys != NULL and s.spare != NULL and (s.held != NULL or not hold_values)
    return s


cdef inline void _free_sort_scratch(SortScratch* s) noexcept nogil:
    free(s.keys)
    free(s.spare)
    free(s.held)


cdef inline int _row_to_mapped_order(const int32_t* idx, const value_t* val, int64_t n,
                                     const int32_t* col_map, uint32_t n_map, SortScratch* s,
                                     int32_t* out_idx, value_t* out_val,
                                     int64_t* kept) noexcept nogil:
    """Move one row's columns through ``col_map`` (-1 drops) and write them sorted
    (``dc_row_sort``, in place if ``out_* == idx/val``), in a thread's scratch ``s``
    (made with ``hold_values`` for float64).

    Returns E_CELL_RANGE for a column outside col_map (row untouched) and E_ZERO_GAP for two
    columns mapped to one (the row may be partly rewritten; callers raise).
    """
    cdef int st
    if value_t is double:
        st = dc_row_sort(idx, NULL, val, n, col_map, n_map, s.keys, s.spare, s.held,
                         s.capacity, out_idx, NULL, out_val, kept)
    else:  # int32 and float32 travel as their 32 bits
        st = dc_row_sort(idx, <const uint32_t*>val, NULL, n, col_map, n_map, s.keys, s.spare,
                         NULL, s.capacity, out_idx, <uint32_t*>out_val, NULL, kept)
    if st == 1:
        return E_CELL_RANGE
    if st == 2:
        return E_ZERO_GAP
    return OK


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
                      const int32_t* col_map, int64_t n_map, int64_t capacity,
                      Py_ssize_t n_rows, const int64_t* out_indptr, int32_t* out_indices,
                      value_t* out_data, int n_threads, int32_t* status,
                      int64_t* bad_row) noexcept nogil:
    """``_row_to_mapped_order`` over blocks of ``ROWS_PER_BLOCK`` rows in parallel, with
    per-thread scratch of ``capacity`` entries; block ``b`` stops at its first bad row and
    records it in ``status[b]`` / ``bad_row[b]``."""
    cdef Py_ssize_t block, n_blocks = (n_rows + ROWS_PER_BLOCK - 1) // ROWS_PER_BLOCK
    cdef int64_t r, kept
    cdef int st
    cdef SortScratch sorting
    with parallel(num_threads=n_threads):
        sorting = _new_sort_scratch(capacity, sizeof(value_t) == 8)
        for block in prange(n_blocks, schedule="dynamic"):
            if not sorting.ready:
                status[block] = E_NOMEM
                continue
            for r in range(block * ROWS_PER_BLOCK, min(n_rows, (block + 1) * ROWS_PER_BLOCK)):
                kept = 0  # assigned here so that Cython makes it thread-private
                st = _row_to_mapped_order(
                    indices + indptr[r], data + indptr[r], indptr[r + 1] - indptr[r], col_map,
                    <uint32_t>n_map, &sorting, out_indices + out_indptr[r],
                    out_data + out_indptr[r], &kept)
                if st == OK and kept != out_indptr[r + 1] - out_indptr[r]:
                    st = E_CELL_RANGE
                if st != OK:
                    status[block] = st
                    bad_row[block] = r
                    break
        _free_sort_scratch(&sorting)


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
                    capacity, n_rows, &out_indptr[0], idx_out, val_out, n_threads,
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
    cdef int64_t j, r, length, kept, n_map = 0, n_cols = 0, longest = 0, capacity
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
        sorting = _new_sort_scratch(capacity, sizeof(value_t) == 8)
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
                kept = 0  # assigned here so that Cython makes it thread-private
                status_v[k] = _row_to_mapped_order(
                    &indices[indptr[r]], &data[indptr[r]], length, map_p, <uint32_t>n_map,
                    &sorting, idx_out + out_indptr[j], val_out + out_indptr[j], &kept)
                if status_v[k] == OK and kept != out_indptr[j + 1] - out_indptr[j]:
                    status_v[k] = E_CELL_RANGE
        _free_sort_scratch(&sorting)
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
