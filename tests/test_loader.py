"""Loader: every cell once per epoch across ranks and workers, determinism, resume, contents."""

from __future__ import annotations

import re
import subprocess
import sys

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import DATA_DIR
from hypothesis import given, settings
from hypothesis import strategies as st
from test_writer import small_adata

import deltacells as dc
from deltacells.codec import _rows
from deltacells.train.loader import BatchRuns, EpochPlan, plan_epoch

MODES = ("tiles", "cells", "none")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 1,000-cell dataset in tiles of 128 cells (the last one short), and its AnnData."""
    root = tmp_path_factory.mktemp("loader")
    adata = small_adata(n_cells=1000, n_genes=150, seed=8)
    dc.write_deltacells(adata, root / "d", tile_size=128, n_chunks=4, progress=False)
    return str(root / "d"), adata


def cells_of(loader) -> list[np.ndarray]:
    return [batch.cells for batch in loader]


def test_plan_visits_every_cell_once_and_keeps_tiles_together():
    tile_cells = [128] * 7 + [104]
    starts = np.concatenate([[0], np.cumsum(tile_cells)])
    for mode in MODES:
        order = plan_epoch(tile_cells, shuffle=mode, buffer_tiles=3, seed=1, epoch=0)
        np.testing.assert_array_equal(np.sort(order), np.arange(1000))
    order = plan_epoch(tile_cells, shuffle="tiles", buffer_tiles=3, seed=1, epoch=0)
    tiles = np.searchsorted(starts, order, side="right") - 1
    # Buffers of 3 tiles: the first buffer's cells come from exactly 3 tiles, then others.
    buffer = set(tiles[:300].tolist())
    size = sum(tile_cells[t] for t in buffer)
    assert len(buffer) == 3 and set(tiles[:size].tolist()) == buffer
    assert tiles[size] not in buffer
    assert not np.array_equal(order, np.sort(order))
    again = plan_epoch(tile_cells, shuffle="tiles", buffer_tiles=3, seed=1, epoch=0)
    other = plan_epoch(tile_cells, shuffle="tiles", buffer_tiles=3, seed=1, epoch=1)
    np.testing.assert_array_equal(order, again)
    assert not np.array_equal(order, other)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("n_workers", [1, 2])
def test_every_cell_once_per_epoch_across_ranks_and_workers(pair, mode, world_size, n_workers):
    url, _ = pair
    per_rank, everything = [], []
    for rank in range(world_size):
        count = 0
        for worker in range(n_workers):
            loader = dc.Loader(url, batch_size=64, shuffle=mode, seed=3, rank=rank,
                               world_size=world_size, buffer_tiles=2)  # fmt: skip
            loader.set_worker(worker, n_workers)
            batches = cells_of(loader)
            count += len(batches)
            everything.extend(batches)
        per_rank.append(count)
    assert len(set(per_rank)) == 1  # the same number of batches on every rank
    cells = np.concatenate(everything)
    # Documented padding: ceil(1000 / world_size) cells per rank, the extra ones wrapped
    # around from the start of the epoch's order.
    length = -(-1000 // world_size)
    assert len(cells) == length * world_size
    counts = np.bincount(cells, minlength=1000)
    assert counts.min() == 1
    assert counts.sum() - 1000 == length * world_size - 1000
    order = plan_epoch([128] * 7 + [104], shuffle=mode, buffer_tiles=2, seed=3, epoch=0)
    padded = order[: length * world_size - 1000]
    assert np.all(counts[padded] == 2)


def test_drop_last_gives_each_cell_at_most_once_and_full_batches(pair):
    url, _ = pair
    seen = []
    for rank in range(3):
        loader = dc.Loader(url, batch_size=64, rank=rank, world_size=3, drop_last=True, seed=2)
        batches = cells_of(loader)
        assert len(batches) == (1000 // 3) // 64 == len(loader)
        assert all(len(b) == 64 for b in batches)
        seen.extend(batches)
    cells = np.concatenate(seen)
    assert len(np.unique(cells)) == len(cells)


@pytest.mark.parametrize("mode", MODES)
def test_batches_hold_the_rows_of_their_cells(pair, mode):
    url, adata = pair
    X = sp.csr_matrix(adata.X)
    loader = dc.Loader(url, batch_size=100, shuffle=mode, seed=5,
                       obs=["cell_type", "n_counts", "flag"])  # fmt: skip
    for batch in loader:
        assert batch.X.has_sorted_indices
        assert (batch.X != X[batch.cells]).nnz == 0
        codes = batch.obs["cell_type"]
        expected = adata.obs["cell_type"].iloc[batch.cells]
        categories = np.asarray(adata.obs["cell_type"].cat.categories)
        decoded = np.where(codes >= 0, categories[np.maximum(codes, 0)], None)
        assert list(decoded) == [None if isinstance(v, float) else v for v in expected]
        np.testing.assert_array_equal(
            batch.obs["n_counts"], adata.obs["n_counts"].iloc[batch.cells]
        )
        flags = adata.obs["flag"].iloc[batch.cells].astype("float32").to_numpy(na_value=np.nan)
        np.testing.assert_array_equal(batch.obs["flag"], flags)
    assert list(loader.var_names) == list(adata.var_names)


@pytest.mark.parametrize("mode", MODES)
def test_unsorted_indices_hold_the_same_rows_and_say_so(pair, mode):
    # sorted_indices=False: source-order columns, entries in the stored gene order; scipy is
    # told, and sorting gives the default batch exactly.
    url, adata = pair
    X = sp.csr_matrix(adata.X)
    sorted_batches = list(dc.Loader(url, batch_size=100, shuffle=mode, seed=5,
                                    normalize=1e4, log1p=True))  # fmt: skip
    unsorted = dc.Loader(url, batch_size=100, shuffle=mode, seed=5, normalize=1e4, log1p=True,
                         sorted_indices=False)  # fmt: skip
    seen_unsorted = False
    for plain, batch in zip(sorted_batches, unsorted, strict=True):
        np.testing.assert_array_equal(plain.cells, batch.cells)
        assert np.array_equal(np.diff(batch.X.indptr), np.diff(X[batch.cells].indptr))
        in_order = all(np.all(np.diff(row.indices) > 0) for row in batch.X)
        seen_unsorted |= not in_order
        if not in_order:  # what scipy is told must be true
            assert not batch.X.has_sorted_indices
        again = batch.X.copy()
        again.sort_indices()
        np.testing.assert_array_equal(again.indices, plain.X.indices)
        np.testing.assert_array_equal(again.data, plain.X.data)
    assert seen_unsorted or mode == "cells"  # "cells" batches come sorted either way


def test_unsorted_indices_are_for_scipy_batches(pair):
    url, _ = pair
    with pytest.raises(ValueError, match="sorted_indices=False is for output='scipy'"):
        dc.Loader(url, output="numpy", sorted_indices=False)


def test_stored_column_order_follows_the_stored_var_names(pair):
    url, adata = pair
    loader = dc.Loader(url, batch_size=200, column_order="stored", shuffle="none")
    batch = next(iter(loader))
    expected = adata[batch.cells, list(loader.var_names)].X
    assert (batch.X != sp.csr_matrix(expected)).nnz == 0


def test_determinism_epochs_and_resume(pair):
    url, _ = pair
    first = cells_of(dc.Loader(url, batch_size=64, seed=9))
    again = cells_of(dc.Loader(url, batch_size=64, seed=9))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    loader = dc.Loader(url, batch_size=64, seed=9)
    loader.set_epoch(1)
    second = cells_of(loader)
    assert not np.array_equal(np.concatenate(first), np.concatenate(second))
    assert loader.epoch == 2  # a finished epoch moves on to the next
    # Interrupted after 5 batches, resumed in a new loader: the rest is what an uninterrupted
    # run yields.
    loader = dc.Loader(url, batch_size=64, seed=9, shuffle="tiles")
    iterator = iter(loader)
    head = [next(iterator).cells for _ in range(5)]
    state = loader.state_dict()
    del iterator
    assert state == {"seed": 9, "epoch": 0, "batches_done": 5}
    resumed = dc.Loader(url, batch_size=64, seed=9, shuffle="tiles")
    resumed.load_state_dict(state)
    tail = cells_of(resumed)
    assert len(head) + len(tail) == len(first)
    for a, b in zip(head + tail, first, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="seed"):
        dc.Loader(url, seed=1).load_state_dict(state)


@pytest.mark.parametrize("mode", ["tiles", "cells"])
def test_gene_subset_equals_slicing_afterwards(pair, mode):
    url, adata = pair
    rng = np.random.default_rng(4)
    names = list(rng.choice(adata.var_names, 40, replace=False))  # any order
    loader = dc.Loader(url, batch_size=128, shuffle=mode, genes=names)
    assert list(loader.var_names) == names
    for batch in loader:
        expected = sp.csr_matrix(adata[batch.cells, names].X)
        assert batch.X.shape == expected.shape
        assert (batch.X != expected).nnz == 0
    mask = rng.random(adata.n_vars) < 0.3
    batch = next(iter(dc.Loader(url, batch_size=128, genes=mask)))
    assert (batch.X != sp.csr_matrix(adata[batch.cells][:, mask].X)).nnz == 0
    # Dense outputs skip the sort of each row's entries: same values.
    dense = next(iter(dc.Loader(url, batch_size=128, shuffle=mode, genes=names, output="numpy")))
    np.testing.assert_array_equal(dense.X, adata[dense.cells, names].X.toarray())
    # Plain names (not numpy's repr), how many, and where the names are listed.
    with pytest.raises(KeyError, match=r"1 of the genes are not in the dataset: "
                                       r"\['no-such-gene'\] \(deltacells.open_dataset"):
        dc.Loader(url, genes=[names[0], "no-such-gene"])
    with pytest.raises(KeyError, match=r"7 of the genes .* and 2 more"):
        dc.Loader(url, genes=[f"nope{i}" for i in range(7)])
    with pytest.raises(ValueError, match=f"genes lists {names[1]!r} more than once"):
        dc.Loader(url, genes=[names[0], names[1], names[1]])
    with pytest.raises(IndexError, match=f"gene position {adata.n_vars} out of range: the "
                                         f"dataset has {adata.n_vars} genes"):
        dc.Loader(url, genes=[0, adata.n_vars])


@pytest.fixture(scope="module")
def liao_subset(tmp_path_factory):
    """3,000 real cells (liao2020_balf) written as a dataset."""
    adata = ad.read_h5ad(DATA_DIR / "liao2020_balf.h5ad")[:3000].copy()
    root = tmp_path_factory.mktemp("loader-real")
    dc.write_deltacells(adata, root / "d", tile_size=1024, progress=False)
    return str(root / "d"), adata


@pytest.mark.parametrize("mode", ["tiles", "cells"])
def test_normalisation_equals_scanpy_on_real_data(liao_subset, mode):
    sc = pytest.importorskip("scanpy")
    url, adata = liao_subset
    hvg = list(adata.var_names[np.argsort(-np.asarray(adata.X.sum(axis=0)).ravel())[:500]])
    loader = dc.Loader(url, batch_size=512, shuffle=mode, normalize=1e4, log1p=True, seed=1)
    subset = dc.Loader(url, batch_size=512, shuffle=mode, normalize=1e4, log1p=True, seed=1,
                       genes=hvg)  # fmt: skip
    for batch, batch_subset in zip(loader, subset, strict=True):
        expected = adata[batch.cells].copy()
        expected.X = sp.csr_matrix(expected.X, dtype=np.float32)
        sc.pp.normalize_total(expected, target_sum=1e4)
        sc.pp.log1p(expected)
        np.testing.assert_allclose(batch.X.toarray(), expected.X.toarray(), rtol=1e-5, atol=1e-6)
        # Library sizes count all genes, so a subset equals slicing the normalised matrix.
        np.testing.assert_allclose(batch_subset.X.toarray(), expected[:, hvg].X.toarray(),
                                   rtol=1e-5, atol=1e-6)  # fmt: skip


def test_outputs_numpy_and_torch(pair):
    torch = pytest.importorskip("torch")
    url, adata = pair
    X = sp.csr_matrix(adata.X)
    dense = next(iter(dc.Loader(url, batch_size=50, output="numpy")))
    np.testing.assert_array_equal(dense.X, X[dense.cells].toarray())
    sparse = next(iter(dc.Loader(url, batch_size=50, output="torch")))
    assert sparse.X.layout == torch.sparse_csr
    np.testing.assert_array_equal(sparse.X.to_dense().numpy(), X[sparse.cells].toarray())
    dense_t = next(iter(dc.Loader(url, batch_size=50, output="torch_dense")))
    assert dense_t.X.dtype == torch.float32
    np.testing.assert_array_equal(dense_t.X.numpy(), X[dense_t.cells].toarray())


def test_torch_batches_do_not_warn_that_nothing_is_checked(pair):
    # torch warns once per process, so the first sparse batch is made in a fresh one.
    pytest.importorskip("torch")
    url, _ = pair
    script = (
        "import sys, warnings\n"
        "import deltacells as dc\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    batch = next(iter(dc.Loader(sys.argv[1], batch_size=50, output='torch')))\n"
        "    batch.X.to_dense()\n"
        "print('|'.join(str(w.message) for w in seen))\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(url)], capture_output=True,
                          text=True, check=True, timeout=120)  # fmt: skip
    assert "invariant checks are implicitly disabled" not in done.stdout + done.stderr


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_torch_dataloader_workers_cover_every_cell_once(pair, context):
    torch = pytest.importorskip("torch")
    url, _ = pair
    dataset = dc.TorchIterableDataset(url, batch_size=64, seed=6, obs=["cell_type"])
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         multiprocessing_context=context)  # fmt: skip
    batches = list(loader)
    cells = np.concatenate([b["cells"].numpy() for b in batches])
    np.testing.assert_array_equal(np.sort(cells), np.arange(1000))
    single = np.concatenate(cells_of(dc.Loader(url, batch_size=64, seed=6)))
    np.testing.assert_array_equal(np.sort(single), np.sort(cells))
    assert all(b["cell_type"].dtype == torch.int32 for b in batches)


def test_torch_dataset_names_a_mistaken_option_when_made(pair):
    # Its loaders are made in the worker processes; the mistake is named here, not there.
    pytest.importorskip("torch")
    url, _ = pair
    with pytest.raises(ValueError, match=re.escape("batch_size must be >= 1, not 0")):
        dc.TorchIterableDataset(url, batch_size=0)
    with pytest.raises(TypeError, match="normalize must be a number"):
        dc.TorchIterableDataset(url, normalize="1e4")
    with pytest.raises(TypeError, match="Loader got an unexpected keyword argument 'batchsize'"):
        dc.TorchIterableDataset(url, batchsize=64)



def test_checking_options_does_not_ask_for_threads(pair, monkeypatch):
    # The check in the parent must not count as starting OpenMP: workers it forks later
    # would then be held to one thread (and warned).
    pytest.importorskip("torch")
    from deltacells.codec import threads

    url, _ = pair
    monkeypatch.setattr(threads, "_threads_started", False)
    dc.TorchIterableDataset(url, batch_size=64, n_threads=2)
    assert threads._threads_started is False
    with pytest.raises(ValueError, match="n_threads=0 is not allowed"):
        dc.TorchIterableDataset(url, n_threads=0)


def test_torch_dataloader_resumes_mid_epoch(pair):
    torch = pytest.importorskip("torch")
    url, _ = pair
    options = {"batch_size": 48, "seed": 2, "shuffle": "tiles"}

    def loader_over(dataset):
        return torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=3,
                                           multiprocessing_context="fork")  # fmt: skip

    full = [b["cells"].numpy() for b in loader_over(dc.TorchIterableDataset(url, **options))]
    assert len(full) == -(-1000 // 48)
    for taken in (5, 19):
        dataset = dc.TorchIterableDataset(url, **options)
        dataset.load_state_dict(dataset.state_dict(taken))
        rest = [b["cells"].numpy() for b in loader_over(dataset)]
        assert len(rest) == len(full) - taken
        for a, b in zip(rest, full[taken:], strict=True):
            np.testing.assert_array_equal(a, b)


def test_obs_given_as_one_name_or_none(pair):
    url, adata = pair
    one = next(iter(dc.Loader(url, batch_size=50, shuffle="none", obs="cell_type")))
    assert list(one.obs) == ["cell_type"]
    codes = adata.obs["cell_type"].cat.codes.to_numpy()[one.cells]
    np.testing.assert_array_equal(one.obs["cell_type"], codes)
    none = next(iter(dc.Loader(url, batch_size=50, shuffle="none", obs=None)))
    assert none.obs == {}
    # Names as a pandas Index (adata.obs.columns) or a numpy array work as a list does.
    for names in (adata.obs.columns[:1], np.array(["cell_type"])):
        batch = next(iter(dc.Loader(url, batch_size=50, shuffle="none", obs=names)))
        np.testing.assert_array_equal(batch.obs["cell_type"], codes)


def test_errors(pair):
    url, _ = pair
    with pytest.raises(ValueError, match="shuffle"):
        dc.Loader(url, shuffle="sometimes")
    with pytest.raises(ValueError, match="rank"):
        dc.Loader(url, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"category codes and numbers only; look its values up "
                                         r"by each batch's cells \(read_deltacells\(\.\.\.\)"
                                         r"\.obs_names\[batch\.cells\]\)"):
        dc.Loader(url, obs=["_index"])
    with pytest.raises(ValueError, match="float"):
        dc.Loader(url, values_dtype=np.int32, normalize=1e4)
    # Refused when the loader is made, naming the argument (not in its first batch).
    with pytest.raises(ValueError, match="n_threads=0 is not allowed"):
        dc.Loader(url, n_threads=0)
    with pytest.raises(TypeError, match="n_threads must be an int or None, not str"):
        dc.Loader(url, n_threads="2")
    with pytest.raises(TypeError, match="batch_size must be an int, not float"):
        dc.Loader(url, batch_size=64.0)
    with pytest.raises(TypeError, match="prefetch must be an int, not bool"):
        dc.Loader(url, prefetch=True)
    # seed: every rank and worker draws the same order from it, so it must be a plain int.
    with pytest.raises(TypeError, match="seed must be an int, not float"):
        dc.Loader(url, seed=1.5)
    with pytest.raises(TypeError, match="seed must be an int, not NoneType"):
        dc.Loader(url, seed=None)
    with pytest.raises(ValueError, match="seed must be >= 0, not -1"):
        dc.Loader(url, seed=-1)
    with pytest.raises(TypeError, match="world_size must be an int, not str"):
        dc.Loader(url, rank=0, world_size="2")
    # normalize is a positive target sum (scanpy's target_sum); 0, NaN or a string was taken.
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="normalize must be a positive target sum"):
            dc.Loader(url, normalize=bad)
    with pytest.raises(TypeError, match=r"normalize must be a number .* not str"):
        dc.Loader(url, normalize="1e4")


def test_take_rows_kernel_checks_its_output_rows():
    matrix = sp.random(10, 20, density=0.3, format="csr", random_state=0, dtype=np.float32)
    indptr = matrix.indptr.astype(np.int64)
    rows = np.array([3, 1], dtype=np.int64)
    out_indptr = np.array([0, 1, 2], dtype=np.int64)  # wrong lengths
    with pytest.raises(ValueError, match="length"):
        _rows.take_rows_into(indptr, matrix.indices, matrix.data, rows,
                                np.arange(2, dtype=np.int64), out_indptr,
                                np.empty(2, np.int32), np.empty(2, np.float32))  # fmt: skip
    col_map = np.arange(20, dtype=np.int64)
    col_map[::2] = -1
    kept = _rows.kept_per_row(indptr, matrix.indices, col_map, 2)
    np.testing.assert_array_equal(kept, [np.sum(matrix[r].indices % 2) for r in range(10)])
    with pytest.raises(ValueError, match="outside col_map"):
        _rows.kept_per_row(indptr, matrix.indices, col_map[:5], 2)
    lengths = kept[rows]
    good = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = np.empty(int(good[-1]) + 1, np.int32), np.empty(int(good[-1]) + 1, np.float32)
    both = np.arange(2, dtype=np.int64)
    _rows.take_rows_into(indptr, matrix.indices, matrix.data, rows, both, good, *out,
                            col_map, 2, False)  # fmt: skip
    assert np.all(out[0][: good[-1]] % 2 == 1)
    short = good.copy()
    short[1:] -= 1  # one entry too few for row 3
    with pytest.raises(ValueError, match="wrong length"):
        _rows.take_rows_into(indptr, matrix.indices, matrix.data, rows, both, short, *out,
                                col_map, 2, False)  # fmt: skip



def test_the_sort_limit_runs_the_row_steps_own_sort(row_sort):
    # bench_loader's floor: every row renumbered and sorted by the sort the row step uses (the
    # checksum, the sum of each row's middle sorted column, is scipy's and the same on 1 and
    # 2 threads); two columns sent to one place are refused, as the row step refuses them.
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 400, 120)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = np.concatenate([np.sort(rng.choice(3_000, n, replace=False))
                              for n in lengths]).astype(np.int32)  # fmt: skip
    data = rng.random(indices.shape[0]).astype(np.float32)
    col_map = rng.permutation(3_000).astype(np.int64)
    rows = rng.permutation(len(lengths)).astype(np.int64)
    expected = 0
    for r in rows:
        columns = np.sort(col_map[indices[indptr[r] : indptr[r + 1]]])
        expected += int(columns[len(columns) // 2]) if len(columns) else 0
    for n_threads in (1, 2):
        got = _rows.sort_rows_only(indptr, indices, data, rows, col_map, n_threads)
        assert got == expected % 2**32
    with pytest.raises(ValueError, match="two mapped"):
        _rows.sort_rows_only(indptr, indices, data, rows, col_map // 2)
    with pytest.raises(ValueError, match="col_map"):
        _rows.sort_rows_only(indptr, indices, data, rows, np.where(col_map == 0, -1, col_map))
    with pytest.raises(ValueError, match="out of range"):
        _rows.sort_rows_only(indptr, indices, data, np.array([len(lengths)]), col_map)
    with pytest.raises(ValueError, match="outside col_map"):
        _rows.sort_rows_only(indptr, indices, data, rows, col_map[:2_000])
    falling = indptr.copy()
    falling[1] = indices.shape[0] + 100  # row 0 would run past the end of indices
    with pytest.raises(ValueError, match="outside indices"):
        _rows.sort_rows_only(falling, indices, data, np.array([0]), col_map)
    with pytest.raises(ValueError, match="shorter"):
        _rows.sort_rows_only(indptr, indices, data[:-1], rows, col_map)


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.float64])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("misaligned", [False, True], ids=["lines alike", "values shifted"])
def test_taken_rows_in_source_order_equal_scipy(row_sort, dtype, n_threads, misaligned):
    # The loader's source-order step (rows renumbered and sorted, the next row prefetched,
    # the output streamed past the cache) against scipy's own column permutation, with every
    # row sort; rows of 30-600 entries take the sorts' own paths, a few short ones the
    # insertion sort. Rows start anywhere in a cache line; with the values shifted by one
    # entry against the indices, "simd16" streams them one at a time instead of by lines.
    rng = np.random.default_rng(11)
    n_rows, n_cols = 300, 2_000
    lengths = np.where(rng.random(n_rows) < 0.1, rng.integers(0, 20, n_rows),
                       rng.integers(30, 600, n_rows))  # fmt: skip
    rows_idx = [np.sort(rng.choice(n_cols, n, replace=False)) for n in lengths]
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = np.concatenate(rows_idx).astype(np.int32)
    data = rng.integers(1, 1000, len(indices)).astype(dtype)
    col_map = rng.permutation(n_cols).astype(np.int64)  # stored column j is column col_map[j]
    source = sp.csr_matrix((data.copy(), col_map[indices], indptr), shape=(n_rows, n_cols))
    source.sort_indices()
    rows = rng.permutation(n_rows)[:250].astype(np.int64)  # random order, as batches take them
    positions = rng.permutation(len(rows)).astype(np.int64)
    out_indptr = np.concatenate([[0], np.cumsum(lengths[rows])]).astype(np.int64)
    # One spare entry past the end each side: nothing may be written there.
    out_idx = np.full(int(out_indptr[-1]) + 1, -7, np.int32)
    out_val = np.full(int(out_indptr[-1]) + 2, -7, dtype)[int(misaligned):][: len(out_idx)]
    _rows.take_rows_into(indptr, indices, data, rows, positions, out_indptr, out_idx, out_val,
                         col_map, n_threads, True)  # fmt: skip
    expected = source[rows]
    np.testing.assert_array_equal(out_idx[:-1], expected.indices)
    np.testing.assert_array_equal(out_val[:-1], expected.data)
    assert out_idx[-1] == -7 and out_val[-1] == -7

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_taken_rows_refuse_two_columns_sent_to_one(row_sort, dtype):
    # A map sending two of a row's columns to one place is refused by the streamed row step,
    # whichever sort runs and wherever the pair lands in the sorted row: among its first
    # entries, in the middle (whole cache lines with "simd16") and at its tail.
    rng = np.random.default_rng(3)
    n_cols, length = 4_000, 203
    columns = np.sort(rng.choice(n_cols, length, replace=False)).astype(np.int32)
    indptr = np.array([0, length], np.int64)
    data = np.ones(length, dtype)
    rows = positions = np.array([0], np.int64)
    for first in (0, 1, 15, 100, length - 2):  # 15: across two lines of sixteen
        col_map = rng.permutation(n_cols).astype(np.int64)
        landing = np.sort(col_map[columns])
        # the pair: the columns sorted at first and first + 1 both go to the first's place
        pair = [columns[col_map[columns] == c][0] for c in landing[first : first + 2]]
        col_map[pair[1]] = col_map[pair[0]]
        out = (np.zeros(length, np.int32), np.zeros(length, dtype))
        with pytest.raises(ValueError, match="two mapped to one place"):
            _rows.take_rows_into(indptr, columns, data, rows, positions, indptr, *out, col_map,
                                 1, True)  # fmt: skip


def test_decoded_tiles_are_dropped_after_their_last_batch(pair, monkeypatch):
    from deltacells.train import loader as loader_module

    url, _ = pair
    held = []
    release = loader_module._BatchBuilder.release

    def counting_release(self, batch_index):
        held.append((len(self.decoded), len(getattr(self, "outputs", ())),
                     len(getattr(self, "parsed", ()))))  # fmt: skip
        release(self, batch_index)

    monkeypatch.setattr(loader_module._BatchBuilder, "release", counting_release)
    loader = dc.Loader(url, batch_size=64, buffer_tiles=2, seed=1, column_order="stored")
    assert len(cells_of(loader)) == 16
    # A 64-cell batch from a 2-tile buffer needs those 2 tiles, or 4 when it straddles two
    # buffers; nothing else stays decoded.
    decoded = [h[0] for h in held]
    assert max(decoded) <= 4 and min(decoded) >= 1
    # The source order decodes each buffer straight into its batches: no tile is held
    # decoded, only the batches laid out but not yet handed over (a 256-cell buffer feeds at
    # most 5 of 64 cells) and the compressed tiles they wait for.
    held.clear()
    assert len(cells_of(dc.Loader(url, batch_size=64, buffer_tiles=2, seed=1))) == 16
    assert max(h[0] for h in held) == 0
    assert 0 < max(h[1] for h in held) <= 5 and max(h[2] for h in held) <= 4


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
def test_batches_decoded_straight_into_place_equal_scipy(pair, dtype, monkeypatch):
    # The default (source order, sorted) decodes each buffer's cells straight into the
    # batches that take them: every batch must still hold exactly its cells' rows, across
    # ranks whose padding wraps to the start, workers, and batches straddling buffers.
    from deltacells.train import loader as loader_module

    url, adata = pair
    X = sp.csr_matrix(adata.X).astype(dtype)
    calls = []
    many = loader_module.gather_tiles_into_many

    def counted(*args, **kwargs):
        calls.append(len(args[2]))
        return many(*args, **kwargs)

    monkeypatch.setattr(loader_module, "gather_tiles_into_many", counted)
    seen = 0
    cases = [(1, 0, 1, 0, 100), (3, 2, 1, 0, 96), (2, 1, 2, 1, 64), (3, 0, 2, 0, 37),
             (1, 0, 1, 0, 300)]  # the last: batches larger than a 256-cell buffer
    for world_size, rank, workers, worker, size in cases:
        loader = dc.Loader(url, batch_size=size, seed=4, rank=rank, world_size=world_size,
                           values_dtype=dtype, buffer_tiles=2)  # fmt: skip
        loader.set_worker(worker, workers)
        for batch in loader:
            expected = X[batch.cells]
            assert batch.X.has_canonical_format and batch.X.dtype == dtype
            np.testing.assert_array_equal(batch.X.indptr, expected.indptr)
            np.testing.assert_array_equal(batch.X.indices, expected.indices)
            np.testing.assert_array_equal(batch.X.data, expected.data)
            seen += len(batch.cells)
    # Every cell the ranks took was decoded once, by this path.
    assert sum(calls) == seen


def test_a_damaged_tile_raises_in_the_consumer_and_stopping_early_ends_the_thread(pair, tmp_path):
    import shutil
    import threading
    import time

    url, _ = pair
    copy = tmp_path / "d"
    shutil.copytree(url, copy)
    tile = copy / "tiles" / "tile_000003.dct"
    blob = bytearray(tile.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    tile.write_bytes(bytes(blob))
    with pytest.raises(dc.FormatError, match="tile_000003"):
        for _ in dc.Loader(copy, batch_size=64, shuffle="none"):
            pass
    iterator = iter(dc.Loader(url, batch_size=16, prefetch=1))
    next(iterator)
    iterator.close()  # the consumer stops early: the background thread must end too
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(
        t.name == "deltacells-loader" for t in threading.enumerate()
    ):
        time.sleep(0.05)
    assert not any(t.name == "deltacells-loader" for t in threading.enumerate())


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    tile_cells=st.lists(st.integers(0, 50), min_size=0, max_size=12),
    batch_size=st.integers(1, 40),
    world_size=st.integers(1, 5),
    n_workers=st.integers(1, 4),
    mode=st.sampled_from(MODES),
    buffer_tiles=st.integers(1, 4),
    drop_last=st.booleans(),
)
def test_epoch_split_covers_every_cell_as_documented(
    tile_cells, batch_size, world_size, n_workers, mode, buffer_tiles, drop_last
):
    from deltacells.train.loader import split_batches

    order = plan_epoch(tile_cells, shuffle=mode, buffer_tiles=buffer_tiles, seed=5, epoch=2)
    n = sum(tile_cells)
    np.testing.assert_array_equal(np.sort(order), np.arange(n))
    per_rank, cells = [], []
    for rank in range(world_size):
        runs = [split_batches(order, batch_size, rank=rank, world_size=world_size,
                              worker=(w, n_workers), drop_last=drop_last)
                for w in range(n_workers)]  # fmt: skip
        # The loader's lazy plan draws exactly these batches, a buffer at a time.
        plan = EpochPlan(tile_cells, shuffle=mode, buffer_tiles=buffer_tiles, seed=5, epoch=2)
        for w, run in enumerate(runs):
            lazy = BatchRuns(plan, batch_size, rank=rank, world_size=world_size,
                             worker=(w, n_workers), drop_last=drop_last)  # fmt: skip
            assert len(lazy) == len(run)
            for i, batch in enumerate(run):
                np.testing.assert_array_equal(lazy[i], batch)
                tiles = np.searchsorted(np.cumsum(tile_cells), batch, side="right")
                assert set(tiles.tolist()) <= set(plan.tiles_at(*lazy.bounds(i)))
        lengths = [len(run) for run in runs]
        assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
        per_rank.append(sum(lengths))
        cells.extend(np.concatenate(run) for run in runs if run)
    assert len(set(per_rank)) == 1  # every rank yields as many batches
    seen = np.concatenate(cells) if cells else np.zeros(0, dtype=np.int64)
    counts = np.bincount(seen, minlength=n)
    if drop_last:
        assert counts.max(initial=0) <= 1
        full = (n // world_size) // batch_size * batch_size
        assert len(seen) == full * world_size
    else:
        # Every cell once, plus the wrapped-around padding from the start of the order.
        padded = np.resize(order, -(-n // world_size) * world_size) if n else order
        np.testing.assert_array_equal(counts, np.bincount(padded, minlength=n))


@pytest.mark.parametrize("shuffle", ["tiles", "cells"])
def test_tiles_fetched_ahead_give_the_same_batches(pair, shuffle, monkeypatch):
    """prefetch_tiles only changes when tiles are read: the same batches, and the fetches
    come from the look-ahead (every tile once)."""
    from deltacells.store.storage import Store

    root = pair[0]
    plain = dc.Loader(root, batch_size=100, shuffle=shuffle, seed=3, prefetch_tiles=0)
    ahead = dc.Loader(root, batch_size=100, shuffle=shuffle, seed=3, prefetch_tiles=3)
    assert plain.prefetch_tiles == 0 and ahead.prefetch_tiles == 3
    # Local files are read a few tiles ahead by default (remote stores further).
    from deltacells.train.loader import LOCAL_TILES_IN_FLIGHT

    assert dc.Loader(root, batch_size=100).prefetch_tiles == LOCAL_TILES_IN_FLIGHT > 0
    asked = []
    original = Store.prefetch
    monkeypatch.setattr(Store, "prefetch", lambda self, names, sizes=None: (
        asked.extend(names), original(self, names, sizes))[1])  # fmt: skip
    for a, b in zip(plain, ahead, strict=True):
        assert np.array_equal(a.cells, b.cells) and (a.X != b.X).nnz == 0
    n_tiles = ahead.dataset.manifest.n_tiles
    assert sorted(asked) == sorted({f"tiles/tile_{t:06d}.dct" for t in range(n_tiles)})


def test_an_epoch_over_100m_cells_holds_per_tile_state_only():
    """Planning an epoch and drawing a batch over 100M cells (24,415 tiles) allocates a few
    MB, not the 800 MB of a per-cell order (shuffle="cells" would)."""
    import tracemalloc

    tile_cells = [4096] * 24414 + [1024]
    tracemalloc.start()
    try:
        plan = EpochPlan(tile_cells, shuffle="tiles", buffer_tiles=2, seed=0, epoch=3)
        runs = BatchRuns(plan, 4096, rank=1, world_size=2, worker=(1, 2))
        middle = runs[len(runs) // 2]
        first_tiles = plan.tiles_at(*runs.bounds(0))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert plan.n_cells == 24414 * 4096 + 1024
    assert len(runs) == 6104 and len(middle) == 4096  # half of ceil(50,000,384 / 4096)
    assert len(set(middle.tolist())) == 4096 and len(first_tiles) in (2, 4)
    assert peak < 8 * 2**20, peak


def _epoch_reading(loader, epoch: int, monkeypatch) -> tuple[list, list[int]]:
    """Epoch ``epoch``'s batches (rows of their cells) and the tiles read for it."""
    read: list[int] = []
    real = type(loader.dataset).tile

    def counting(dataset, index, **kwargs):
        read.append(index)
        return real(dataset, index, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(type(loader.dataset), "tile", counting)
        loader.set_epoch(epoch)
        batches = [(batch.cells, sp.csr_matrix(batch.X)) for batch in loader]
    return batches, read


@pytest.mark.parametrize("mode", ["tiles", "none"])
def test_tile_modes_keep_tiles_across_epochs(pair, mode, monkeypatch):
    url, adata = pair
    n_tiles = dc.open_dataset(url).manifest.n_tiles
    kept = dc.Loader(url, batch_size=96, shuffle=mode, seed=4)
    unkept = dc.Loader(url, batch_size=96, shuffle=mode, seed=4, tile_cache_bytes=0)
    for epoch in range(4):
        got, read = _epoch_reading(kept, epoch, monkeypatch)
        want, read_again = _epoch_reading(unkept, epoch, monkeypatch)
        # Nothing kept in the first epoch (a loader iterated once holds no more memory); the
        # second keeps what it reads, and later ones read (and check) nothing again.
        assert sorted(read) == (list(range(n_tiles)) if epoch < 2 else [])
        assert len(kept._kept_tiles) == (0 if epoch == 0 else n_tiles)
        assert sorted(set(read_again)) == list(range(n_tiles))
        for (cells, matrix), (cells2, matrix2) in zip(got, want, strict=True):
            np.testing.assert_array_equal(cells, cells2)
            assert (matrix != matrix2).nnz == 0 and (matrix != adata.X[cells]).nnz == 0
    assert len(kept._kept_tiles) == n_tiles and unkept._kept_tiles == {}


def test_kept_tiles_stay_within_the_budget_and_are_not_pickled(pair, monkeypatch):
    import pickle

    url, _ = pair
    sizes = dc.open_dataset(url).manifest.tile_bytes
    budget = int(sum(sizes) // 3)
    loader = dc.Loader(url, batch_size=128, seed=1, tile_cache_bytes=budget)
    _epoch_reading(loader, 0, monkeypatch)
    assert loader._kept_tiles == {}
    _, first = _epoch_reading(loader, 1, monkeypatch)
    assert sorted(set(first)) == list(range(len(sizes)))
    kept = set(loader._kept_tiles)
    assert 0 < loader._kept_bytes <= budget and loader._kept_bytes == sum(sizes[t] for t in kept)
    # The first tiles kept stay; later epochs read only the others.
    _, second = _epoch_reading(loader, 2, monkeypatch)
    assert set(second) == set(range(len(sizes))) - kept and set(loader._kept_tiles) == kept
    # A worker keeps its share of the budget.
    worker = dc.Loader(url, batch_size=128, seed=1, tile_cache_bytes=budget)
    worker.set_worker(0, 2)
    for epoch in range(2):
        _epoch_reading(worker, epoch, monkeypatch)
    assert 0 < worker._kept_bytes <= budget // 2
    # Pickled (for spawned workers) without them: each process keeps its own.
    copy = pickle.loads(pickle.dumps(loader))
    assert copy._kept_tiles == {} and copy._kept_bytes == 0 and copy._iterations == 0
    assert [c.tolist() for c in cells_of(copy)] == [c.tolist() for c in cells_of(loader)]
    # "cells" mode keeps nothing across epochs (its cache lives for one epoch).
    cells_mode = dc.Loader(url, batch_size=128, shuffle="cells", seed=1)
    for epoch in range(2):
        _epoch_reading(cells_mode, epoch, monkeypatch)
    assert cells_mode._kept_tiles == {}
    with pytest.raises(ValueError, match="tile_cache_bytes must be >= 0"):
        dc.Loader(url, tile_cache_bytes=-1)
    with pytest.raises(TypeError, match="tile_cache_bytes must be an int, not float"):
        dc.Loader(url, tile_cache_bytes=1.5e8)


def test_torch_dataset_keeps_its_loader_and_tiles_in_one_process(pair, monkeypatch):
    torch = pytest.importorskip("torch")
    import pickle

    url, _ = pair
    dataset = dc.TorchIterableDataset(url, batch_size=100, seed=3)
    first = [b["cells"].numpy() for b in dataset]
    loader = dataset._loader[1]
    dataset.set_epoch(1)
    assert len([b for b in dataset]) == len(first) and loader._kept_tiles  # kept from here on
    dataset.set_epoch(2)
    read: list[int] = []
    real = type(loader.dataset).tile
    monkeypatch.setattr(type(loader.dataset), "tile",
                        lambda ds, i, **kw: read.append(i) or real(ds, i, **kw))
    second = [b["cells"].numpy() for b in torch.utils.data.DataLoader(dataset, batch_size=None)]
    assert dataset._loader[1] is loader and read == []  # the same loader, no tile read again
    expected = dc.Loader(url, batch_size=100, seed=3)
    expected.set_epoch(2)
    for got, want in zip(second, cells_of(expected), strict=True):
        np.testing.assert_array_equal(got, want)
    assert len(first) == len(second)
    assert pickle.loads(pickle.dumps(dataset))._loader is None  # workers make their own
