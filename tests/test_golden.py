"""Golden tiles: files written once per format version must decode forever."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from tilekit import read_header

import deltacells as dc

DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize("version", [1, 2])
def test_golden_tile_decodes_to_its_matrix(version):
    blob = (DATA / f"golden_v{version}.dct").read_bytes()
    expected = sp.load_npz(DATA / f"golden_v{version}.npz").tocsr()
    assert read_header(blob)["version"] == version
    tile = dc.Tile(blob, name=f"golden_v{version}.dct")
    assert tile.version == version
    decoded = tile.decode(np.int32)
    assert (decoded != expected).nnz == 0
    np.testing.assert_array_equal(decoded.indices, expected.indices)
    rows = np.arange(expected.shape[0])[::-1]
    assert (tile.gather(rows, np.float64) != expected[rows]).nnz == 0


def test_golden_v2_exercises_both_exception_kinds():
    tile = dc.Tile((DATA / "golden_v2.dct").read_bytes())
    value_exc, gap_exc = tile.exception_counts.sum(axis=0)
    assert value_exc >= 2 and gap_exc >= 3
    expected = sp.load_npz(DATA / "golden_v2.npz").tocsr()
    assert expected[8, 10] == 2**31 - 1
    np.testing.assert_array_equal(expected[9].indices, [1, 65537, 139999])  # two gap exceptions


@pytest.mark.parametrize("version", [1, 2])
def test_our_encoder_reproduces_the_golden_matrix(version):
    expected = sp.load_npz(DATA / f"golden_v{version}.npz").tocsr()
    blob = dc.encode_tile(expected)
    assert read_header(blob)["version"] == 2  # writers write version 2 only
    assert (dc.decode_tile(blob, values_dtype=np.int32) != expected).nnz == 0
