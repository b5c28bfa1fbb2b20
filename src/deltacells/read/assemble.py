"""``read_deltacells``: a dataset as an AnnData whose X decodes only the tiles a slice touches,
with obs, var and every stored part restored."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pyarrow as pa
from numpy.typing import DTypeLike

from deltacells.codec._rows import decimal_name_objects, decimal_names
from deltacells.codec.arguments import check_flags, check_ints
from deltacells.codec.format import FormatError, LimitError, get_limits
from deltacells.codec.threads import check_n_threads
from deltacells.read.dataset import (
    Dataset,
    open_dataset,
)
from deltacells.read.integrations import _register_with_scanpy
from deltacells.read.lazy_matrix import DeltacellsCSRDataset, written_values_dtype
from deltacells.read.obscache import ObsCache
from deltacells.read.outofcore import (
    OutOfCoreAnnData,
    PreparedObs,
    dask_array_type,
)
from deltacells.spatial.grid import SELECT_MODES
from deltacells.store.manifest import MANIFEST_NAME, StoredParts
from deltacells.store.obs_dtypes import index_string_dtype, restore_dtypes

__all__ = ["read_deltacells", "read_obs_names", "written_values_dtype"]


def read_deltacells(
    url_or_path: str | os.PathLike,
    *,
    obs: bool | Sequence[str] = True,
    column_order: str = "source",
    values_dtype: DTypeLike | None = None,
    storage_options: dict | None = None,
    cache_dir: str | os.PathLike | None = None,
    n_threads: int | None = None,
    tile_cache_bytes: int = 256 * 2**20,
    dask: bool = False,
    timeout: float | None = None,
    deadline: float | None = None,
    elements: bool | str = True,
    bbox: tuple[float, float, float, float] | None = None,
    bbox_mode: str = "intersects",
    row_order: str = "stored",
    ranged_reads: bool = False,
    obs_names: str = "names",
) -> ad.AnnData:
    """Open a deltacells dataset as an AnnData with a lazily decoded X.

    Parameters
    ----------
    url_or_path
        Local directory or fsspec URL of the dataset (format version 1 or 2).
    obs
        ``True`` for all obs columns, a list of column names (or one name), or ``False`` for
        obs_names only.
    column_order
        ``"source"`` (default): genes in the order they were written, with ``var`` in that
        order; ``"stored"``: the on-disk order (faster, no column permutation).
    values_dtype
        dtype of decoded values: ``float32``, ``float64`` or ``int32``. Default: the counts'
        dtype as written (int32 counts come back as int32, float32 as float32; see
        :func:`~deltacells.read.lazy_matrix.written_values_dtype`), float32 for datasets that do not
        record it.
    storage_options
        fsspec options for URLs.
    cache_dir
        Where obs columns are cached (see :func:`~deltacells.read.obscache.cache_root`).
    n_threads
        Decoding threads; ``None`` resolves like scikit-learn. From two, millions of obs
        names made as Python strings (pandas 2) also get their memory's pages faulted in
        ahead by a helper thread.
    tile_cache_bytes
        Most bytes of parsed tiles kept in memory.
    dask
        Make X a dask array with one scipy-CSR chunk per tile (see
        :meth:`~deltacells.DeltacellsCSRDataset.to_dask`) instead of the lazy CSR dataset.
    timeout, deadline
        Remote stores: seconds one request may take before it is retried, and seconds one
        read may take in all, retries included (see :func:`~deltacells.open_dataset`).
    elements
        The rest of the AnnData, if the dataset stored it: count layers and raw as lazy
        matrices like X (always); obsm, varm, obsp, varp, uns and other layers read into
        memory (``True``), as dask arrays that read their chunks when computed (``"lazy"``;
        uns is read whole), or not at all (``False``).
    bbox, bbox_mode
        For a dataset written in spatial order: only the cells in the box (xmin, ymin, xmax,
        ymax), selected as :meth:`Dataset.query_bbox` does (``"intersects"``: the cell's
        shape touches the box, borders included; ``"centroid"``: its centroid is in the
        box). The result holds those cells only, in stored (spatial) order: their obs, the
        elements' rows, and X and count layers as lazy matrices of those rows
        (:meth:`~deltacells.DeltacellsCSRDataset.take_rows`) that decode only the tiles the
        cells are in.
    row_order
        ``"stored"`` (default): cells in the order they are stored (shuffled or spatial
        datasets store them in another order than written); ``"source"``: in the order they
        were written, undoing ``cell_order.npy`` (X stays lazy, a lazy matrix of the rows
        in that order, decoding only what a slice touches). The same for datasets stored in
        source order.
    ranged_reads
        Row selections fetch only the chunks holding the rows (the header, chunk table,
        indptr slice and frames of each tile touched) instead of whole tiles: fewer bytes for
        small or clustered selections, such as a box. Every structural and frame check still
        runs; the tile's CRC, which covers the whole tile, cannot (``verify`` checks it).
    obs_names
        ``"names"`` (default): the stored obs names, or ``"0" .. "n-1"`` (each cell's stored
        position) for a dataset without them. ``"positions"``: obs_names is a
        :class:`pandas.RangeIndex` of the stored positions (an integer index of them for a
        box or ``row_order="source"``), built without a string per cell, so that an atlas of
        100M cells opens in constant memory; stored names are not read. Slicing, views, scanpy
        and the loader work as usual; a copy (``to_memory()``, ``copy()``, in-place filters)
        names its cells by their positions as strings, as anndata does for any integer index
        (with its ``ImplicitModificationWarning``, except in in-place filters). Looking cells
        up by name and ``anndata.concat(..., index_unique=...)`` need string names: use them
        on a copy.

    Returns
    -------
    anndata.AnnData
        X is a :class:`DeltacellsCSRDataset` (or a dask array); obs and var are in memory.
    """
    _register_with_scanpy()
    check_n_threads(n_threads)  # a bad count is named before anything is read
    obs = [obs] if isinstance(obs, str) else obs  # one column, named alone
    _check_arguments(obs=obs, tile_cache_bytes=tile_cache_bytes, dask=dask,
                     ranged_reads=ranged_reads, bbox_mode=bbox_mode, cache_dir=cache_dir)
    dataset = open_dataset(url_or_path, storage_options=storage_options, timeout=timeout,
                           deadline=deadline)  # fmt: skip
    options = {
        "column_order": column_order,
        "values_dtype": values_dtype,
        "n_threads": n_threads,
        "tile_cache_bytes": tile_cache_bytes,
        "dask": dask,
        "ranged_reads": ranged_reads,
    }
    if row_order not in ("stored", "source"):
        raise ValueError(f"row_order must be 'stored' or 'source', not {row_order!r}")
    if obs_names not in ("names", "positions"):
        raise ValueError(f"obs_names must be 'names' or 'positions', not {obs_names!r}")
    if not (isinstance(elements, bool) or elements == "lazy"):
        raise ValueError(f"elements must be True, False or 'lazy', not {elements!r}")
    if (dask or elements == "lazy") and dask_array_type() is None:
        flag = "dask=True" if dask else "elements='lazy'"
        raise ImportError(f"{flag} needs dask: pip install 'deltacells[dask]'")
    X = _lazy_matrix(dataset, options)
    var = _var(dataset, column_order)
    rows = None if bbox is None else dataset.query_bbox(bbox, mode=bbox_mode).rows
    cell_order = dataset.cell_order() if row_order == "source" else None
    if cell_order is not None:
        # Source row s is stored row inverse[s]: keep the selected rows, in source order.
        selected = np.arange(dataset.manifest.n_cells) if rows is None else rows
        rows = selected[np.argsort(cell_order[selected], kind="stable")]
    parts = _stored_parts(dataset, X, elements, options)
    # Written with layer=: the tiles hold that layer, and the AnnData's own X is an element.
    X = parts.pop("X", X)
    obs_frame, names_unique = _obs(dataset, obs, cache_dir, rows, obs_names == "positions",
                                   n_threads)
    if rows is not None:
        # Only the selected cells are built: lazy matrices show those rows, elements are cut.
        X, parts = _take_rows(X, rows), _parts_of_rows(parts, rows)
    if obs_names == "positions" and "obsm" in parts:
        # anndata matches the index of a DataFrame in obsm against obs_names.
        parts["obsm"] = {k: v.set_axis(obs_frame.index) if isinstance(v, pd.DataFrame) else v
                         for k, v in parts["obsm"].items()}  # fmt: skip
    return OutOfCoreAnnData(X=X, obs=PreparedObs(obs_frame), var=var,
                            obs_names_unique=names_unique, **parts)  # fmt: skip


def _check_arguments(*, obs, tile_cache_bytes, dask, ranged_reads, bbox_mode, cache_dir) -> None:
    """Refuse a mistaken argument of :func:`read_deltacells` by name, before anything is read
    (a truthy string such as ``ranged_reads="no"`` would otherwise mean True)."""
    listed = isinstance(obs, Sequence | pd.Index | np.ndarray) and not isinstance(obs, bytes)
    if not isinstance(obs, bool) and not listed:
        raise TypeError(f"obs must be True, False or a list of obs column names, not "
                        f"{type(obs).__name__}")  # fmt: skip
    check_flags({"dask": dask, "ranged_reads": ranged_reads})
    check_ints({"tile_cache_bytes": tile_cache_bytes}, at_least={"tile_cache_bytes": 0})
    if bbox_mode not in SELECT_MODES:
        raise ValueError(f"bbox_mode must be one of {SELECT_MODES}, not {bbox_mode!r}")
    if cache_dir is not None and not isinstance(cache_dir, str | os.PathLike):
        raise TypeError(f"cache_dir must be a path or None, not {type(cache_dir).__name__}")


def read_obs_names(
    url_or_path: str | os.PathLike | Dataset,
    positions: Sequence[int] | np.ndarray,
    *,
    cache_dir: str | os.PathLike | None = None,
    storage_options: dict | None = None,
) -> pd.Index:
    """The obs names of the cells at stored ``positions``, as :func:`read_deltacells` names
    them, made for those cells only.

    With ``read_deltacells(url, obs_names="positions")`` the obs names are the cells' stored
    positions; this gives the names of a selection back::

        adata = deltacells.read_deltacells(url, obs_names="positions")
        rows = adata.obs_names[mask]             # the selected cells' positions
        sub = adata[mask].to_memory()
        sub.obs_names = deltacells.read_obs_names(url, rows)

    Parameters
    ----------
    url_or_path
        The dataset (URL, path or an opened :class:`~deltacells.Dataset`).
    positions
        Stored positions (integers in ``0 .. n_cells - 1``), e.g. the obs names of an
        AnnData read with ``obs_names="positions"`` or of a view of it.
    cache_dir, storage_options
        As for :func:`read_deltacells`. Stored names come from the local obs cache, which
        holds the names column memory-mapped (fetched and checked on first use, like any obs
        column), so only the selected names are read from it.

    Returns
    -------
    pandas.Index
        The stored names, or ``"0" .. "n-1"`` for a dataset without them.
    """
    dataset = (url_or_path if isinstance(url_or_path, Dataset)
               else open_dataset(url_or_path, storage_options=storage_options))  # fmt: skip
    rows = np.asarray(positions)
    if rows.dtype.kind not in "iu" and rows.size:
        raise TypeError(
            f"positions must be integers (stored positions, as obs_names='positions' gives), "
            f"not {rows.dtype}; names a copy made of them: np.asarray(names, dtype=int)"
        )
    rows = rows.astype(np.int64, copy=False).ravel()
    n_cells = dataset.shape[0]
    if rows.size and (rows.min() < 0 or rows.max() >= n_cells):
        raise IndexError(f"positions must lie in 0 .. {n_cells - 1} (the dataset's cells)")
    schema = dataset.obs_schema()
    index_column = None if schema is None else dataset.obs_index_column(schema)
    if index_column is None:
        return _default_obs_names(dataset, rows)
    return ObsCache(dataset.obs_part, cache_dir).names(index_column, rows)


def _take_rows(value: Any, rows: np.ndarray) -> Any:
    """Rows ``rows`` of a lazy matrix (still lazy), a dask array (still lazy), a DataFrame or
    an in-memory array."""
    if isinstance(value, DeltacellsCSRDataset):
        return value.take_rows(rows)
    if isinstance(value, pd.DataFrame):
        return value.iloc[rows]
    return value[rows]


def _parts_of_rows(parts: dict, rows: np.ndarray) -> dict:
    """:func:`_stored_parts` for the cells ``rows`` only (obsp on both axes)."""
    out = dict(parts)
    if "layers" in parts:
        out["layers"] = {k: _take_rows(v, rows) for k, v in parts["layers"].items()}
    if "raw" in parts:
        out["raw"] = {**parts["raw"], "X": _take_rows(parts["raw"]["X"], rows)}
    if "obsm" in parts:
        out["obsm"] = {k: _take_rows(v, rows) for k, v in parts["obsm"].items()}
    if "obsp" in parts:
        out["obsp"] = {k: _take_rows(_take_rows(v, rows).T, rows).T
                       for k, v in parts["obsp"].items()}  # fmt: skip
    return out


def _lazy_matrix(dataset: Dataset, options: dict) -> Any:
    matrix = DeltacellsCSRDataset(
        dataset, column_order=options["column_order"], values_dtype=options["values_dtype"],
        n_threads=options["n_threads"], tile_cache_bytes=options["tile_cache_bytes"],
        ranged_reads=options.get("ranged_reads", False),
    )  # fmt: skip
    return matrix.to_dask() if options["dask"] else matrix


def _stored_parts(dataset: Dataset, X: Any, elements: bool | str, options: dict) -> dict:
    """layers, raw, obsm, varm, obsp, varp and uns as AnnData takes them (see
    :mod:`deltacells.store.elements`); ``X`` is the AnnData's X, which a layer may be."""
    from deltacells.store.elements import read_elements

    where = dataset.store.describe(MANIFEST_NAME)
    parts = StoredParts.from_manifest(dataset.manifest, where)
    store = dataset.store
    out: dict[str, Any] = {}
    layers: dict[str, Any] = {}
    for name, location in parts.layers.items():
        if location == ".":
            layers[name] = X
            continue
        sub = dataset.open_nested(location)
        if sub.shape != dataset.shape:
            raise FormatError(f"{where}: layer {name!r} has shape {sub.shape}")
        layers[name] = _lazy_matrix(sub, options)
    if parts.raw == "raw":
        sub = dataset.open_nested(parts.raw)
        if sub.shape[0] != dataset.shape[0]:
            raise FormatError(f"{where}: raw has {sub.shape[0]} cells, X {dataset.shape[0]}")
        out["raw"] = {"X": _lazy_matrix(sub, options), "var": _var(sub, options["column_order"])}
    if elements and parts.elements:
        stored = read_elements(store, list(parts.elements), lazy=elements == "lazy",
                               files=dataset.files)  # fmt: skip
        layers |= stored.pop("layers", {})
        order = dataset.gene_order()
        if options["column_order"] == "stored" and order is not None:
            # varm and varp are stored in source gene order, like var.
            for key in ("varm", "varp"):
                stored[key] = {k: _take_genes(v, order, key == "varp")
                               for k, v in stored.get(key, {}).items()}  # fmt: skip
        out |= stored
    if layers:
        out["layers"] = layers
    return out


