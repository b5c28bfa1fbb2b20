"""Type stubs for the compiled kernels of _encode.pyx."""

import numpy as np
from numpy.typing import NDArray

def zstd_version() -> str: ...
def zstd_level_range() -> tuple[int, int]: ...
def encode_chunks(
    indptr: NDArray[np.int64],
    indices: NDArray[np.int32],
    data: NDArray[np.int32],
    bounds: NDArray[np.int64],
    n_genes: int,
    level: int,
    n_threads: int,
    where: object = ...,
) -> tuple[list[list[bytes]], NDArray[np.int64]]: ...
