"""Property tests: Hypothesis-made count matrices round-trip exactly, scipy as the oracle."""

from __future__ import annotations

import itertools
import sys
from itertools import pairwise

import numpy as np
import pytest
import scipy.sparse as sp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deltacells as dc
from deltacells.codec import _rows, _sortchoice, rowsort
from deltacells.codec._decode import ColumnMap
from deltacells.codec.scatter import gather_tiles_into_many
from deltacells.codec.tile import gather_tiles_into, stable_order

GENE_COUNTS = [1, 2, 17, 300, 65535, 65536, 65537, 200_000]
SPECIAL_COUNTS = np.array([1, 2, 255, 256, 65535, 65536, 65537, 2**24, 2**31 - 1])


@st.composite
def count_matrices(draw) -> sp.csr_matrix:
    """Sparse int64 count matrices: empty cells, wide rows, counts at the uint16 edges."""
    n_cells = draw(st.integers(0, 40))
    n_genes = draw(st.sampled_from(GENE_COUNTS))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    per_cell = draw(st.sampled_from([0, 1, 3, 30, 200]))
    rows, cols = [], []
    for r in range(n_cells):
        if rng.random() < 0.2:
            continue  # an empty cell
        k = min(n_genes, int(rng.integers(0, per_cell + 1)))
        genes = rng.choice(n_genes, size=k, replace=False) if k else []
        rows += [r] * k
        cols += list(genes)
    nnz = len(rows)
    values = rng.integers(1, 40, nnz)
    special = rng.random(nnz) < draw(st.sampled_from([0.0, 0.01, 0.2]))
    values[special] = rng.choice(SPECIAL_COUNTS, int(special.sum()))
    return sp.csr_matrix((values, (rows, cols)), shape=(n_cells, n_genes), dtype=np.int64)


def assert_equal_csr(decoded: sp.csr_matrix, expected: sp.csr_matrix) -> None:
    expected = expected.tocsr()
    expected.sort_indices()
    assert decoded.shape == expected.shape
    np.testing.assert_array_equal(decoded.indptr, expected.indptr)
    np.testing.assert_array_equal(decoded.indices, expected.indices)
    np.testing.assert_array_equal(decoded.data, expected.data)


