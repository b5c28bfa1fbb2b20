"""Write AnnData (in memory, backed, or .h5ad / .zarr files, or a list of them) as a dataset.

Two passes over the counts, each in row blocks so X is never loaded whole: the first checks
every value and adds up gene totals (for the gene order), the second encodes tiles. Nothing is
written before the first pass succeeds. Tiles and shards appear atomically, the manifest last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import scipy.sparse as sp

from deltacells import _kernels
from deltacells._obs_write import InputSummary, ObsInputs, plan_obs, summarize, write_obs
from deltacells.codec import (
    DEFAULT_LEVEL,
    DEFAULT_N_CHUNKS,
    CountError,
    canonical_csr,
    encode_tile,
    exception_limit,
)
from deltacells.dataset import CELL_ORDER_FILE
from deltacells.elements import ANNDATA_GROUP, layer_names
from deltacells.format import HEADER_SIZE, MAGIC, STREAM_MAX, FormatError
from deltacells.integrity import chunk_sums_record, file_record, tile_checksum_row
from deltacells.manifest import (
    GENE_ORDER_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    METADATA_KEYS,
    OBS_INDEX_COLUMN,
    OBS_SCHEMA_NAME,
    TILE_SUMS_NAME,
    VAR_NAMES_NAME,
    VAR_TABLE_NAME,
    Manifest,
    StoredParts,
    tile_name,
)
from deltacells.npy import npy_bytes
from deltacells.storage import Store, open_store

__all__ = ["DEFAULT_TILE_SIZE", "OBS_INDEX_COLUMN", "write_deltacells"]

#: Cells per tile by default. That is about 3 MB per tile on typical 10x data, a good object
#: size for one GET, and small enough that shuffling buffers of several tiles stay modest.
DEFAULT_TILE_SIZE = 4096
CELL_ORDER_NAME = CELL_ORDER_FILE
#: Cells per chunk by default when writing in spatial order.
SPATIAL_CELLS_PER_CHUNK = 64
JOINS = ("same", "inner", "outer")


# ---------------------------------------------------------------------------------------------
# Reading the source in row blocks


class _RowReader:
    """Rows of one input matrix as scipy CSR blocks (columns in the input's own order)."""

    #: Whether the matrix is in memory already (then nothing is cached between passes).
    in_memory = False

    def block(self, start: int, stop: int) -> sp.csr_matrix:
        raise NotImplementedError

    def rows(self, sorted_rows: np.ndarray) -> sp.csr_matrix:
        raise NotImplementedError

    def close(self) -> None:
        """Release temporary files."""


class _CsrReader(_RowReader):
    """In-memory scipy CSR or anndata's backed CSR dataset (both slice rows cheaply)."""

    def __init__(self, matrix: Any) -> None:
        self.matrix = matrix
        self.in_memory = sp.issparse(matrix)

    def block(self, start: int, stop: int) -> sp.csr_matrix:
        return sp.csr_matrix(self.matrix[start:stop])

    def rows(self, sorted_rows: np.ndarray) -> sp.csr_matrix:
        return sp.csr_matrix(self.matrix[sorted_rows])


class _DenseReader(_RowReader):
    """A dense numpy, h5py or zarr array."""

    def __init__(self, array: Any) -> None:
        self.array = array
        self.in_memory = isinstance(array, np.ndarray)

    def block(self, start: int, stop: int) -> sp.csr_matrix:
        return sp.csr_matrix(np.asarray(self.array[start:stop]))

    def rows(self, sorted_rows: np.ndarray) -> sp.csr_matrix:
        if hasattr(self.array, "oindex"):  # zarr
            return sp.csr_matrix(np.asarray(self.array.oindex[sorted_rows, :]))
        return sp.csr_matrix(np.asarray(self.array[sorted_rows]))


class _CscSpillReader(_RowReader):
    """A CSC matrix on disk, turned into CSR in bounded memory.

    Row slices of a CSC matrix touch every column, so the matrix is transposed once through
    memory-mapped temporary files: count nonzeros per row, then scatter column blocks into
    their rows. Memory holds one column block and the per-row counts.
    """

    def __init__(self, dataset: Any, shape: tuple[int, int], block_nnz: int = 2**24) -> None:
        n_rows = shape[0]
        self._tmp = tempfile.TemporaryDirectory(prefix="deltacells-csc-")
        indptr_src = np.asarray(dataset.group["indptr"][:], dtype=np.int64)
        indices_src, data_src = dataset.group["indices"], dataset.group["data"]
        nnz = int(indptr_src[-1])
        col_blocks = _column_blocks(indptr_src, block_nnz)
        row_nnz = np.zeros(n_rows, dtype=np.int64)
        for j0, j1 in col_blocks:
            rows = np.asarray(indices_src[indptr_src[j0] : indptr_src[j1]], dtype=np.int64)
            row_nnz += np.bincount(rows, minlength=n_rows)
        indptr = np.zeros(n_rows + 1, dtype=np.int64)
        np.cumsum(row_nnz, out=indptr[1:])
        tmp = Path(self._tmp.name)
        shape1 = (max(nnz, 1),)
        indices = np.memmap(tmp / "indices.bin", dtype=np.int32, mode="w+", shape=shape1)
        data = np.memmap(tmp / "data.bin", dtype=data_src.dtype, mode="w+", shape=shape1)
        fill = indptr[:-1].copy()
        for j0, j1 in col_blocks:
            a, b = int(indptr_src[j0]), int(indptr_src[j1])
            rows = np.asarray(indices_src[a:b], dtype=np.int64)
            cols = np.repeat(np.arange(j0, j1, dtype=np.int32), np.diff(indptr_src[j0 : j1 + 1]))
            values = np.asarray(data_src[a:b])
            # Columns are visited in increasing order, so each row receives its entries sorted.
            order = np.argsort(rows, kind="stable")
            rows, cols, values = rows[order], cols[order], values[order]
            counts = np.bincount(rows, minlength=n_rows)
            first = np.concatenate([[0], np.cumsum(counts)[:-1]])
            rank = np.arange(len(rows)) - first[rows]
            positions = fill[rows] + rank
            indices[positions] = cols
            data[positions] = values
            fill += counts
        indices.flush()
        data.flush()
        self.matrix = sp.csr_matrix((data[:nnz], indices[:nnz], indptr), shape=shape, copy=False)

    def block(self, start: int, stop: int) -> sp.csr_matrix:
        return sp.csr_matrix(self.matrix[start:stop], copy=True)

    def rows(self, sorted_rows: np.ndarray) -> sp.csr_matrix:
        return sp.csr_matrix(self.matrix[sorted_rows], copy=True)

    def close(self) -> None:
        self.matrix = None
        self._tmp.cleanup()


def _column_blocks(indptr: np.ndarray, block_nnz: int) -> list[tuple[int, int]]:
    """Consecutive column ranges holding about ``block_nnz`` nonzeros each."""
    n_cols = len(indptr) - 1
    blocks, j0 = [], 0
    while j0 < n_cols:
        j1 = int(np.searchsorted(indptr, indptr[j0] + block_nnz, side="right")) - 1
        j1 = min(max(j1, j0 + 1), n_cols)
        blocks.append((j0, j1))
        j0 = j1
    return blocks


def _reader_for(matrix: Any) -> _RowReader:
    """A row reader for an in-memory or backed X."""
    if sp.issparse(matrix):
        return _CsrReader(matrix if matrix.format == "csr" else matrix.tocsr())
    fmt = getattr(matrix, "format", None)
    if fmt == "csr":
        return _CsrReader(matrix)
    if fmt == "csc":
        return _CscSpillReader(matrix, matrix.shape)
    if hasattr(matrix, "shape") and len(matrix.shape) == 2:
        return _DenseReader(matrix)
    raise TypeError(f"cannot read counts from {type(matrix).__name__}")


# ---------------------------------------------------------------------------------------------
# Inputs


@dataclass
class _Part:
    """One input (file or AnnData): its counts reader, obs and var.

    A file is open only while its counts are read: ``reader`` opens it on first use and
    ``release`` closes it again (an atlas of thousands of files never holds them all open:
    each open HDF5 file keeps caches of its own, and a process has a limited number of file
    descriptors). A CSC file stays open once read, its transposed copy being costly to
    remake. For files, ``var`` holds the gene names only until the genes are aligned, then
    ``None``; ``full_var`` reads the whole table when the output's var table is built, and
    ``read_obs`` reads obs each time it is called (it is not kept).
    """

    label: str
    n_obs: int
    read_obs: Callable[[], pd.DataFrame]
    var: pd.DataFrame | None
    open_reader: Callable[[], tuple[_RowReader, list[Callable[[], None]]]]
    read_var: Callable[[], pd.DataFrame] | None = None
    from_file: bool = False
    #: For counts taken from X: what a bad value's error adds (which layers to try), worked
    #: out only when there is such an error.
    count_hint: Callable[[], str] | None = None
    #: The dtype the input stores its counts in (None: unknown).
    dtype: np.dtype | None = None
    _reader: _RowReader | None = None
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def reader(self) -> _RowReader:
        if self._reader is None:
            self._reader, self._closers = self.open_reader()
        return self._reader

    @property
    def in_memory(self) -> bool:
        return not self.from_file and self.reader.in_memory

    def full_var(self) -> pd.DataFrame:
        """The whole var table (read now for files)."""
        return self.read_var() if self.read_var is not None else self.var

    def release(self) -> None:
        """Close a file input until its counts are needed again."""
        if self.from_file and not isinstance(self._reader, _CscSpillReader):
            self.close()

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        for close in self._closers:
            close()
        self._reader, self._closers = None, []


def _open_part(source: Any, layer: str | None, use_raw: bool, tables: bool = True) -> _Part:
    """An input opened for reading; ``tables=False`` skips reading its obs and var (empty
    frames instead), for the encoding tasks that need its counts only."""
    if isinstance(source, ad.AnnData):
        return _part_from_anndata(source, layer, use_raw)
    if isinstance(source, str | os.PathLike):
        return _part_from_path(Path(source), layer, use_raw, tables)
    raise TypeError(f"source must be an AnnData or a path to .h5ad / .zarr, not {type(source)}")


def _part_from_anndata(adata: ad.AnnData, layer: str | None, use_raw: bool) -> _Part:
    label = str(adata.filename) if adata.isbacked else "<AnnData>"
    if use_raw:
        if adata.raw is None:
            raise ValueError("use_raw=True but the AnnData has no .raw")
        matrix, var = adata.raw.X, adata.raw.var
    elif layer is not None:
        if layer not in adata.layers:
            raise KeyError(f"layer {layer!r} not found (layers: {layer_names(adata)})")
        matrix, var = adata.layers[layer], adata.var
    else:
        matrix, var = adata.X, adata.var
    if matrix is None:
        raise ValueError("the AnnData has no X")
    reader = _reader_for(matrix)
    hint = None if use_raw or layer is not None else lambda: _layer_hint(
        [name for name in layer_names(adata) if _looks_like_counts(adata.layers[name])],
        adata.raw is not None and _looks_like_counts(adata.raw.X))  # fmt: skip
    return _Part(label, adata.n_obs, lambda: adata.obs, var, lambda: (reader, []),
                 count_hint=hint, dtype=_dtype_of(matrix), _reader=reader)


def _dtype_of(matrix: Any) -> np.dtype | None:
    try:
        return np.dtype(matrix.dtype)
    except (AttributeError, TypeError):
        return None


def _looks_like_counts(matrix: Any, sample: int = 100_000) -> bool:
    """Whether the first stored values of ``matrix`` are non-negative integers (a hint for
    an error message, not a check)."""
    try:
        values = matrix.data[:sample] if sp.issparse(matrix) else np.asarray(
            matrix[: max(1, sample // max(matrix.shape[1], 1))]).ravel()  # fmt: skip
        values = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError, AttributeError):
        return False
    return bool(values.size) and bool(np.all(values >= 0) and np.all(values == np.round(values)))


def _layer_hint(count_layers: list[str], raw_counts: bool) -> str:
    """What to pass when X is not counts: the layers (and raw) that look like counts."""
    if count_layers:
        name = count_layers[0]
        return (f"; X does not hold counts, but layers {count_layers} do: pass "
                f"layer={name!r} (deltacells convert --layer {name}); X is kept too")
    if raw_counts:
        return "; X does not hold counts, raw.X does: pass use_raw=True (deltacells convert --raw)"
    return ""  # nothing to point to: the value and its place say it all


def _file_layer_hint(path: Path) -> str:
    """:func:`_layer_hint` for a file: the first rows of each layer and of raw.X looked at."""
    from deltacells._extras import has_raw

    group, closers = _open_group(path)
    try:
        def first_rows(elem: Any) -> Any:
            matrix = _matrix_of(elem)
            return sp.csr_matrix(matrix[: min(64, matrix.shape[0])])

        layers = [name for name in (group["layers"] if "layers" in group else [])
                  if _looks_like_counts(first_rows(group["layers"][name]))]  # fmt: skip
        raw = has_raw(group) and _looks_like_counts(first_rows(group["raw"]["X"]))
        return _layer_hint(layers, raw)
    except Exception:  # only a hint: never hide the error it adds to
        return ""
    finally:
        for close in closers:
            close()


def _open_group(path: Path) -> tuple[Any, list[Callable[[], None]]]:
    """The root group of a .h5ad file or .zarr store, and how to close it."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    if path.suffix == ".zarr" or path.is_dir():
        import zarr

        if (path / "manifest.json").exists():
            raise FormatError(f"{path}: a deltacells dataset, not an AnnData input: the source "
                              "comes first, then the target")  # fmt: skip
        try:
            return zarr.open_group(str(path), mode="r"), []
        except (FileNotFoundError, ValueError, KeyError, OSError) as err:
            raise FormatError(f"{path}: not an AnnData .zarr store ({err}); the inputs are "
                              "AnnData .h5ad files or .zarr folders") from err  # fmt: skip
    import h5py

    try:
        group = h5py.File(path, "r")
    except OSError as err:
        raise FormatError(f"{path}: not an HDF5 file, so not an .h5ad ({err}); the inputs are "
                          "AnnData .h5ad files or .zarr folders") from err  # fmt: skip
    return group, [group.close]


def _elements(group: Any, path: Path, layer: str | None, use_raw: bool) -> tuple[Any, Any]:
    """The counts element and its var group."""
    if use_raw:
        from deltacells._extras import has_raw

        if not has_raw(group):
            raise ValueError(f"{path}: use_raw=True but the file has no raw")
        return group["raw"]["X"], group["raw"]["var"]
    if layer is not None:
        if "layers" not in group or layer not in group["layers"]:
            raise KeyError(f"{path}: layer {layer!r} not found")
        return group["layers"][layer], group["var"]
    return group["X"], group["var"]


def _matrix_of(elem: Any) -> Any:
    encoding = dict(elem.attrs).get("encoding-type", "")
    return ad.io.sparse_dataset(elem) if "matrix" in str(encoding) else elem


def _part_from_path(path: Path, layer: str | None, use_raw: bool, tables: bool = True) -> _Part:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")

    def open_reader() -> tuple[_RowReader, list[Callable[[], None]]]:
        group, closers = _open_group(path)
        try:
            return _reader_for(_matrix_of(_elements(group, path, layer, use_raw)[0])), closers
        except BaseException:
            for close in closers:
                close()
            raise

    def read_var() -> pd.DataFrame:
        group, closers = _open_group(path)
        try:
            return ad.io.read_elem(_elements(group, path, layer, use_raw)[1])
        finally:
            for close in closers:
                close()

    def read_obs() -> pd.DataFrame:
        group, closers = _open_group(path)
        try:
            obs = ad.io.read_elem(group["obs"])
        finally:
            for close in closers:
                close()
        if len(obs) != n_obs:
            raise ValueError(f"{path}: obs has {len(obs)} rows but the counts have {n_obs}")
        return obs

    group, closers = _open_group(path)
    try:
        elem, var_elem = _elements(group, path, layer, use_raw)
        n_obs = int(_matrix_of(elem).shape[0])
        if not tables:
            return _Part(str(path), n_obs, read_obs, pd.DataFrame(), open_reader,
                         from_file=True)  # fmt: skip
        names = _var_names_only(var_elem)
        var = ad.io.read_elem(var_elem) if names is None else names
        hint = None if layer is not None or use_raw else lambda: _file_layer_hint(path)
        return _Part(str(path), n_obs, read_obs, var, open_reader, read_var, from_file=True,
                     count_hint=hint, dtype=_dtype_of(_matrix_of(elem)))  # fmt: skip
    finally:
        for close in closers:
            close()


def _var_names_only(elem) -> pd.DataFrame | None:
    """A var table of the gene names alone, indexed as anndata's reader indexes the whole
    table; None for encodings other than anndata's dataframe (read whole then)."""
    attrs = dict(elem.attrs)
    key = attrs.get("_index")
    if attrs.get("encoding-type") != "dataframe" or not isinstance(key, str) or key not in elem:
        return None
    frame = pd.DataFrame(index=ad.io.read_elem(elem[key]))
    if key != "_index":
        frame.index.name = key
    return frame


# ---------------------------------------------------------------------------------------------
# Genes


def _align_genes(parts: list[_Part], join: str) -> tuple[pd.Index, list[np.ndarray], pd.DataFrame]:
    """Output gene names, each part's column map into them (-1: dropped) and the var table."""
    for part in parts:
        if not part.var.index.is_unique:
            dup = part.var.index[part.var.index.duplicated()][0]
            raise ValueError(f"{part.label}: var_names are not unique ({dup!r} repeats)")
    names = parts[0].var.index
    if join == "same":
        for part in parts[1:]:
            if len(part.var.index) != len(names) or not part.var.index.isin(names).all():
                raise ValueError(
                    f"{part.label}: its genes differ from {parts[0].label}'s; pass "
                    "join='inner' or join='outer' to intersect or unite them"
                )
    elif join == "inner":
        for part in parts[1:]:
            names = names[names.isin(part.var.index)]
    elif join == "outer":
        for part in parts[1:]:
            names = names.append(part.var.index[~part.var.index.isin(names)])
    else:
        raise ValueError(f"join must be one of {JOINS}, not {join!r}")
    maps: list[np.ndarray] = []
    for p, part in enumerate(parts):
        # Inputs with the same genes in the same order (the usual atlas) share one map.
        same = p > 0 and part.var.index.equals(parts[p - 1].var.index)
        maps.append(maps[-1] if same else names.get_indexer(part.var.index).astype(np.int64))
    # Each gene's row from the first input that has it (columns and dtypes as one
    # concatenation of all the tables gives), read one table at a time.
    var = parts[0].full_var()
    for part in parts[1:]:
        var = pd.concat([var, part.full_var()])
        var = var[~var.index.duplicated(keep="first")]
    for part in parts:
        if part.read_var is not None:
            part.var = None  # read again only to name a gene in an error
    return names, maps, var.reindex(names)


def _resolve_gene_order(gene_order: Any, totals: np.ndarray) -> np.ndarray | None:
    n = len(totals)
    if isinstance(gene_order, str):
        if gene_order == "total_counts":
            return np.argsort(-totals, kind="stable").astype(np.int32)
        if gene_order == "none":
            return None
        raise ValueError(
            f"gene_order must be 'total_counts', 'none' or a permutation, not {gene_order!r}"
        )
    if gene_order is None:
        return None
    order = np.asarray(gene_order)
    if (
        order.shape != (n,)
        or order.dtype.kind not in "iu"
        or not np.array_equal(np.sort(order), np.arange(n))
    ):
        raise ValueError(f"gene_order must be a permutation of 0..{n - 1}")
    return order.astype(np.int32)


# ---------------------------------------------------------------------------------------------
# The writer


@dataclass
class _Plan:
    """What pass 1 found and decided."""

    n_cells: int
    n_genes: int
    col_maps: list[np.ndarray]
    var_names: pd.Index
    var: pd.DataFrame
    gene_order: np.ndarray | None
    cell_order: np.ndarray | None
    offsets: np.ndarray
    obs_names_unique: bool = True
    obs_pandas: dict | None = None
    spatial: Any = None  # deltacells._spatial_write.SpatialPlan


def _remap_columns(block: sp.csr_matrix, col_map: np.ndarray, n_genes: int) -> sp.csr_matrix:
    """Columns of ``block`` moved to their output positions (-1: dropped), rows sorted.

    The block is checked and made canonical first (duplicates summed, zeros dropped), so the
    kernel only permutes.
    """
    indptr, indices, data, shape = canonical_csr(block)
    out = _kernels.remap_columns(indptr, indices, data, col_map, n_genes)
    matrix = sp.csr_matrix((out[2], out[1], out[0]), shape=(shape[0], n_genes), copy=False)
    matrix.has_canonical_format = True
    return matrix


def _iter_blocks(
    parts: list[_Part], block_size: int
) -> Iterator[tuple[int, int, int, sp.csr_matrix]]:
    for p, part in enumerate(parts):
        for start in range(0, part.n_obs, block_size):
            stop = min(start + block_size, part.n_obs)
            yield p, start, stop, part.reader.block(start, stop)
        part.release()


def _check_and_total(
    parts: list[_Part], col_maps, n_genes: int, block_size: int, progress, cache: dict, budget: int
) -> np.ndarray:
    """Pass 1: every value checked, gene totals (in output gene space) added up.

    Checked blocks are kept in ``cache`` while they fit in ``budget`` bytes, so that small
    inputs are read (and, for .h5ad, decompressed) once; past the budget the cache is dropped
    and pass 2 reads again, keeping memory flat whatever the input size.
    """
    totals = np.zeros(n_genes, dtype=np.float64)
    fitting = block_size  # the largest tile size whose blocks hold few enough large counts
    cached_bytes = 0
    blocks = _iter_blocks(parts, block_size)
    n_blocks = sum(-(-part.n_obs // block_size) for part in parts)
    for p, start, stop, block in progress(blocks, total=n_blocks, desc="checking counts"):
        try:
            (indptr, indices, data, shape), part_totals, allowed = _checked_block(block,
                                                                                  block_size)
        except CountError as err:
            raise _count_error(parts[p], err.problem, start + err.cell, err.gene) from None
        fitting = min(fitting, allowed)
        mapped = col_maps[p]
        keep = mapped >= 0
        totals[mapped[keep]] += part_totals[keep]  # mapped columns are distinct
        if budget > 0:
            cached_bytes += indptr.nbytes + indices.nbytes + data.nbytes
            if cached_bytes <= budget:
                cache[(p, start, stop)] = sp.csr_matrix((data, indices, indptr), shape=shape)
            else:
                cache.clear()
                budget = 0
    return totals, fitting


def _checked_block(block: Any, block_size: int) -> tuple[tuple, np.ndarray, int]:
    """One block of an input, checked and made canonical (a CountError names the block's own
    row): its CSR parts, its gene totals (the input's own genes) and the most cells per tile
    its counts above 65535 allow. Both first passes (here and on dask) check with it."""
    indptr, indices, data, shape = canonical_csr(block)
    totals = np.bincount(indices, weights=data, minlength=shape[1])
    return (indptr, indices, data, shape), totals, _cells_per_tile_for_exceptions(
        indptr, data, block_size)  # fmt: skip


def _count_error(part: _Part, problem: str, cell: int, gene: int) -> CountError:
    """A CountError naming the input, the cell and the gene."""
    hint = part.count_hint() if part.count_hint is not None and problem in (
        "non-integral count", "negative count") else ""  # fmt: skip
    return CountError(problem, cell, gene, message=(
        f"{part.label}: {problem} at cell {cell} ({part.read_obs().index[cell]!r}), gene {gene} "
        f"({part.full_var().index[gene]!r}){hint}"))  # fmt: skip


#: Blocks (of the tile size) one pass-1 dask task checks.
CHECK_BLOCKS_PER_TASK = 16


def _check_task(item: Any, layer, use_raw, start: int, stop: int, block_size: int) -> tuple:
    """One pass-1 dask task: cells ``start:stop`` of one input checked in the blocks the
    single-process pass reads, their gene totals (the input's own genes) and the tile size
    their large counts allow; or the first bad value as ``("error", problem, cell, gene)``."""
    part = _open_part(item, layer, use_raw, tables=False)
    try:
        totals, fitting = None, block_size
        for first in range(start, stop, block_size):
            block = part.reader.block(first, min(first + block_size, stop))
            try:
                _, block_totals, allowed = _checked_block(block, block_size)
            except CountError as err:
                return ("error", err.problem, first + err.cell, err.gene)
            fitting = min(fitting, allowed)
            totals = block_totals if totals is None else totals + block_totals
        return ("ok", totals, fitting)
    finally:
        part.close()


def _check_and_total_distributed(client, sources: list, parts: list[_Part], layer, use_raw,
                                 col_maps, n_genes: int, block_size: int,
                                 progress) -> tuple[np.ndarray, int]:  # fmt: skip
    """Pass 1 on dask.distributed: a task per run of blocks of each input file, summed here.
    Counts are integers, so the float64 totals are exact in any order: the result, and so the
    gene order, equals the single-process pass's."""
    from distributed import as_completed

    step = block_size * CHECK_BLOCKS_PER_TASK
    jobs = [(p, start, min(start + step, part.n_obs))
            for p, part in enumerate(parts) for start in range(0, part.n_obs, step)]  # fmt: skip
    futures = {client.submit(_check_task, sources[p], layer, use_raw, start, stop, block_size,
                             pure=False): (p, start) for p, start, stop in jobs}  # fmt: skip
    results: dict[tuple[int, int], tuple] = {}
    bar = iter(progress(range(len(jobs)), total=len(jobs), desc="checking counts (dask)",
                         unit="task"))
    next(bar, None)
    for future in as_completed(futures):
        results[futures[future]] = future.result()
        next(bar, None)
    totals = np.zeros(n_genes, dtype=np.float64)
    fitting = block_size
    for p, start, _ in jobs:  # in input order: the first bad value is the one reported
        outcome = results[(p, start)]
        if outcome[0] == "error":
            raise _count_error(parts[p], *outcome[1:])
        _, part_totals, part_fitting = outcome
        fitting = min(fitting, part_fitting)
        keep = col_maps[p] >= 0
        totals[col_maps[p][keep]] += part_totals[keep]
    return totals, fitting


def _obs_summary_task(item: Any, layer, use_raw, labels: list[str], exclude: Sequence[str],
                      list_input: bool, p: int, max_categories: int) -> InputSummary:  # fmt: skip
    """One dask task: input ``p``'s obs read on the worker and summarised for planning."""
    readers: list = [None] * len(labels)
    readers[p] = _open_part(item, layer, use_raw, tables=False).read_obs
    return summarize(ObsInputs(readers, labels, exclude, list_input).frame(p), max_categories)


def _obs_summaries_distributed(client, sources: list, layer, use_raw, inputs: ObsInputs,
                               max_categories: int, progress
                               ) -> Iterator[InputSummary]:  # fmt: skip
    """Each input's obs summary made by a task, yielded in input order (each released once
    used, so this process holds one at a time)."""
    futures = [client.submit(_obs_summary_task, item, layer, use_raw, inputs.labels,
                             inputs.exclude, inputs.file_names is not None, p, max_categories,
                             pure=False) for p, item in enumerate(sources)]  # fmt: skip
    for future in progress(futures, total=len(futures), desc="planning obs (dask)",
                           unit="input"):
        summary = future.result()
        future.release()
        yield summary


def _cells_per_tile_for_exceptions(indptr: np.ndarray, data: np.ndarray, cells: int) -> int:
    """The most cells per tile this block allows: every run of that many cells holds at most
    ``exception_limit`` counts above 65535 (runs over the block's cells, in order)."""
    large = data > STREAM_MAX
    if not large.any():
        return cells
    row_of = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    per_cell = np.bincount(row_of[large], minlength=len(indptr) - 1)
    nnz_per_cell = np.diff(indptr)
    size = cells
    while size >= 1:
        window = np.ones(min(size, len(per_cell)), dtype=np.int64)
        exceptions = np.convolve(per_cell, window, mode="valid")
        nonzeros = np.convolve(nnz_per_cell, window, mode="valid")
        if (exceptions <= exception_limit(nonzeros)).all():
            return size
        size = size // 2 if size > 1 else 0
    return 0


def _settle_tile_size(tile_size: int, fitting: int, chosen: bool) -> int:
    """``tile_size``, or a smaller one that holds the data's large counts (with a warning),
    or an error naming the size that would (for an explicit ``tile_size``)."""
    if fitting >= tile_size:
        return tile_size
    if fitting < 1:
        raise ValueError(
            "a single cell holds more than 1024 counts above 65535: values this large are not "
            "raw counts (the format stores them as rare exceptions)"
        )
    if chosen:
        raise ValueError(
            f"tiles of {tile_size} cells would hold more counts above 65535 than a tile may "
            f"(max(1024, nnz/200)); pass tile_size={fitting} or smaller, or leave tile_size "
            "unset to let the writer choose"
        )
    import warnings

    warnings.warn(
        f"many counts above 65535: writing tiles of {fitting} cells instead of {tile_size} "
        "(a tile may hold at most max(1024, nnz/200) of them)",
        UserWarning,
        stacklevel=3,
    )
    return fitting


def _tile_rows(plan: _Plan, tile: int, tile_size: int) -> np.ndarray:
    start, stop = tile * tile_size, min((tile + 1) * tile_size, plan.n_cells)
    if plan.cell_order is None:
        return np.arange(start, stop, dtype=np.int64)
    return plan.cell_order[start:stop]


def _max_open_inputs() -> int:
    """How many file inputs a reordered write keeps open: a quarter of the soft limit on
    open files (at least 4), leaving the rest to the process."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1024 if soft == resource.RLIM_INFINITY else max(4, soft // 4)


def _tile_matrix(
    parts: list[_Part], plan: _Plan, rows: np.ndarray, contiguous: bool, cache: dict,
    opened: OrderedDict | None = None,
) -> sp.csr_matrix:
    """The counts of global rows ``rows`` in stored gene order.

    In order, an input is released once its last row is read. Reordered, any tile may need
    any input: the inputs used last stay open (in ``opened``), up to :func:`_max_open_inputs`.
    """
    pieces, positions = [], []
    keep_open = _max_open_inputs() if opened is not None else 0
    part_of = np.searchsorted(plan.offsets, rows, side="right") - 1
    for p in np.unique(part_of):
        mine = np.flatnonzero(part_of == p)
        local = rows[mine] - plan.offsets[p]
        if contiguous:
            key = (int(p), int(local[0]), int(local[-1]) + 1)
            block = cache.pop(key) if key in cache else parts[p].reader.block(*key[1:])
            if key[2] == parts[p].n_obs:  # in order, so this input is done with
                parts[p].release()
        else:
            order = np.argsort(local, kind="stable")
            block = parts[p].reader.rows(local[order])[np.argsort(order)]
            if opened is not None:
                opened[p] = None
                opened.move_to_end(p)
                while len(opened) > keep_open:
                    parts[opened.popitem(last=False)[0]].release()
        pieces.append(_remap_columns(sp.csr_matrix(block), plan.col_maps[p], plan.n_genes))
        positions.append(mine)
    matrix = sp.vstack(pieces, format="csr") if len(pieces) > 1 else pieces[0]
    if not contiguous and len(pieces) > 1:
        matrix = matrix[np.argsort(np.concatenate(positions))]
    return matrix


def _progress_factory(progress: bool) -> Callable:
    if not progress:
        return lambda iterable, **_: iterable
    from deltacells._progress import progress as progress_of

    # The bars stay as a one-line summary of each pass once it is done.
    return lambda iterable, **kwargs: progress_of(iterable, **{"unit": "tile", **kwargs})


#: Names a dataset written by this package may hold (FORMAT.md's layout plus the writer's
#: own files and the temporary files of an interrupted atomic write).
_OWN_FILE = re.compile(
    r"((layers/[^/]+|raw)/)?"  # count layers and raw are datasets of their own
    r"(manifest\.json|gene_order\.npy|var_names\.txt|var\.parquet|cell_order\.npy"
    r"|spatial/(tile_offsets|centroids|shapes|geometry_offsets)\.npy|spatial/geometry\.wkb"
    r"|genes/block_\d{6}\.dct|(tiles|genes)/chunk_crc32\.bin|spatial/grid_crc32\.npy"
    r"|obs/schema\.json|tiles/tile_\d{6}\.dct|obs/obs_\d{4}\.parquet"
    r"|((tiles|obs|spatial|genes)/)?\.[^/]+\.tmp)"
    r"|anndata\.zarr/.+"  # anndata's element IO
)
_OWN_DIRS = re.compile(
    r"((layers/[^/]+|raw)/)?(tiles|obs)|layers(/[^/]+)?|raw|spatial|genes|anndata\.zarr(/.+)?"
)


def _check_target(store: Store, overwrite: bool) -> bool:
    """Whether writing to ``store`` replaces a dataset (raises if it must not be written).

    Overwrite only replaces what is provably a deltacells dataset: every entry has a name of
    the format's layout (no other files, no links, FIFOs or extra folders), and either the
    manifest is valid or, for an interrupted write without one, every tile starts with the
    tile magic. Anything else is refused and nothing is deleted.
    """
    entries = store.entries()
    if not entries:
        return False
    if not overwrite:
        raise FileExistsError(
            f"{store.describe()} is not empty; pass overwrite=True (deltacells convert "
            "--overwrite) to replace the deltacells dataset there"
        )
    foreign = [
        name
        for name, kind in entries
        if not ((kind == "file" and _OWN_FILE.fullmatch(name)) or
                (kind == "dir" and _OWN_DIRS.fullmatch(name)))
    ]  # fmt: skip
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        raise FileExistsError(
            f"{store.describe()} holds entries that are not a deltacells dataset's ({shown}); "
            "refusing to replace it even with overwrite=True"
        )
    names = {name for name, kind in entries if kind == "file"}
    try:
        if MANIFEST_NAME in names:
            Manifest.from_json_text(store.read_bytes(MANIFEST_NAME, max_size=MAX_MANIFEST_BYTES))
        else:
            for name in sorted(n for n in names if n.startswith("tiles/tile_")):
                if store.read_range(name, 0, len(MAGIC)) != MAGIC:
                    raise FormatError(f"{store.describe(name)}: not a deltacells tile")
    except FormatError as err:
        raise FileExistsError(
            f"{store.describe()} is not a valid deltacells dataset ({err}); refusing to "
            "replace it even with overwrite=True"
        ) from None
    return True


def write_deltacells(
    source: Any,
    path: str | os.PathLike,
    *,
    tile_size: int | None = None,
    n_chunks: int | None = None,
    zstd_level: int = DEFAULT_LEVEL,
    gene_order: str | Sequence[int] | np.ndarray = "total_counts",
    obs: bool = True,
    var: bool = True,
    layer: str | None = None,
    use_raw: bool = False,
    join: str = "same",
    shuffle: bool = False,
    seed: int = 0,
    cell_order: Sequence[int] | np.ndarray | None = None,
    spatial_key: str | None = None,
    shapes: Any = None,
    grid_tile_size: float | tuple[float, float] | None = None,
    origin: tuple[float, float] | None = None,
    gene_major: bool = False,
    obs_exclude: Sequence[str] = (),
    max_categories: int = 20_000,
    obs_tiles_per_file: int = 1000,
    n_threads: int | None = None,
    n_workers: int = 1,
    client: Any = None,
    overwrite: bool = False,
    progress: bool = True,
    storage_options: dict | None = None,
    metadata: dict | None = None,
    cache_bytes: int = 2**28,
    elements: bool = True,
) -> Manifest:
    """Write an AnnData (counts, obs, var and the rest) as a deltacells dataset.

    Parameters
    ----------
    source
        An :class:`~anndata.AnnData` (in memory, with X as CSR, CSC or dense, or backed), a path
        to a ``.h5ad`` file or ``.zarr`` store, or a list of these (an atlas: cells
        concatenated in order, genes aligned by name). Files and backed data are read in row
        blocks; X is never loaded whole.
    path
        Target directory or fsspec URL. It must be empty unless ``overwrite=True`` (which only
        replaces an existing deltacells dataset).
    tile_size
        Cells per tile. ``None`` (default): :data:`.DEFAULT_TILE_SIZE`, or fewer for data with
        many counts above 65535 (each such count is an exception, and a tile may hold at most
        ``max(1024, nnz / 200)``): the writer then picks the largest size that fits and warns.
        An explicit size that cannot hold the data is refused naming the size that would.
    n_chunks
        Independently decodable chunks per tile: the unit a row selection decompresses. The
        default is 8, or one chunk per 64 cells for spatial order (a box's cells are a few
        short runs of rows, so small chunks are what it decodes and, with
        ``ranged_reads``, fetches). 8 (about 512 cells per chunk with 4,096-cell tiles) keeps
        files smallest and
        whole-tile decoding fastest; random cell access (``X[random_rows]``,
        ``Loader(shuffle="cells")``) decompresses every chunk a selected cell lives in, so for
        it write ``n_chunks=tile_size // 8`` or so, at a cost of a few percent in size and
        slower whole-tile decoding (the read benchmark compares both layouts).
    zstd_level
        zstd level; the default balances size and speed (see the codec benchmark), 19 is the
        smallest.
    gene_order
        ``"total_counts"`` (genes by decreasing total counts over all cells, ties in source
        order; smallest files), ``"none"``, or a permutation (stored column ``j`` is source
        column ``gene_order[j]``).
    obs, var
        Write the obs table / the var table and gene names.
    layer, use_raw
        Take counts from ``layers[layer]`` or from ``.raw`` instead of X.
    join
        For a list of inputs: ``"same"`` (identical gene sets, the default), ``"inner"``
        (genes in all inputs) or ``"outer"`` (genes in any input, zeros where absent).
    shuffle, seed
        Write cells in a seeded random order (recorded in ``cell_order.npy``), so contiguous
        reads are random samples for training.
    cell_order
        Write cells in this order instead: stored row ``i`` is source row ``cell_order[i]``
        (a permutation; recorded in ``cell_order.npy``).
    spatial_key, shapes, grid_tile_size, origin
        Spatial order (RFC 4, see ``docs/spatial.md``): cells stably sorted by the grid tile of
        their centroid, taken from ``obsm[spatial_key]`` (x, y) or from ``shapes``, a
        GeoDataFrame or GeoParquet path with one shape per cell indexed by obs name (points,
        points with a ``radius`` column for circles, polygons, multipolygons). The grid has
        square tiles of ``grid_tile_size`` from ``origin`` (default: the centroids' lower-left
        corner and tiles holding about 250 cells on average). Stores the grid, the margin,
        ``spatial/tile_offsets.npy``, the centroids and shapes in stored order, and the cell
        order; :meth:`Dataset.query_bbox` and ``read_deltacells(..., bbox=...)`` use them.
        A single input only; not with ``shuffle`` or ``cell_order``.
    gene_major
        Also build the gene-major companion (``genes/``: each block of up to 65,536 cells
        transposed, same codec; block size chosen from the data), so that one gene for every
        cell is a few small reads (:meth:`Dataset.genes`, ``adata[:, ["CD3E"]].X``). Adds
        about as many bytes as the tiles; it can be added later with
        ``deltacells add-gene-major``.
    obs_exclude
        obs columns to leave out (e.g. datetimes, which the format does not store).
    max_categories
        Categorical or string obs columns with more distinct values are stored as strings.
    obs_tiles_per_file
        Tiles (row groups) per obs parquet shard.
    n_threads
        Threads compressing chunks of a tile; ``None`` resolves like scikit-learn.
    n_workers, client
        Encode tiles on dask.distributed (``pip install 'deltacells[dask]'``): with a
        ``client``, on its cluster; else with ``n_workers > 1``, on a ``LocalCluster`` of that
        many worker processes started for this write. Each task opens the input files on its
        worker (in-memory AnnData are scattered once) and writes its tiles to ``path``, which
        all workers must reach (a shared directory or an object store). When every input is a
        file, the first pass (checks, gene totals, a summary of each input's obs) runs as
        tasks too; obs, the var table and the manifest are written by this process. 1 and no
        client: everything here.
    overwrite
        Replace an existing dataset at ``path``.
    progress
        Show tqdm progress bars.
    storage_options
        fsspec options for URL targets.
    metadata
        Extra JSON-serialisable entries for the manifest's ``metadata`` (not named as the
        writer's own entries, :data:`deltacells.manifest.METADATA_KEYS`).
    cache_bytes
        Input read from files is checked in a first pass and encoded in a second; up to this
        many bytes of checked blocks are kept between the passes so that small inputs are read
        once. Larger inputs are read twice and memory stays bounded by a few tiles.
    elements
        Also store the rest of a single input: layers and raw whose values are counts as
        deltacells matrices of their own (``layers/<name>/``, ``raw/``; sliced lazily like
        X), other layers and obsm, varm, obsp, varp and uns with anndata's element IO in the
        ``anndata.zarr`` group. Per-cell elements follow the stored cell order. Lists of
        inputs store X, obs and var only (with a warning if the inputs have more).

    Returns
    -------
    Manifest
        The manifest written last.

    Raises
    ------
    CountError
        For a value that is not a count, naming the file, cell and gene.
    ValueError
        For unsupported obs columns, mismatched genes and bad arguments.
    FileExistsError
        If ``path`` is not empty and ``overwrite`` is false.

    Notes
    -----
    The output is byte-identical for any ``n_threads`` and ``n_workers`` and for in-memory or
    on-disk input of the same data.

    For a list of files, memory does not grow with the atlas beyond a few bytes per cell:
    input files are open only while their counts are read, their obs is read one input at a
    time (once to plan the schema, once to write it) and a hash of each obs name is kept.
    Writing in another cell order (``shuffle``, ``cell_order``), where any tile may hold cells
    of any input, goes through a temporary Arrow file of the encoded obs, memory-mapped (in
    the directory ``TMPDIR`` names, about the size of the encoded obs), and keeps the cell
    order (8 bytes per cell).
    """
    chosen_tile_size = tile_size is not None
    tile_size = DEFAULT_TILE_SIZE if tile_size is None else tile_size
    if tile_size < 1 or (n_chunks is not None and n_chunks < 1) or obs_tiles_per_file < 1:
        raise ValueError("tile_size, n_chunks and obs_tiles_per_file must be >= 1")
    if n_chunks is not None and n_chunks > tile_size:
        raise ValueError(f"n_chunks={n_chunks} is more than the {tile_size:,} cells of a tile "
                         "(tile_size), and a chunk holds at least one cell; chunks of 64 to 512 "
                         f"cells suit random reads (e.g. n_chunks={max(1, tile_size // 256)})")
    reserved = sorted(set(metadata or {}) & set(METADATA_KEYS))
    if reserved:
        raise ValueError(f"metadata keys {reserved} are the writer's own; name yours otherwise "
                         "(e.g. metadata={'my_" + reserved[0] + "': ...})")  # fmt: skip
    _check_options(zstd_level=zstd_level, layer=layer, use_raw=use_raw, spatial_key=spatial_key,
                   shapes=shapes, grid_tile_size=grid_tile_size, origin=origin, obs=obs,
                   obs_exclude=obs_exclude)  # fmt: skip
    sources = list(source) if isinstance(source, list | tuple) else [source]
    if not sources:
        raise ValueError("no source given")
    _check_target_path(path)
    target = open_store(path, storage_options)
    # Before reading any input: refusing a target should not wait for a pass over the counts.
    _check_target(target, overwrite)
    progress_bar = _progress_factory(progress)
    parts: list[_Part] = []
    cluster = contextlib.ExitStack()  # a LocalCluster started for this write
    try:
        for item in sources:
            parts.append(_open_part(item, layer, use_raw))
        var_names, col_maps, var_table = _align_genes(parts, join)
        n_genes = len(var_names)
        if n_genes == 0:
            raise ValueError("no genes to write (the inputs share none)" if len(parts) > 1
                             else f"{parts[0].label}: the input has no genes")  # fmt: skip
        if any("\n" in str(name) for name in var_names):
            raise ValueError("a gene name contains a newline, which var_names.txt cannot hold")
        on_disk = any(not p.in_memory for p in parts)
        # Blocks kept from pass 1 serve pass 2 only when both read the source in order.
        reordered = shuffle or cell_order is not None or spatial_key is not None \
            or shapes is not None  # fmt: skip
        dask_client = client if client is not None else (
            cluster.enter_context(_local_client(n_workers)) if n_workers > 1 else None)
        files_on_cluster = dask_client is not None and all(
            isinstance(item, str | os.PathLike) for item in sources)
        obs_plan = None
        if obs:
            obs_inputs = ObsInputs([p.read_obs for p in parts], [p.label for p in parts],
                                   obs_exclude, len(sources) > 1)  # fmt: skip
            # Files on a cluster: each worker summarises the obs of the files it reads.
            summaries = _obs_summaries_distributed(
                dask_client, sources, layer, use_raw, obs_inputs, max_categories,
                progress_bar) if files_on_cluster else None  # fmt: skip
            obs_plan = plan_obs(obs_inputs, max_categories, summaries)
        cache: dict = {}
        if files_on_cluster:
            totals, fitting = _check_and_total_distributed(
                dask_client, sources, parts, layer, use_raw, col_maps, n_genes, tile_size,
                progress_bar)  # fmt: skip
        else:
            # Blocks kept for pass 2 help only when this process writes the tiles.
            budget = cache_bytes if on_disk and not reordered and dask_client is None else 0
            totals, fitting = _check_and_total(parts, col_maps, n_genes, tile_size,
                                               progress_bar, cache, budget)  # fmt: skip
        tile_size = _settle_tile_size(tile_size, fitting, chosen_tile_size)
        if n_chunks is None:
            spatially = spatial_key is not None or shapes is not None
            n_chunks = max(DEFAULT_N_CHUNKS, tile_size // SPATIAL_CELLS_PER_CHUNK) \
                if spatially else DEFAULT_N_CHUNKS  # fmt: skip
        order = _resolve_gene_order(gene_order, totals)
        n_cells = sum(p.n_obs for p in parts)
        spatial = None
        if spatial_key is not None or shapes is not None:
            if shuffle or cell_order is not None or len(parts) > 1:
                raise ValueError("spatial order (spatial_key / shapes) takes a single input, "
                                 "without shuffle or cell_order")  # fmt: skip
            from deltacells._spatial_write import plan_spatial_order

            spatial = plan_spatial_order(sources[0], parts[0].read_obs().index,
                                         spatial_key=spatial_key,
                                         shapes=shapes, grid_tile_size=grid_tile_size,
                                         origin=origin)  # fmt: skip
            cell_order = spatial.cell_order
        elif shuffle:
            if cell_order is not None:
                raise ValueError("pass shuffle or cell_order, not both")
            cell_order = np.random.default_rng(seed).permutation(n_cells)
        elif cell_order is not None:
            cell_order = _check_permutation(cell_order, n_cells)
        stored_maps = col_maps
        if order is not None:
            inverse = np.empty(n_genes, dtype=np.int64)
            inverse[order] = np.arange(n_genes)
            stored: dict[int, np.ndarray] = {}  # shared maps stay shared
            stored_maps = [stored.setdefault(id(m), np.where(m >= 0, inverse[np.maximum(m, 0)],
                                                             -1)) for m in col_maps]  # fmt: skip
        plan = _Plan(
            n_cells=n_cells,
            n_genes=n_genes,
            col_maps=stored_maps,
            var_names=var_names if order is None else var_names[order],
            var=var_table if order is None else var_table.iloc[order],
            gene_order=order,
            cell_order=cell_order,
            offsets=np.concatenate([[0], np.cumsum([p.n_obs for p in parts])]).astype(np.int64),
            obs_names_unique=obs_plan is None or obs_plan.names_unique,
            obs_pandas=None if obs_plan is None else obs_plan.record,
            spatial=spatial,
        )

        # A dataset already there is replaced only at the end: the new one is written beside
        # it and swapped in whole, so a failed or killed write leaves the old one readable.
        # Checked again here: the target may have changed during the first pass.
        replacing = _check_target(target, overwrite)
        if replacing:
            store = target.staging_sibling()
        else:
            store = target
            existed = not store.is_local or os.path.lexists(store.describe())
            store.make_root()
        try:
            settings = _Settings(
                tile_size=tile_size, n_chunks=n_chunks, zstd_level=zstd_level,
                n_threads=n_threads, n_workers=n_workers, obs=obs, var=var, shuffle=shuffle,
                seed=seed, use_raw=use_raw, layer=layer, join=join, metadata=metadata,
                obs_tiles_per_file=obs_tiles_per_file,
                source=sources[0] if elements and len(sources) == 1 else None,
                storage_options=storage_options, inputs=tuple(sources),
                client=dask_client,
            )  # fmt: skip
            if elements and len(sources) > 1:
                _warn_if_dropped(sources)
            manifest = _write_dataset(store, parts, plan, obs_plan, settings, progress_bar, cache)
            if gene_major:
                from deltacells.dataset import open_dataset
                from deltacells.genemajor import add_gene_major

                written = open_dataset(store)
                add_gene_major(written, n_threads=n_threads, progress=lambda blocks: progress_bar(
                    blocks, desc="gene-major blocks"))  # fmt: skip
                manifest = written.manifest
            if replacing:
                _check_target(target, overwrite)  # still only a dataset of ours
                target.replace_with(store)
        except BaseException:
            # Nothing left behind that the user did not ask for: a failed overwrite leaves the
            # old dataset, a failed new write no folder at all (an empty folder that was
            # there before stays).
            store.remove_tree()  # the staging folder, or a target empty (or absent) before
            if not replacing and existed and store.is_local:
                store.make_root()
            raise
        return manifest
    finally:
        for part in parts:
            part.close()
        cluster.close()


@dataclass(frozen=True)
class _Settings:
    """The write options pass 2 needs (see :func:`write_deltacells`)."""

    tile_size: int
    n_chunks: int
    zstd_level: int
    n_threads: int | None
    n_workers: int
    obs: bool
    var: bool
    shuffle: bool
    seed: int
    use_raw: bool
    layer: str | None
    join: str
    metadata: dict | None
    obs_tiles_per_file: int
    source: Any = None  # the single input whose other elements are stored too
    storage_options: dict | None = None
    inputs: tuple = ()  # every input, for dask workers that open them themselves
    client: Any = None  # a dask.distributed Client encoding tiles (None: this process)


def _write_dataset(
    store: Store, parts: list[_Part], plan: _Plan, obs_plan, settings: _Settings, progress_bar,
    cache: dict,
) -> Manifest:  # fmt: skip
    """Pass 2: tiles, gene and obs files, and the manifest last (the commit point)."""
    s = settings
    if s.client is not None:
        tile_cells, tile_nnz, tile_bytes, tile_crc32, headers, sum_rows = \
            _write_tiles_distributed(s.client, store, s, plan, progress_bar)  # fmt: skip
    else:
        tile_cells, tile_nnz, tile_bytes, tile_crc32, headers, sum_rows = _write_tiles(
            store, parts, plan, s.tile_size, s.n_chunks, s.zstd_level, s.n_threads,
            progress_bar, cache,
        )  # fmt: skip
    files: dict[str, dict] = {}

    def put(name: str, data: bytes) -> None:
        store.write_atomic(name, data)
        files[name] = file_record(data)

    chunk_sums, sums_data = chunk_sums_record(TILE_SUMS_NAME, sum_rows, headers)
    store.write_atomic(TILE_SUMS_NAME, sums_data)  # its rows are tied by chunk_sums
    if plan.gene_order is not None:
        put(GENE_ORDER_NAME, npy_bytes(plan.gene_order.astype(np.int32)))
    if s.var:
        names_text = "".join(f"{name}\n" for name in plan.var_names)
        put(VAR_NAMES_NAME, names_text.encode("utf-8"))
        put(VAR_TABLE_NAME, _var_parquet(plan.var))
    if plan.cell_order is not None:
        put(CELL_ORDER_NAME, npy_bytes(plan.cell_order.astype(np.int64)))
    if plan.spatial is not None:
        for name, data in plan.spatial.files().items():
            put(name, data)
    obs_fields: dict[str, Any] = {}
    if s.obs:
        obs_fields = write_obs(store, obs_plan, lambda t: _tile_rows(plan, t, s.tile_size),
                               plan.offsets, plan.cell_order, tile_cells,
                               s.obs_tiles_per_file)  # fmt: skip
        files[OBS_SCHEMA_NAME] = file_record(store.read_bytes(OBS_SCHEMA_NAME))
    extras = None
    if s.source is not None:
        from deltacells._extras import write_extras

        # Count layers and raw are stored in the same cell order as X.
        options = {"tile_size": s.tile_size, "n_chunks": s.n_chunks, "zstd_level": s.zstd_level,
                   "n_threads": s.n_threads, "cell_order": plan.cell_order,
                   "storage_options": s.storage_options}  # fmt: skip
        extras = write_extras(store, s.source, layer=s.layer, use_raw=s.use_raw,
                              gene_order=plan.gene_order, cell_order=plan.cell_order,
                              options=options, write_dataset=write_deltacells)  # fmt: skip
        # Nested datasets are tied by their manifests; anndata's element files one by one.
        stored = StoredParts(dict(extras["layers"]), extras["raw"], tuple(extras["elements"]))
        for location in stored.matrices:
            name = f"{location}/{MANIFEST_NAME}"
            files[name] = file_record(store.read_bytes(name))
        for name in store.list(ANNDATA_GROUP):
            files[name] = file_record(store.read_bytes(name))
    meta = {
        "writer": f"deltacells {_package_version()}",
        "anndata": extras,
        "obs_index_column": OBS_INDEX_COLUMN if s.obs else None,
        # What verify holds the index column to (AnnData allows repeated obs_names).
        "obs_names_unique": bool(plan.obs_names_unique) if s.obs else None,
        # Exact pandas dtypes and non-string names (deltacells.obs_dtypes).
        "obs_pandas": plan.obs_pandas if s.obs else None,
        "sources": [p.label for p in parts],
        "layer": "raw" if s.use_raw else s.layer,
        "join": s.join if len(parts) > 1 else None,
        "shuffle": {"seed": s.seed, "cell_order": CELL_ORDER_NAME} if s.shuffle else None,
        "cell_order": CELL_ORDER_NAME if plan.cell_order is not None else None,
        "spatial_index": plan.spatial.index.to_json() if plan.spatial is not None else None,
        # What readers decode into by default: the counts' dtype as written.
        "values_dtype": _written_dtype(parts),
    } | dict(s.metadata or {})
    manifest = Manifest(
        version=2,
        n_cells=plan.n_cells,
        n_genes=plan.n_genes,
        tile_size=s.tile_size,
        tile_cells=tile_cells,
        tile_nnz=tile_nnz,
        tile_bytes=tile_bytes,
        tile_crc32=tile_crc32,
        n_chunks=s.n_chunks,
        zstd_level=s.zstd_level,
        has_gene_order=plan.gene_order is not None,
        has_var_names=bool(s.var),
        has_var_table=bool(s.var),
        has_obs=bool(s.obs),
        metadata=meta,
        files=files,
        chunk_sums=chunk_sums,
        **obs_fields,
    )
    store.write_atomic(MANIFEST_NAME, manifest.to_json_text().encode("utf-8"))
    return manifest


def _written_dtype(parts: list[_Part]) -> str | None:
    """The dtype the inputs store their counts in (their common type), if numeric."""
    dtypes = [p.dtype for p in parts if p.dtype is not None]
    if not dtypes or len(dtypes) != len(parts):
        return None
    dtype = np.result_type(*dtypes)
    return dtype.name if dtype.kind in "iuf" else None


def _check_options(*, zstd_level, layer, use_raw, spatial_key, shapes, grid_tile_size, origin,
                   obs, obs_exclude) -> None:  # fmt: skip
    """Options that contradict each other or cannot work, refused before anything is read or
    written, naming the options (the command line says them as flags)."""
    lo, hi = _kernels.zstd_level_range()
    if isinstance(zstd_level, bool) or not isinstance(zstd_level, int | np.integer) \
            or not lo <= int(zstd_level) <= hi:  # fmt: skip
        raise ValueError(f"zstd_level={zstd_level!r} is outside zstd's {lo}..{hi} (the default "
                         f"is {DEFAULT_LEVEL})")  # fmt: skip
    if layer is not None and use_raw:
        raise ValueError(f"layer={layer!r} and use_raw=True both say where the counts are; "
                         "pass one of them")  # fmt: skip
    if spatial_key is not None and shapes is not None:
        raise ValueError("spatial_key= and shapes= both give the cells' positions; pass one "
                         "(shapes= when the cells have polygons or circles)")  # fmt: skip
    if spatial_key is None and shapes is None and (grid_tile_size is not None
                                                   or origin is not None):  # fmt: skip
        raise ValueError("grid_tile_size= and origin= shape the spatial order, which needs "
                         "spatial_key= or shapes=")  # fmt: skip
    if not obs and len(obs_exclude):
        raise ValueError("obs=False stores no obs, so obs_exclude= has nothing to leave out; "
                         "pass one of them")  # fmt: skip


#: File names that say "AnnData file", not "dataset folder".
_ANNDATA_SUFFIXES = (".h5ad", ".h5", ".loom", ".zarr")


def _check_target_path(path: Any) -> None:
    """A target that cannot be a dataset folder, refused before anything is read."""
    text = os.fspath(path) if not isinstance(path, Store) else path.describe()
    name = text.rstrip("/").rsplit("/", 1)[-1]
    if name.lower().endswith(_ANNDATA_SUFFIXES):
        raise ValueError(f"{text}: a deltacells dataset is a folder, and this name is an "
                         "AnnData file's; pick another (e.g. "
                         f"{name.rsplit('.', 1)[0]}.dc) or check the order of source and "
                         "target")  # fmt: skip
    if isinstance(path, Store) or _is_url_path(text):
        return
    if os.path.isfile(text):
        raise FileExistsError(f"{text}: a file is there; a dataset is a folder: pick another "
                              "path")  # fmt: skip
    parent = os.path.dirname(os.path.abspath(text))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise FileExistsError(f"{text}: {parent} is a file, not a folder: pick another path")


def _is_url_path(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


def _check_permutation(order: Any, n: int) -> np.ndarray:
    array = np.asarray(order)
    if array.ndim != 1 or array.dtype.kind not in "iu" or len(array) != n or not np.array_equal(
            np.sort(array), np.arange(n)):  # fmt: skip
        raise ValueError(f"cell_order must be a permutation of 0..{n - 1} (integers)")
    return array.astype(np.int64)


def _warn_if_dropped(sources: list) -> None:
    """Lists of inputs keep X, obs and var: say so, once, naming what any input (in memory or
    a file) has beyond them (a file's groups are only listed, not read)."""
    import warnings

    from deltacells._extras import has_raw
    from deltacells.elements import ELEMENTS, ElementsWarning

    names = (*ELEMENTS, "layers")
    found: set[str] = set()
    for item in sources:
        if isinstance(item, ad.AnnData):
            found.update(n for n in ELEMENTS if len(getattr(item, n)))
            found.update(["layers"] if layer_names(item) else [])
            found.update(["raw"] if item.raw is not None else [])
        else:
            group, closers = _open_group(Path(item))
            try:
                found.update(n for n in names if n in group and len(group[n]))
                found.update(["raw"] if has_raw(group) else [])
            finally:
                for close in closers:
                    close()
    extra = [n for n in (*names, "raw") if n in found]
    if extra:
        warnings.warn(
            f"writing a list of inputs keeps X, obs and var only; {', '.join(extra)} "
            "are left out (write each input on its own to keep them)",
            ElementsWarning,
            stacklevel=3,
        )


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltacells")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def _write_tiles(store, parts, plan, tile_size, n_chunks, level, n_threads, progress, cache):
    n_tiles = -(-plan.n_cells // tile_size)
    records = []
    bar = progress(range(n_tiles), total=n_tiles, desc="encoding tiles")
    ticks = iter(bar)
    # tqdm counts an item when the next one is asked for: start the bar now, so that the
    # tick after each written tile counts it and the last one closes the bar at n/n.
    next(ticks, None)
    opened: OrderedDict = OrderedDict()
    for t in range(n_tiles):
        records.append(_encode_tile_to(store, parts, plan, t, tile_size, n_chunks, level,
                                       n_threads, cache, opened))  # fmt: skip
        next(ticks, None)
    return _columns(records)


def _encode_tile_to(store: Store, parts, plan: _Plan, t: int, tile_size: int, n_chunks: int,
                    level: int, n_threads, cache: dict, opened: OrderedDict,
                    rows: np.ndarray | None = None) -> tuple[int, int, int, int]:  # fmt: skip
    """Encode tile ``t`` and write it; return what the manifest records of it (cells,
    nonzeros, bytes, the header's CRC). ``rows``: the tile's source rows of a reordered
    write, when ``plan`` does not carry the cell order."""
    in_order = rows is None and plan.cell_order is None
    rows = _tile_rows(plan, t, tile_size) if rows is None else rows
    matrix = _tile_matrix(parts, plan, rows, in_order, cache, opened)
    blob = encode_tile(matrix, n_chunks=n_chunks, level=level, n_threads=n_threads)
    store.write_atomic(tile_name(t), blob)
    nnz = int(np.frombuffer(blob, "<u8", 1, 24)[0])
    return (matrix.shape[0], nnz, len(blob), int.from_bytes(blob[56:60], "little"),
            bytes(blob[:HEADER_SIZE]), tile_checksum_row(blob))  # fmt: skip


def _columns(records: list) -> tuple[list, ...]:
    """The tiles' records as columns: cells, nonzeros, bytes, CRC-32, headers, checksum rows."""
    if not records:
        return [], [], [], [], [], []
    return tuple(list(c) for c in zip(*records, strict=True))


@contextlib.contextmanager
def _local_client(n_workers: int):
    """A dask.distributed ``LocalCluster`` of ``n_workers`` processes and its client, for one
    write. One thread each: distributed starts workers with ``OMP_NUM_THREADS=1``, so their
    kernels run on one thread too, and the workers are the parallelism."""
    try:
        from distributed import Client, LocalCluster
    except ImportError as err:  # pragma: no cover - exercised without the extra
        raise ImportError("n_workers > 1 needs dask.distributed: pip install "
                          "'deltacells[dask]'") from err  # fmt: skip
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:  # fmt: skip
        yield client


#: Tiles one dask task encodes: enough work to amortise opening the inputs, small enough to
#: balance the workers.
TILES_PER_TASK = 4


def _encode_task(inputs: tuple, layer, use_raw, plan: _Plan, tile_size: int, n_chunks: int,
                 level: int, n_threads, store: Store, tiles: list[int],
                 tile_rows: list[np.ndarray] | None = None) -> list:  # fmt: skip
    """One dask task: open the inputs its tiles' rows are in, here (files are read by the
    worker, not shipped; their counts only, not obs and var), then encode and write
    ``tiles`` (whose source rows are ``tile_rows`` in a reordered write). The other inputs
    stay unopened: a task's cost does not grow with the atlas."""
    reordered = tile_rows is not None
    if tile_rows is None:
        tile_rows = [_tile_rows(plan, t, tile_size) for t in tiles]
    rows = np.concatenate(tile_rows)
    needed = set(np.unique(np.searchsorted(plan.offsets, rows, side="right") - 1).tolist())
    parts = [_open_part(item, layer, use_raw, tables=False) if p in needed else None
             for p, item in enumerate(inputs)]  # fmt: skip
    try:
        opened: OrderedDict = OrderedDict()
        return [(t, _encode_tile_to(store, parts, plan, t, tile_size, n_chunks, level,
                                    n_threads, {}, opened, own if reordered else None))
                for t, own in zip(tiles, tile_rows, strict=True)]  # fmt: skip
    finally:
        for part in parts:
            if part is not None:
                part.close()


def _write_tiles_distributed(client, store: Store, s: _Settings, plan: _Plan, progress):
    """Pass 2 on dask.distributed: a task per few tiles opens the inputs on its worker and
    writes its tiles to the target; the tiles are those of the single-process writer."""
    from distributed import as_completed

    n_tiles = -(-plan.n_cells // s.tile_size)
    # Files travel as paths; in-memory AnnData once per worker that needs it.
    inputs = tuple(client.scatter(item, broadcast=False) if isinstance(item, ad.AnnData)
                   else item for item in s.inputs)  # fmt: skip
    # What every worker needs, without the per-cell arrays (a shuffled 100M-cell atlas's cell
    # order is 800 MB): each task gets its own tiles' rows instead.
    shared = dataclasses.replace(plan, cell_order=None, var=plan.var.iloc[:0], spatial=None)
    plan_future = client.scatter(shared, broadcast=False)
    groups = [list(range(t, min(t + TILES_PER_TASK, n_tiles)))
              for t in range(0, n_tiles, TILES_PER_TASK)]  # fmt: skip
    futures = [client.submit(_encode_task, inputs, s.layer, s.use_raw, plan_future, s.tile_size,
                             s.n_chunks, s.zstd_level, s.n_threads, store, group,
                             None if plan.cell_order is None
                             else [_tile_rows(plan, t, s.tile_size) for t in group],
                             pure=False) for group in groups]  # fmt: skip
    records: dict[int, tuple] = {}
    bar = progress(range(n_tiles), total=n_tiles, desc="encoding tiles (dask)")
    ticks = iter(bar)
    next(ticks, None)
    for future in as_completed(futures):
        for t, record in future.result():
            records[t] = record
            next(ticks, None)
    return _columns([records[t] for t in range(n_tiles)])


def _var_parquet(var: pd.DataFrame) -> bytes:
    try:
        table = pa.Table.from_pandas(var, preserve_index=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(f"var cannot be stored as parquet: {err}") from None
    buffer = pa.BufferOutputStream()  # not a Python file object (see deltacells.dataset)
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue().to_pybytes()
