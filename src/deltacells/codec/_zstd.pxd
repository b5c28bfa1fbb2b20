# Declarations of the libzstd API used by the kernels (stable API of zstd >= 1.4).
# One place for them, so every kernel calls the same functions the same way.


cdef extern from "zstd.h" nogil:
    ctypedef struct ZSTD_CCtx
    ctypedef struct ZSTD_DCtx

    unsigned long long ZSTD_CONTENTSIZE_UNKNOWN
    unsigned long long ZSTD_CONTENTSIZE_ERROR

    unsigned ZSTD_versionNumber()
    const char* ZSTD_versionString()
    unsigned ZSTD_isError(size_t code)
    const char* ZSTD_getErrorName(size_t code)
    int ZSTD_minCLevel()
    int ZSTD_maxCLevel()

    size_t ZSTD_compressBound(size_t src_size)
    ZSTD_CCtx* ZSTD_createCCtx()
    size_t ZSTD_freeCCtx(ZSTD_CCtx* cctx)
    size_t ZSTD_compressCCtx(ZSTD_CCtx* cctx, void* dst, size_t dst_capacity,
                             const void* src, size_t src_size, int level)

    ZSTD_DCtx* ZSTD_createDCtx()
    size_t ZSTD_freeDCtx(ZSTD_DCtx* dctx)
    size_t ZSTD_decompressDCtx(ZSTD_DCtx* dctx, void* dst, size_t dst_capacity,
                               const void* src, size_t src_size)
    unsigned long long ZSTD_getFrameContentSize(const void* src, size_t src_size)
    size_t ZSTD_findFrameCompressedSize(const void* src, size_t src_size)
