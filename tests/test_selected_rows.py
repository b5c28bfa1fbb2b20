"""A box (``bbox=``) or the source order of a shuffled dataset (``row_order="source"``) builds
an AnnData of the selected cells only: obs, elements and lazy matrices of those rows, not a
view of the whole dataset. It must equal that view, part by part."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from test_whole_anndata import processed

import deltacells as dc


def _dense(x):
    x = x.to_memory() if isinstance(x, dc.DeltacellsCSRDataset) else x
    x = x.compute() if hasattr(x, "compute") else x
    return x.toarray() if sp.issparse(x) else np.asarray(x)


def assert_same_cells(got, want):
    """``got`` (built for the selected rows) equals ``want`` (a view of the whole read)."""
    assert not got.is_view and got.shape == want.shape
    assert list(got.obs_names) == list(want.obs_names)
    pd.testing.assert_frame_equal(got.obs, pd.DataFrame(want.obs), check_index_type=False)
    assert isinstance(got.X, dc.DeltacellsCSRDataset)
    np.testing.assert_array_equal(_dense(got.X), _dense(want.X))
    assert set(got.layers) == set(want.layers)
    for key in want.layers:
        np.testing.assert_array_equal(_dense(got.layers[key]), _dense(want.layers[key]))
    for key in want.obsm:
        left, right = got.obsm[key], want.obsm[key]
        if isinstance(right, pd.DataFrame):
            pd.testing.assert_frame_equal(pd.DataFrame(left), pd.DataFrame(right),
                                          check_index_type=False)
        else:
            np.testing.assert_array_equal(_dense(left), _dense(right))
    for key in want.obsp:
        np.testing.assert_array_equal(_dense(got.obsp[key]), _dense(want.obsp[key]))
    if want.raw is not None:
        np.testing.assert_array_equal(_dense(got.raw.X), _dense(want.raw.X))


@pytest.fixture(scope="module")
def shuffled(tmp_path_factory):
    root = tmp_path_factory.mktemp("rows") / "shuffled.dc"
    dc.write_deltacells(processed(n_cells=500, seed=21), root, tile_size=64, shuffle=True,
                        seed=3, progress=False)  # fmt: skip
    return root


def test_source_order_builds_the_cells_in_source_order(shuffled):
    whole = dc.read_deltacells(shuffled)
    order = dc.open_dataset(shuffled).cell_order()
    want = whole[np.argsort(order, kind="stable")]
    got = dc.read_deltacells(shuffled, row_order="source")
    assert_same_cells(got, want)
    assert list(got.obs_names) == list(processed(n_cells=500, seed=21).obs_names)


def test_a_box_builds_only_its_cells(tmp_path):
    source = processed(n_cells=500, seed=22)
    root = tmp_path / "spatial.dc"
    dc.write_deltacells(source, root, spatial_key="spatial", tile_size=64, progress=False)
    box = (100.0, 200.0, 600.0, 700.0)
    for mode in ("intersects", "centroid"):
        whole = dc.read_deltacells(root)
        rows = dc.open_dataset(root).query_bbox(box, mode=mode).rows
        assert 0 < len(rows) < source.n_obs
        got = dc.read_deltacells(root, bbox=box, bbox_mode=mode)
        assert_same_cells(got, whole[rows])
        assert got.X.nnz == whole.X.to_memory()[rows].nnz
    # both at once: the box's cells in the order they were written
    got = dc.read_deltacells(root, bbox=box, row_order="source")
    order = dc.open_dataset(root).cell_order()
    rows = dc.open_dataset(root).query_bbox(box).rows
    assert_same_cells(got, dc.read_deltacells(root)[rows[np.argsort(order[rows])]])


def test_selected_rows_stay_lazy_and_slice_like_the_whole(shuffled):
    got = dc.read_deltacells(shuffled, row_order="source")
    whole = dc.read_deltacells(shuffled).X.to_memory()
    order = np.argsort(dc.open_dataset(shuffled).cell_order(), kind="stable")
    rng = np.random.default_rng(5)
    picks = rng.choice(got.n_obs, 50)
    assert (got.X[picks] != whole[order[picks]]).nnz == 0
    assert (got[picks].X != whole[order[picks]]).nnz == 0
    np.testing.assert_allclose(np.asarray(got.X.sum(axis=1)).ravel(),
                               np.asarray(whole[order].sum(axis=1)).ravel())  # fmt: skip
    pytest.importorskip("dask")  # an optional extra
    assert (got.X.to_dask().compute() != whole[order]).nnz == 0
