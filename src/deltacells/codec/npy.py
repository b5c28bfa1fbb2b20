"""The ``.npy`` files a dataset holds (gene order, cell order, spatial arrays): an array's
bytes for the writer, and a checked parse of a header for the readers. No I/O."""

from __future__ import annotations

import io

import numpy as np

from deltacells.codec.format import FormatError

__all__ = ["npy_bytes", "parse_npy_header"]


def npy_bytes(array: np.ndarray) -> bytes:
    """``array`` as the bytes of a ``.npy`` file (no pickled objects)."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return buffer.getvalue()


def parse_npy_header(data: bytes, where: str) -> tuple[tuple, bool, np.dtype, int]:
    """Shape, Fortran order, dtype and data offset of the ``.npy`` file starting ``data``
    (only its header need be there).

    Raises
    ------
    FormatError
        Naming ``where``, when ``data`` does not start with a version 1 or 2 ``.npy`` header.
    """
    stream = io.BytesIO(data)
    try:
        major, _ = np.lib.format.read_magic(stream)
        if major == 1:
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif major == 2:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise ValueError(f".npy version {major} is not supported")
    except (ValueError, EOFError, SyntaxError, TypeError, OverflowError) as err:
        raise FormatError(f"{where}: not a .npy array ({err})") from None
    return shape, fortran, dtype, stream.tell()
