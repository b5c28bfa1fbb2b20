"""SpatialData export (RFC 4): a zarr store that spatialdata reads, with the cells as a shapes
element in tile order and the expression table both cell-major and gene-major.

Written here without importing spatialdata (it needs Python >= 3.12; the tests read the
result with spatialdata in a virtualenv of its own): the shapes parquet through geopandas and
pyarrow, the table through anndata's element IO, the element metadata as spatialdata 0.8
writes it, plus RFC 4's additions (``spatial_index`` with the margin in the shapes element's
attributes, ``index/0/tile_offsets``, one parquet row group per grid tile, GeoArrow geometry,
``layers/X_csc``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["SPATIALDATA_VERSION", "to_spatialdata"]

#: The spatialdata store layout written (root ``spatialdata_attrs.version``; shapes elements
#: are version 0.3 and tables 0.2, as spatialdata 0.8 writes them).
SPATIALDATA_VERSION = "0.2"
_SHAPES_VERSION = "0.3"
_TABLE_VERSION = "0.2"
_INSTANCE_KEY = "instance_id"
_REGION_KEY = "region"


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
        return gpd.GeoDataFrame(geometry=geoms, index=obs_names)
    radius = records[:, 1].copy() if records is not None else np.zeros(n)
    points = kinds == 0.0
    if points.any():
        if point_radius is None or not point_radius > 0:
            raise ValueError("the dataset's cells are points (centroids without shapes); "
                             "spatialdata stores them as circles: pass point_radius (e.g. "
                             "the spot radius) or write the dataset with shapes=")  # fmt: skip
        radius[points] = float(point_radius)
    frame = gpd.GeoDataFrame({"radius": radius},
                             geometry=gpd.points_from_xy(centroids[:, 0], centroids[:, 1]),
                             index=obs_names)  # fmt: skip
    return frame


def _write_shapes(group_path: Path, frame, offsets: np.ndarray | None) -> None:
    """shapes.parquet with GeoArrow geometry and, when ``offsets`` are given, one row group per
    grid tile (empty ones included)."""
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
    with pq.ParquetWriter(target, table.schema) as writer:
        for k in range(len(offsets) - 1):
            writer.write_table(table.slice(int(offsets[k]), int(offsets[k + 1] - offsets[k])))


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

    The store holds ``shapes/<shapes_name>`` (the cells in tile order: GeoArrow geometry, one
    parquet row group per grid tile, ``spatial_index`` with the margin in the element's
    attributes and ``index/0/tile_offsets``) and ``tables/<table_name>`` (X as CSR and
    ``layers["X_csc"]`` as CSC of the same values, rows in the shapes' order, annotating the
    shapes through the ``region`` and ``instance_id`` obs columns). Polygons and
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

    from deltacells.backed import read_deltacells
    from deltacells.dataset import open_dataset

    out = Path(out)
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
    element.attrs.update({
        "encoding-type": "ngff:shapes",
        "axes": ["x", "y"],
        "coordinateTransformations": _identity_transform(index.coordinate_system),
        "spatialdata_attrs": {"version": _SHAPES_VERSION},
        "spatial_index": spatial_index,
    })  # fmt: skip
    element.create_group("index").create_group("0").create_array(
        "tile_offsets", data=np.asarray(offsets, dtype=np.int64))
    _write_shapes(out / "shapes" / shapes_name, frame, offsets)

    table = ad.AnnData(X=adata.X, obs=adata.obs.copy(), var=adata.var)
    table.layers["X_csc"] = adata.X.tocsc()
    table.obs[_REGION_KEY] = pd.Categorical([shapes_name] * table.n_obs)
    table.obs[_INSTANCE_KEY] = np.asarray(adata.obs_names, dtype=object)
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