PROFILE = settings(
    max_examples=120, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@PROFILE
@given(matrix=count_matrices(), n_chunks=st.sampled_from([1, 2, 8, 64]))
def test_round_trip(matrix, n_chunks):
    policy_limit = max(1024, matrix.nnz // 200)
    if np.count_nonzero(matrix.data > 65535) > policy_limit:
        return  # the writer refuses such tiles; covered by test_encode_errors
    blob = dc.encode_tile(matrix, n_chunks=n_chunks, level=1)
    tile = dc.Tile(blob)
    assert tile.n_chunks == min(n_chunks, matrix.shape[0]) or tile.n_chunks <= n_chunks
    assert_equal_csr(tile.decode(np.int32), matrix)
    assert_equal_csr(tile.decode(np.float64, n_threads=1).astype(np.int64), matrix)
    if matrix.shape[0]:
        rows = np.random.default_rng(0).integers(0, matrix.shape[0], 25)
        assert_equal_csr(tile.gather(rows, np.int32, n_threads=2), matrix[rows])


@PROFILE
@given(matrix=count_matrices(), seed=st.integers(0, 2**32 - 1))
def test_remap_columns_with_either_row_sort(row_sort, matrix, seed):
    # Renumbering through a map that drops some columns and reorders the rest, then sorting
    # each row: equal to scipy's column selection, whichever sort runs; a map sending two
    # columns to one place is refused. Rows above 24 entries and below 65,537 columns take the
    # 32-bit-key path when row_sort is "simd"; wider ones fall back to the radix sort.
    if np.count_nonzero(matrix.data > 2**31 - 1):
        return
    rng = np.random.default_rng(seed)
    n_genes = matrix.shape[1]
    kept = np.flatnonzero(rng.random(n_genes) < 0.8)
    col_map = np.full(n_genes, -1, dtype=np.int64)
    col_map[kept] = rng.permutation(len(kept))
    selection = sp.csr_matrix(
        (np.ones(len(kept)), (kept, col_map[kept])), shape=(n_genes, max(len(kept), 1))
    )
    for dtype in (np.int32, np.float32, np.float64):
        data = matrix.data.astype(dtype)
        as_written = sp.csr_matrix((data.astype(np.float64), matrix.indices, matrix.indptr),
                                   shape=matrix.shape)
        expected = (as_written @ selection).tocsr()  # one term per entry: exact
        indptr, indices, values = _rows.remap_columns(
            matrix.indptr.astype(np.int64), matrix.indices.astype(np.int32), data, col_map,
            max(len(kept), 1), n_threads=2,
        )
        got = sp.csr_matrix((values, indices, indptr), shape=expected.shape)
        assert_equal_csr(got.astype(np.float64), expected)
    if len(kept) > 1:
        twice = col_map.copy()
        twice[kept[1]] = twice[kept[0]]
        rows_with_both = [
            r for r in range(matrix.shape[0])
            if np.isin(kept[:2], matrix.indices[matrix.indptr[r]:matrix.indptr[r + 1]]).all()
        ]
        if rows_with_both:
            with pytest.raises(ValueError):
                _rows.remap_columns(
                    matrix.indptr.astype(np.int64), matrix.indices.astype(np.int32),
                    matrix.data.astype(np.float32), twice, len(kept), n_threads=2,
                )


@pytest.mark.parametrize("n_genes", [300, 65536, 70_000])
@pytest.mark.parametrize("length", [5, 40, 1000])
def test_either_row_sort_refuses_two_columns_sent_to_one(row_sort, n_genes, length):
    # A map sending two of a row's columns to one place is refused by both sorts, for short
    # rows (insertion sort), long narrow rows (32-bit keys with "simd") and wide columns.
    rng = np.random.default_rng(length)
    length = min(length, n_genes)
    columns = np.sort(rng.choice(n_genes, length, replace=False)).astype(np.int32)
    col_map = rng.permutation(n_genes).astype(np.int64)
    good = _rows.remap_columns(np.array([0, length], np.int64), columns,
                               np.arange(1, length + 1, dtype=np.float32), col_map, n_genes)
    order = np.argsort(col_map[columns])
    np.testing.assert_array_equal(good[1], col_map[columns][order])
    np.testing.assert_array_equal(good[2], np.arange(1, length + 1)[order])
    col_map[columns[-1]] = col_map[columns[0]]
    with pytest.raises(ValueError, match="two columns of row 0 to the same place"):
        _rows.remap_columns(np.array([0, length], np.int64), columns,
                            np.ones(length, np.float32), col_map, n_genes)


@pytest.mark.parametrize("vector", [True, False], ids=["by blocks", "one at a time"])
@pytest.mark.parametrize("sort", ["bitmap", "simd16"])
def test_sorts_by_column_renumber_every_block_edge_alike(sort, vector):
    # The bitmap sort renumbers eight entries at a time (AVX2) and hands a block with a
    # dropped column, or a column outside col_map, to the one-at-a-time loop; "simd16" reads
    # values back sixteen at a time (AVX-512F) after a tail of dropped entries shortens the
    # row. Drops at a block's first, middle and last entry, whole dropped blocks, a row's
    # short tail, and a column past the map in the second block of either width all give
    # what the one-at-a-time loops give (scipy's columns).
    before = _sortchoice._use_row_sort(sort)
    vector_before = _sortchoice._use_vector_loops(vector)
    try:
        rng = np.random.default_rng(11)
        n_genes, length = 2_000, 203  # 25 blocks of eight and a tail of three
        columns = np.sort(rng.choice(n_genes, length, replace=False)).astype(np.int32)
        values = np.arange(1, length + 1, dtype=np.float32)
        col_map = rng.permutation(n_genes).astype(np.int64)
        for dropped in ([], [0], [8 + 3], [15], list(range(16, 24)), [16 + 5], [31],
                        list(range(32, 48)), [length - 1], list(range(0, length, 7))):  # fmt: skip
            moved = col_map.copy()
            moved[columns[dropped]] = -1
            kept = np.flatnonzero(moved[columns] >= 0)
            order = np.argsort(moved[columns][kept])
            for dtype in (np.float32, np.float64):
                got = _rows.remap_columns(np.array([0, length], np.int64), columns,
                                          values.astype(dtype), moved, n_genes)  # fmt: skip
                np.testing.assert_array_equal(got[1], moved[columns][kept][order])
                np.testing.assert_array_equal(got[2], values[kept][order])
        rows = np.array([0], np.int64)
        out = (np.zeros(length, np.int32), np.zeros(length, np.float32))
        for past, at in itertools.product((n_genes, 2**31 - 1), (8 + 5, 16 + 5)):
            outside = columns.copy()  # the first block is fine, the second is not
            outside[at] = past
            with pytest.raises(ValueError, match="columns outside col_map"):
                _rows.take_rows_into(np.array([0, length], np.int64), outside, values, rows,
                                     rows, np.array([0, length], np.int64), *out, col_map)
    finally:
        _sortchoice._use_row_sort(before)
        _sortchoice._use_vector_loops(vector_before)


@PROFILE
@given(matrix=count_matrices(), seed=st.integers(0, 2**32 - 1))
def test_decode_through_a_column_permutation(row_sort, matrix, seed):
    # Decoding with col_map (cells renumbered and sorted chunk by chunk) equals decoding and
    # then moving the columns with scipy, for every values dtype and thread count.
    if np.count_nonzero(matrix.data > 65535) > max(1024, matrix.nnz // 200):
        return
    tile = dc.Tile(dc.encode_tile(matrix, n_chunks=3, level=1))
    col_map = np.random.default_rng(seed).permutation(matrix.shape[1])
    moved = sp.csr_matrix((matrix.data, col_map[matrix.indices], matrix.indptr), shape=matrix.shape)
    rows = np.random.default_rng(seed).integers(0, max(matrix.shape[0], 1), 30)
    # A ColumnMap is the same permutation, checked once (what the lazy X passes per tile).
    checked = ColumnMap(col_map, matrix.shape[1]) if matrix.shape[1] else col_map
    for dtype, n_threads in ((np.int32, 1), (np.float32, 2), (np.float64, 3)):
        for mapping in (col_map, checked):
            decoded = tile.decode(dtype, n_threads=n_threads, col_map=mapping)
            assert_equal_csr(decoded, moved.astype(dtype))  # float32: exact to 2^24 only
            if matrix.shape[0]:
                gathered = tile.gather(rows, dtype, n_threads=n_threads, col_map=mapping)
                assert_equal_csr(gathered, moved[rows].astype(dtype))
    if matrix.shape[0] and matrix.shape[1] > 1:
        not_a_permutation = col_map.copy()
        not_a_permutation[0] = not_a_permutation[1]
        for bad in (not_a_permutation, col_map[:-1], col_map.astype(np.float64)):
            with pytest.raises(ValueError, match="permutation"):
                tile.decode(col_map=bad)
            with pytest.raises(ValueError, match="permutation"):
                ColumnMap(bad, matrix.shape[1])
        # checked for another number of columns: checked again, and refused
        other = ColumnMap(np.arange(matrix.shape[1] - 1), matrix.shape[1] - 1)
        with pytest.raises(ValueError, match="permutation"):
            tile.decode(col_map=other)
        assert not checked.array.flags.writeable  # cannot be changed after its check


@PROFILE
@given(matrix=count_matrices(), seed=st.integers(0, 2**32 - 1), n_tiles=st.integers(1, 3))
def test_gathering_from_many_tiles_at_once_equals_each_tile_alone(matrix, seed, n_tiles):
    # The random read's fast path (one parallel section over the chunks of every touched tile)
    # against the plain one (each tile's gather in turn) and scipy: same rows, same order.
    if np.count_nonzero(matrix.data > 65535) > max(1024, matrix.nnz // 200):
        return
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, matrix.shape[0] + 1, n_tiles - 1))
    bounds = np.concatenate([[0], cuts, [matrix.shape[0]]]).astype(np.int64)
    tiles = [dc.Tile(dc.encode_tile(matrix[lo:hi], n_chunks=2, level=1), name=f"tile {t}")
             for t, (lo, hi) in enumerate(pairwise(bounds))]  # fmt: skip
    if not matrix.shape[0]:
        return
    cells = rng.integers(0, matrix.shape[0], 25)  # repeats and any order
    tile_of = np.searchsorted(bounds[1:], cells, side="right")
    local = cells - bounds[tile_of]
    groups = [np.flatnonzero(tile_of == t) for t in range(n_tiles)]
    col_map = rng.permutation(matrix.shape[1])
    moved = sp.csr_matrix((matrix.data, col_map[matrix.indices], matrix.indptr),
                          shape=matrix.shape)  # fmt: skip
    indptr = np.zeros(len(cells) + 1, dtype=np.int64)
    np.cumsum(np.diff(matrix.indptr)[cells], out=indptr[1:])
    for dtype, n_threads, mapping, expected in (
        (np.int32, 1, None, matrix),
        (np.float32, 2, col_map, moved),
        (np.float64, 3, col_map, moved),
    ):
        outputs = []
        for together in (True, False):
            indices = np.full(indptr[-1], -1, dtype=np.int32)
            values = np.zeros(indptr[-1], dtype=dtype)
            if together:
                gather_tiles_into(tiles, groups, local, indptr, indices, values,
                                  n_threads=n_threads, col_map=mapping)  # fmt: skip
            else:
                for tile, mine in zip(tiles, groups, strict=True):
                    tile.gather_into(local, indptr, indices, values, positions=mine,
                                     n_threads=n_threads, col_map=mapping)  # fmt: skip
            outputs.append(sp.csr_matrix((values, indices, indptr),
                                         shape=(len(cells), matrix.shape[1])))  # fmt: skip
        assert_equal_csr(outputs[0], expected[cells].astype(dtype))
        assert_equal_csr(outputs[1], expected[cells].astype(dtype))
        if mapping is None:
            continue
        # The loader's path: the same rows straight into several outputs (two batches),
        # each row at its own offset, in an order unrelated to the rows'.
        lengths = np.diff(indptr)
        which = rng.integers(0, 2, len(cells))
        offsets = np.zeros(len(cells), dtype=np.int64)
        places = []
        for out in (0, 1):
            mine = rng.permutation(np.flatnonzero(which == out))
            offsets[mine] = np.concatenate([[0], np.cumsum(lengths[mine])[:-1]]).astype(np.int64)
            size = int(lengths[mine].sum())
            places.append((np.full(size, -1, dtype=np.int32), np.zeros(size, dtype=dtype), mine))
        gather_tiles_into_many(tiles, groups, local, [p[:2] for p in places], which, offsets,
                               mapping, n_threads=n_threads)  # fmt: skip
        for indices, values, mine in places:
            got_indptr = np.concatenate([[0], np.cumsum(lengths[mine])]).astype(np.int64)
            got = sp.csr_matrix((values, indices, got_indptr), shape=(len(mine), matrix.shape[1]))
            assert_equal_csr(got, expected[cells[mine]].astype(dtype))


@PROFILE
@given(matrix=count_matrices())
def test_same_bytes_for_any_thread_count(matrix):
    if np.count_nonzero(matrix.data > 65535) > max(1024, matrix.nnz // 200):
        return
    blobs = {dc.encode_tile(matrix, n_chunks=8, n_threads=n) for n in (1, 2, 4)}
    assert len(blobs) == 1


def test_several_gap_exceptions_in_one_cell():
    # 250k genes, one cell touching genes far apart: three gaps above 65535.
    genes = [5, 70_000, 140_001, 210_002]
    matrix = sp.csr_matrix(([3, 1, 65536, 2], ([0, 0, 0, 0], genes)), shape=(2, 250_000))
    tile = dc.Tile(dc.encode_tile(matrix))
    assert tile.exception_counts.sum(axis=0).tolist() == [1, 3]
    assert_equal_csr(tile.decode(np.int32), matrix)


def test_realistic_wide_matrix_with_gap_exceptions():
    # 150k genes at a realistic 1% density in source order: gaps above 65535 are rare.
    rng = np.random.default_rng(7)
    matrix = sp.random(300, 150_000, density=0.01, format="csr", random_state=rng)
    matrix.data = np.ceil(matrix.data * 5).astype(np.int64)
    matrix = matrix.tolil()
    matrix[0, :] = 0
    matrix[0, 0] = 1
    matrix[0, 149_999] = 1
    matrix = matrix.tocsr()
    tile = dc.Tile(dc.encode_tile(matrix))
    assert tile.exception_counts[:, 1].sum() == 1  # cell 0's jump from gene 0 to 149,999
    assert_equal_csr(tile.decode(np.int32), matrix)


def test_zero_cells_and_all_empty_tiles():
    for shape in [(0, 5), (7, 5), (3, 1)]:
        matrix = sp.csr_matrix(shape, dtype=np.int64)
        tile = dc.Tile(dc.encode_tile(matrix))
        assert tile.shape == shape and tile.nnz == 0
        assert tile.n_chunks == min(8, shape[0])
        assert_equal_csr(tile.decode(np.int32), matrix)


def test_many_chunks_few_rows():
    matrix = sp.csr_matrix(np.array([[0, 2, 0], [1, 0, 1], [0, 0, 0]]))
    tile = dc.Tile(dc.encode_tile(matrix, n_chunks=100))
    assert tile.n_chunks == 3
    assert_equal_csr(tile.decode(np.int32), matrix)


@PROFILE
@given(values=st.lists(st.one_of(st.integers(0, 10**6),
                                 st.sampled_from([0, 9, 10, 99, 100, 10**9, 2**63 - 1]),
                                 st.integers(0, 2**63 - 1)), max_size=200))  # fmt: skip
def test_decimal_names_are_str_of_each_position(values):
    # Default obs names are built by these kernels: into Arrow buffers (pandas 3) or as
    # Python strings (pandas 2).
    from deltacells.codec._rows import decimal_name_objects, decimal_names

    positions = np.array(values, dtype=np.int64)
    offsets, data = decimal_names(positions)
    text = data.tobytes().decode()
    assert [text[a:b] for a, b in pairwise(offsets)] == [str(v) for v in values]
    objects = decimal_name_objects(positions)
    assert objects.dtype == object and objects.tolist() == [str(v) for v in values]
    # Strings written in place must behave as any other: hashed, looked up, compared.
    lookup = {str(v): i for i, v in enumerate(values)}
    assert [lookup[name] for name in objects] == [lookup[str(v)] for v in values]
    assert set(objects) == set(lookup)


def test_decimal_names_refuse_negative_positions():
    from deltacells.codec._rows import decimal_name_objects, decimal_names

    for kernel in (decimal_names, decimal_name_objects):
        with pytest.raises(ValueError, match="negative"):
            kernel(np.array([3, -1], dtype=np.int64))
        with pytest.raises(ValueError, match="negative"):
            kernel(range(-1, 3))
        with pytest.raises(ValueError, match="step 1"):
            kernel(range(0, 10, 2))
        with pytest.raises(ValueError, match="past 2"):
            kernel(range(2**63 - 2, 2**63 + 1))


@pytest.mark.parametrize("start, stop", [(0, 0), (0, 1), (0, 12_345), (98, 1_002),
                                         (10**12 - 5, 10**12 + 5), (2**63 - 3, 2**63 - 1)])
def test_decimal_names_of_a_range_equal_those_of_its_array(start, stop):
    """read_deltacells names every cell from ``range(n_cells)`` (no array of positions):
    the same names as from the array."""
    from deltacells.codec._rows import decimal_name_objects, decimal_names

    array = np.arange(start, stop, dtype=np.int64)
    for got, expected in zip(decimal_names(range(start, stop)), decimal_names(array),
                             strict=True):  # fmt: skip
        np.testing.assert_array_equal(got, expected)
    objects = decimal_name_objects(range(start, stop))
    assert objects.tolist() == decimal_name_objects(array).tolist()
    assert objects.tolist()[-1:] == [str(v) for v in range(start, stop)][-1:]


def test_name_objects_only_have_the_names_lengths():
    """bench_scale's limit for an index of Python strings: the same count and lengths as the
    names, every character "0"."""
    from deltacells.codec._rows import decimal_name_objects, name_objects_only

    for positions in (range(0, 1_002), range(98, 98), np.array([7, 10**12, 2**63 - 1])):
        names = decimal_name_objects(positions)
        slots = name_objects_only(positions)
        assert [len(s) for s in slots] == [len(s) for s in names]
        assert set("".join(slots)) <= {"0"}
    with pytest.raises(ValueError, match="name_objects_only: negative position"):
        name_objects_only(range(-1, 3))


@PROFILE
@given(chunks=st.lists(st.lists(st.text(max_size=12), max_size=30), max_size=4))
def test_string_objects_equal_the_arrow_strings(chunks):
    """Stored obs names on pandas 2 are made from Arrow buffers by this kernel: the same
    strings as pyarrow's (ASCII copied in place, any other text decoded), chunk after chunk,
    each a plain str that hashes and compares as any other."""
    import pyarrow as pa

    from deltacells.codec._rows import string_objects

    buffers = []
    for strings in chunks:
        array = pa.array(strings, type=pa.large_string())
        offsets = np.frombuffer(array.buffers()[1], dtype=np.int64)[:len(strings) + 1]
        data = array.buffers()[2]
        data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
        buffers.append((offsets, data))
    made = string_objects(buffers)
    expected = [text for strings in chunks for text in strings]
    assert made.dtype == object and made.tolist() == expected
    assert all(type(text) is str for text in made)
    assert {text: i for i, text in enumerate(made)} == {t: i for i, t in enumerate(expected)}


@pytest.mark.parametrize("n_threads", [1, 2])
def test_name_strings_from_a_window_of_arenas_are_ordinary(n_threads):
    """Past about a million names the strings take pymalloc's arenas from a reserved window whose
    pages a helper thread faults in ahead (``arenas.h``): the same names as without, alive
    after the window closes, freed and made again, with the window opened (on Linux builds
    with pymalloc arenas) and handing out at most the strings' bytes."""
    import gc
    import sysconfig

    from deltacells.codec._rows import _last_window_bytes, decimal_name_objects

    n = 1_500_000  # 48-64 bytes a string: past the window's 64 MiB threshold on 3.11-3.13
    positions = np.arange(n, dtype=np.int64)[::-1].copy()
    names = decimal_name_objects(positions, n_threads=n_threads)
    handed_out = _last_window_bytes()
    small = decimal_name_objects(positions[:1000], n_threads=n_threads)  # below the window
    assert _last_window_bytes() == handed_out
    assert names.tolist() == [str(v) for v in positions.tolist()]
    assert small.tolist() == names[:1000].tolist()
    lookup = dict(zip(names.tolist(), range(n), strict=True))
    assert lookup["0"] == n - 1 and lookup[str(n - 1)] == 0
    if sys.platform.startswith("linux") and not sysconfig.get_config_var("Py_GIL_DISABLED"):
        # Arenas with room left from earlier work are filled first, so the window hands out
        # up to the strings' 48-64 bytes each, never more than they need.
        assert 0 < handed_out <= 80 * n
    for _ in range(3):  # arenas of the window go back to the kernel as pymalloc's own
        del names
        gc.collect()
        names = decimal_name_objects(range(n), n_threads=n_threads)
    assert names[-1] == str(n - 1) and len(set(names.tolist())) == n


def test_row_sort_choice_from_the_environment(monkeypatch):
    # DELTACELLS_ROW_SORT picks the sort; "auto" asks numpy whether it sorts with AVX-512 (and
    # takes the bitmap sort where it does not); a value that is none of these is named in a
    # warning and "auto" is used; the kernels refuse an unknown name.
    for value, expected in (("radix", "radix"), ("simd", "simd"), ("SIMD ", "simd"),
                            ("bitmap", "bitmap"), ("simd16", "simd16")):  # fmt: skip
        monkeypatch.setenv(rowsort.ENV_VAR, value)
        assert rowsort.row_sort_wanted() == expected
    auto = "simd" if rowsort.numpy_sorts_with_avx512() else "bitmap"
    if rowsort.numpy_sorts16_with_avx512():
        auto = "simd16"
    monkeypatch.setenv(rowsort.ENV_VAR, "auto")
    assert rowsort.row_sort_wanted() == auto
    monkeypatch.setenv(rowsort.ENV_VAR, "fastest")
    with pytest.warns(RuntimeWarning, match="DELTACELLS_ROW_SORT='fastest'.*radix"):
        assert rowsort.row_sort_wanted() == auto
    with pytest.raises(ValueError, match="'fastest' is not one of simd16, simd, bitmap, radix"):
        _sortchoice._use_row_sort("fastest")


def test_gathers_slowed_reads_linuxs_report(tmp_path):
    # "simd16" reads values back one at a time where Linux reports the Gather Data Sampling
    # mitigation (gathers several times slower), sixteen at a time elsewhere.
    report = tmp_path / "gather_data_sampling"
    for text, slowed in (("Mitigation: Microcode\n", True), ("Not affected\n", False),
                         ("Vulnerable\n", False)):  # fmt: skip
        report.write_text(text)
        assert rowsort.gathers_slowed(str(report)) is slowed
    assert rowsort.gathers_slowed(str(tmp_path / "missing")) is False


@PROFILE
@given(
    keys=st.lists(st.integers(-(2**40), 2**40), max_size=300),
    narrow=st.booleans(),
)
def test_stable_order_equals_numpys_stable_argsort(keys, narrow):
    # Reads group cells by tile and chunk with it: 16-bit radix keys when they fit, the
    # same permutation (ties in input order) as numpy's stable sort either way.
    keys = np.asarray(keys, dtype=np.int64)
    if narrow:
        keys = keys % 70_000 - 5  # some spans fit 16 bits, some do not
    np.testing.assert_array_equal(stable_order(keys), np.argsort(keys, kind="stable"))
