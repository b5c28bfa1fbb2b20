"""Spatial order (RFC 4 as NOTES.md applies it): the grid conventions, writing in tile order,
and box queries checked against brute force on real Visium spots, circles and polygons."""

from __future__ import annotations

import json

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import DATA_DIR

import deltacells as dc
from deltacells.spatial.grid import (
    SpatialIndex,
    choose_grid,
    grid_tiles_overlapping,
    margin_of,
    select_in_box,
    tile_ids,
)
from deltacells.testing import reseal

VISIUM = DATA_DIR / "visium_multisample.h5ad"


def index(origin=(0.0, 0.0), size=(10.0, 10.0), shape=(3, 4), margin=(0.0, 0.0), n=0):
    return SpatialIndex(origin=origin, tile_size=size, grid_shape=shape, margin=margin,
                        n_rows=n)  # fmt: skip


# -- the grid ---------------------------------------------------------------------------------


def test_tile_ids_are_c_order_over_x_then_y_with_half_open_tiles():
    idx = index()
    xy = np.array([[0, 0], [0, 39.9], [10, 0], [9.999, 10], [29.9, 39.9]], dtype=float)
    # k = ix * ny + iy with ny = 4
    assert tile_ids(xy, idx).tolist() == [0, 3, 4, 1, 11]


def test_last_tile_is_closed_at_the_upper_edge_and_outliers_are_clipped():
    idx = index()
    xy = np.array([[30.0, 40.0], [-5.0, -5.0], [100.0, 2.0]])
    assert tile_ids(xy, idx).tolist() == [11, 0, 8]


def test_default_grid_rule():
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 1000, size=(20_000, 2))
    origin, size, shape = choose_grid(xy)
    assert origin == tuple(xy.min(axis=0))
    # about 250 cells per tile: 80 tiles over the box, square
    assert size[0] == size[1]
    assert 70 <= shape[0] * shape[1] <= 100
    assert np.bincount(tile_ids(xy, index(origin, size, shape))).mean() == pytest.approx(
        20_000 / (shape[0] * shape[1]))  # fmt: skip
    assert choose_grid(xy, grid_tile_size=100.0, origin=(0, 0))[2] == (10, 10)
    with pytest.raises(ValueError, match="origin"):
        choose_grid(xy, origin=(500.0, 0.0))
    with pytest.raises(ValueError, match="more than"):
        choose_grid(xy, grid_tile_size=0.1)
    # all cells on a line: one tile across
    line = np.column_stack([np.arange(5000.0), np.zeros(5000)])
    assert choose_grid(line)[2][1] == 1


def test_margin_is_the_largest_overhang_per_axis():
    xy = np.array([[5.0, 5.0], [20.0, 20.0]])
    bounds = np.array([[4.0, 2.0, 7.0, 6.0], [19.5, 19.0, 20.5, 21.0]])
    assert margin_of(xy, bounds) == (2.0, 3.0)
    assert margin_of(xy, None) == (0.0, 0.0)


def test_grid_tiles_of_a_box_grow_by_the_margin():
    idx = index(margin=(5.0, 0.0))
    assert grid_tiles_overlapping(idx, (12, 12, 18, 18), grow=False).tolist() == [5]
    assert grid_tiles_overlapping(idx, (12, 12, 18, 18)).tolist() == [1, 5, 9]
    assert grid_tiles_overlapping(idx, (100, 100, 200, 200), grow=False).tolist() == [11]
    assert grid_tiles_overlapping(idx, (-50, -50, -40, -40), grow=False).tolist() == [0]
    with pytest.raises(ValueError, match="xmin <= xmax"):
        grid_tiles_overlapping(idx, (5, 0, 1, 1))


def test_borders_are_inclusive():
    xy = np.array([[0.0, 0.0], [10.0, 5.0], [10.000001, 5.0]])
    assert select_in_box((0, 0, 10, 10), xy, None).tolist() == [True, True, False]


# -- writing in spatial order ------------------------------------------------------------------


@pytest.fixture(scope="module")
def visium(tmp_path_factory):
    source = ad.read_h5ad(VISIUM)
    source.X = sp.csr_matrix(source.X)
    root = tmp_path_factory.mktemp("spatial") / "visium"
    dc.write_deltacells(source, root, spatial_key="spatial", tile_size=512, progress=False)
    return root, source


