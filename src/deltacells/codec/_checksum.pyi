"""Type stubs for the compiled kernels of _checksum.pyx."""

import numpy as np
from numpy.typing import NDArray

def crc_backend() -> str: ...
def crc32_range(blob: NDArray[np.uint8] | bytes | bytearray, start: int, n_threads: int) -> int: ...
def chunk_crcs(
    entries: NDArray[np.uint8],
    indptr: NDArray[np.uint8],
    indptr_start: NDArray[np.int64],
    indptr_stop: NDArray[np.int64],
    data: NDArray[np.uint8],
    frame_pos: NDArray[np.int64],
    frame_len: NDArray[np.int64],
) -> NDArray[np.uint32]: ...
