"""Round trips against scipy on the real data, in every value dtype and thread count."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from conftest import DATASETS, sort_genes_by_total

import deltacells as dc
from deltacells.codec.tile import chunk_bounds


def assert_same(decoded: sp.csr_matrix, expected: sp.csr_matrix) -> None:
    assert decoded.shape == expected.shape
    expected = sp.csr_matrix(expected)
    expected.sort_indices()
    np.testing.assert_array_equal(decoded.indptr, expected.indptr)
    np.testing.assert_array_equal(decoded.indices, expected.indices)
    np.testing.assert_array_equal(decoded.data, expected.data.astype(decoded.dtype))


@pytest.mark.parametrize("name", DATASETS)
@pytest.mark.parametrize("sorted_genes", [True, False], ids=["sorted", "unsorted"])
def test_real_data_round_trip(real_counts, name, sorted_genes):
    matrix = real_counts[name]
    if sorted_genes:
        matrix, _ = sort_genes_by_total(matrix)
    tile = dc.Tile(dc.encode_tile(matrix, level=1))
    assert tile.shape == matrix.shape and tile.nnz == matrix.nnz
    assert_same(tile.decode(np.int32), matrix)
    assert_same(tile.decode(np.float64, n_threads=1), matrix)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, matrix.shape[0], 300)
    assert_same(tile.gather(rows, np.int32), matrix[rows])


def test_counts_above_uint16_use_value_exceptions(real_counts):
    matrix = real_counts["chung2017_smartseq2"]
    assert matrix.data.max() > 2_000_000
    tile = dc.Tile(dc.encode_tile(matrix))
    assert tile.exception_counts[:, 0].sum() == np.count_nonzero(matrix.data > 65535) == 3229
    assert_same(tile.decode(np.int32), matrix)


def test_tiles_of_10000_cells(liao):
    for start in range(0, liao.shape[0], 10_000):
        block = liao[start : start + 10_000]
        assert_same(dc.decode_tile(dc.encode_tile(block), values_dtype=np.int32), block)


def test_same_bytes_and_matrix_for_every_thread_count(liao):
    block = liao[:3000]
    tiles = {n: dc.encode_tile(block, n_threads=n) for n in (1, 2, 3, 8)}
    assert len(set(tiles.values())) == 1
    tile = dc.Tile(tiles[1])
    decoded = [tile.decode(np.int32, n_threads=n) for n in (1, 2, 5)]
    for other in decoded[1:]:
        assert (other != decoded[0]).nnz == 0
    rows = np.arange(3000)[::-7]
    gathered = [tile.gather(rows, n_threads=n) for n in (1, 2, 5)]
    for other in gathered[1:]:
        assert (other != gathered[0]).nnz == 0


def test_decode_into_reused_buffers(liao):
    block = liao[:2000]
    tile = dc.Tile(dc.encode_tile(block))
    indices = np.full(tile.nnz + 10, -1, dtype=np.int32)
    values = np.zeros(tile.nnz + 10, dtype=np.float32)
    for _ in range(2):
        result = tile.decode(np.float32, out=(indices, values))
        assert np.shares_memory(result.data, values)
        assert_same(result, block)
    with pytest.raises(ValueError, match="values_dtype"):
        tile.decode(np.float64, out=(indices, values))
    with pytest.raises(ValueError, match="entries"):
        tile.decode_into(indices[:5], values)


def test_input_formats_give_identical_tiles(liao):
    block = liao[:500]
    expected = dc.encode_tile(block)
    variants = [
        block.tocsc(),
        block.tocoo(),
        block.toarray(),
        block.astype(np.float64),
        block.astype(np.int64).toarray(),
        sp.csr_array(block),
    ]
    for variant in variants:
        assert dc.encode_tile(variant) == expected


def test_duplicates_summed_and_zeros_dropped():
    rows = np.array([0, 0, 0, 1, 1, 2])
    cols = np.array([3, 3, 1, 0, 2, 4])
    vals = np.array([2, 5, 1, 0, 4, 0])
    coo = sp.coo_matrix((vals, (rows, cols)), shape=(3, 5))
    decoded = dc.decode_tile(dc.encode_tile(coo), values_dtype=np.int32)
    expected = sp.csr_matrix(np.array([[0, 1, 0, 7, 0], [0, 0, 4, 0, 0], [0, 0, 0, 0, 0]]))
    assert_same(decoded, expected)
    assert decoded.nnz == 3  # the explicit zeros are gone


def test_chunks_split_by_nonzeros_on_cell_boundaries():
    indptr = np.array([0, 10, 10, 30, 40, 40, 100], dtype=np.int64)
    bounds = chunk_bounds(indptr, 4)
    assert bounds[0] == 0 and bounds[-1] == 6
    assert np.all(np.diff(bounds) > 0)  # no empty chunks
    assert len(chunk_bounds(indptr, 8)) - 1 <= 6  # never more chunks than cells
    np.testing.assert_array_equal(chunk_bounds(np.zeros(5, dtype=np.int64), 2), [0, 2, 4])
    np.testing.assert_array_equal(chunk_bounds(np.zeros(1, dtype=np.int64), 8), [0])


def test_gather_orders_repeats_negatives_and_errors(liao):
    block = liao[:1000]
    tile = dc.Tile(dc.encode_tile(block, n_chunks=5))
    rows = np.array([999, 0, 0, 500, -1, 3, 3, 3])
    assert_same(tile.gather(rows, np.int32), block[rows])
    assert tile.gather(np.array([], dtype=np.int64)).shape == (0, block.shape[1])
    with pytest.raises(IndexError):
        tile.gather([1000])
    with pytest.raises(TypeError):
        tile.gather([0.5])


def _rows_of_lengths(lengths: list[int], n_genes: int, seed: int) -> sp.csr_matrix:
    """A CSR whose row i has lengths[i] nonzeros at random genes, counts 1..65535."""
    rng = np.random.default_rng(seed)
    indices = [np.sort(rng.choice(n_genes, k, replace=False)) for k in lengths]
    indptr = np.cumsum([0, *lengths])
    data = rng.integers(1, 65536, int(indptr[-1]))
    return sp.csr_matrix((data, np.concatenate(indices), indptr), shape=(len(lengths), n_genes))


@pytest.mark.parametrize("n_chunks", [1, 3, 7])
def test_whole_chunk_gaps_pass_at_every_cell_boundary(n_chunks):
    # Chunks without gap exceptions are decoded in one pass, 16 values at a time inside a
    # cell and one by one around its ends: cells of every length near a multiple of 16, empty
    # ones, and cells of 32,768+ nonzeros (too long for that pass, decoded cell by cell).
    lengths = [0, 1, 2, 15, 16, 17, 0, 31, 32, 33, 47, 48, 49, 3, 64, 100, 0, 5, 250, 1]
    lengths += [32_767, 32_768, 40_000, 9, 0]
    matrix = _rows_of_lengths(lengths, 60_000, seed=3)
    tile = dc.Tile(dc.encode_tile(matrix, n_chunks=n_chunks, level=1))
    order = np.random.default_rng(4).permutation(matrix.shape[1])
    for threads in (1, 2):
        for dtype in (np.int32, np.float32, np.float64):
            assert_same(tile.decode(dtype, n_threads=threads), matrix)
        # With col_map the same pass writes with regular stores, then rows are sorted.
        permuted = matrix.copy()
        permuted.indices = order[permuted.indices].astype(np.int32)
        assert_same(tile.decode(np.float32, n_threads=threads, col_map=order), permuted)


def test_whole_chunk_gaps_pass_at_every_output_alignment():
    # The output of a chunk starts at any int32 offset of a 16-byte line.
    matrix = _rows_of_lengths([70, 90, 33, 200, 18, 64], 5_000, seed=5)
    tile = dc.Tile(dc.encode_tile(matrix, n_chunks=2, level=1))
    for shift in range(4):
        indices = np.zeros(matrix.nnz + shift, np.int32)
        values = np.zeros(matrix.nnz + shift, np.float32)
        tile.decode_into(indices[shift:], values[shift:], n_threads=1)
        decoded = sp.csr_matrix((values[shift:], indices[shift:], tile.indptr), matrix.shape)
        assert_same(decoded, matrix)
