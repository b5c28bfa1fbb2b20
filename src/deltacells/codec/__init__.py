"""The tile format in memory: FORMAT.md's constants and checks, the Cython kernels and
:class:`~deltacells.codec.tile.Tile`; no I/O.

The names below were the module ``deltacells.codec`` before it became this subpackage.
"""

from deltacells.codec.tile import (
    DEFAULT_LEVEL,
    DEFAULT_N_CHUNKS,
    CountError,
    Tile,
    decode_tile,
    encode_tile,
    exception_limit,
)

__all__ = [
    "DEFAULT_LEVEL",
    "DEFAULT_N_CHUNKS",
    "CountError",
    "Tile",
    "decode_tile",
    "encode_tile",
    "exception_limit",
]