def _take_genes(value: Any, order: np.ndarray, both_axes: bool) -> Any:
    if isinstance(value, pd.DataFrame):
        return value.iloc[order]
    value = value[order]
    return value[:, order] if both_axes else value


def _var(dataset: Dataset, column_order: str) -> pd.DataFrame:
    var = dataset.var()
    if var is None:
        names = dataset.var_names()
        var = pd.DataFrame(index=pd.Index(names if names is not None else
                                          _default_var_names(dataset)))  # fmt: skip
    var.index = var.index.astype(str)
    order = dataset.gene_order()
    if column_order == "source" and order is not None:
        var = var.iloc[np.argsort(order)]
    return var


#: What a default gene name costs in memory, about (a short Python string and its pointer).
_NAME_BYTES = 64


def _default_var_names(dataset: Dataset) -> list[str]:
    """``"0" .. "n-1"`` for a dataset without stored gene names, once the tiles show that the
    manifest's gene count is in proportion to the bytes stored: a small manifest claiming 2^31
    genes must not make this build two billion names."""
    m = dataset.manifest
    if m.n_tiles:
        dataset.check_tile_sizes(sorted({0, m.n_tiles - 1}))
    budget = get_limits().decoded_budget(sum(m.tile_bytes))
    if _NAME_BYTES * m.n_genes > budget:
        raise LimitError(
            f"{dataset.store.describe(MANIFEST_NAME)}: {m.n_genes} genes without stored names "
            f"would take about {_NAME_BYTES * m.n_genes} bytes of default names, more than the "
            f"limit of {int(budget)} for {sum(m.tile_bytes)} stored bytes (a damaged n_genes?; "
            "deltacells.set_limits(decoded_ratio=...) raises it)"
        )
    return [str(i) for i in range(m.n_genes)]


