"""deltacells: the AnnData IO backend for the deltacells single-cell count-matrix format.

Tiles: :func:`encode_tile`, :func:`decode_tile`, :class:`Tile`. Datasets:
:func:`write_deltacells`, :func:`open_dataset`, :func:`read_deltacells` (a lazy AnnData).
Training: :class:`Loader`. Spatial: ``write_deltacells(..., spatial_key=)``,
:meth:`Dataset.query_bbox`, :func:`add_gene_major`, :func:`to_spatialdata`.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from deltacells import _moved
from deltacells.codec.format import FormatError, LimitError, Limits, get_limits, set_limits

if TYPE_CHECKING:  # the names below load on first use; listed here for type checkers
    from deltacells.codec.tile import DEFAULT_LEVEL, CountError, Tile, decode_tile, encode_tile
    from deltacells.export import to_spatialdata
    from deltacells.read.assemble import read_deltacells, read_obs_names
    from deltacells.read.dataset import Dataset, open_dataset
    from deltacells.read.lazy_matrix import DeltacellsCSRDataset
    from deltacells.spatial.genemajor import add_gene_major
    from deltacells.train.loader import Batch, Loader
    from deltacells.train.torchdata import TorchIterableDataset
    from deltacells.write.writer import write_deltacells

#: Public name -> the module that defines it. They are imported on first use, so that a process
#: that only trains (``from deltacells import Loader``) or converts does not import anndata,
#: dask and the rest of the reading stack: about 180 MB of resident memory and a second.
_LAZY: dict[str, str] = {
    "DEFAULT_LEVEL": "deltacells.codec.tile",
    "CountError": "deltacells.codec.tile",
    "Tile": "deltacells.codec.tile",
    "decode_tile": "deltacells.codec.tile",
    "encode_tile": "deltacells.codec.tile",
    "to_spatialdata": "deltacells.export",
    "read_deltacells": "deltacells.read.assemble",
    "read_obs_names": "deltacells.read.assemble",
    "Dataset": "deltacells.read.dataset",
    "open_dataset": "deltacells.read.dataset",
    "DeltacellsCSRDataset": "deltacells.read.lazy_matrix",
    "add_gene_major": "deltacells.spatial.genemajor",
    "Batch": "deltacells.train.loader",
    "Loader": "deltacells.train.loader",
    "TorchIterableDataset": "deltacells.train.torchdata",
    "write_deltacells": "deltacells.write.writer",
}

_moved.install()


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is not None:
        try:
            value = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError as err:  # pragma: no cover - exercised without torch
            # The torch adapter needs torch, an optional extra.
            if name != "TorchIterableDataset" or err.name != "torch":
                raise
            raise ImportError(
                "TorchIterableDataset needs torch: pip install 'deltacells[torch]'"
            ) from err
        globals()[name] = value  # later lookups skip this function
        return value
    if name in _moved.MOVED:  # ``deltacells.storage`` and the other paths before the move
        return importlib.import_module(f"deltacells.{name}")
    raise AttributeError(f"module 'deltacells' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


try:
    __version__ = version("deltacells")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "DEFAULT_LEVEL",
    "Batch",
    "CountError",
    "Dataset",
    "DeltacellsCSRDataset",
    "FormatError",
    "LimitError",
    "Limits",
    "Loader",
    "Tile",
    "TorchIterableDataset",
    "__version__",
    "add_gene_major",
    "decode_tile",
    "encode_tile",
    "get_limits",
    "open_dataset",
    "read_deltacells",
    "read_obs_names",
    "set_limits",
    "to_spatialdata",
    "write_deltacells",
]
