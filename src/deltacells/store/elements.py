"""The rest of an AnnData: obsm, varm, obsp, varp, uns and non-count layers.

They are written and read with anndata's own element IO (``anndata.io.write_elem`` /
``read_elem``) into a zarr group, ``anndata.zarr``, beside the tiles, so their encoding is
anndata's, versioned by anndata and readable by every scverse tool. zarr rather than HDF5:
each array is chunked objects that object stores serve by key (an HDF5 file on S3 is one
object read through ranged requests into a format built for local files), and one element can be
read, lazily too, without the others.

Per-cell elements follow the dataset's cell order: with ``shuffle=True`` the rows of obsm and
non-count layers, and both axes of obsp, are written in the stored order, as obs is. Per-gene
elements (varm, varp) stay in the source gene order, which is what readers present by default.
Count layers and raw are not here: they are deltacells datasets of their own (see
:func:`deltacells.write_deltacells`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp

from deltacells.codec.format import FormatError
from deltacells.store.integrity import FileTable
from deltacells.store.storage import Store

__all__ = [
    "ANNDATA_GROUP",
    "ELEMENTS",
    "ElementsWarning",
    "layer_names",
    "open_group",
    "permute_cells",
    "read_elements",
    "write_elements",
]

#: The zarr group holding the AnnData elements that are not counts.
ANNDATA_GROUP = "anndata.zarr"
#: Elements stored there (plus ``layers`` for layers that are not counts).
ELEMENTS = ("obsm", "varm", "obsp", "varp", "uns")


def layer_names(adata: ad.AnnData) -> list[str]:
    """The names of ``adata``'s layers (anndata 0.13 also lists X there, as ``None``)."""
    return [name for name in adata.layers if name is not None]


class ElementsWarning(UserWarning):
    """Part of an AnnData could not be stored and was left out (the message names it)."""


def _group_location(store: Store, read_only: bool) -> Any:
    """What ``zarr.open_group`` takes for the group inside ``store``."""
    if store.is_local:
        return store.describe(ANNDATA_GROUP)
    from zarr.storage import FsspecStore

    return FsspecStore.from_url(store.describe(ANNDATA_GROUP),
                                storage_options=store.storage_options or None,
                                read_only=read_only)  # fmt: skip


def open_group(store: Store, mode: str = "r"):
    """The ``anndata.zarr`` group of a dataset (``mode="w"`` creates it)."""
    import zarr

    if mode == "r":
        return zarr.open_group(_group_location(store, read_only=True), mode="r")
    return zarr.open_group(_group_location(store, read_only=False), mode="w",
                           zarr_format=_zarr_write_format())  # fmt: skip


def _zarr_write_format() -> int:
    """The zarr format anndata writes elements in: its setting up to 0.12; from 0.13, which
    deprecates the setting (zarr 3 becomes its only default in 0.14), format 3."""
    from importlib.metadata import version

    major, minor = (int(p) for p in version("anndata").split(".")[:2])
    return 3 if (major, minor) >= (0, 13) else ad.settings.zarr_write_format


def permute_cells(value: Any, order: np.ndarray, both_axes: bool = False) -> Any:
    """Rows of ``value`` (array, sparse matrix or DataFrame) in ``order``; with ``both_axes``
    the columns too (obsp)."""
    if isinstance(value, pd.DataFrame):
        return value.iloc[order]
    if sp.issparse(value):
        value = sp.csr_matrix(value)[order]
        return sp.csr_matrix(value[:, order]) if both_axes else value
    array = np.asarray(value)[order]
    return array[:, order] if both_axes else array


def write_elements(
    store: Store, elements: Mapping[str, Any], cell_order: np.ndarray | None
) -> list[str]:
    """Write ``elements`` (``{"obsm": {...}, "uns": {...}, "layers": {...}}``) into the
    dataset's ``anndata.zarr`` group; return the names written.

    An element anndata cannot write is left out with an :class:`ElementsWarning` naming it.
    """
    written: list[str] = []
    present = {k: v for k, v in elements.items()
               if v is not None and (k in ("X", "raw") or len(v))}  # fmt: skip
    if not present:
        return written
    group = open_group(store, "w")
    for name, mapping in present.items():
        if name == "X":  # one matrix, rows in the stored cell order
            out = mapping if cell_order is None else permute_cells(mapping, cell_order)
        elif name == "raw":  # an AnnData of raw's X, var and varm
            X = mapping.X if cell_order is None else permute_cells(mapping.X, cell_order)
            out = ad.Raw(ad.AnnData(X=X, var=mapping.var, varm=dict(mapping.varm)))
        else:
            out = {}
            for key, value in mapping.items():
                if cell_order is not None and name in ("obsm", "obsp", "layers"):
                    value = permute_cells(value, cell_order, both_axes=name == "obsp")
                out[key] = value
        try:
            if isinstance(out, dict):
                _write_key_by_key(group, name, out)
            else:
                ad.io.write_elem(group, name, out)
        except Exception as err:  # anndata's IORegistryError and friends: say what is dropped
            if name in group:
                del group[name]
            warnings.warn(f"{name} could not be stored with anndata's element IO and is left "
                          f"out: {err}", ElementsWarning, stacklevel=3)  # fmt: skip
            continue
        written.append(name)
    return written


