"""Spatial datasets: the grid index, box queries and the gene-major companion.

The names below were the module ``deltacells.spatial`` before it became this subpackage.
"""

from deltacells.spatial.grid import (
    DEFAULT_CELLS_PER_GRID_TILE,
    SpatialIndex,
    choose_grid,
    grid_tiles_overlapping,
    select_in_box,
    tile_ids,
)

__all__ = [
    "DEFAULT_CELLS_PER_GRID_TILE",
    "SpatialIndex",
    "choose_grid",
    "grid_tiles_overlapping",
    "select_in_box",
    "tile_ids",
]