def test_cells_are_stored_in_grid_tile_order(visium):
    root, source = visium
    dataset = dc.open_dataset(root)
    idx = dataset.spatial_index()
    assert idx.n_rows == source.n_obs and idx.margin == (0.0, 0.0)
    meta = dataset.manifest.metadata
    assert meta["spatial_index"]["grid_shape"] == list(idx.grid_shape)
    assert meta["cell_order"] == "cell_order.npy"
    order = np.load(root / "cell_order.npy")
    ids = tile_ids(source.obsm["spatial"], idx)
    assert np.array_equal(order, np.argsort(ids, kind="stable"))
    offsets = np.load(root / "spatial" / "tile_offsets.npy")
    assert np.array_equal(offsets, np.concatenate([[0], np.cumsum(np.bincount(
        ids, minlength=idx.n_grid_tiles))]))  # fmt: skip
    back = dc.read_deltacells(root)
    assert list(back.obs_names) == list(source.obs_names[order])
    assert (back.X.to_memory() != source.X[order]).nnz == 0
    np.testing.assert_array_equal(back.obsm["spatial"], source.obsm["spatial"][order])
    np.testing.assert_array_equal(back.obs["array_row"], source.obs["array_row"].iloc[order])


def brute_force(points, box):
    xmin, ymin, xmax, ymax = box
    return np.flatnonzero((points[:, 0] >= xmin) & (points[:, 0] <= xmax)
                          & (points[:, 1] >= ymin) & (points[:, 1] <= ymax))  # fmt: skip


def random_boxes(points, n, seed=0):
    rng = np.random.default_rng(seed)
    lo, hi = points.min(axis=0), points.max(axis=0)
    for _ in range(n):
        a = rng.uniform(lo - 50, hi + 50)
        w = rng.uniform(0, (hi - lo) / 3)
        yield (a[0], a[1], a[0] + w[0], a[1] + w[1])


def test_box_queries_equal_brute_force_on_visium(visium):
    root, source = visium
    dataset = dc.open_dataset(root)
    stored = source.obsm["spatial"][np.load(root / "cell_order.npy")]
    points = stored.copy()
    boxes = list(random_boxes(points, 60))
    # Boxes whose edges pass exactly through spots: borders are inclusive.
    boxes += [(p[0], p[1], p[0] + 300, p[1] + 300) for p in points[::400]]
    total = 0
    for box in boxes:
        got = dataset.query_bbox(box)
        assert np.array_equal(got.rows, brute_force(points, box)), box
        assert np.array_equal(dataset.query_bbox(box, mode="centroid").rows, got.rows)
        total += len(got.rows)
    assert total > 500  # the boxes did select cells


def test_a_small_box_reads_a_small_part(visium):
    root, source = visium
    dataset = dc.open_dataset(root)
    centroids_bytes = (root / "spatial" / "centroids.npy").stat().st_size
    x, y = source.obsm["spatial"][0]
    query = dataset.query_bbox((x - 1, y - 1, x + 1, y + 1))
    assert len(query.rows) >= 1
    assert len(query.grid_tiles) <= 4
    assert query.bytes_read < centroids_bytes / 4


def test_read_deltacells_with_a_box(visium):
    root, source = visium
    points = source.obsm["spatial"]
    box = (float(np.median(points[:, 0])), float(np.median(points[:, 1])),
           float(np.median(points[:, 0])) + 800, float(np.median(points[:, 1])) + 800)  # fmt: skip
    sub = dc.read_deltacells(root, bbox=box)
    expected = set(source.obs_names[brute_force(points, box)])
    assert set(sub.obs_names) == expected and sub.n_obs == len(expected)
    back = sub.to_memory()
    rows = source.obs_names.get_indexer(back.obs_names)
    assert (back.X != source.X[rows]).nnz == 0
    np.testing.assert_array_equal(back.obsm["spatial"], points[rows])


def test_dataset_without_spatial_order_says_so(tmp_path):
    from test_writer import small_adata

    dc.write_deltacells(small_adata(), tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match="not written in spatial order"):
        dc.open_dataset(tmp_path / "d").query_bbox((0, 0, 1, 1))


