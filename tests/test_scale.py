"""Scale: datasets simulated by repeating tiles, and what opening and reading them holds."""

from __future__ import annotations

import numpy as np
import pytest
from test_writer import small_adata

import deltacells as dc
from deltacells.testing import repeat_tiles


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    adata = small_adata(n_cells=400, n_genes=90, seed=4)
    dc.write_deltacells(adata, root / "base", tile_size=100, n_chunks=4, obs_tiles_per_file=4,
                        progress=False)  # fmt: skip
    return root, adata


def test_repeated_tiles_make_a_valid_larger_dataset(base):
    root, adata = base
    big = repeat_tiles(root / "base", root / "big", 40)
    ds = dc.open_dataset(big)
    assert ds.shape == (4000, 90)
    assert ds.manifest.metadata["simulated"]["repeats"] == 10
    ds.verify()  # every tile's CRC and place, obs shards' hashes and the fingerprint
    back = dc.read_deltacells(big, column_order="source")
    rows = np.array([0, 399, 1234, 3999])
    expected = adata.X[rows % 400].toarray()
    np.testing.assert_array_equal(back.X[rows].toarray(), expected)
    np.testing.assert_array_equal(back.obs["n_counts"].to_numpy()[rows],
                                  adata.obs["n_counts"].to_numpy()[rows % 400])  # fmt: skip
    # Repeated names would not be unique: they are dropped and cells named by position.
    assert list(back.obs_names[[0, 3999]]) == ["0", "3999"]
    assert "_index" not in back.obs.columns


def test_repeat_tiles_refuses_what_it_cannot_repeat(base, tmp_path):
    root, _ = base
    with pytest.raises(ValueError, match="multiple of 4"):
        repeat_tiles(root / "base", tmp_path / "x", 6)
