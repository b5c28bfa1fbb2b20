"""Declarations shared by the codec's kernel modules: the C helpers of ``kernels.h``, the
chunk-table columns, the status codes written by parallel regions and the value types."""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "kernels.h" nogil:
    int DELTACELLS_OPENMP
    const char* DELTACELLS_CRC_BACKEND
    uint32_t dc_crc32(uint32_t crc, const uint8_t* buf, int64_t n) noexcept nogil
    int32_t dc_prefix_planes(const uint8_t* lo, const uint8_t* hi, int64_t n, int32_t g,
                             int32_t* out, int stream) noexcept nogil
    int dc_any_zero_planes(const uint8_t* lo, const uint8_t* hi, int64_t n) noexcept nogil
    int dc_planes_to_f32(const uint8_t* lo, const uint8_t* hi, int64_t n, float* out,
                         int stream) noexcept nogil
    void dc_store_fence() noexcept nogil
    void dc_prefetch(const void* p, int64_t bytes) noexcept nogil
    int dc_chunk_gaps(const uint8_t* lo, const uint8_t* hi, int64_t n, const int64_t* indptr,
                      int64_t cell_lo, int64_t cell_hi, int64_t a, int64_t n_genes,
                      int32_t* out, int stream) noexcept nogil
    ctypedef int (*dc_sort32_fn)(void* start, Py_ssize_t n, void* unused) noexcept nogil
    ctypedef struct dc_bitmap:
        uint64_t* bits
        uint32_t* ranks
        uint32_t* cols
        void* vals
        uint32_t n_cols
        int vector
        dc_sort32_fn sort16
        uint16_t* cols16
        void* dense
        int wide
    int dc_cpu_has_popcnt() noexcept nogil
    int dc_cpu_has_avx2() noexcept nogil
    int dc_cpu_has_avx512f() noexcept nogil
    int dc_row_sort(const int32_t* idx, const uint32_t* val32, const double* val64, int64_t n,
                    const int32_t* col_map, uint32_t n_map, uint64_t* keys, uint64_t* spare,
                    double* held, int64_t capacity, dc_sort32_fn sort32, const dc_bitmap* bm,
                    int32_t* out_idx, uint32_t* out32, double* out64, int64_t* kept,
                    int stream) noexcept nogil

ctypedef fused value_t:
    int32_t
    float
    double

# Chunk-table columns (same order as deltacells.codec.format.CHUNK_FIELDS).


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