def _obs(dataset: Dataset, obs: bool | Sequence[str], cache_dir,
         rows: np.ndarray | None = None, positions: bool = False,
         n_threads: int | None = None) -> tuple[pd.DataFrame, bool]:  # fmt: skip
    """obs of every cell, or of stored rows ``rows`` only (built for those alone), and whether
    its names are known unique: ``"0" .. "n-1"``, stored names the writer recorded unique
    (``verify`` checks them), or ``positions`` (the stored positions, as integers)."""
    schema = dataset.obs_schema()
    n_cells = dataset.shape[0] if rows is None else len(rows)
    if positions:
        names = pd.RangeIndex(n_cells) if rows is None else pd.Index(rows, dtype=np.int64)
    if schema is None:
        index = names if positions else _default_obs_names(dataset, rows, n_threads)
        return pd.DataFrame(index=index), True
    stored_names = dataset.obs_index_column(schema)
    index_column = None if positions else stored_names  # positions: names not read
    names_unique = index_column is None or bool(
        dataset.manifest.metadata.get("obs_names_unique"))
    if obs is True:
        columns = [c for c in schema.names if c != stored_names]
    elif obs is False:
        columns = []
    else:
        columns = list(obs)
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise KeyError(f"obs columns not in the dataset: {missing}")
    cache = ObsCache(dataset.obs_part, cache_dir)
    cache.localize(([index_column] if index_column is not None else []) + columns)
    def selected(name: str) -> pd.Series:
        series = cache.series(name)
        return series if rows is None else series.iloc[rows].reset_index(drop=True)

    frame = pd.DataFrame({c: selected(c).to_numpy() if schema[c].kind != "category"
                          else selected(c) for c in columns})  # fmt: skip
    if positions:
        frame.index = names
    elif index_column is not None:
        frame.index = cache.names(index_column, rows, n_threads)
    else:
        frame.index = _default_obs_names(dataset, rows, n_threads)
    if len(frame) != n_cells:  # no columns asked for: an empty frame of the right length
        frame = pd.DataFrame(index=frame.index)
    record = dataset.manifest.metadata.get("obs_pandas")
    return restore_dtypes(frame, record, dataset.store.describe(MANIFEST_NAME)), names_unique


