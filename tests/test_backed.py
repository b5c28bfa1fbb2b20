"""read_deltacells: the lazy X answers every index the way anndata in memory does."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import DATA_DIR
from test_writer import small_adata

import deltacells as dc


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A dataset written from a small AnnData (several tiles), and the AnnData itself."""
    root = tmp_path_factory.mktemp("backed")
    adata = small_adata(n_cells=700, n_genes=150, seed=5)
    adata.X = adata.X.astype(np.float32)
    dc.write_deltacells(adata, root / "d", tile_size=128, n_chunks=4, progress=False)
    return dc.read_deltacells(root / "d"), adata


def same(actual, expected) -> None:
    if sp.issparse(expected) or sp.issparse(actual):
        actual, expected = sp.csr_matrix(actual), sp.csr_matrix(expected)
        assert actual.shape == expected.shape
        assert (actual != expected).nnz == 0
    else:
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected))


INDICES = [
    5,
    -1,
    slice(None),
    slice(10, 300),
    slice(690, 10, -7),
    slice(None, None, 3),
    np.array([650, 3, 3, 129, 0, 699]),
    [1, 2, 3],
    (slice(100, 200), slice(5, 40)),
    (np.array([7, 300, 7]), np.array([3, 0, 149])),
    (5, 7),
    (slice(0, 50), [4, 2, 2]),
]


@pytest.mark.parametrize("index", INDICES, ids=[repr(i)[:40] for i in INDICES])
def test_x_getitem_matches_scipy(pair, index):
    backed, adata = pair
    same(backed.X[index], adata.X[index])


def test_boolean_masks(pair):
    backed, adata = pair
    mask = np.random.default_rng(0).random(700) < 0.3
    same(backed.X[mask], adata.X[mask])
    gene_mask = np.random.default_rng(1).random(150) < 0.5
    same(backed.X[mask][:, gene_mask], adata.X[mask][:, gene_mask])
    same(backed.X[slice(None), gene_mask], adata.X[:, gene_mask])


@pytest.mark.parametrize(
    "index",
    [slice(20, 400), np.array([600, 2, 2, 130]), (slice(None), slice(10, 60)),
     (np.array([5, 1]), np.array([9, 3])), "mask"],
    ids=["slice", "fancy", "cols", "both", "mask"],
)  # fmt: skip
def test_views_and_to_memory(pair, index):
    backed, adata = pair
    if isinstance(index, str):
        index = adata.obs["is_doublet"].to_numpy() | (np.arange(700) % 9 == 0)
    view, expected = backed[index], adata[index]
    same(view.X, expected.X)
    same(view.to_memory().X, expected.X)
    assert list(view.obs_names) == list(expected.obs_names)
    assert list(view.var_names) == list(expected.var_names)


def test_whole_matrix_and_metadata(pair):
    backed, adata = pair
    in_memory = backed.to_memory()
    assert isinstance(in_memory.X, sp.csr_matrix)
    same(in_memory.X, adata.X)
    assert isinstance(backed.X, ad.abc.CSRDataset)
    assert backed.X.shape == adata.shape and backed.X.dtype == np.float32
    same(backed.X.to_memory(), adata.X)
    assert list(backed.var_names) == list(adata.var_names)  # source order restored
    np.testing.assert_array_equal(backed.var["gene_ids"], adata.var["gene_ids"])
    assert list(backed.obs_names) == list(adata.obs_names)
    assert backed.obs["batch"].tolist() == adata.obs["batch"].tolist()


def test_stored_column_order(pair, tmp_path):
    _, adata = pair
    dc.write_deltacells(adata, tmp_path / "d", tile_size=100, progress=False)
    stored = dc.read_deltacells(tmp_path / "d", column_order="stored", obs=False)
    order = dc.open_dataset(tmp_path / "d").gene_order()
    same(stored.X.to_memory(), adata.X[:, order])
    assert list(stored.var_names) == list(adata.var_names[order])
    assert list(stored.obs.columns) == []
    assert list(stored.obs_names) == list(adata.obs_names)


def test_values_dtypes_and_obs_selection(pair, tmp_path):
    _, adata = pair
    dc.write_deltacells(adata, tmp_path / "d", tile_size=100, progress=False)
    as_int = dc.read_deltacells(tmp_path / "d", values_dtype=np.int32, obs=["cell_type"])
    assert as_int.X.dtype == np.int32 and as_int.X[3:9].dtype == np.int32
    assert list(as_int.obs.columns) == ["cell_type"]
    with pytest.raises(KeyError, match="nope"):
        dc.read_deltacells(tmp_path / "d", obs=["nope"])


def test_real_data_slices(real_counts, tmp_path):
    dc.write_deltacells(DATA_DIR / "liao2020_balf.h5ad", tmp_path / "liao", progress=False)
    backed = dc.read_deltacells(tmp_path / "liao")
    X = real_counts["liao2020_balf"]
    rng = np.random.default_rng(2)
    rows = rng.integers(0, X.shape[0], 2000)
    same(backed.X[rows], X[rows])
    same(backed.X[5000:9000], X[5000:9000])
    same(backed.X.to_memory(), X)


def test_errors(pair):
    backed, _ = pair
    with pytest.raises(IndexError):
        backed.X[700]
    with pytest.raises(IndexError):
        backed.X[np.array([0, 800])]
    with pytest.raises(IndexError):
        backed.X[0, 0, 0]
    with pytest.raises(ValueError, match="column_order"):
        dc.DeltacellsCSRDataset(backed.X.dataset, column_order="sideways")


