"""The encoder refuses what is not a count matrix, with messages naming cell and gene."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

import deltacells as dc
from deltacells.codec.threads import effective_n_threads


def matrix_with(value, dtype=np.float64):
    m = np.zeros((4, 6), dtype=dtype)
    m[0, 1] = 3
    m[2, 4] = value
    return m


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (np.nan, "non-finite count .* cell 2, gene 4"),
        (np.inf, "non-finite count .* cell 2, gene 4"),
        (1.5, "non-integral count at cell 2, gene 4"),
        (-1.0, "negative count at cell 2, gene 4"),
        (2.0**31, "count >= 2\\^31 at cell 2, gene 4"),
    ],
)
def test_bad_float_values(value, match):
    with pytest.raises(ValueError, match=match):
        dc.encode_tile(matrix_with(value))
    with pytest.raises(ValueError, match=match):
        dc.encode_tile(sp.csc_matrix(matrix_with(value)))


def test_bad_integer_values():
    with pytest.raises(ValueError, match="negative count at cell 2, gene 4"):
        dc.encode_tile(matrix_with(-5, np.int32))
    with pytest.raises(ValueError, match="count >= 2\\^31"):
        dc.encode_tile(matrix_with(2**31, np.int64))


def test_duplicates_that_sum_past_the_limit_are_refused():
    coo = sp.coo_matrix(([2**31 - 1, 2**31 - 1], ([0, 0], [1, 1])), shape=(1, 3), dtype=np.int32)
    with pytest.raises(ValueError, match="count >= 2\\^31 at cell 0, gene 1"):
        dc.encode_tile(coo)


def test_input_is_not_modified():
    csr = sp.csr_matrix((np.array([1, 2, 0]), np.array([2, 2, 0]), np.array([0, 3])), shape=(1, 3))
    before = (csr.data.copy(), csr.indices.copy())
    dc.encode_tile(csr)
    np.testing.assert_array_equal(csr.data, before[0])
    np.testing.assert_array_equal(csr.indices, before[1])


def test_shape_and_dtype_errors():
    with pytest.raises(ValueError, match=r"1\.\.2\^31 genes"):
        dc.encode_tile(np.zeros((3, 0)))
    with pytest.raises(ValueError, match="2-D"):
        dc.encode_tile(np.zeros(3))
    with pytest.raises(ValueError, match="integers or floats"):
        dc.encode_tile(np.array([["a"]], dtype=object))
    with pytest.raises(ValueError, match="n_chunks"):
        dc.encode_tile(np.ones((2, 2)), n_chunks=0)
    with pytest.raises(ValueError, match="zstd level"):
        dc.encode_tile(np.ones((2, 2)), level=99)
    with pytest.raises(ValueError, match="values_dtype"):
        dc.decode_tile(dc.encode_tile(np.ones((2, 2))), values_dtype=np.int16)


def test_exception_policy_refuses_tiles_where_large_counts_are_not_rare():
    # 2,000 counts above 65535 among 2,000 nonzeros: more than max(1024, nnz / 200).
    matrix = sp.csr_matrix(np.full((20, 100), 70_000))
    with pytest.raises(ValueError, match=r"2000 exceptions \(count above 65535\).* allows"):
        dc.encode_tile(matrix)
    # At the limit it is accepted.
    matrix = sp.csr_matrix(np.full((1024, 1), 70_000))
    assert dc.Tile(dc.encode_tile(matrix)).exception_counts[:, 0].sum() == 1024


def test_exception_policy_for_gaps():
    # Every cell jumps over more than 65535 genes: 1,500 gap exceptions in 3,000 nonzeros.
    rows = np.repeat(np.arange(1500), 2)
    cols = np.tile([0, 100_000], 1500)
    matrix = sp.csr_matrix((np.ones(3000), (rows, cols)), shape=(1500, 100_001))
    with pytest.raises(ValueError, match=r"1500 exceptions \(gene gap above 65535\)"):
        dc.encode_tile(matrix)


def test_effective_n_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = effective_n_threads(None)
    assert cpus >= 1
    assert effective_n_threads(3) == 3
    assert effective_n_threads(-1) == cpus
    assert effective_n_threads(-cpus - 5) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "5,2")
    assert effective_n_threads(None) == 5
    with pytest.raises(ValueError):
        effective_n_threads(0)
    with pytest.raises(TypeError):
        effective_n_threads(1.5)
