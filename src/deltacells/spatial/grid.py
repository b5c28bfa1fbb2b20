"""Spatial order of cells (RFC 4 as applied in NOTES.md): the grid, tile ids, margins and box
selection. Pure computation, no I/O: the writer sorts cells with it, the dataset layer reads
the stored index and answers box queries with it.

Conventions (NOTES.md, "Spatial order and gene-major reads"):

* ``ix = floor((x - ox) / tx)`` clipped to ``[0, nx)`` (likewise ``iy``), so tiles are
  half-open and the last one is closed at the upper edge; the tile id is ``k = ix * ny + iy``
  (C order over (x, y)).
* cells of grid tile ``k`` are the stored rows ``tile_offsets[k] : tile_offsets[k + 1]``.
* ``margin`` per axis is the largest distance from a centroid to its shape's bounding-box edge;
  a box query reads the grid tiles overlapping the box grown by it, then tests exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltacells.codec.format import FormatError

__all__ = [
    "DEFAULT_CELLS_PER_GRID_TILE",
    "MAX_GRID_TILES",
    "SpatialIndex",
    "choose_grid",
    "grid_tiles_overlapping",
    "margin_of",
    "select_in_box",
    "tile_ids",
]

#: The default grid aims at this many cells per grid tile on average over the centroids'
#: bounding box: small enough that a box of 1% of the area over-reads little (a ring of grid
#: tiles around it), large enough that ``tile_offsets`` stays small (8 bytes per grid tile).
DEFAULT_CELLS_PER_GRID_TILE = 250
#: Most grid tiles a dataset may declare (``tile_offsets`` is read whole when opened: 8 MiB).
MAX_GRID_TILES = 2**20
SELECT_MODES = ("intersects", "centroid")


@dataclass(frozen=True)
class SpatialIndex:
    """The ``spatial_index`` record of a dataset's manifest metadata.

    Attributes
    ----------
    origin, tile_size
        Lower corner of the grid and the size of its tiles, per axis (x, y).
    grid_shape
        Number of tiles ``(nx, ny)``.
    margin
        Largest overhang of a shape past its centroid, per axis (0 for points).
    n_rows
        Cells indexed (the dataset's cells).
    axes, coordinate_system, order
        ``("x", "y")``, the name of the coordinate system, ``"C"``.
    """

    origin: tuple[float, float]
    tile_size: tuple[float, float]
    grid_shape: tuple[int, int]
    margin: tuple[float, float]
    n_rows: int
    axes: tuple[str, str] = ("x", "y")
    coordinate_system: str = "global"
    order: str = "C"

    @property
    def n_grid_tiles(self) -> int:
        """``nx * ny``."""
        return self.grid_shape[0] * self.grid_shape[1]

    def to_json(self) -> dict:
        """The record as stored in the manifest metadata."""
        return {
            "axes": list(self.axes),
            "coordinate_system": self.coordinate_system,
            "origin": list(self.origin),
            "tile_size": list(self.tile_size),
            "grid_shape": list(self.grid_shape),
            "order": self.order,
            "margin": list(self.margin),
            "n_rows": self.n_rows,
            "tile_offsets": TILE_OFFSETS_NAME,
        }

    @classmethod
    def from_json(cls, obj: object, where: str, n_cells: int) -> SpatialIndex:
        """Parse and check a stored record (``where`` names the manifest in errors)."""
        if not isinstance(obj, dict):
            raise FormatError(f"{where}: 'spatial_index' must be an object")

        def pair(key: str, kind: type, positive: bool = False, nonneg: bool = False) -> tuple:
            value = obj.get(key)
            ok = isinstance(value, list) and len(value) == 2 and all(
                isinstance(v, kind) and not isinstance(v, bool) for v in value)  # fmt: skip
            if ok and kind is float:
                ok = all(math.isfinite(v) for v in value)
            if ok and positive:
                ok = all(v > 0 for v in value)
            if ok and nonneg:
                ok = all(v >= 0 for v in value)
            if not ok:
                need = "positive " if positive else "non-negative " if nonneg else ""
                raise FormatError(f"{where}: spatial_index '{key}' must be two {need}"
                                  f"{'numbers' if kind is float else 'integers'}")  # fmt: skip
            return tuple(kind(v) for v in value)

        for key in ("origin", "tile_size", "margin"):  # JSON numbers may be written as ints
            if isinstance(obj.get(key), list):
                obj = {**obj, key: [float(v) if isinstance(v, int) and not isinstance(v, bool)
                                    else v for v in obj[key]]}  # fmt: skip
        grid = pair("grid_shape", int, positive=True)
        if grid[0] * grid[1] > MAX_GRID_TILES:
            raise FormatError(f"{where}: spatial_index grid_shape {list(grid)} has more than "
                              f"{MAX_GRID_TILES} tiles")  # fmt: skip
        if obj.get("axes") != ["x", "y"] or obj.get("order") != "C":
            raise FormatError(f"{where}: spatial_index must have axes ['x', 'y'] and order 'C'")
        if obj.get("n_rows") != n_cells:
            raise FormatError(f"{where}: spatial_index n_rows {obj.get('n_rows')!r} is not the "
                              f"dataset's {n_cells} cells")  # fmt: skip
        system = obj.get("coordinate_system", "global")
        if not isinstance(system, str):
            raise FormatError(f"{where}: spatial_index coordinate_system must be a string")
        return cls(origin=pair("origin", float), tile_size=pair("tile_size", float, positive=True),
                   grid_shape=grid, margin=pair("margin", float, nonneg=True), n_rows=n_cells,
                   coordinate_system=system)  # fmt: skip


#: Where ``tile_offsets`` (int64, ``nx * ny + 1``) is stored in a dataset.
TILE_OFFSETS_NAME = "spatial/tile_offsets.npy"
#: Centroids (float64, ``n_cells x 2``, stored row order): what box queries test.
CENTROIDS_NAME = "spatial/centroids.npy"
#: Per-cell shape records (float64 ``n_cells x 5``, stored row order): kind (:data:`POINT`,
#: :data:`CIRCLE` with its radius next, or :data:`BOX_ONLY`, a polygon, with its bounding box
#: next). Absent when every cell is a point.
SHAPES_NAME = "spatial/shapes.npy"
#: Polygons as WKB, concatenated in stored row order (empty for points and circles), and the
#: int64 offsets of each row's bytes (``n_cells + 1``): rows of a grid tile are one range.
GEOMETRY_NAME = "spatial/geometry.wkb"
GEOMETRY_OFFSETS_NAME = "spatial/geometry_offsets.npy"
#: CRC-32s of what a box query reads (uint32, ``4 x (n_grid_tiles + 1)``): per file of
#: :data:`GRID_SUMS_FILES`, the CRC of its ``.npy`` header, then one per grid tile of the bytes
#: a query reads for that tile's rows (geometry offsets: the rows and the next one). Box queries
#: read a few grid tiles' rows, which a whole-file hash cannot check.
GRID_SUMS_NAME = "spatial/grid_crc32.npy"
GRID_SUMS_FILES = (CENTROIDS_NAME, SHAPES_NAME, GEOMETRY_OFFSETS_NAME, GEOMETRY_NAME)
#: Bytes per row of the row files, and rows read past each grid tile's own.
ROW_LAYOUT = {CENTROIDS_NAME: (16, 0), SHAPES_NAME: (40, 0), GEOMETRY_OFFSETS_NAME: (8, 1)}


def grid_checksums(files: dict[str, bytes], tile_offsets: np.ndarray) -> np.ndarray:
    """The contents of :data:`GRID_SUMS_NAME` for the spatial ``files`` a writer stores
    (rows of absent files are zero)."""
    import zlib

    offsets = np.asarray(tile_offsets, dtype=np.int64)
    n_cells = int(offsets[-1])
    out = np.zeros((len(GRID_SUMS_FILES), len(offsets)), dtype="<u4")
    bounds = None
    if GEOMETRY_OFFSETS_NAME in files:
        data = files[GEOMETRY_OFFSETS_NAME]
        bounds = np.frombuffer(data, dtype="<i8", offset=len(data) - 8 * (n_cells + 1))
    for f, name in enumerate(GRID_SUMS_FILES):
        data = files.get(name)
        if data is None:
            continue
        view = memoryview(data)
        if name in ROW_LAYOUT:
            row_bytes, extra = ROW_LAYOUT[name]
            start = len(data) - row_bytes * (n_cells + extra)
            out[f, 0] = zlib.crc32(view[:start])
            ranges = [(start + row_bytes * int(offsets[k]),
                       start + row_bytes * (int(offsets[k + 1]) + extra))
                      for k in range(len(offsets) - 1)]  # fmt: skip
        else:  # the WKB bytes, located by the geometry offsets
            ranges = [(int(bounds[offsets[k]]), int(bounds[offsets[k + 1]]))
                      for k in range(len(offsets) - 1)]  # fmt: skip
        for k, (lo, hi) in enumerate(ranges):
            out[f, 1 + k] = zlib.crc32(view[lo:hi])
    return out


def _pair_of_numbers(value: Any, name: str, *, positive: bool) -> tuple[float, float]:
    """``value`` as (x, y): one number for both or two numbers, finite (and > 0), else a
    ValueError naming ``name`` and what it takes."""
    what = "a positive number or two (x, y)" if positive else "two finite numbers (x, y)"
    if isinstance(value, str | bytes):
        raise ValueError(f"{name} must be {what}, not the text {value!r}")
    try:
        values = np.asarray(value, dtype=np.float64).ravel()
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {what}, not {value!r}") from None
    if positive and values.size == 1:
        values = np.repeat(values, 2)
    if values.size != 2:
        raise ValueError(f"{name} must be {what}, not {values.size} values ({value!r}); "
                         "spatial order is 2-D")  # fmt: skip
    if not np.isfinite(values).all() or (positive and not (values > 0).all()):
        raise ValueError(f"{name} must be {what}, not {value!r}")
    return float(values[0]), float(values[1])


def choose_grid(
    centroids: np.ndarray,
    grid_tile_size: float | tuple[float, float] | None = None,
    origin: tuple[float, float] | None = None,
) -> tuple[tuple[float, float], tuple[float, float], tuple[int, int]]:
    """Origin, tile size and grid shape for ``centroids`` (``n x 2``).

    The default rule: the origin is the centroids' lower-left corner; tiles are square, of
    side ``sqrt(area / max(1, n / DEFAULT_CELLS_PER_GRID_TILE))`` over the centroids'
    bounding box (about :data:`DEFAULT_CELLS_PER_GRID_TILE` cells per tile on average), and
    the grid covers the bounding box. A degenerate box (all cells on a line or a point) gets
    one tile along its empty axis.
    """
    xy = np.asarray(centroids, dtype=np.float64)
    if xy.ndim != 2 or xy.shape[1] != 2:
        raise ValueError(f"centroids must be an (n, 2) array, not shape {xy.shape}")
    if len(xy) and not np.isfinite(xy).all():
        raise ValueError("centroids hold NaN or infinite coordinates")
    lo = xy.min(axis=0) if len(xy) else np.zeros(2)
    hi = xy.max(axis=0) if len(xy) else np.zeros(2)
    if origin is not None:
        ox, oy = _pair_of_numbers(origin, "origin", positive=False)
        if len(xy) and (lo[0] < ox or lo[1] < oy):
            raise ValueError(f"origin {(ox, oy)} is not below and left of every centroid "
                             f"(the lowest are {tuple(lo)})")  # fmt: skip
        lo = np.array([ox, oy])
    extent = np.maximum(hi - lo, 0.0)
    if grid_tile_size is None:
        n_tiles = max(1.0, len(xy) / DEFAULT_CELLS_PER_GRID_TILE)
        area = float(extent[0] * extent[1])
        if area > 0:
            side = math.sqrt(area / n_tiles)
        else:  # all on a line (or one point): tile the line only
            side = max(float(extent.max()) / n_tiles, 1.0)
        size = (side, side)
    else:
        size = _pair_of_numbers(grid_tile_size, "grid_tile_size", positive=True)
    shape = tuple(max(1, math.ceil(e / s)) if e > 0 else 1
                  for e, s in zip(extent, size, strict=True))  # fmt: skip
    if shape[0] * shape[1] > MAX_GRID_TILES:
        raise ValueError(f"a grid of {shape[0]} x {shape[1]} tiles is more than "
                         f"{MAX_GRID_TILES}; choose a larger grid_tile_size")  # fmt: skip
    return (float(lo[0]), float(lo[1])), size, shape  # type: ignore[return-value]


def tile_ids(centroids: np.ndarray, index: SpatialIndex) -> np.ndarray:
    """Grid tile id ``k = ix * ny + iy`` of each centroid (int64)."""
    xy = np.asarray(centroids, dtype=np.float64)
    nx, ny = index.grid_shape
    ix = _axis_cell(xy[:, 0], index.origin[0], index.tile_size[0], nx)
    iy = _axis_cell(xy[:, 1], index.origin[1], index.tile_size[1], ny)
    return ix * ny + iy


def _axis_cell(values: np.ndarray, origin: float, size: float, n: int) -> np.ndarray:
    return np.clip(np.floor((values - origin) / size), 0, n - 1).astype(np.int64)


def margin_of(centroids: np.ndarray, bounds: np.ndarray | None) -> tuple[float, float]:
    """Per-axis largest distance from a centroid to its shape's bounding-box edge.

    ``bounds`` is ``n x 4`` (xmin, ymin, xmax, ymax) or None for points (margin 0)."""
    if bounds is None or len(bounds) == 0:
        return (0.0, 0.0)
    xy = np.asarray(centroids, dtype=np.float64)
    b = np.asarray(bounds, dtype=np.float64)
    over = np.maximum(np.maximum(xy - b[:, 0:2], b[:, 2:4] - xy), 0.0)
    return (float(over[:, 0].max()), float(over[:, 1].max()))


def grid_tiles_overlapping(index: SpatialIndex, box: tuple[float, float, float, float],
                           grow: bool = True) -> np.ndarray:  # fmt: skip
    """Ids of the grid tiles that overlap ``box`` (xmin, ymin, xmax, ymax), grown by the
    margin when ``grow``, in increasing order. Cells outside the grid were clipped into its
    edge tiles, so a box beyond the grid still reaches them."""
    xmin, ymin, xmax, ymax = _check_box(box)
    mx, my = index.margin if grow else (0.0, 0.0)
    nx, ny = index.grid_shape
    ix = _axis_range(xmin - mx, xmax + mx, index.origin[0], index.tile_size[0], nx)
    iy = _axis_range(ymin - my, ymax + my, index.origin[1], index.tile_size[1], ny)
    return (np.arange(*ix)[:, None] * ny + np.arange(*iy)[None, :]).ravel().astype(np.int64)


def _axis_range(lo: float, hi: float, origin: float, size: float, n: int) -> tuple[int, int]:
    # Clipped like the tile ids: cells beyond the grid live in its edge tiles, so a box
    # beyond the grid reaches those (the exact test then decides).
    # Clamped as floats first: a box edge of 1e308 over a fine grid is no integer.
    first = math.floor(min(max((lo - origin) / size, 0.0), n - 1.0))
    last = math.floor(min(max((hi - origin) / size, 0.0), n - 1.0))
    return first, last + 1


def _check_box(box) -> tuple[float, float, float, float]:
    if isinstance(box, str | bytes):  # "1234" would read as (1, 2, 3, 4)
        raise ValueError(f"bbox must be four numbers (xmin, ymin, xmax, ymax), not {box!r}")
    try:
        xmin, ymin, xmax, ymax = (float(v) for v in box)
    except (TypeError, ValueError):
        raise ValueError(f"bbox must be (xmin, ymin, xmax, ymax), not {box!r}") from None
    if not all(math.isfinite(v) for v in (xmin, ymin, xmax, ymax)) or xmin > xmax or ymin > ymax:
        raise ValueError(f"bbox must be finite with xmin <= xmax and ymin <= ymax, not {box!r}")
    return xmin, ymin, xmax, ymax


#: Kinds in a shape record's first column.
POINT, CIRCLE, BOX_ONLY = 0.0, 1.0, 2.0


def select_in_box(
    box: tuple[float, float, float, float],
    centroids: np.ndarray,
    records: np.ndarray | None,
    mode: str = "intersects",
    geometries=None,
) -> np.ndarray:
    """Boolean mask of the cells ``box`` selects (borders inclusive: a point on the box's
    edge is inside; a shape touching the box intersects it).

    ``mode="centroid"`` tests centroids; ``"intersects"`` (default) tests each cell's shape:
    points as points, circles exactly (distance from the centre to the box <= radius), and
    polygons exactly with shapely when ``geometries`` (shapely geometries, same rows) are
    given, otherwise by their bounding boxes.
    """
    if mode not in SELECT_MODES:
        raise ValueError(f"mode must be one of {SELECT_MODES}, not {mode!r}")
    xmin, ymin, xmax, ymax = _check_box(box)
    xy = np.asarray(centroids, dtype=np.float64)
    inside = (xy[:, 0] >= xmin) & (xy[:, 0] <= xmax) & (xy[:, 1] >= ymin) & (xy[:, 1] <= ymax)
    if mode == "centroid" or records is None:
        return inside
    kind = records[:, 0]
    # Circles: the nearest point of the box to the centre is within the radius.
    dx = np.maximum(np.maximum(xmin - xy[:, 0], xy[:, 0] - xmax), 0.0)
    dy = np.maximum(np.maximum(ymin - xy[:, 1], xy[:, 1] - ymax), 0.0)
    circle_hit = dx * dx + dy * dy <= records[:, 1] ** 2
    bbox_hit = (records[:, 1] <= xmax) & (records[:, 3] >= xmin) & \
        (records[:, 2] <= ymax) & (records[:, 4] >= ymin)  # fmt: skip
    hit = np.where(kind == POINT, inside, np.where(kind == CIRCLE, circle_hit, bbox_hit))
    if geometries is not None:
        candidates = np.flatnonzero(hit & (kind == BOX_ONLY))
        if len(candidates):
            import shapely

            query = shapely.box(xmin, ymin, xmax, ymax)
            exact = shapely.intersects(np.asarray(geometries, dtype=object)[candidates], query)
            hit[candidates] = exact
    return hit
