"""Type stubs for the compiled kernels of _status.pyx."""

import numpy as np
from numpy.typing import NDArray

def raise_status(
    status: NDArray[np.int32],
    detail: NDArray[np.int64],
    where: object,
    chunk_ids: NDArray[np.int64] | None = None,
) -> None: ...
