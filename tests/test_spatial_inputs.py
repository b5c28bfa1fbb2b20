"""Bad spatial inputs get one clear error naming the value and the way forward, and leave
nothing behind; valid extremes give the right result."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import spatial_counts

import deltacells as dc
from deltacells.export import to_spatialdata

gpd = pytest.importorskip("geopandas", reason="the spatial extra")
shapely = pytest.importorskip("shapely")

N = 60


@pytest.fixture(scope="module")
def cells():
    adata = spatial_counts(N, 15, extent=100, max_count=9, seed=3)
    boxes = [shapely.box(x, y, x + 1, y + 1) for x, y in adata.obsm["spatial"]]
    return adata, boxes


def _shapes(adata, boxes, first):
    return gpd.GeoDataFrame(geometry=[first, *boxes[1:]], index=adata.obs_names)


#: (name, options built from (adata, boxes), what the error says).
BAD_WRITES = [
    ("empty polygon", lambda a, b: {"shapes": _shapes(a, b, shapely.Polygon())},
     "cell 'c0' has an empty shape (1 cell in all); give every cell a shape"),
    ("NaN vertex", lambda a, b: {"shapes": _shapes(a, b, shapely.Polygon(
        [(0, 0), (1, np.nan), (1, 1)]))}, "cell 'c0' has a NaN or infinite vertex"),
    ("3-D polygon", lambda a, b: {"shapes": _shapes(a, b, shapely.Polygon(
        [(0, 0, 1), (1, 0, 1), (1, 1, 1)]))}, "cell 'c0' has a 3-D shape"),
    ("a line", lambda a, b: {"shapes": _shapes(a, b, shapely.LineString([(0, 0), (1, 1)]))},
     "cell 'c0' is a LineString; only points"),
    ("missing shape", lambda a, b: {"shapes": _shapes(a, b, None)},
     "cell 'c0' is a missing shape (None)"),
    ("3 tile sizes", lambda a, b: {"spatial_key": "spatial", "grid_tile_size": (1, 2, 3)},
     "grid_tile_size must be a positive number or two (x, y), not 3 values"),
    ("tile size as text", lambda a, b: {"spatial_key": "spatial", "grid_tile_size": "5"},
     "grid_tile_size must be a positive number or two (x, y), not the text '5'"),
    ("negative tile size", lambda a, b: {"spatial_key": "spatial", "grid_tile_size": -1},
     "grid_tile_size must be a positive number"),
    ("NaN origin", lambda a, b: {"spatial_key": "spatial", "origin": (np.nan, 0)},
     "origin must be two finite numbers (x, y), not (nan, 0)"),
    ("3-value origin", lambda a, b: {"spatial_key": "spatial", "origin": (0, 0, 0)},
     "origin must be two finite numbers (x, y), not 3 values"),
    ("origin inside the cells", lambda a, b: {"spatial_key": "spatial", "origin": (50, 50)},
     "is not below and left of every centroid"),
    ("too fine a grid", lambda a, b: {"spatial_key": "spatial", "grid_tile_size": 0.01},
     "choose a larger grid_tile_size"),
    ("a missing shapes file", lambda a, b: {"shapes": "nothere.parquet"},
     "shapes file nothere.parquet: not found"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "options", "message"), BAD_WRITES,
                         ids=[case[0] for case in BAD_WRITES])  # fmt: skip
def test_bad_spatial_writes_are_named_and_leave_nothing(cells, tmp_path, monkeypatch, name,
                                                        options, message):  # fmt: skip
    adata, boxes = cells
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "out.dc"
    with pytest.raises((ValueError, FileNotFoundError)) as caught:
        dc.write_deltacells(adata, target, progress=False, **options(adata, boxes))
    assert message in str(caught.value)
    assert not target.exists()


def test_self_intersecting_shapes_are_kept_with_a_warning(cells, tmp_path):
    adata, boxes = cells
    bowtie = shapely.Polygon([(0, 0), (1, 1), (1, 0), (0, 1)])
    with pytest.warns(UserWarning, match=r"1 cell' shapes are not valid polygons, e\.g\. 'c0' "
                      r"\(Self-intersection"):  # fmt: skip
        dc.write_deltacells(adata, tmp_path / "d", shapes=_shapes(adata, boxes, bowtie),
                            progress=False)  # fmt: skip
    dataset = dc.open_dataset(tmp_path / "d")
    stored = np.asarray([bowtie, *boxes[1:]], dtype=object)[dataset.cell_order()]
    for box in [(0, 0, 0.2, 0.2), (0.4, 0.4, 0.6, 0.6), (-5, -5, 200, 200)]:
        truth = np.flatnonzero(shapely.intersects(stored, shapely.box(*box)))
        np.testing.assert_array_equal(dataset.query_bbox(box).rows, truth)


def test_box_queries_take_extreme_boxes_and_refuse_meaningless_ones(cells, tmp_path):
    adata, _ = cells
    dc.write_deltacells(adata, tmp_path / "d", spatial_key="spatial", grid_tile_size=0.1,
                        progress=False)  # fmt: skip
    dataset = dc.open_dataset(tmp_path / "d")
    assert dataset.spatial_index().n_grid_tiles > 900_000
    assert len(dataset.query_bbox((-1e308, -1e308, 1e308, 1e308)).rows) == N
    for box, message in [((0, 0, np.inf, np.inf), "bbox must be finite"),
                         ((np.nan, 0, 1, 1), "bbox must be finite"),
                         ((5, 5, 1, 1), "xmin <= xmax"),
                         ("1234", "must be four numbers")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            dataset.query_bbox(box)


def test_export_point_radius_is_checked(cells, tmp_path):
    adata, _ = cells
    dc.write_deltacells(adata, tmp_path / "d", spatial_key="spatial", progress=False)
    with pytest.raises(ValueError, match="pass point_radius"):
        to_spatialdata(tmp_path / "d", tmp_path / "a.zarr")
    for radius in (-1, 0, np.nan):
        with pytest.raises(ValueError, match=r"point_radius=.* must be a positive number"):
            to_spatialdata(tmp_path / "d", tmp_path / "b.zarr", point_radius=radius)
