"""SpatialData export, read back by spatialdata itself in its own Python >= 3.12 virtualenv
(made by the test on first use, as the loader benchmark does for annbatch)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import anndata as ad
import numpy as np
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp
import zarr
from conftest import DATA_DIR, spatial_counts

import deltacells as dc
from deltacells.cli import main
from deltacells.export import ROW_GROUP_MIN_ROWS, row_group_tiles, to_spatialdata
from deltacells.testing import SPATIALDATA_SPEC, side_python

gpd = pytest.importorskip("geopandas", reason="the spatial extra")
shapely = pytest.importorskip("shapely")

ROOT = Path(__file__).resolve().parents[1]
VISIUM = DATA_DIR / "visium_multisample.h5ad"

#: What the child reports of a store, read with spatialdata.
READ_BACK = r"""
import json, sys
import numpy as np
import spatialdata as sd
s = sd.read_zarr(sys.argv[1])
shapes, table = s.shapes[sys.argv[2]], s.tables[sys.argv[3]]
X, csc = table.X, table.layers["X_csc"]
attrs = table.uns["spatialdata_attrs"]
print(json.dumps({
    "n_shapes": len(shapes), "index": [int(i) for i in shapes.index],
    "names": [str(v) for v in shapes["cell_id"]], "table_names": [str(v) for v in table.obs_names],
    "geom_types": sorted(set(shapes.geometry.geom_type)),
    "radius": shapes["radius"].tolist() if "radius" in shapes else None,
    "table_shape": list(table.shape), "csr": X.format, "csc": csc.format,
    "same_values": bool((X != csc.tocsr()).nnz == 0), "X_sum": float(X.sum()),
    "instance": [int(v) for v in table.obs[attrs["instance_key"]]],
    "instance_dtype": str(table.obs[attrs["instance_key"]].dtype), "X_dtype": str(X.dtype),
    "region": attrs["region"], "annotates": sorted(set(table.obs[attrs["region_key"]])),
}))
"""


@pytest.fixture(scope="module")
def spatialdata_python():
    explicit = os.environ.get("DELTACELLS_SPATIALDATA_PYTHON")
    python = explicit or side_python(ROOT / ".venvs" / "spatialdata", SPATIALDATA_SPEC)
    if python is None:
        pytest.skip("spatialdata needs Python >= 3.12, and this machine has none")
    return python


def read_back(python: str, store: Path, shapes="cells", table="table") -> dict:
    done = subprocess.run([python, "-c", READ_BACK, str(store), shapes, table],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_visium_spots_export_and_spatialdata_reads_them(tmp_path, spatialdata_python):
    source = ad.read_h5ad(VISIUM)
    source.X = sp.csr_matrix(source.X)
    root = tmp_path / "visium.dc"
    dc.write_deltacells(source, root, spatial_key="spatial", progress=False)
    with pytest.raises(ValueError, match="point_radius"):
        to_spatialdata(root, tmp_path / "no.zarr")
    out = to_spatialdata(root, tmp_path / "visium.zarr", point_radius=27.5, overwrite=True)
    dataset = dc.open_dataset(root)
    order = dataset.cell_order()
    stored_names = list(source.obs_names[order])

    got = read_back(spatialdata_python, out)
    assert got["n_shapes"] == source.n_obs and got["names"] == stored_names
    assert got["index"] == list(range(source.n_obs))  # integer instance ids
    assert got["geom_types"] == ["Point"] and set(got["radius"]) == {27.5}
    assert got["table_shape"] == list(source.shape)
    assert got["csr"] == "csr" and got["csc"] == "csc" and got["same_values"]
    assert got["X_sum"] == pytest.approx(float(source.X.sum()))
    assert got["X_dtype"] == str(source.X.dtype)  # the counts' dtype as written
    # table rows in the shapes' order, joined on integer ids, names kept
    assert got["instance"] == got["index"] and got["instance_dtype"] == "int64"
    assert got["table_names"] == stored_names
    assert got["region"] == "cells" and got["annotates"] == ["cells"]

    # RFC 4's additions, read directly
    element = zarr.open_group(str(out / "shapes" / "cells"), mode="r")
    index = dataset.spatial_index()
    assert element.attrs["spatial_index"]["grid_shape"] == list(index.grid_shape)
    assert element.attrs["spatial_index"]["margin"] == list(index.margin)
    offsets = element["index/0/tile_offsets"][:]
    np.testing.assert_array_equal(offsets, dataset.spatial().tile_offsets)
    parquet = pq.ParquetFile(out / "shapes" / "cells" / "shapes.parquet")
    groups = element.attrs["spatial_index"]["row_group_tiles"]
    assert groups == row_group_tiles(offsets).tolist() and groups[-1] == index.n_grid_tiles
    assert parquet.metadata.num_row_groups == len(groups) - 1
    sizes = [parquet.metadata.row_group(i).num_rows for i in range(len(groups) - 1)]
    assert sizes == np.diff(offsets[groups]).tolist()  # whole grid tiles per group
    geo = json.loads(parquet.metadata.metadata[b"geo"])
    assert geo["columns"]["geometry"]["encoding"] == "point"  # GeoArrow, not WKB


def test_polygons_export_as_multipolygons(tmp_path, spatialdata_python):
    from test_writer import small_adata

    adata = small_adata(n_cells=200, seed=4)
    rng = np.random.default_rng(4)
    centres = rng.uniform(0, 100, (200, 2))
    polys = [shapely.box(x - 1, y - 1, x + 1, y + 1) for x, y in centres]
    polys[0] = shapely.MultiPolygon([polys[0], shapely.box(-5, -5, -4, -4)])
    root = tmp_path / "poly.dc"
    shapes = gpd.GeoDataFrame(geometry=polys, index=adata.obs_names)
    dc.write_deltacells(adata, root, shapes=shapes, grid_tile_size=20, progress=False)
    assert main(["export-spatialdata", str(root), str(tmp_path / "poly.zarr")]) == 0
    got = read_back(spatialdata_python, tmp_path / "poly.zarr")
    assert got["geom_types"] == ["MultiPolygon"] and got["radius"] is None
    assert got["n_shapes"] == 200 and got["same_values"]
    order = dc.open_dataset(root).cell_order()
    assert got["names"] == list(adata.obs_names[order])
    # geopandas reads the GeoArrow parquet too, geometries exact
    frame = gpd.read_parquet(tmp_path / "poly.zarr" / "shapes" / "cells" / "shapes.parquet")
    assert list(frame["cell_id"]) == list(adata.obs_names[order])
    expected = [polys[i] for i in order]
    assert all(shapely.equals(a, b) for a, b in zip(frame.geometry, expected, strict=True))


def test_export_needs_spatial_order(tmp_path, capsys):
    from test_writer import small_adata

    dc.write_deltacells(small_adata(), tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match="not written in spatial order"):
        to_spatialdata(tmp_path / "d", tmp_path / "out.zarr")
    assert main(["export-spatialdata", str(tmp_path / "d"), str(tmp_path / "out.zarr")]) == 1
    assert "write it with --spatial-key or --shapes" in capsys.readouterr().err


#: Runs spatialdata's bounding_box_query on the boxes given as JSON; prints the selected
#: shape names per box.
BOX_QUERIES = r"""
import json, sys
import spatialdata as sd
from spatialdata import bounding_box_query
s = sd.read_zarr(sys.argv[1])
shapes = s.shapes[sys.argv[2]]
out = []
for box in json.loads(sys.argv[3]):
    hit = bounding_box_query(shapes, axes=("x", "y"), min_coordinate=box[:2],
                             max_coordinate=box[2:], target_coordinate_system="global")
    out.append([] if hit is None else [str(i) for i in hit["cell_id"]])
