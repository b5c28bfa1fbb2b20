"""Type stubs for the compiled kernels (see _kernels.pyx)."""

import numpy as np
from numpy.typing import NDArray

def crc_backend() -> str: ...
def openmp_enabled() -> bool: ...
def zstd_version() -> str: ...
def zstd_level_range() -> tuple[int, int]: ...
def check_frames(
    blob: NDArray[np.uint8] | bytes,
    chunks: NDArray[np.int64],
    where: object,
    n_threads: int = 1,
) -> NDArray[np.int64]: ...
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
    col_map: NDArray[np.integer] | None = None,
) -> None: ...
def gather_into(
    blob: NDArray[np.uint8] | bytes,
    chunks: NDArray[np.int64],
    indptr: NDArray[np.int64],
    exc: NDArray[np.int64],
    n_genes: int,
    rows: NDArray[np.int64],
    order: NDArray[np.int64],
    group_chunks: NDArray[np.int64],
    group_starts: NDArray[np.int64],
    out_indptr: NDArray[np.int64],
    indices: NDArray[np.int32],
    values: NDArray[np.int32] | NDArray[np.float32] | NDArray[np.float64],
    n_threads: int,
    where: object,
    col_map: NDArray[np.integer] | None = None,
) -> None: ...
def decompress_only(
    blob: NDArray[np.uint8] | bytes, chunks: NDArray[np.int64], n_threads: int
) -> int: ...
def crc32_range(blob: NDArray[np.uint8] | bytes | bytearray, start: int, n_threads: int) -> int: ...
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
