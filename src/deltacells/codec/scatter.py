"""Cells of compressed tiles decoded straight into many outputs: the loader's minibatches.

A buffer of shuffled cells feeds several batches. Decoding it with
:func:`gather_tiles_into_many` reads each touched chunk once and writes every cell,
renumbered through a column map and sorted while it is in cache, at its own place in the
batch that takes it, so no row is decoded into a tile first and copied out after.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from deltacells.codec.tile import Tile, _check_buffer, _gather, gathered_indptr

__all__ = ["gather_tiles_into_many"]


def gather_tiles_into_many(
    tiles: Sequence[Tile],
    groups: Sequence[np.ndarray],
    rows: np.ndarray,
    outputs: Sequence[tuple[np.ndarray, np.ndarray]],
    which_output: np.ndarray,
    offsets: np.ndarray,
    col_map: Any,
    *,
    n_threads: int | None = None,
) -> None:
    """Decode cells of several tiles, renumbered through ``col_map`` and sorted, each into
    its place in one of several outputs, in one parallel section.

    As :func:`deltacells.codec.tile.gather_tiles_into`, except that row ``j`` (a cell
    ``rows[j]`` of the tile whose group holds ``j``) goes to output ``which_output[j]`` (an
    ``(indices, values)`` pair of 1-D int32 and value arrays), starting at entry
    ``offsets[j]``: the minibatches a buffer of shuffled cells feeds, filled straight from the
    compressed tiles. Rows must not overlap, and ``col_map`` (a permutation of the columns)
    is required.
    """
    if col_map is None:
        raise ValueError("gather_tiles_into_many needs col_map (a permutation of the columns)")
    if not tiles:
        return
    rows = np.asarray(rows, dtype=np.int64)
    which_output = np.asarray(which_output, dtype=np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    if not (len(rows) == len(which_output) == len(offsets)) or not outputs:
        raise ValueError("rows, which_output and offsets differ in length, or no outputs")
    value_dtype = outputs[0][1].dtype
    for indices, values in outputs:
        _check_buffer("indices", indices, np.dtype(np.int32), 0)
        _check_buffer("values", values, value_dtype, 0)
    out_indptr = gathered_indptr(tiles, groups, rows)  # each row's length, from its tile
    lengths = np.diff(out_indptr)
    if len(rows) and (which_output.min() < 0 or which_output.max() >= len(outputs)):
        raise ValueError("which_output names an output that does not exist")
    room = np.array([min(len(i), len(v)) for i, v in outputs], dtype=np.int64)
    ends = offsets + lengths
    if len(rows) and (offsets.min() < 0 or (ends > room[which_output]).any()):
        raise ValueError("a row does not fit in its output")
    written = np.flatnonzero(lengths)  # empty rows write nothing, wherever they point
    by_place = written[np.lexsort((offsets[written], which_output[written]))]
    same = which_output[by_place][1:] == which_output[by_place][:-1]
    if (same & (offsets[by_place][1:] < ends[by_place][:-1])).any():
        raise ValueError("two rows overlap in one output")
    idx_base = np.array([i.ctypes.data for i, _ in outputs], dtype=np.uintp)
    val_base = np.array([v.ctypes.data for _, v in outputs], dtype=np.uintp)
    dst_idx = idx_base[which_output] + (offsets * 4).astype(np.uintp)
    dst_val = val_base[which_output] + (offsets * value_dtype.itemsize).astype(np.uintp)
    unused = (np.zeros(0, dtype=np.int32), np.zeros(0, dtype=value_dtype))
    _gather(tiles, groups, rows, out_indptr, *unused, n_threads, col_map, dst_idx, dst_val)
