"""The lazy X registered with anndata's writers and ``to_memory``, fast_array_utils' and
scanpy's dispatched statistics (tile by tile) and scanpy's dask implementations."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import anndata as ad
import numpy as np
import scipy.sparse as sp
import wrapt
from numpy.typing import DTypeLike

from deltacells.read.lazy_matrix import (
    _LAZY_ADVICE,
    DeltacellsCSRDataset,
    _count_nonzero_of,
    _into,
    _swap_lazy,
)
from deltacells.read.outofcore import (
    OutOfCoreAnnData,
    join_dispatchers,
)

__all__ = ["TileMapped", "write_lazy_csr"]


def write_lazy_csr(f: Any, key: str, elem: DeltacellsCSRDataset, *, _writer: Any = None,
                   dataset_kwargs: Any = None) -> None:  # fmt: skip
    """Write a lazy X as anndata's ``csr_matrix`` encoding into an h5py or zarr group, tile by
    tile: memory holds one decoded tile, whatever the matrix size."""
    import h5py

    kwargs = dict(dataset_kwargs or {})
    group = f.require_group(key)
    group.attrs["shape"] = elem.shape
    nnz = elem.nnz
    columns = {"data": (nnz, elem.dtype), "indices": (nnz, np.dtype(np.int32)),
               "indptr": (elem.shape[0] + 1, np.dtype(np.int64))}  # fmt: skip
    if isinstance(group, h5py.Group):
        arrays = {name: group.create_dataset(name, shape=(n,), dtype=dtype, **kwargs)
                  for name, (n, dtype) in columns.items()}  # fmt: skip
    else:
        arrays = {name: group.create_array(name, shape=(n,), dtype=dtype, **kwargs)
                  for name, (n, dtype) in columns.items()}  # fmt: skip
    offset, row = 0, 0
    arrays["indptr"][0:1] = np.zeros(1, dtype=np.int64)
    for t in range(elem.n_blocks):
        matrix = elem.block_matrix(t)
        end = offset + matrix.nnz
        if matrix.nnz:
            arrays["data"][offset:end] = matrix.data
            arrays["indices"][offset:end] = matrix.indices
        rows = matrix.shape[0]
        arrays["indptr"][row + 1 : row + rows + 1] = matrix.indptr[1:] + offset
        offset, row = end, row + rows


def _register_with_anndata() -> None:
    """Let anndata materialize and write our X.

    anndata dispatches ``to_memory`` on its own backed classes only (not on
    ``anndata.abc.CSRDataset``), so an AnnData holding our X would keep it lazy, and its IO
    registry has no writer for it. Both are internal to anndata: if they move,
    ``AnnData.to_memory()`` keeps X lazy and ``write_h5ad`` refuses it, while
    ``adata.X.to_memory()`` still works.
    """
    try:
        from anndata._core.file_backing import to_memory
    except ImportError:  # pragma: no cover - anndata internals changed
        pass
    else:
        to_memory.register(DeltacellsCSRDataset)(lambda x, *, copy=False: x.to_memory())
    try:
        import h5py
        import zarr
        from anndata._io.specs.registry import _REGISTRY, IOSpec
    except ImportError:  # pragma: no cover - anndata internals changed
        return
    for group_type in (h5py.Group, zarr.Group):
        _REGISTRY.register_write(group_type, DeltacellsCSRDataset,
                                 IOSpec("csr_matrix", "0.1.0"))(write_lazy_csr)  # fmt: skip
    # The registry looks writers up by exact type: the AnnData we return writes as AnnData.
    for (dest, source, modifiers), writer in list(_REGISTRY.write.items()):
        if source is ad.AnnData:
            _REGISTRY.write[(dest, OutOfCoreAnnData, modifiers)] = writer
    if ad.AnnData in _REGISTRY.write_specs:
        _REGISTRY.write_specs[OutOfCoreAnnData] = _REGISTRY.write_specs[ad.AnnData]


_register_with_anndata()
OutOfCoreAnnData.lazy_matrix_type = DeltacellsCSRDataset


def _axis_sum_lazy(x: Any, /, *, axis: Any = None, dtype: DTypeLike = None) -> Any:
    # 1-D like scanpy's dask version (its callers square the result: no np.matrix here).
    total = x.sum(axis=axis, dtype=dtype)
    return total if axis is None else np.asarray(total).ravel()


def _register_with_fast_array_utils() -> None:
    """scanpy 1.12 computes its statistics with fast_array_utils, which dispatches on the
    array type and raises a bare ``NotImplementedError`` for types it does not know: sums of
    our X are computed tile by tile; anything else says what to do instead. Internal to
    fast_array_utils: if it moves, scanpy's error stays its own."""
    try:
        from fast_array_utils.stats._generic_ops import generic_op
    except ImportError:  # not installed (scanpy < 1.12), or its internals moved
        return

    @generic_op.register(DeltacellsCSRDataset)
    def _generic_op_lazy(x: DeltacellsCSRDataset, /, op: str, *, axis: Any = None,
                         dtype: Any = None, keep_cupy_as_array: bool = False) -> Any:  # fmt: skip
        if op == "sum":
            return _axis_sum_lazy(x, axis=axis, dtype=dtype)
        raise TypeError(_LAZY_ADVICE.format(what=f"the {op} of X"))