def test_spatial_order_arguments_are_checked(tmp_path):
    from test_writer import small_adata

    adata = small_adata()
    with pytest.raises(ValueError, match="no obsm\\['spatial'\\]"):
        dc.write_deltacells(adata, tmp_path / "a", spatial_key="spatial", progress=False)
    adata.obsm["spatial"] = np.zeros((adata.n_obs, 3))
    with pytest.raises(ValueError, match="n x 2"):
        dc.write_deltacells(adata, tmp_path / "b", spatial_key="spatial", progress=False)
    adata.obsm["spatial"] = np.zeros((adata.n_obs, 2))
    adata.obsm["spatial"][7, 1] = np.nan
    with pytest.raises(ValueError, match=r"cell 7 .* NaN"):
        dc.write_deltacells(adata, tmp_path / "c", spatial_key="spatial", progress=False)
    adata.obsm["spatial"][7, 1] = 0
    with pytest.raises(ValueError, match="without shuffle"):
        dc.write_deltacells(adata, tmp_path / "d", spatial_key="spatial", shuffle=True,
                            progress=False)  # fmt: skip


def test_count_layers_follow_the_spatial_order(tmp_path):
    from test_writer import small_adata

    adata = small_adata(n_cells=400)
    adata.layers["counts"] = adata.X.copy()
    adata.obsm["spatial"] = np.random.default_rng(3).uniform(0, 100, (adata.n_obs, 2))
    dc.write_deltacells(adata, tmp_path / "d", spatial_key="spatial", grid_tile_size=20,
                        tile_size=64, progress=False)  # fmt: skip
    order = np.load(tmp_path / "d" / "cell_order.npy")
    back = dc.read_deltacells(tmp_path / "d").to_memory()
    assert (back.layers["counts"] != adata.layers["counts"][order]).nnz == 0
    assert list(back.obs_names) == list(adata.obs_names[order])


# -- hostile spatial files --------------------------------------------------------------------


@pytest.fixture
def small_spatial(tmp_path):
    from test_writer import small_adata

    adata = small_adata(n_cells=300)
    adata.obsm["spatial"] = np.random.default_rng(1).uniform(0, 100, (adata.n_obs, 2))
    dc.write_deltacells(adata, tmp_path / "d", spatial_key="spatial", grid_tile_size=25,
                        progress=False)  # fmt: skip
    return tmp_path / "d"


@pytest.mark.parametrize(("key", "value", "match"), [
    ("grid_shape", [0, 4], "grid_shape"),
    ("grid_shape", [2048, 2048], "more than"),
    ("tile_size", [0.0, 1.0], "tile_size"),
    ("origin", ["a", 1.0], "origin"),
    ("margin", [-1.0, 0.0], "margin"),
    ("n_rows", 5, "n_rows"),
    ("order", "F", "order"),
])  # fmt: skip
def test_bad_spatial_index(small_spatial, key, value, match):
    path = small_spatial / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["metadata"]["spatial_index"][key] = value
    reseal(small_spatial, manifest)
    with pytest.raises(dc.FormatError, match=match):
        dc.open_dataset(small_spatial).query_bbox((0, 0, 10, 10))


def test_tile_offsets_that_do_not_rise(small_spatial):
    path = small_spatial / "spatial" / "tile_offsets.npy"
    offsets = np.load(path)
    offsets[3], offsets[4] = offsets[4] + 1, offsets[3]
    np.save(path, offsets)
    with pytest.raises(dc.FormatError, match=r"tile_offsets\.npy: SHA-256"):
        dc.open_dataset(small_spatial).query_bbox((0, 0, 10, 10))
    reseal(small_spatial)
    with pytest.raises(dc.FormatError, match=r"tile_offsets\.npy: tile offsets must rise"):
        dc.open_dataset(small_spatial).query_bbox((0, 0, 10, 10))


def test_centroids_of_the_wrong_size(small_spatial):
    path = small_spatial / "spatial" / "centroids.npy"
    np.save(path, np.load(path)[:-1])
    with pytest.raises(dc.FormatError, match=r"centroids\.npy: expected float64 \(300, 2\)"):
        dc.open_dataset(small_spatial).query_bbox((0, 0, 10, 10))
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(dc.FormatError, match=r"centroids\.npy"):
        dc.open_dataset(small_spatial).query_bbox((0, 0, 10, 10))


# -- shapes: circles and polygons ----------------------------------------------------------------

gpd = pytest.importorskip("geopandas", reason="shapes need the spatial extra")
shapely = pytest.importorskip("shapely")


def shaped_adata(n=600, seed=5):
    from test_writer import small_adata

    adata = small_adata(n_cells=n, seed=seed)
    rng = np.random.default_rng(seed)
    centres = rng.uniform(0, 200, (n, 2))
    return adata, centres, rng