print(json.dumps(out))
"""


def spatialdata_boxes(python: str, store: Path, boxes: list, shapes="cells") -> list[set]:
    done = subprocess.run([python, "-c", BOX_QUERIES, str(store), shapes, json.dumps(boxes)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [set(names) for names in json.loads(done.stdout.strip().splitlines()[-1])]


def random_boxes(points: np.ndarray, n: int, seed: int) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    lo, hi = points.min(axis=0), points.max(axis=0)
    corner = rng.uniform(lo, hi, size=(n, 2))
    size = rng.uniform(0.002, 0.25, size=(n, 2)) * (hi - lo)
    return [[*map(float, c), *map(float, c + w)] for c, w in zip(corner, size, strict=True)]


def test_box_queries_agree_with_spatialdata_on_visium(tmp_path, spatialdata_python):
    """spatialdata keeps circles by their centre: that is deltacells' mode="centroid" (the
    default "intersects" also keeps circles that only reach into the box; test_spatial.py
    checks that rule against brute force)."""
    source = ad.read_h5ad(VISIUM)
    root = tmp_path / "visium.dc"
    dc.write_deltacells(source, root, spatial_key="spatial", progress=False)
    out = to_spatialdata(root, tmp_path / "visium.zarr", point_radius=27.5)
    boxes = random_boxes(source.obsm["spatial"], 300, seed=1)
    theirs = spatialdata_boxes(spatialdata_python, out, boxes)
    dataset = dc.open_dataset(root)
    names = np.asarray(source.obs_names[dataset.cell_order()])
    selected = 0
    for box, expected in zip(boxes, theirs, strict=True):
        ours = set(names[dataset.query_bbox(box, mode="centroid").rows])
        assert ours == expected, box
        selected += len(ours)
    assert selected > 1000


def test_polygon_box_queries_against_spatialdata(tmp_path, spatialdata_python):
    """For polygons spatialdata keeps those that intersect the box, as deltacells' default
    rule does (both checked on 300 boxes; exact polygons, borders included)."""
    from test_writer import small_adata

    adata = small_adata(n_cells=400, seed=6)
    rng = np.random.default_rng(6)
    centres = rng.uniform(0, 300, (400, 2))
    sizes = rng.uniform(0.5, 12, 400)  # varied polygon sizes
    polys = [shapely.Polygon([(x - s, y - s / 2), (x + s, y - s), (x + s / 3, y + s)])
             for (x, y), s in zip(centres, sizes, strict=True)]  # fmt: skip
    root = tmp_path / "poly.dc"
    dc.write_deltacells(adata, root, shapes=gpd.GeoDataFrame(geometry=polys,
                        index=adata.obs_names), grid_tile_size=30, progress=False)  # fmt: skip
    out = to_spatialdata(root, tmp_path / "poly.zarr")
    boxes = random_boxes(centres, 300, seed=2)
    theirs = spatialdata_boxes(spatialdata_python, out, boxes)
    dataset = dc.open_dataset(root)
    names = np.asarray(adata.obs_names[dataset.cell_order()])
    stored = np.asarray(polys, dtype=object)[dataset.cell_order()]
    differ = 0
    for box, expected in zip(boxes, theirs, strict=True):
        ours = set(names[dataset.query_bbox(box).rows])
        truth = set(names[shapely.intersects(stored, shapely.box(*box))])
        assert ours == truth, box
        differ += ours != expected
    assert differ == 0


#: spatialdata's join of the table with the shapes; prints rows, whether the table rows
#: follow the shapes and the seconds the join took.
JOIN = r"""
import json, sys, time
import numpy as np
import spatialdata as sd
s = sd.read_zarr(sys.argv[1])
t = time.perf_counter()
element, table = sd.join_spatialelement_table(sdata=s, spatial_element_names="cells",
                                              table_name="table", how="left")
