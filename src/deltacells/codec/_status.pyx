# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Errors reported by the parallel regions: status codes to exceptions (with the GIL held)."""

from libc.stdint cimport int32_t, int64_t

from deltacells.codec._common cimport (
    OK,
    E_NOMEM,
    E_FRAME_HEADER,
    E_FRAME_SIZE,
    E_FRAME_LENGTH,
    E_DECOMPRESS,
    E_CELL_RANGE,
    E_ZERO_GAP,
    E_GENE_RANGE,
    E_EXC_SIZE,
    E_EXC_ORDER,
    E_VEXC_PAYLOAD,
    E_GEXC_PAYLOAD,
    E_EXC_STORED,
    E_ZERO_COUNT,
    E_ENC_ORDER,
    E_ENC_VALUE,
    E_ENC_COMPRESS,
    E_COL_MAP,
)
from deltacells.codec.format import FormatError

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


def raise_status(int32_t[::1] status, int64_t[::1] detail, object where, object chunk_ids=None):
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
