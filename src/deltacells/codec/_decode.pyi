"""Type stubs for the compiled kernels of _decode.pyx."""

import numpy as np
from numpy.typing import NDArray

class ColumnMap:
    array: NDArray[np.int32]
    n_genes: int
    def __init__(self, col_map: NDArray[np.integer], n_genes: int) -> None: ...

def openmp_enabled() -> bool: ...
def decode_into(
    blob: NDArray[np.uint8] | bytes,
    chunks: NDArray[np.int64],
    indptr: NDArray[np.int64],
    exc: NDArray[np.int64],
    n_genes: int,
    indices: NDArray[np.int32],
    values: NDArray[np.int32] | NDArray[np.float32] | NDArray[np.float64],
    n_threads: int,
    where: object,
    col_map: NDArray[np.integer] | ColumnMap | None = None,
) -> None: ...
def gather_into(
    blobs: list[NDArray[np.uint8] | bytes],
    chunk_tables: list[NDArray[np.int64]],
    indptrs: list[NDArray[np.int64]],
    excs: list[NDArray[np.int64]],
    n_genes: int,
    rows: NDArray[np.int64],
    order: NDArray[np.int64],
    group_tiles: NDArray[np.int64],
    group_chunks: NDArray[np.int64],
    group_starts: NDArray[np.int64],
    out_indptr: NDArray[np.int64],
    indices: NDArray[np.int32],
    values: NDArray[np.int32] | NDArray[np.float32] | NDArray[np.float64],
    n_threads: int,
    names: list[str],
    col_map: NDArray[np.integer] | ColumnMap | None = None,
    dst_idx: NDArray[np.uintp] | None = None,
    dst_val: NDArray[np.uintp] | None = None,
) -> None: ...
