"""Ranged reads of a tile's rows (:mod:`deltacells.store.ranged`): equal to reading the whole
tile, and each check of the pieces they fetch refuses damage with its own message (a test per
check, failing if the check is removed)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from test_writer import small_adata

import deltacells as dc
from deltacells.codec.format import CELL_HI, CELL_LO, GAPS_LEN, GAPS_OFF, HEADER_SIZE, NNZ_LO
from deltacells.codec.tile import encode_tile
from deltacells.store.ranged import RangedTile
from deltacells.store.storage import Store

N_CELLS, N_CHUNKS = 400, 16
ENTRY = 96  # bytes of a version-2 chunk-table entry


def _matrix(seed: int = 0) -> sp.csr_matrix:
    rng = np.random.default_rng(seed)
    X = sp.random(N_CELLS, 300, density=0.05, format="csr", random_state=rng)
    X.data = np.ceil(X.data * 40).astype(np.float32)
    X.data[X.indptr[7] : X.indptr[8]] = 0  # an empty row
    X.eliminate_zeros()
    return X


def _stored(tmp_path, blob: bytes) -> RangedTile:
    (tmp_path / "t.dct").write_bytes(blob)
    return RangedTile(Store(tmp_path), "t.dct", len(blob))


def _read(ranged: RangedTile, runs) -> tuple[dc.Tile, np.ndarray]:
    plan = ranged.plan(runs)
    return plan.assemble_one(plan.fetch_all())


def _table_edit(blob: bytes, chunk: int, field: int, value: int) -> bytes:
    out = bytearray(blob)
    at = HEADER_SIZE + ENTRY * chunk + 8 * field
    out[at : at + 8] = int(value).to_bytes(8, "little")
    return bytes(out)


def _field(blob: bytes, chunk: int, field: int) -> int:
    at = HEADER_SIZE + ENTRY * chunk + 8 * field
    return int.from_bytes(blob[at : at + 8], "little")


@pytest.fixture(scope="module")
def blob() -> bytes:
    return encode_tile(_matrix(), n_chunks=N_CHUNKS)


@pytest.mark.parametrize("seed", range(6))
def test_many_runs_as_one_tile_equal_the_rows(tmp_path, blob, seed):
    """Random runs (single rows, long stretches, neighbours sharing no chunk) give the same
    rows as the matrix, at the shifts the plan reports."""
    X = _matrix()
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, N_CELLS), size=2 * rng.integers(1, 12), replace=False))
    runs = [(int(a), int(b)) for a, b in cuts.reshape(-1, 2)]
    tile, shifts = _read(_stored(tmp_path, blob), runs)
    got = tile.decode()
    for (lo, hi), shift in zip(runs, shifts, strict=True):
        assert (got[lo + shift : hi + shift] != X[lo:hi]).nnz == 0


def test_rows_tile_names_its_first_row(tmp_path, blob):
    tile, first = _stored(tmp_path, blob).rows_tile(130, 140)
    assert (tile.decode()[130 - first : 140 - first] != _matrix()[130:140]).nnz == 0


def test_rows_outside_the_tile_are_an_index_error(tmp_path, blob):
    with pytest.raises(IndexError, match=r"rows 395:401 outside the tile's 400"):
        _stored(tmp_path, blob).plan([(10, 12), (395, 401)])


def test_chunks_that_do_not_meet_are_refused(tmp_path, blob):
    damaged = _table_edit(blob, 5, CELL_LO, _field(blob, 5, CELL_LO) + 1)
    with pytest.raises(dc.FormatError, match=r"t\.dct: chunks 4\.\. do not cover rows"):
        _read(_stored(tmp_path, damaged), [(1, 2), (_field(blob, 4, CELL_LO), _field(blob, 5,
                                                                                     CELL_HI))])


def test_rows_beyond_the_last_chunk_are_refused(tmp_path, blob):
    damaged = _table_edit(blob, N_CHUNKS - 1, CELL_HI, N_CELLS - 5)
    with pytest.raises(dc.FormatError, match=r"rows 397:398 are beyond its chunks"):
        _read(_stored(tmp_path, damaged), [(397, 398)])


def test_frames_outside_the_tile_are_refused(tmp_path, blob):
    damaged = _table_edit(blob, 3, GAPS_OFF, len(blob) - 8)
    lo = _field(blob, 3, CELL_LO)
    with pytest.raises(dc.FormatError, match=r"frames of chunks 3\.\. lie outside the tile"):
        _read(_stored(tmp_path, damaged), [(lo, lo + 1)])


def test_chunks_without_frames_are_refused(tmp_path, blob):
    damaged = blob
    for field in range(GAPS_LEN, GAPS_LEN + 8, 2):
        damaged = _table_edit(damaged, 2, field, 0)
    lo = _field(blob, 2, CELL_LO)
    with pytest.raises(dc.FormatError, match=r"frames of chunks 2\.\. have no frames"):
        _read(_stored(tmp_path, damaged), [(lo, lo + 1)])


def test_an_indptr_that_disagrees_with_the_chunks_is_refused(tmp_path, blob):
    damaged = _table_edit(blob, 6, NNZ_LO, _field(blob, 6, NNZ_LO) + 1)
    lo = _field(blob, 6, CELL_LO)
    with pytest.raises(dc.FormatError, match=r"indptr does not match chunks 6\.\."):
        _read(_stored(tmp_path, damaged), [(lo, lo + 1)])


def test_a_changed_frame_byte_is_refused_by_the_chunk_checksum(tmp_path):
    """A dataset with chunk checksums: one flipped byte inside a values frame of a chunk that
    a ranged read fetches is refused by that chunk's CRC-32, naming the tile and chunk."""
    root = tmp_path / "d"
    dc.write_deltacells(small_adata(n_cells=300), root, tile_size=300, n_chunks=30,
                        progress=False)  # fmt: skip
    rows = [95, 96]
    assert (dc.read_deltacells(root, ranged_reads=True).X[rows]
            != dc.read_deltacells(root).X[rows]).nnz == 0  # fmt: skip
    tile = next((root / "tiles").glob("*.dct"))
    blob = bytearray(tile.read_bytes())
    chunk = next(c for c in range(30) if _field(blob, c, CELL_LO) <= 95 < _field(blob, c, CELL_HI))
    offset, length = _field(blob, chunk, GAPS_OFF + 2), _field(blob, chunk, GAPS_LEN + 2)
    blob[offset + length // 2] ^= 0x10
    tile.write_bytes(bytes(blob))
    with pytest.raises(dc.FormatError,
                       match=rf"{tile.name}: chunk {chunk} .*CRC-32 in the chunk checksums"):
        dc.read_deltacells(root, ranged_reads=True).X[rows]
