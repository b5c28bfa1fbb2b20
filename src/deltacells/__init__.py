"""deltacells: the AnnData IO backend for the deltacells single-cell count-matrix format.

Tiles: :func:`encode_tile`, :func:`decode_tile`, :class:`Tile`. Datasets:
:func:`write_deltacells`, :func:`open_dataset`, :func:`read_deltacells` (a lazy AnnData).
Training: :class:`Loader`. Spatial: ``write_deltacells(..., spatial_key=)``,
:meth:`Dataset.query_bbox`, :func:`add_gene_major`, :func:`to_spatialdata`.
"""

from importlib.metadata import PackageNotFoundError, version

from deltacells import _moved
from deltacells.codec.format import FormatError, LimitError, Limits, get_limits, set_limits
from deltacells.codec.tile import DEFAULT_LEVEL, CountError, Tile, decode_tile, encode_tile
from deltacells.export import to_spatialdata
from deltacells.read.assemble import read_deltacells, read_obs_names
from deltacells.read.dataset import Dataset, open_dataset
from deltacells.read.lazy_matrix import DeltacellsCSRDataset
from deltacells.spatial.genemajor import add_gene_major
from deltacells.train.loader import Batch, Loader
from deltacells.write.writer import write_deltacells

_moved.install()


def __getattr__(name: str):
    # The torch adapter imports torch (an optional extra) only when asked for.
    if name == "TorchIterableDataset":
        try:
            from deltacells.train.torchdata import TorchIterableDataset
        except ModuleNotFoundError as err:  # pragma: no cover - exercised without torch
            if err.name != "torch":
                raise
            raise ImportError(
                "TorchIterableDataset needs torch: pip install 'deltacells[torch]'"
            ) from err
        return TorchIterableDataset
    if name in _moved.MOVED:  # ``deltacells.storage`` and the other paths before the move
        import importlib

        return importlib.import_module(f"deltacells.{name}")
    raise AttributeError(f"module 'deltacells' has no attribute {name!r}")


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