def test_circles_intersect_exactly_and_need_the_margin(tmp_path):
    adata, centres, rng = shaped_adata()
    radius = rng.uniform(0.5, 6.0, len(centres))
    shapes = gpd.GeoDataFrame({"radius": radius}, geometry=gpd.points_from_xy(*centres.T),
                              index=adata.obs_names)  # fmt: skip
    root = tmp_path / "circles"
    dc.write_deltacells(adata, root, shapes=shapes, grid_tile_size=20, progress=False)
    dataset = dc.open_dataset(root)
    assert dataset.spatial_index().margin == pytest.approx((radius.max(), radius.max()))
    order = np.load(root / "cell_order.npy")
    c, r = centres[order], radius[order]
    truth_geoms = shapely.buffer(shapely.points(c), r, quad_segs=64)
    missed_without_margin = 0
    for box in random_boxes(c, 80, seed=2):
        got = dataset.query_bbox(box).rows
        dx = np.maximum(np.maximum(box[0] - c[:, 0], c[:, 0] - box[2]), 0)
        dy = np.maximum(np.maximum(box[1] - c[:, 1], c[:, 1] - box[3]), 0)
        assert np.array_equal(got, np.flatnonzero(dx**2 + dy**2 <= r**2)), box
        # the polygonised circles agree except within the polygon's tolerance
        approx = np.flatnonzero(shapely.intersects(truth_geoms, shapely.box(*box)))
        assert len(np.setxor1d(got, approx)) <= 1
        assert np.array_equal(dataset.query_bbox(box, mode="centroid").rows, brute_force(c, box))
    # With the margin zeroed, boxes miss circles that poke in from a neighbouring grid tile.
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["metadata"]["spatial_index"]["margin"] = [0.0, 0.0]
    reseal(root, manifest)
    no_margin = dc.open_dataset(root)
    for box in random_boxes(c, 80, seed=2):
        missed_without_margin += len(np.setdiff1d(dataset.query_bbox(box).rows,
                                                  no_margin.query_bbox(box).rows))  # fmt: skip
    assert missed_without_margin > 0


def test_polygons_intersect_exactly(tmp_path):
    adata, centres, rng = shaped_adata(n=400, seed=8)
    polys = []
    for (x, y), k in zip(centres, rng.integers(3, 8, len(centres)), strict=True):
        angles = np.sort(rng.uniform(0, 2 * np.pi, k))
        radii = rng.uniform(1, 8, k)
        polys.append(shapely.Polygon(np.column_stack([x + radii * np.cos(angles),
                                                      y + radii * np.sin(angles)])))  # fmt: skip
    # a few multipolygons
    for i in range(0, len(polys), 50):
        polys[i] = shapely.MultiPolygon([polys[i], shapely.affinity.translate(polys[i], 10, 0)])
    shapes = gpd.GeoDataFrame(geometry=polys, index=adata.obs_names)
    root = tmp_path / "polygons"
    dc.write_deltacells(adata, root, shapes=shapes, grid_tile_size=25, progress=False)
    dataset = dc.open_dataset(root)
    order = np.load(root / "cell_order.npy")
    stored = np.asarray(polys, dtype=object)[order]
    mx, my = dataset.spatial_index().margin
    assert mx > 0 and my > 0
    selected = 0
    for box in random_boxes(centres, 80, seed=4):
        truth = np.flatnonzero(shapely.intersects(stored, shapely.box(*box)))
        got = dataset.query_bbox(box).rows
        assert np.array_equal(got, truth), box
        selected += len(got)
    assert selected > 100
    back = dc.read_deltacells(root, bbox=(50, 50, 80, 80))
    assert set(back.obs_names) == set(adata.obs_names[order][dataset.query_bbox((50, 50, 80,
                                                                                 80)).rows])


def test_shapes_must_cover_every_cell_once(tmp_path):
    adata, centres, _ = shaped_adata(n=50)
    shapes = gpd.GeoDataFrame(geometry=gpd.points_from_xy(*centres.T), index=adata.obs_names)
    with pytest.raises(ValueError, match="no shape for 1 cells"):
        dc.write_deltacells(adata, tmp_path / "a", shapes=shapes.iloc[1:], progress=False)
    twice = gpd.GeoDataFrame(geometry=[*shapes.geometry, shapes.geometry.iloc[0]],
                             index=[*adata.obs_names, adata.obs_names[0]])  # fmt: skip
    with pytest.raises(ValueError, match="more than one shape"):
        dc.write_deltacells(adata, tmp_path / "b", shapes=twice, progress=False)
    lines = gpd.GeoDataFrame(geometry=[shapely.LineString([(0, 0), (1, 1)])] * 50,
                             index=adata.obs_names)  # fmt: skip
    with pytest.raises(ValueError, match="only points"):
        dc.write_deltacells(adata, tmp_path / "c", shapes=lines, progress=False)


