"""deltacells: the AnnData IO backend for the deltacells single-cell count-matrix format.

The tile codec is available now: :func:`encode_tile`, :func:`decode_tile` and :class:`Tile`.
"""

from importlib.metadata import PackageNotFoundError, version

from deltacells.codec import DEFAULT_LEVEL, Tile, decode_tile, encode_tile
from deltacells.format import FormatError

try:
    __version__ = version("deltacells")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = ["DEFAULT_LEVEL", "FormatError", "Tile", "__version__", "decode_tile", "encode_tile"]