seconds = time.perf_counter() - t
shapes = element["cells"]
print(json.dumps({"rows": int(table.n_obs), "seconds": seconds,
                  "aligned": bool(np.array_equal(np.asarray(table.obs["instance_id"]),
                                                 np.asarray(shapes.index))),
                  "names": bool(np.array_equal(np.asarray(shapes["cell_id"]),
                                               np.asarray(table.obs_names)))}))
"""


def test_export_of_200000_cells_joins_in_spatialdata_and_bounds_row_groups(
    tmp_path, spatialdata_python
):
    """Integer instance ids: spatialdata joins its table with the shapes on them (string ids
    made that join take minutes at this size). A fine grid shares row groups between tiles."""
    n = 200_000
    adata = spatial_counts(n, 12, extent=5000, max_count=50, seed=11, prefix="cell-")
    root = tmp_path / "many.dc"
    dc.write_deltacells(adata, root, spatial_key="spatial", grid_tile_size=10, progress=False)
    index = dc.open_dataset(root).spatial_index()
    assert index.n_grid_tiles == 250_000  # more grid tiles than cells
    out = to_spatialdata(root, tmp_path / "many.zarr", point_radius=1.0)
    parquet = pq.ParquetFile(out / "shapes" / "cells" / "shapes.parquet")
    assert parquet.metadata.num_row_groups <= n // ROW_GROUP_MIN_ROWS + 1
    done = subprocess.run([spatialdata_python, "-c", JOIN, str(out)], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rows"] == n and got["aligned"] and got["names"], got
