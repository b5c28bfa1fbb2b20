"""Inputs of a write: AnnData in memory, backed, or .h5ad / .zarr files, each read in
row blocks whatever its matrix format (CSR, dense, CSC spilled to disk).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from deltacells.codec.format import FormatError
from deltacells.store.elements import layer_names

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
        raise ValueError(f"{label}: the AnnData has no X"
                         + _no_x_hint(layer_names(adata), adata.raw is not None))  # fmt: skip
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


def _no_x_hint(layers: list[str], raw: bool) -> str:
    """What to store instead of a missing X: one of the layers, raw, or counts set as X."""
    if layers:
        return (f": pass layer={layers[0]!r} (deltacells convert --layer {layers[0]}) to "
                f"store one of its layers {layers}")  # fmt: skip
    if raw:
        return ": pass use_raw=True (deltacells convert --raw) to store raw.X"
    return ": set X to the counts to store"


def _layer_hint(count_layers: list[str], raw_counts: bool) -> str:
    """What to pass when X is not counts: the layers (and raw) that look like counts."""
    if count_layers:
        name = count_layers[0]
        return (f"; X does not hold counts, but layers {count_layers} do: pass "
                f"layer={name!r} (deltacells convert --layer {name}); X is kept too")
    if raw_counts:
        return "; X does not hold counts, raw.X does: pass use_raw=True (deltacells convert --raw)"
    # Nothing to point to: say what the format holds and how scanpy users keep it.
    return ("; deltacells stores raw counts (whole numbers >= 0), and neither a layer nor "
            "raw.X holds them: write the counts from before normalizing (keep them with "
            "adata.layers['counts'] = adata.X.copy() and pass layer='counts')")


def _file_layer_hint(path: Path) -> str:
    """:func:`_layer_hint` for a file: the first rows of each layer and of raw.X looked at."""
    from deltacells.write.extras import group_layer_names, has_raw

    group, closers = _open_group(path)
    try:
        def first_rows(elem: Any) -> Any:
            matrix = _matrix_of(elem)
            return sp.csr_matrix(matrix[: min(64, matrix.shape[0])])

        layers = [name for name in group_layer_names(group)
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
    from deltacells.write.extras import group_layer_names, has_raw

    if use_raw:
        if not has_raw(group):
            raise ValueError(f"{path}: use_raw=True but the file has no raw")
        return group["raw"]["X"], group["raw"]["var"]
    if layer is not None:
        layers = group_layer_names(group)
        if layer not in layers:
            raise KeyError(f"{path}: layer {layer!r} not found (layers: {layers})")
        return group["layers"][layer], group["var"]
    if "X" not in group:
        raise ValueError(f"{path}: the file has no X"
                         + _no_x_hint(group_layer_names(group), has_raw(group)))  # fmt: skip
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