def test_verify_checks_the_spatial_part(small_spatial, capsys):
    from deltacells.cli import main

    assert main(["verify", "--quiet", str(small_spatial)]) == 0
    path = small_spatial / "spatial" / "centroids.npy"
    centroids = np.load(path)
    centroids[[0, -1]] = centroids[[-1, 0]]
    np.save(path, centroids)
    assert main(["verify", str(small_spatial)]) == 1
    assert "centroids.npy: SHA-256" in capsys.readouterr().err
    reseal(small_spatial)  # recorded anew: the grid check itself must see it
    assert main(["verify", str(small_spatial)]) == 1
    assert "lies outside the grid tile" in capsys.readouterr().err


def test_cli_converts_in_spatial_order_and_info_shows_the_grid(tmp_path, capsys):
    from deltacells.cli import main

    out = tmp_path / "v.dc"
    assert main(["convert", str(VISIUM), str(out), "--spatial-key", "spatial",
                 "--grid-tile-size", "1000", "--quiet"]) == 0  # fmt: skip
    index = dc.open_dataset(out).spatial_index()
    assert index.tile_size == (1000.0, 1000.0)
    capsys.readouterr()
    assert main(["info", str(out)]) == 0
    shown = capsys.readouterr().out
    nx, ny = index.grid_shape
    assert f"spatial order: grid of {nx} x {ny} tiles of 1000 x 1000" in shown
    # The reordering is said, with the way back to the input's order.
    assert "cells stored by grid tile" in shown and "row_order='source'" in shown
    assert main(["info", "--json", str(out)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["spatial_index"]["grid_shape"] == [nx, ny]
    assert info["cell_order"] == "spatial"


def test_source_row_order_undoes_the_spatial_order(visium):
    root, source = visium
    back = dc.read_deltacells(root, row_order="source")
    assert list(back.obs_names) == list(source.obs_names)
    assert (back.X[:] != source.X).nnz == 0
    np.testing.assert_array_equal(back.obsm["spatial"], source.obsm["spatial"])
    memory = back.to_memory()
    assert (memory.X != source.X).nnz == 0
    np.testing.assert_array_equal(memory.obs["array_row"], source.obs["array_row"])
    # a box, in source order
    points = source.obsm["spatial"]
    box = (float(points[:, 0].min()), float(points[:, 1].min()),
           float(np.median(points[:, 0])), float(np.median(points[:, 1])))  # fmt: skip
    sub = dc.read_deltacells(root, bbox=box, row_order="source")
    assert list(sub.obs_names) == list(source.obs_names[brute_force(points, box)])
    with pytest.raises(ValueError, match="row_order"):
        dc.read_deltacells(root, row_order="sorted")


def test_source_row_order_of_a_shuffled_dataset(tmp_path):
    from test_writer import small_adata

    adata = small_adata(n_cells=300)
    dc.write_deltacells(adata, tmp_path / "d", shuffle=True, seed=4, tile_size=64,
                        progress=False)  # fmt: skip
    stored = dc.read_deltacells(tmp_path / "d")
    assert list(stored.obs_names) != list(adata.obs_names)
    back = dc.read_deltacells(tmp_path / "d", row_order="source")
    assert list(back.obs_names) == list(adata.obs_names)
    assert (back.X[:] != adata.X).nnz == 0


def test_damaged_cell_order_is_refused(small_spatial):
    np.save(small_spatial / "cell_order.npy", np.zeros(300, dtype=np.int64))
    with pytest.raises(dc.FormatError, match=r"cell_order\.npy: SHA-256"):
        dc.read_deltacells(small_spatial, row_order="source")
    reseal(small_spatial)
    with pytest.raises(dc.FormatError, match="not a permutation"):
        dc.read_deltacells(small_spatial, row_order="source")


def test_a_box_given_as_text_is_refused(small_spatial):
    dataset = dc.open_dataset(small_spatial)
    for bad in ("1234", b"1234"):
        with pytest.raises(ValueError, match="bbox must be four numbers"):
            dataset.query_bbox(bad)
