"""Type stubs for the compiled kernels of _checksum.pyx."""

import numpy as np
from numpy.typing import NDArray

def crc_backend() -> str: ...
def crc32_range(blob: NDArray[np.uint8] | bytes | bytearray, start: int, n_threads: int) -> int: ...