def _default_obs_names(dataset: Dataset, rows: np.ndarray | None = None,
                       n_threads: int | None = None) -> pd.Index:
    """``"0" .. "n-1"`` for a dataset without stored obs names.

    The manifest's cell count is believed only once the tiles that claim the most cells (the
    first, holding ``tile_size``, and the last) are on the store at their stated sizes,
    which hold 8 bytes per cell: a small manifest claiming 2^40 cells must not make this
    build a trillion names.
    """
    m = dataset.manifest
    if m.n_tiles:
        dataset.check_tile_sizes(sorted({0, m.n_tiles - 1}))
    # Every cell: a range, not an array of 8 bytes per cell (80 MB of fresh pages at 10M).
    positions = range(m.n_cells) if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
    default = index_string_dtype()
    if isinstance(default, np.dtype):
        # pandas 2: object strings, as anndata 0.12 expects (it refuses to write an
        # Arrow-backed index by default), made from their digits without Arrow in between.
        return pd.Index(decimal_name_objects(positions, n_threads), dtype=object, copy=False)
    # pandas 3: its Arrow-backed ``str`` straight from Arrow buffers, no Python string each.
    offsets, data = decimal_names(positions)
    names = pa.LargeStringArray.from_buffers(len(positions), pa.py_buffer(offsets),
                                             pa.py_buffer(data))  # fmt: skip
    return pd.Index(pd.array(names, dtype=default), copy=False)