_register_with_fast_array_utils()


class TileMapped:
    """A function of each decoded tile of a lazy X (``X * X`` for a variance), reduced tile
    by tile by the statistics scanpy dispatches (``axis_sum``, ``axis_nnz``) and otherwise
    handed to scanpy as its dask array. Not an AnnData matrix: made only by
    :func:`_register_with_scanpy`'s ``elem_mul``."""

    ndim = 2

    def __init__(self, base: DeltacellsCSRDataset, function: Callable, dtype: Any) -> None:
        self.base, self.function, self.dtype = base, function, np.dtype(dtype)
        self.shape = base.shape

    def _tile_reduce(self, per_tile: Callable[[sp.csr_matrix], Any]) -> list:
        return self.base._tile_reduce(lambda m: per_tile(self.function(m)))

    def sum(self, axis: int | None = None, dtype: DTypeLike = None, out: Any = None) -> Any:
        """Like :meth:`DeltacellsCSRDataset.sum`, of the mapped tiles."""
        return _into(DeltacellsCSRDataset._sum(self, axis, dtype), out)  # type: ignore[arg-type]

    def to_dask(self) -> Any:
        """The mapped tiles as a dask array (one chunk per tile)."""
        return self.base.to_dask().map_blocks(self.function, dtype=self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(_LAZY_ADVICE.format(what="converting X to a numpy array"))


def _register_with_scanpy() -> None:
    """Where scanpy has a dask implementation of a dispatched function, our X uses it on
    its dask array over tiles (see :mod:`deltacells.read.outofcore`). Done once scanpy is
    imported (importing it for this would cost seconds): from :func:`read_deltacells`, and
    when scanpy's import completes after that (``_on_scanpy_import``). Never raises: it runs
    inside the user's ``import scanpy`` and every read, which must not fail for it."""
    global _join_failed
    try:
        _register_tile_statistics()
        _import_lazy_statistics()
        join_dispatchers(DeltacellsCSRDataset, DeltacellsCSRDataset.to_dask)
        join_dispatchers(TileMapped, TileMapped.to_dask)
    except Exception as err:  # scanpy's or fast_array_utils' internals changed
        if not _join_failed:
            _join_failed = True
            warnings.warn(f"deltacells could not hand its lazy X to scanpy ({err!r}): where "
                          "scanpy fails on it, use adata.to_memory() or "
                          "read_deltacells(..., dask=True)", RuntimeWarning, stacklevel=2)


_join_failed = False  # warned once per process


def _on_scanpy_import(_module: Any) -> None:
    _register_with_scanpy()


def _import_lazy_statistics() -> None:
    """Import fast_array_utils' statistics modules, so that they can be joined now: its
    functions import them on first use (``power``, ``is_constant``), and a dispatcher
    imported after the join would raise a bare ``NotImplementedError`` on our X (as scanpy's
    ``experimental.pp.highly_variable_genes`` did)."""
    global _statistics_imported
    stats = sys.modules.get("fast_array_utils.stats")
    if stats is None or _statistics_imported:
        return
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(getattr(stats, "__path__", [])):
        try:
            importlib.import_module(f"{stats.__name__}.{module.name}")
        except ImportError:  # pragma: no cover - an optional part of fast_array_utils
            continue
    _statistics_imported = True  # once per process, not a folder listing on every read


_statistics_imported = False


def _register_tile_statistics() -> None:
    """scanpy's own statistics on the lazy X, reduced tile by tile: its dask versions of
    per-gene counts and sums concatenate every chunk first (a whole matrix in memory).
    scanpy 1.11 dispatches these in ``scanpy._utils``; later versions reach them through
    fast_array_utils (registered at import) or the same functions."""
    utils = sys.modules.get("scanpy._utils")
    if utils is None:
        return
    lazy_types = (DeltacellsCSRDataset, TileMapped)
    axis_nnz = getattr(utils, "axis_nnz", None)
    if axis_nnz is not None and hasattr(axis_nnz, "register"):
        for kind in lazy_types:
            if kind not in axis_nnz.registry:
                axis_nnz.register(kind)(lambda x, /, axis: _count_nonzero_of(x, axis))
    axis_sum = getattr(utils, "axis_sum", None)
    if axis_sum is not None and hasattr(axis_sum, "register"):
        for kind in lazy_types:
            if kind not in axis_sum.registry:
                axis_sum.register(kind)(_axis_sum_lazy)
    elem_mul = getattr(utils, "elem_mul", None)
    if elem_mul is not None and hasattr(elem_mul, "register") \
            and DeltacellsCSRDataset not in elem_mul.registry:  # fmt: skip

        @elem_mul.register(DeltacellsCSRDataset)
        def _elem_mul_lazy(x: DeltacellsCSRDataset, y: Any) -> Any:
            if y is x:  # the square of X, for a variance: stays tile by tile
                return TileMapped(x, lambda m: m.multiply(m).tocsr(), x.dtype)
            return elem_mul(x.to_dask(), _swap_lazy(y))


# scanpy imported after a read (a notebook that imports it later) joins the lazy X as soon
# as its import completes (at once if it is imported already: hence the end of the module).
wrapt.register_post_import_hook(_on_scanpy_import, "scanpy")
