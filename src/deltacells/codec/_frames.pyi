"""Type stubs for the compiled kernels of _frames.pyx."""

import numpy as np
from numpy.typing import NDArray

def check_frames(
    blob: NDArray[np.uint8] | bytes,
    chunks: NDArray[np.int64],
    where: object,
    n_threads: int = 1,
) -> NDArray[np.int64]: ...
def decompress_only(
    blob: NDArray[np.uint8] | bytes, chunks: NDArray[np.int64], n_threads: int
) -> int: ...
