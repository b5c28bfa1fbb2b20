"""Type stubs for the compiled kernels of _rows.pyx."""

import numpy as np
from numpy.typing import NDArray

def remap_columns(
    indptr: NDArray[np.int64],
    indices: NDArray[np.int32],
    data: NDArray[np.int32] | NDArray[np.float32] | NDArray[np.float64],
    col_map: NDArray[np.int64],
    n_out_cols: int,
    n_threads: int = 1,
) -> tuple[NDArray[np.int64], NDArray[np.int32], NDArray[np.generic]]: ...
def permute_columns(
    indptr: NDArray[np.int64],
    indices: NDArray[np.int32],
    data: NDArray[np.int32] | NDArray[np.float32] | NDArray[np.float64],
    col_map: NDArray[np.int64],
    n_threads: int = 1,
) -> None: ...
def take_rows_into(
    indptr: NDArray[np.int64],
    indices: NDArray[np.int32],
    data: NDArray[np.int32] | NDArray[np.float32] | NDArray[np.float64],
    rows: NDArray[np.int64],
    positions: NDArray[np.int64],
    out_indptr: NDArray[np.int64],
    out_indices: NDArray[np.int32],
    out_data: NDArray[np.int32] | NDArray[np.float32] | NDArray[np.float64],
    col_map: NDArray[np.int64] | None = None,
    n_threads: int = 1,
    sort: bool = True,
) -> None: ...
def sort_rows_only(
    indptr: NDArray[np.int64],
    indices: NDArray[np.int32],
    data: NDArray[np.int32] | NDArray[np.float32] | NDArray[np.float64],
    rows: NDArray[np.int64],
    col_map: NDArray[np.int64],
    n_threads: int = 1,
) -> int: ...
def normalize_rows(
    indptr: NDArray[np.int64],
    data: NDArray[np.float32] | NDArray[np.float64],
    totals: NDArray[np.float64],
    target_sum: float,
    log1p: bool,
    n_threads: int = 1,
) -> None: ...
def row_sums(
    indptr: NDArray[np.int64],
    data: NDArray[np.int32] | NDArray[np.float32] | NDArray[np.float64],
    n_threads: int = 1,
) -> NDArray[np.float64]: ...
def kept_per_row(
    indptr: NDArray[np.int64],
    indices: NDArray[np.int32],
    col_map: NDArray[np.int64],
    n_threads: int = 1,
) -> NDArray[np.int64]: ...
def decimal_names(
    positions: NDArray[np.int64] | range,
) -> tuple[NDArray[np.int64], NDArray[np.uint8]]: ...
def string_objects(
    chunks: list[tuple[NDArray[np.int64], NDArray[np.uint8]]], n_threads: int | None = None
) -> NDArray[np.object_]: ...
def decimal_name_objects(
    positions: NDArray[np.int64] | range, n_threads: int | None = None
) -> NDArray[np.object_]: ...
def name_objects_only(
    positions: NDArray[np.int64] | range, n_threads: int | None = None
) -> NDArray[np.object_]: ...
