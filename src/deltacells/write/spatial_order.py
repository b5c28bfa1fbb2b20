"""The writer's side of spatial order: centroids and shapes of the input's cells, the grid,
the cell order and the files that hold them (see :mod:`deltacells.spatial.grid`)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from deltacells.codec.format import FormatError
from deltacells.codec.npy import npy_bytes
from deltacells.spatial.grid import (
    BOX_ONLY,
    CENTROIDS_NAME,
    CIRCLE,
    GEOMETRY_NAME,
    GEOMETRY_OFFSETS_NAME,
    GRID_SUMS_NAME,
    POINT,
    SHAPES_NAME,
    TILE_OFFSETS_NAME,
    SpatialIndex,
    choose_grid,
    grid_checksums,
    margin_of,
    tile_ids,
)


@dataclass
class SpatialPlan:
    """What the writer stores for a spatially ordered dataset."""

    index: SpatialIndex
    cell_order: np.ndarray  # stored row i is source row cell_order[i]
    tile_offsets: np.ndarray
    centroids: np.ndarray  # stored order
    records: np.ndarray | None  # stored order; None when all cells are points
    wkb: list[bytes] | None  # stored order; polygons only

    def files(self) -> dict[str, bytes]:
        """File name -> bytes of everything this plan stores."""
        out = {TILE_OFFSETS_NAME: npy_bytes(self.tile_offsets),
               CENTROIDS_NAME: npy_bytes(self.centroids)}  # fmt: skip
        if self.records is not None:
            out[SHAPES_NAME] = npy_bytes(self.records)
        if self.wkb is not None:
            lengths = np.fromiter((len(b) for b in self.wkb), dtype=np.int64, count=len(self.wkb))
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            out[GEOMETRY_OFFSETS_NAME] = npy_bytes(offsets)
            out[GEOMETRY_NAME] = b"".join(self.wkb)
        out[GRID_SUMS_NAME] = npy_bytes(grid_checksums(out, self.tile_offsets))
        return out


def plan_spatial_order(
    source: Any,
    obs_names: pd.Index,
    *,
    spatial_key: str | None,
    shapes: Any,
    grid_tile_size: Any,
    origin: Any,
    coordinate_system: str = "global",
) -> SpatialPlan:
    """Centroids (``obsm[spatial_key]`` or the shapes'), grid, stable tile order, margin."""
    records = wkb = None
    bounds = None
    if shapes is not None:
        centroids, records, bounds, wkb = _from_shapes(shapes, obs_names)
    else:
        centroids = _obsm_coordinates(source, spatial_key)
    if len(centroids) != len(obs_names):
        raise ValueError(f"{len(centroids)} spatial coordinates for {len(obs_names)} cells")
    if not np.isfinite(centroids).all():
        bad = int(np.flatnonzero(~np.isfinite(centroids).all(axis=1))[0])
        raise ValueError(f"cell {bad} ({obs_names[bad]!r}) has a NaN or infinite coordinate")
    grid_origin, size, shape = choose_grid(centroids, grid_tile_size, origin)
    index = SpatialIndex(origin=grid_origin, tile_size=size, grid_shape=shape,
                         margin=margin_of(centroids, bounds), n_rows=len(centroids),
                         coordinate_system=coordinate_system)  # fmt: skip
    ids = tile_ids(centroids, index)
    order = np.argsort(ids, kind="stable").astype(np.int64)
    counts = np.bincount(ids, minlength=index.n_grid_tiles)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return SpatialPlan(
        index=index, cell_order=order, tile_offsets=offsets,
        centroids=np.ascontiguousarray(centroids[order]),
        records=None if records is None else np.ascontiguousarray(records[order]),
        wkb=None if wkb is None else [wkb[i] for i in order],
    )  # fmt: skip


def _obsm_coordinates(source: Any, key: str | None) -> np.ndarray:
    from deltacells.write.extras import _Source

    if key is None:
        raise ValueError("spatial order needs spatial_key (an obsm key) or shapes")
    src = _Source(source)
    try:
        value = src.obsm_entry(key)
    finally:
        src.close()
    where = "the AnnData" if src.adata is not None else os.fspath(source)
    if value is None:
        raise ValueError(f"{where} has no obsm[{key!r}] to order cells by")
    value = np.asarray(value, dtype=np.float64)
    if value.ndim != 2 or value.shape[1] != 2:
        raise ValueError(f"obsm[{key!r}] must hold x and y per cell (n x 2), not shape "
                         f"{value.shape}; spatial order is 2-D")  # fmt: skip
    return value


def _check_geometries(geoms: np.ndarray, is_point: np.ndarray, obs_names: pd.Index,
                      shapely: Any) -> None:  # fmt: skip
    """Shapes a box query could not answer right (empty, 3-D, non-finite ones), refused
    naming the first cell and the fix; invalid (self-intersecting) ones kept with a warning."""

    def refuse(mask: np.ndarray, problem: str, fix: str) -> None:
        if mask.any():
            first = int(np.flatnonzero(mask)[0])
            count = int(mask.sum())
            raise ValueError(f"shapes: cell {obs_names[first]!r} {problem} ({count} "
                             f"{'cell' if count == 1 else 'cells'} in all); {fix}")  # fmt: skip

    refuse(shapely.is_empty(geoms), "has an empty shape", "give every cell a shape")
    refuse(shapely.has_z(geoms), "has a 3-D shape", "spatial order is 2-D: drop z with "
           "shapely.force_2d")  # fmt: skip
    finite = np.array([np.isfinite(shapely.get_coordinates(g)).all() for g in geoms])
    refuse(~finite, "has a NaN or infinite vertex", "fix or drop those vertices")
    invalid = ~is_point & ~shapely.is_valid(geoms)
    if invalid.any():
        # Box queries test such shapes as they are (shapely's predicates take them), so they
        # are kept, but other tools may refuse them: say so.
        first = int(np.flatnonzero(invalid)[0])
        count = int(invalid.sum())
        warnings.warn(f"shapes: {count} {'cell' if count == 1 else 'cells'}' shapes are not "
                      f"valid polygons, e.g. {obs_names[first]!r} "
                      f"({shapely.is_valid_reason(geoms[first])}); stored as given (box "
                      "queries test them as they are); repair them with shapely.make_valid "
                      "if other tools need valid ones", UserWarning, stacklevel=4)  # fmt: skip


def _from_shapes(shapes: Any, obs_names: pd.Index):
    """Centroids, shape records, bounds and WKB (polygons) of a GeoDataFrame or GeoParquet
    path, one shape per cell, joined by obs name."""
    try:
        import geopandas as gpd
        import shapely
    except ImportError as err:
        raise ImportError("shapes need geopandas: pip install 'deltacells[spatial]'") from err
    if isinstance(shapes, str | os.PathLike):
        shapes = os.path.expanduser(os.fspath(shapes))
        if not os.path.exists(shapes):
            raise FileNotFoundError(f"shapes file {os.fspath(shapes)}: not found (a GeoParquet "
                                    "file with one shape per obs name)")  # fmt: skip
        try:
            frame = gpd.read_parquet(shapes)
        except (OSError, ValueError) as err:
            raise FormatError(f"shapes file {os.fspath(shapes)}: not a GeoParquet file "
                              f"({err})") from err  # fmt: skip
    else:
        frame = shapes
    if not isinstance(frame, gpd.GeoDataFrame):
        raise TypeError(f"shapes must be a GeoDataFrame or a GeoParquet path, not {type(frame)}")
    index = frame.index.astype(str)
    if index.has_duplicates:
        raise ValueError(f"shapes: {index[index.duplicated()][0]!r} has more than one shape")
    missing = pd.Index(obs_names.astype(str)).difference(index)
    if len(missing):
        raise ValueError(f"shapes: no shape for {len(missing)} cells, e.g. {missing[0]!r}")
    frame = frame.set_axis(index).loc[obs_names.astype(str)]
    geoms = np.asarray(frame.geometry.values, dtype=object)
    kinds = shapely.get_type_id(geoms)
    point, polygon, multi = 0, 3, 6
    if not np.isin(kinds, [point, polygon, multi]).all():
        bad = int(np.flatnonzero(~np.isin(kinds, [point, polygon, multi]))[0])
        kind = "missing shape (None)" if geoms[bad] is None else geoms[bad].geom_type
        raise ValueError(f"shapes: cell {obs_names[bad]!r} is a {kind}; only points (circles "
                         "with a radius column), polygons and multipolygons are supported")
    _check_geometries(geoms, kinds == point, obs_names, shapely)
    is_point = kinds == point
    radius = frame["radius"].to_numpy(dtype=np.float64) if "radius" in frame.columns \
        else np.zeros(len(frame))  # fmt: skip
    if (radius[is_point] < 0).any() or not np.isfinite(radius[is_point]).all():
        raise ValueError("shapes: a circle's radius is negative or not finite")
    centroids = np.empty((len(geoms), 2))
    centroids[is_point] = shapely.get_coordinates(geoms[is_point])[:, :2]
    if (~is_point).any():
        middle = shapely.centroid(geoms[~is_point])
        centroids[~is_point] = shapely.get_coordinates(middle)[:, :2]
    bounds = shapely.bounds(geoms)
    bounds[is_point] = np.column_stack([centroids[is_point] - radius[is_point, None],
                                        centroids[is_point] + radius[is_point, None]])  # fmt: skip
    records = np.zeros((len(geoms), 5))
    records[:, 0] = np.where(is_point, np.where(radius > 0, CIRCLE, POINT), BOX_ONLY)
    records[is_point, 1] = radius[is_point]
    records[~is_point, 1:5] = bounds[~is_point]
    wkb = None
    if (~is_point).any():
        wkb = [b"" if p else shapely.to_wkb(g) for g, p in zip(geoms, is_point, strict=True)]
    return centroids, records, bounds, wkb