def _write_key_by_key(group: Any, name: str, mapping: dict) -> None:
    """Write ``mapping`` as element ``name`` one key at a time, as anndata writes a mapping,
    leaving out (with an :class:`ElementsWarning` each) only the keys anndata cannot write:
    one odd entry of uns does not cost the rest. Raises only if the mapping itself (empty)
    cannot be written."""
    ad.io.write_elem(group, name, {})
    for key, value in mapping.items():
        if not isinstance(key, str):
            warnings.warn(f"{name}[{key!r}] is left out: anndata's element IO stores string "
                          f"keys only; rename it (for example {name}[{str(key)!r}])",
                          ElementsWarning, stacklevel=4)  # fmt: skip
            continue
        try:
            ad.io.write_elem(group[name], key, value)
        except Exception as err:  # named in the warning; the rest is kept
            if key in group[name]:
                del group[name][key]
            warnings.warn(f"{name}[{key!r}] could not be stored with anndata's element IO and "
                          f"is left out: {err}", ElementsWarning, stacklevel=4)  # fmt: skip


def read_elements(store: Store, names: list[str], lazy: bool = False,
                  files: FileTable | None = None) -> dict[str, Any]:  # fmt: skip
    """The stored elements ``names`` as anndata reads them (``lazy``: arrays as dask arrays
    that read their chunks when computed; uns is always read whole).

    Every file is read through the dataset's store and, with the manifest's file table
    ``files``, checked against it (see :mod:`deltacells.store.element_store`); arrays whose declared
    size is out of proportion to their stored bytes are refused before anything is read.

    Raises
    ------
    FormatError
        If the group or an element is missing, damaged or unreadable (naming the file when a
        file's check failed).
    """
    import zarr

    from deltacells.store.element_store import CheckedZarrStore, check_declared_sizes

    where = store.describe(ANNDATA_GROUP)
    files = files if files is not None else FileTable(None, where)
    try:
        zstore = CheckedZarrStore(store, files, ANNDATA_GROUP)
        group = zarr.open_group(zstore, mode="r")
        check_declared_sizes(group, zstore)
    except FormatError:
        raise
    except Exception as err:
        checked = _format_error_in(err)
        if checked is not None:
            raise checked from None
        raise FormatError(f"{where}: cannot open the anndata group ({_cause(err)})") from None
    out: dict[str, Any] = {}
    for name in names:
        if name not in group:
            raise FormatError(f"{where}: element {name!r} is missing")
        try:
            if name == "X":
                out[name] = _read_lazily(group[name]) if lazy else ad.io.read_elem(group[name])
            elif name == "raw":
                raw = ad.io.read_elem(group[name])
                out[name] = {"X": raw.X, "var": raw.var, "varm": dict(raw.varm)}
            elif lazy and name != "uns":
                out[name] = {key: _read_lazily(group[name][key]) for key in group[name]}
            else:
                out[name] = ad.io.read_elem(group[name])
        except ImportError:
            raise  # a module missing here (dask, for lazy arrays) is not the file's fault
        except Exception as err:
            checked = _format_error_in(err)
            if checked is not None:
                raise checked from None
            raise FormatError(f"{where}: cannot read {name!r} ({_cause(err)})") from None
    return out


def _format_error_in(err: BaseException) -> FormatError | None:
    """The FormatError (or StorageError) behind ``err``: anndata wraps what a store raised
    in errors of its own, and the store's message is the one that names the file."""
    from deltacells.store.storage import StorageError

    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, FormatError | StorageError):
            return err if isinstance(err, FormatError) else FormatError(str(err))
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def _cause(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _read_lazily(elem: Any) -> Any:
    """A dask array for an array or sparse matrix; other elements (data frames, which anndata
    reads lazily only with xarray) are read into memory."""
    from anndata.experimental import read_elem_lazy

    encoding = str(dict(elem.attrs).get("encoding-type", ""))
    if encoding in ("array", "csr_matrix", "csc_matrix"):
        return read_elem_lazy(elem)
    return ad.io.read_elem(elem)
