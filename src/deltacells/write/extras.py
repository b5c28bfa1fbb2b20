"""Writing the parts of an AnnData besides X, obs and var (called by the writer).

Count layers and raw become deltacells datasets of their own under ``layers/<name>/`` and
``raw/`` (same codec, tiles and cell order as X; layers share X's gene order and var), so they
are sliced lazily like X. Layers that are not counts, and obsm, varm, obsp, varp and uns, go to
the ``anndata.zarr`` group through anndata's element IO (:mod:`deltacells.store.elements`).
"""

from __future__ import annotations

import os
import urllib.parse
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import scipy.sparse as sp

from deltacells.codec.tile import CountError
from deltacells.store.elements import ELEMENTS, ElementsWarning, layer_names, write_elements
from deltacells.store.storage import Store

__all__ = ["LAYERS_DIR", "RAW_DIR", "has_raw", "layer_dir", "write_extras"]

LAYERS_DIR = "layers"
RAW_DIR = "raw"


def layer_dir(name: str) -> str:
    """Where count layer ``name`` is stored inside a dataset (the name URL-quoted)."""
    return f"{LAYERS_DIR}/{urllib.parse.quote(name, safe='')}"


def _child(store: Store, name: str) -> str:
    """Path or URL of ``name`` inside ``store``, for a nested write."""
    return store.describe(name)


class _Source:
    """Element access to one input: an AnnData, or an .h5ad / .zarr file opened for reading."""

    def __init__(self, source: Any) -> None:
        self.adata = source if isinstance(source, ad.AnnData) else None
        self._group: Any = None
        self._close = None
        if self.adata is None:
            path = Path(os.fspath(source))
            if path.suffix == ".zarr" or path.is_dir():
                import zarr

                self._group = zarr.open_group(str(path), mode="r")
            else:
                import h5py

                self._group = h5py.File(path, "r")
                self._close = self._group.close

    def close(self) -> None:
        if self._close is not None:
            self._close()

    def element(self, name: str) -> dict:
        if self.adata is not None:
            return dict(getattr(self.adata, name))
        if name not in self._group:
            return {}
        return dict(ad.io.read_elem(self._group[name]))

    def obsm_entry(self, key: str) -> Any:
        """``obsm[key]`` alone (None if absent), without reading the other obsm arrays."""
        if self.adata is not None:
            return self.adata.obsm[key] if key in self.adata.obsm else None
        if "obsm" not in self._group or key not in self._group["obsm"]:
            return None
        return ad.io.read_elem(self._group["obsm"][key])

    def layer_names(self) -> list[str]:
        if self.adata is not None:
            return layer_names(self.adata)
        return group_layer_names(self._group)

    def layer(self, name: str) -> Any:
        if self.adata is not None:
            return self.adata.layers[name]
        return ad.io.read_elem(self._group["layers"][name])

    def x(self) -> Any:
        """X (None if there is none)."""
        if self.adata is not None:
            return self.adata.X
        return ad.io.read_elem(self._group["X"]) if "X" in self._group else None

    def x_is_layer(self, name: str) -> bool:
        """Whether X holds exactly layer ``name``'s values (in-memory inputs; files are not
        compared, their X is kept)."""
        if self.adata is None or self.adata.X is None:
            return False
        x, layer = self.adata.X, self.adata.layers[name]
        if x is layer:
            return True
        if x.shape != layer.shape or sp.issparse(x) != sp.issparse(layer):
            return False
        if sp.issparse(x):
            return (sp.csr_matrix(x) != sp.csr_matrix(layer)).nnz == 0
        return bool(np.array_equal(np.asarray(x), np.asarray(layer)))

    def raw(self) -> ad.AnnData:
        """raw as an AnnData of its X, var and varm."""
        if self.adata is not None:
            raw = self.adata.raw
            return ad.AnnData(X=raw.X, var=raw.var, varm=dict(raw.varm))
        return ad.io.read_elem(self._group["raw"])

    def has_raw(self) -> bool:
        if self.adata is not None:
            return self.adata.raw is not None
        return has_raw(self._group)


def group_layer_names(group: Any) -> list[str]:
    """The layer names in a file's root group (none without a layers group)."""
    return list(group["layers"]) if "layers" in group else []


def has_raw(group: Any) -> bool:
    """Whether a file's group holds raw (anndata writes an empty placeholder array to zarr
    when there is none)."""
    return "raw" in group and hasattr(group["raw"], "keys") and "X" in group["raw"]


def write_extras(
    store: Store,
    source: Any,
    *,
    layer: str | None,
    use_raw: bool,
    gene_order: np.ndarray | None,
    cell_order: np.ndarray | None,
    options: dict,
    write_dataset: Callable[..., Any],
) -> dict:
    """Write layers, raw and the other elements of ``source`` into ``store``; return what the
    manifest's ``metadata["anndata"]`` records of them.

    ``options`` are :func:`~deltacells.write_deltacells` settings shared by the nested
    datasets (tile size, chunks, level, threads, shuffle and seed, storage options);
    ``write_dataset`` writes one of them (:func:`~deltacells.write_deltacells`, handed down by
    the writer so that this module does not import it back).
    """
    src = _Source(source)
    try:
        record: dict[str, Any] = {"layers": {}, "raw": None, "elements": []}
        elements: dict[str, Any] = {name: src.element(name) for name in ELEMENTS}
        other_layers: dict[str, Any] = {}
        nested = dict(options, obs=False, progress=False, overwrite=False, elements=False)
        order = "none" if gene_order is None else gene_order
        for name in src.layer_names():
            if name == layer and not use_raw:
                record["layers"][name] = "."  # X itself
                continue
            try:
                write_dataset(source, _child(store, layer_dir(name)), layer=name, var=False,
                                 gene_order=order, **nested)  # fmt: skip
                record["layers"][name] = layer_dir(name)
            except (CountError, ValueError):
                # Not counts (e.g. normalised values): anndata's encoding, compressed.
                other_layers[name] = src.layer(name)
        if src.has_raw():
            if use_raw:
                record["raw"] = "."
            else:
                try:
                    write_dataset(source, _child(store, RAW_DIR), use_raw=True,
                                     **nested)  # fmt: skip
                    record["raw"] = RAW_DIR
                except (CountError, ValueError):
                    # Not counts (e.g. log-normalised): anndata's encoding, read back as raw.
                    elements["raw"] = src.raw()
        if use_raw and src.adata is not None and src.adata.X is not None:
            warnings.warn("X is left out: with use_raw=True the dataset's X is raw.X",
                          ElementsWarning, stacklevel=3)  # fmt: skip
        if layer is not None and not use_raw and not src.x_is_layer(layer):
            # The tiles hold the layer; the AnnData's own X (log-normalised, say) is kept
            # beside them and read back as X.
            elements["X"] = src.x()
        elements["layers"] = other_layers
        record["elements"] = write_elements(store, elements, cell_order)
        return record
    finally:
        src.close()