def test_pickles_and_reopens(pair):
    import pickle

    backed, adata = pair
    clone = pickle.loads(pickle.dumps(backed.X))
    assert clone is not backed.X and clone.shape == backed.X.shape
    same(clone[10:20], adata.X[10:20])
    assert clone._cache is not backed.X._cache


def _read_in_child(X, rows, queue):
    queue.put(sp.csr_matrix(X[rows]).toarray().sum())


def test_reads_in_a_forked_child_after_the_parent_read(pair):
    """The parent's I/O threads do not exist in a forked child; the child must not hang."""
    import multiprocessing

    backed, adata = pair
    rows = np.array([1, 500, 250, 699])
    backed.X.dataset.store.prefetch(["manifest.json"])["manifest.json"].result()
    backed.X[rows]  # the parent has used its thread pool
    fresh = dc.read_deltacells(backed.X.dataset.store.url, obs=False).X
    fresh._cache.clear()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_read_in_child, args=(fresh, rows, queue))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == pytest.approx(adata.X[rows].toarray().sum())


def test_ranged_reads_equal_whole_tile_reads(tmp_path, monkeypatch):
    """ranged_reads=True fetches only the chunks holding the rows: same matrix, fewer bytes."""
    from deltacells.store.storage import Store

    adata = small_adata(n_cells=2000, n_genes=150, seed=3)
    root = tmp_path / "d"
    dc.write_deltacells(adata, root, tile_size=1000, n_chunks=50, progress=False)
    rng = np.random.default_rng(0)
    whole = dc.read_deltacells(root, elements=False)
    ranged = dc.read_deltacells(root, elements=False, ranged_reads=True)
    mixed = rng.permutation(np.concatenate([np.arange(0, 100), [1500, 1200, 1999, 1500]]))
    for rows in (rng.choice(2000, 30, replace=False), np.arange(480, 530),
                 np.array([5, 5, 1999, 0, 700]), np.arange(2000), mixed):  # fmt: skip
        expected = adata.X[rows]
        assert (ranged.X[rows] != expected).nnz == 0
        assert (whole.X[rows] != expected).nnz == 0
    read = {"bytes": 0}
    original = Store.read_range

    def counting(self, name, start, stop):
        data = original(self, name, start, stop)
        read["bytes"] += len(data)
        return data

    monkeypatch.setattr(Store, "read_range", counting)
    ranged.X[np.arange(100, 110)]
    one_tile = dc.open_dataset(root).manifest.tile_bytes[0]
    # the header's first read takes up to 8 KiB (header and chunk table), then the chunks
    assert 0 < read["bytes"] < one_tile / 2
    assert ranged.X.copy().ranged_reads
    # Rows scattered over many chunks of one tile: a few requests, not two per run of chunks.
    calls = []
    monkeypatch.setattr(Store, "read_range", lambda self, name, start, stop: (
        calls.append(name), original(self, name, start, stop))[1])  # fmt: skip
    rows = np.sort(rng.choice(1000, 15, replace=False))
    assert (ranged.X.copy()[rows] != adata.X[rows]).nnz == 0
    assert len(calls) <= 4  # header + chunk table, indptr, merged frames


def test_ranged_reads_keep_clustered_rows_ranged_and_read_scattered_ones_whole(
    tmp_path, monkeypatch
):
    """Whole tiles are fetched only where the rows touch most chunks: many rows in a few
    chunks (a box query in spatial order) stay ranged, as many rows spread over every chunk
    are read whole (one request for about the same bytes)."""
    from deltacells.store.storage import Store

    adata = small_adata(n_cells=2000, n_genes=150, seed=3)
    root = tmp_path / "d"
    dc.write_deltacells(adata, root, tile_size=1000, n_chunks=50, progress=False)
    ranged = dc.read_deltacells(root, elements=False, ranged_reads=True)
    whole_reads = []
    original = Store.read_buffer

    def counting(self, name, *args, **kwargs):
        if name.startswith("tiles/tile_"):
            whole_reads.append(name)
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(Store, "read_buffer", counting)
    clustered = np.arange(1100, 1400)  # 300 rows, 15 of the tile's 50 chunks
    assert (ranged.X[clustered] != adata.X[clustered]).nnz == 0
    assert whole_reads == []
    scattered = np.random.default_rng(1).choice(np.arange(1000, 2000), 300, replace=False)
    assert (ranged.X[scattered] != adata.X[scattered]).nnz == 0
    assert whole_reads == ["tiles/tile_000001.dct"]


def test_tiles_loaded_side_by_side_equal_those_loaded_in_turn(tmp_path):
    # Several local tiles are read and checked by a thread each; a damaged one still raises
    # FormatError naming its file, and the rows equal a one-thread read's.
    adata = small_adata(n_cells=700, n_genes=150, seed=6)
    root = tmp_path / "d"
    dc.write_deltacells(adata, root, tile_size=128, n_chunks=4, progress=False)
    rows = np.random.default_rng(2).choice(700, 300, replace=False)
    one = dc.DeltacellsCSRDataset(dc.open_dataset(root), n_threads=1)[rows]
    two = dc.DeltacellsCSRDataset(dc.open_dataset(root), n_threads=2)[rows]
    same(two, one)
    same(two, sp.csr_matrix(adata.X)[rows].astype(np.float32))
    tile = sorted((root / "tiles").glob("tile_*.dct"))[3]
    data = bytearray(tile.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tile.write_bytes(bytes(data))
    with pytest.raises(dc.FormatError, match=tile.name):
        dc.DeltacellsCSRDataset(dc.open_dataset(root), n_threads=2)[rows]
