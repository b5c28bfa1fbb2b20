"""SpatialData export (RFC 4): a zarr store that spatialdata reads, with the cells as a shapes
element in tile order and the expression table both cell-major and gene-major.

Written here without importing spatialdata (it needs Python >= 3.12; the tests read the
result with spatialdata in a virtualenv of its own): the shapes parquet through geopandas and
pyarrow, the table through anndata's element IO, the element metadata as spatialdata 0.8
writes it, plus RFC 4's additions (``spatial_index`` with the margin in the shapes element's
attributes, ``index/0/tile_offsets``, row groups of whole grid tiles, integer instance ids,
GeoArrow geometry, ``layers/X_csc``).
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["ROW_GROUP_MIN_ROWS", "SPATIALDATA_VERSION", "row_group_tiles", "to_spatialdata"]

#: The spatialdata store layout written (root ``spatialdata_attrs.version``; shapes elements
#: are version 0.3 and tables 0.2, as spatialdata 0.8 writes them).
SPATIALDATA_VERSION = "0.2"
_SHAPES_VERSION = "0.3"
_TABLE_VERSION = "0.2"
_INSTANCE_KEY = "instance_id"
_REGION_KEY = "region"
#: The shapes' column holding the cells' names (obs names); the index is the instance id.
_NAME_COLUMN = "cell_id"
#: Rows a parquet row group holds at least (the last may hold fewer): consecutive grid tiles
#: share a group, so a fine grid does not make one group (and footer entry) per tile.
ROW_GROUP_MIN_ROWS = 8192


def _instance_ids(n: int) -> pd.Index:
    """Integer instance ids 0..n-1 in stored order: what spatialdata joins tables on (string
    ids make its join slow)."""
    return pd.RangeIndex(n, name=_INSTANCE_KEY)


def row_group_tiles(tile_offsets: np.ndarray, min_rows: int = ROW_GROUP_MIN_ROWS) -> np.ndarray:
    """The first grid tile of each parquet row group, then the number of grid tiles: whole
    consecutive tiles, each group holding at least ``min_rows`` rows (the last one may hold
    fewer)."""
    offsets = np.asarray(tile_offsets, dtype=np.int64)
    n_tiles = len(offsets) - 1
    firsts = [0]
    while True:
        target = offsets[firsts[-1]] + min_rows
        # the first tile boundary at or past the target ends the group
        end = int(np.searchsorted(offsets, target, side="left"))
        if end >= n_tiles:
            break
        firsts.append(max(end, firsts[-1] + 1))
    return np.asarray([*firsts, n_tiles], dtype=np.int64)


def _identity_transform(coordinate_system: str) -> list[dict]:
    axes = [{"name": a, "type": "space", "unit": "unit"} for a in ("x", "y")]
    return [{"type": "identity", "input": {"name": "xy", "axes": axes},
             "output": {"name": coordinate_system, "axes": axes}}]  # fmt: skip


def _shapes_frame(dataset: Any, obs_names: pd.Index, point_radius: float | None):
    """The cells as a GeoDataFrame in stored order: circles (points with a radius) or
    MultiPolygons (a column mixing Polygon and MultiPolygon becomes MultiPolygon). spatialdata
    has no shapes of radius 0, so cells stored as points take ``point_radius``."""
    import geopandas as gpd
    import shapely

    reader = dataset.spatial()
    n = dataset.manifest.n_cells
    centroids = reader._centroids.whole()
    records = reader._records.whole() if reader._records is not None else None
    if records is None or (records[:, 0] != 2.0).sum() == n:
        kinds = np.zeros(n) if records is None else records[:, 0]
    else:
        kinds = records[:, 0]
    polygons = kinds == 2.0
    if polygons.any() and not polygons.all():
        raise ValueError("cells mix polygons with points or circles; one shapes element holds "
                         "one kind (write them as separate datasets)")  # fmt: skip
    if polygons.all() and n:
        wkb_rows = reader._polygons(0, n, records)
        geoms = [g if isinstance(g, shapely.MultiPolygon) else shapely.MultiPolygon([g])
                 for g in wkb_rows]  # fmt: skip
        return gpd.GeoDataFrame({_NAME_COLUMN: np.asarray(obs_names, dtype=object)},
                                geometry=geoms, index=_instance_ids(n))  # fmt: skip
    radius = records[:, 1].copy() if records is not None else np.zeros(n)
    points = kinds == 0.0
    if points.any():
        if point_radius is None:
            raise ValueError("the dataset's cells are points (centroids without shapes); "
                             "spatialdata stores them as circles: pass point_radius (e.g. "
                             "the spot radius) or write the dataset with shapes=")  # fmt: skip
        if not (np.isfinite(point_radius) and point_radius > 0):
            raise ValueError(f"point_radius={point_radius!r} must be a positive number (the "
                             "circles' radius, e.g. the spot radius)")  # fmt: skip
        radius[points] = float(point_radius)
    frame = gpd.GeoDataFrame({"radius": radius,
                              _NAME_COLUMN: np.asarray(obs_names, dtype=object)},
                             geometry=gpd.points_from_xy(centroids[:, 0], centroids[:, 1]),
                             index=_instance_ids(n))  # fmt: skip
    return frame


def _write_shapes(group_path: Path, frame, offsets: np.ndarray | None) -> None:
    """shapes.parquet with GeoArrow geometry and, when ``offsets`` are given, row groups of
    whole consecutive grid tiles (see :func:`row_group_tiles`)."""
    import pyarrow.parquet as pq

    group_path.mkdir(parents=True, exist_ok=True)
    target = group_path / "shapes.parquet"
    # geopandas writes the GeoParquet metadata; the rows are then regrouped by grid tile.
    with tempfile.TemporaryDirectory() as tmp:
        staged = Path(tmp) / "shapes.parquet"
        frame.to_parquet(staged, geometry_encoding="geoarrow", index=True)
        table = pq.read_table(staged)
    if offsets is None:
        pq.write_table(table, target)
        return
    groups = row_group_tiles(offsets)
    with pq.ParquetWriter(target, table.schema) as writer:
        for first, end in itertools.pairwise(groups):
            start, stop = int(offsets[first]), int(offsets[end])
            writer.write_table(
                table.slice(start, stop - start), row_group_size=max(stop - start, 1)
            )


def to_spatialdata(
    url_or_path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    shapes_name: str = "cells",
    table_name: str = "table",
    point_radius: float | None = None,
    storage_options: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a spatially ordered dataset as a SpatialData zarr store.

    The store holds ``shapes/<shapes_name>`` (the cells in tile order: GeoArrow geometry,
    integer instance ids 0..n-1 as the index and the cells' names in a ``cell_id`` column,
    parquet row groups of whole consecutive grid tiles of at least
    ``ROW_GROUP_MIN_ROWS`` (8,192) rows, ``spatial_index`` with the margin and the row groups'
    first tiles (``row_group_tiles``) in the element's attributes and
    ``index/0/tile_offsets``) and ``tables/<table_name>`` (X as CSR and ``layers["X_csc"]``
    as CSC of the same values, in the counts' dtype as written, rows in the shapes' order,
    obs names as written, annotating the shapes through the ``region`` and integer
    ``instance_id`` obs columns). Polygons and
    multipolygons are written as MultiPolygon, circles as points with a ``radius`` column.

    Parameters
    ----------
    url_or_path
        The dataset (written with ``spatial_key=`` or ``shapes=``).
    out
        A local directory for the zarr store.
    shapes_name, table_name
        Element names.
    point_radius
        Radius of the circles that cells stored as points (centroids from ``spatial_key``)
        become: spatialdata has no shapes of radius 0. Required for such datasets.
    storage_options
        fsspec options for a remote dataset.
    overwrite
        Replace an existing ``out``.

    Returns
    -------
    pathlib.Path
        ``out``.

    Notes
    -----
    The table is built in memory (X and its CSC copy): about 24 bytes per nonzero.
    """
    import shutil
    import warnings

    import anndata as ad
    import zarr

    from deltacells.read.assemble import read_deltacells
    from deltacells.read.dataset import open_dataset

    out = Path(out).expanduser()
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists; pass overwrite=True to replace it")
        shutil.rmtree(out)
    dataset = open_dataset(url_or_path, storage_options=storage_options)
    index = dataset.spatial_index()
    if index is None:
        raise ValueError(f"{dataset.store.describe()}: not written in spatial order; write it "
                         "with spatial_key= or shapes= to export shapes in tile order")  # fmt: skip
    adata = read_deltacells(url_or_path, storage_options=storage_options,
                            elements=False).to_memory()  # fmt: skip
    frame = _shapes_frame(dataset, adata.obs_names, point_radius)
    offsets = dataset.spatial().tile_offsets

    root = zarr.open_group(str(out), mode="w", zarr_format=3)
    root.attrs["spatialdata_attrs"] = {"version": SPATIALDATA_VERSION}
    shapes = root.create_group("shapes")
    element = shapes.create_group(shapes_name)
    spatial_index = {k: v for k, v in index.to_json().items() if k != "tile_offsets"}
    spatial_index["tile_offsets"] = "index/0/tile_offsets"
    # Which grid tiles each parquet row group holds (its first; the last entry is the count).
    spatial_index["row_group_tiles"] = row_group_tiles(offsets).tolist()
    element.attrs.update({
        "encoding-type": "ngff:shapes",
        "axes": ["x", "y"],
        "coordinateTransformations": _identity_transform(index.coordinate_system),
        "spatialdata_attrs": {"version": _SHAPES_VERSION},
        "spatial_index": spatial_index,
    })  # fmt: skip
    element.create_group("index").create_group("0").create_array(
        "tile_offsets", data=np.asarray(offsets, dtype=np.int64)
    )
    _write_shapes(out / "shapes" / shapes_name, frame, offsets)

    table = ad.AnnData(X=adata.X, obs=adata.obs.copy(), var=adata.var)
    table.layers["X_csc"] = adata.X.tocsc()
    table.obs[_REGION_KEY] = pd.Categorical([shapes_name] * table.n_obs)
    table.obs[_INSTANCE_KEY] = np.arange(table.n_obs, dtype=np.int64)
    table.uns["spatialdata_attrs"] = {"region": shapes_name, "region_key": _REGION_KEY,
                                      "instance_key": _INSTANCE_KEY}  # fmt: skip
    tables = root.create_group("tables")
    ad.io.write_elem(tables, table_name, table)
    tables[table_name].attrs.update({
        "spatialdata-encoding-type": "ngff:regions_table", "region": shapes_name,
        "region_key": _REGION_KEY, "instance_key": _INSTANCE_KEY, "version": _TABLE_VERSION,
    })  # fmt: skip
    with warnings.catch_warnings():
        # zarr says consolidated metadata is not part of the v3 spec yet; spatialdata writes it.
        warnings.simplefilter("ignore", UserWarning)
        zarr.consolidate_metadata(str(out))
    return out
