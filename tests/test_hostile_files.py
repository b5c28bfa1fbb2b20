"""Damaged and hostile dataset files (not tiles): every one is a FormatError naming the file,
never a crash, a wrong obs frame, a huge allocation or a traceback from ``verify``."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import scipy.sparse as sp
from hypothesis import given, settings
from hypothesis import strategies as st
from test_writer import small_adata

import deltacells as dc
from deltacells.cli import main
from deltacells.codec.format import LimitError, get_limits, set_limits
from deltacells.read.obscache import ObsCache
from deltacells.store.manifest import obs_fingerprint
from deltacells.testing import reseal


@pytest.fixture
def dataset_dir(tmp_path):
    adata = small_adata()
    dc.write_deltacells(adata, tmp_path / "d", tile_size=64, progress=False)
    return tmp_path / "d"


def load_manifest(root) -> dict:
    return json.loads((root / "manifest.json").read_text())


def save_manifest(root, obj) -> None:
    """Write a changed manifest sealed anew (a deliberate edit), with the file table's
    records of the files now there: what stands behind the digest is then tested."""
    reseal(root, obj)


def verify_fails(root, capsys, match: str) -> None:
    """``verify`` (API and CLI) names the problem; the CLI prints one line, no traceback."""
    with pytest.raises(dc.FormatError, match=match):
        dc.open_dataset(root).verify()
    capsys.readouterr()
    assert main(["verify", str(root), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err


# --- item 7: what verify must notice ---------------------------------------------------------


def test_tiles_swapped_with_their_manifest_entries(dataset_dir, capsys):
    m = load_manifest(dataset_dir)
    a, b = dataset_dir / "tiles" / "tile_000000.dct", dataset_dir / "tiles" / "tile_000001.dct"
    blob_a, blob_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(blob_b)
    b.write_bytes(blob_a)
    for key in ("tile_nnz", "tile_bytes"):
        m[key][0], m[key][1] = m[key][1], m[key][0]
    save_manifest(dataset_dir, m)
    verify_fails(dataset_dir, capsys, r"tile_000000\.dct: CRC-32 .*\(tiles swapped")
    with pytest.raises(dc.FormatError, match="tiles swapped"):
        dc.read_deltacells(dataset_dir).X[:10]


@pytest.mark.parametrize("version", [1, 3, 0x0200])
def test_damaged_version_field_of_a_tile_header(dataset_dir, version, capsys):
    """The header is outside the CRC: a damaged version field is told apart from a tile of a
    newer format by the manifest's version, for reads and for verify."""
    tile = dataset_dir / "tiles" / "tile_000000.dct"
    data = bytearray(tile.read_bytes())
    data[8:12] = version.to_bytes(4, "little")
    tile.write_bytes(bytes(data))
    message = rf"tile_000000\.dct: the header says tile version {version}, but the dataset is " \
        r"version 2 \(its manifest\): the tile's header is damaged"  # fmt: skip
    with pytest.raises(dc.FormatError, match=message):
        dc.read_deltacells(dataset_dir, elements=False).X[0]
    assert main(["verify", str(dataset_dir)]) == 1
    assert "the tile's header is damaged" in capsys.readouterr().err


def test_duplicate_json_keys_are_refused(dataset_dir):
    text = (dataset_dir / "manifest.json").read_text()
    (dataset_dir / "manifest.json").write_text(text.replace('"n_genes"', '"n_cells": 1, "n_genes"'))
    with pytest.raises(dc.FormatError, match=r"manifest\.json: not valid JSON .*'n_cells' appears "
                                             "twice"):  # fmt: skip
        dc.open_dataset(dataset_dir)


def test_duplicate_keys_in_the_obs_schema(dataset_dir):
    path = dataset_dir / "obs" / "schema.json"
    path.write_text(path.read_text().replace('"version": 1', '"version": 1, "version": 1'))
    reseal(dataset_dir)
    with pytest.raises(dc.FormatError, match=r"schema\.json: not valid JSON .*appears twice"):
        dc.open_dataset(dataset_dir).obs_schema()


def test_obs_index_column_pointing_at_another_column(dataset_dir, capsys):
    m = load_manifest(dataset_dir)
    m["metadata"]["obs_index_column"] = "cell_type"  # a category column
    save_manifest(dataset_dir, m)
    verify_fails(dataset_dir, capsys, "obs_index_column 'cell_type' is a category column")
    with pytest.raises(dc.FormatError, match="obs_index_column"):
        dc.read_deltacells(dataset_dir)
    m["metadata"]["obs_index_column"] = "nope"
    save_manifest(dataset_dir, m)
    verify_fails(dataset_dir, capsys, "obs_index_column 'nope' is not an obs column")


def test_obs_index_column_pointing_at_a_repeating_string_column(tmp_path, capsys):
    # max_categories=1 stores "batch" (two values) as strings, like obs_names.
    dc.write_deltacells(small_adata(), tmp_path / "d", max_categories=1, progress=False)
    m = load_manifest(tmp_path / "d")
    assert m["metadata"]["obs_names_unique"] is True
    m["metadata"]["obs_index_column"] = "batch"
    save_manifest(tmp_path / "d", m)
    verify_fails(tmp_path / "d", capsys, "obs names in 'batch' repeat")


def test_repeated_obs_names_as_written_still_verify(tmp_path):
    adata = small_adata(n_cells=50)
    adata.obs_names = ["same"] * 50
    dc.write_deltacells(adata, tmp_path / "d", progress=False)
    assert load_manifest(tmp_path / "d")["metadata"]["obs_names_unique"] is False
    dc.open_dataset(tmp_path / "d").verify()


# --- item 8: typed errors naming the file ----------------------------------------------------


def test_empty_gene_order(dataset_dir, capsys):
    (dataset_dir / "gene_order.npy").write_bytes(b"")
    verify_fails(dataset_dir, capsys, r"gene_order\.npy: 0 bytes, the manifest says")
    reseal(dataset_dir)
    verify_fails(dataset_dir, capsys, r"gene_order\.npy: not a \.npy array")


def test_npy_header_claiming_2_to_the_40_entries(dataset_dir, capsys):
    m = load_manifest(dataset_dir)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<i4", "fortran_order": False, "shape": (2**40,)}
    )
    (dataset_dir / "gene_order.npy").write_bytes(header.getvalue() + b"\0" * 4 * m["n_genes"])
    reseal(dataset_dir)
    verify_fails(dataset_dir, capsys, r"gene_order\.npy: expected 120 integers")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<i4", "fortran_order": False, "shape": (m["n_genes"],)}
    )
    (dataset_dir / "gene_order.npy").write_bytes(header.getvalue() + b"\0" * 7)  # truncated
    reseal(dataset_dir)
    verify_fails(dataset_dir, capsys, r"gene_order\.npy: holds 7 bytes of data")


def test_gene_order_of_the_wrong_dtype(dataset_dir, capsys):
    buffer = io.BytesIO()
    np.save(buffer, np.arange(120, dtype=np.float64))
    (dataset_dir / "gene_order.npy").write_bytes(buffer.getvalue())
    reseal(dataset_dir)
    verify_fails(dataset_dir, capsys, r"gene_order\.npy: expected 120 integers, got float64")


@pytest.mark.parametrize("value", [2**64, 2**63, -1, 1.5])
def test_out_of_range_integers_in_the_manifest(dataset_dir, value):
    m = load_manifest(dataset_dir)
    m["tile_cells"] = [value]
    save_manifest(dataset_dir, m)
    with pytest.raises(dc.FormatError, match="'tile_cells' must be a list of integers"):
        dc.open_dataset(dataset_dir)


def test_var_names_that_are_not_utf8(dataset_dir, capsys):
    (dataset_dir / "var_names.txt").write_bytes(b"\xff\xfe" * 200)
    reseal(dataset_dir)
    verify_fails(dataset_dir, capsys, r"var_names\.txt: not UTF-8")


def rewrite_shard(root, change) -> None:
    """Rewrite obs shard 0 with ``change(table)`` and record it in the manifest consistently
    (size, hash, fingerprint), as a buggy or hostile writer would."""
    path = root / "obs" / "obs_0000.parquet"
    parquet = pq.ParquetFile(path)
    buffer = io.BytesIO()
    with pq.ParquetWriter(buffer, parquet.schema_arrow, compression="zstd") as writer:
        for g in range(parquet.metadata.num_row_groups):
            writer.write_table(change(parquet.read_row_group(g)))
    data = buffer.getvalue()
    path.write_bytes(data)
    m = load_manifest(root)
    m["obs_shard_bytes"][0] = len(data)
    m["obs_shard_sha256"][0] = hashlib.sha256(data).hexdigest()
    schema_text = (root / "obs" / "schema.json").read_text()
    m["obs_fingerprint"] = obs_fingerprint(schema_text, m["tile_cells"], m["obs_shard_sha256"])
    save_manifest(root, m)


def test_category_codes_outside_the_vocabulary(dataset_dir, tmp_path, capsys):
    def bad_codes(table):
        i = table.schema.get_field_index("cell_type")
        codes = pa.array(np.full(table.num_rows, 99, dtype=np.int8))
        return table.set_column(i, "cell_type", codes)

    rewrite_shard(dataset_dir, bad_codes)
    with pytest.raises(dc.FormatError, match=r"'cell_type' has category codes outside -1\.\.1"):
        dc.read_deltacells(dataset_dir, cache_dir=tmp_path)
    with pytest.raises(dc.FormatError, match=r"obs_0000\.parquet: column 'cell_type'"):
        dc.open_dataset(dataset_dir).read_obs(["cell_type"])
    verify_fails(dataset_dir, capsys, "category codes outside")


# --- item 5: obs shards are checked on the read path -----------------------------------------


def test_rewritten_obs_shard_is_not_served(dataset_dir, tmp_path):
    path = dataset_dir / "obs" / "obs_0000.parquet"
    parquet = pq.ParquetFile(path)
    buffer = io.BytesIO()
    with pq.ParquetWriter(buffer, parquet.schema_arrow, compression="zstd") as writer:
        for g in range(parquet.metadata.num_row_groups):
            table = parquet.read_row_group(g)
            i = table.schema.get_field_index("n_counts")
            table = table.set_column(i, "n_counts", pa.array(np.full(table.num_rows, 7.0)))
            writer.write_table(table)
    path.write_bytes(buffer.getvalue())  # manifest untouched
    with pytest.raises(dc.FormatError, match=r"obs_0000\.parquet: .*(manifest|SHA-256)"):
        dc.read_deltacells(dataset_dir, cache_dir=tmp_path)


def test_same_size_rewrite_is_caught_by_the_hash(dataset_dir, tmp_path):
    path = dataset_dir / "obs" / "obs_0000.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(dc.FormatError, match=r"obs_0000\.parquet: SHA-256 .* != manifest's"):
        dc.read_deltacells(dataset_dir, cache_dir=tmp_path)


# --- item 4: damaged cache files are fetched again, never trusted -----------------------------


def test_one_bit_flips_in_cached_columns_never_crash_or_lie(dataset_dir, tmp_path):
    """200 single-bit flips in cached Arrow files (a string and a numeric column), each read in
    a child process so that a segfault fails the test instead of ending the run."""
    script = textwrap.dedent(f"""
        import numpy as np
        import deltacells as dc
        from deltacells.read.obscache import ObsCache
        dataset = dc.open_dataset({str(dataset_dir)!r})
        cache_dir = {str(tmp_path / "cache")!r}
        columns = ["_index", "n_counts", "cell_type"]
        first = ObsCache(dataset, cache_dir)
        first.localize(columns)
        expected = {{c: first.series(c).astype(str).tolist() for c in columns}}
        pristine = {{c: first.path(c).read_bytes() for c in columns}}
        rng = np.random.default_rng(0)
        refetched = 0
        for trial in range(200):
            column = columns[trial % 3]
            data = bytearray(pristine[column])
            bit = int(rng.integers(0, 8 * len(data)))
            data[bit // 8] ^= 1 << (bit % 8)
            first.path(column).write_bytes(bytes(data))
            cache = ObsCache(dataset, cache_dir)
            refetched += cache.localize([column]) == [column]
            assert cache.series(column).astype(str).tolist() == expected[column], trial
        print("refetched", refetched)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["refetched", "200"]


def test_cache_files_without_a_checksum_record_are_fetched_again(dataset_dir, tmp_path):
    cache = ObsCache(dc.open_dataset(dataset_dir), tmp_path)
    cache.localize(["n_counts"])
    cache.path("n_counts").with_suffix(".crc").unlink()
    assert ObsCache(dc.open_dataset(dataset_dir), tmp_path).localize(["n_counts"]) == ["n_counts"]


# --- item 9: resource bombs -------------------------------------------------------------------


def test_manifest_claiming_2_to_the_40_cells_without_obs(tmp_path):
    dc.write_deltacells(small_adata(n_cells=10), tmp_path / "d", obs=False, progress=False)
    m = load_manifest(tmp_path / "d")
    n = 2**40
    m.update(n_cells=n, tile_size=n, tile_cells=[n])
    save_manifest(tmp_path / "d", m)
    with pytest.raises(dc.FormatError, match=r"tile 0 claims \d+ bytes, too few for 1099511627776"):
        dc.read_deltacells(tmp_path / "d")
    m.update(tile_bytes=[8 * (n + 1) + 160])  # consistent, but no such file on disk
    save_manifest(tmp_path / "d", m)
    with pytest.raises(dc.FormatError, match=r"tile_000000\.dct: \d+ bytes, the manifest says"):
        dc.read_deltacells(tmp_path / "d")


def test_highly_compressible_tile_is_refused_before_allocating():
    ones = sp.csr_matrix(np.ones((8, 2**20), dtype=np.int32))  # 8M nonzeros, all gaps 1
    blob = dc.encode_tile(ones, n_chunks=1)
    assert len(blob) < 100_000
    previous = set_limits(decoded_floor=16 * 2**20)
    try:
        with pytest.raises(LimitError, match=r"would decode to .*deltacells\.set_limits"):
            dc.Tile(blob)
        bad = bytearray(blob)  # one bad count anywhere: still refused before decoding
        bad[-20] ^= 0xFF
        with pytest.raises(dc.FormatError):
            dc.Tile(bad, verify_crc=False)
    finally:
        set_limits(**vars(previous))
    assert get_limits() == previous
    assert dc.decode_tile(blob, values_dtype=np.int32).nnz == 8 * 2**20  # within the defaults


def test_manifests_claiming_more_than_the_limits_allow(dataset_dir):
    m = load_manifest(dataset_dir)
    m["tile_nnz"][0] = 64 * 120  # every cell full: 92 KB decoded from a few KB, within limits
    save_manifest(dataset_dir, m)
    dc.open_dataset(dataset_dir)
    previous = set_limits(decoded_floor=0, decoded_ratio=2.0)
    try:
        with pytest.raises(LimitError, match=r"manifest\.json: tile 0: 7680 nonzeros"):
            dc.open_dataset(dataset_dir)
    finally:
        set_limits(**vars(previous))


def test_to_memory_checks_tile_sizes_before_allocating(dataset_dir):
    m = load_manifest(dataset_dir)
    last = len(m["tile_bytes"]) - 1
    (dataset_dir / "tiles" / f"tile_{last:06d}.dct").write_bytes(b"\0" * 100)
    adata = dc.read_deltacells(dataset_dir)
    with pytest.raises(dc.FormatError, match=r"tile_00000\d\.dct: 100 bytes, the manifest says"):
        adata.X.to_memory()


def test_cli_errors_never_print_tracebacks(dataset_dir, capsys, monkeypatch):
    from deltacells.read import dataset as dataset_module

    def explode(self, progress=None):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(dataset_module.Dataset, "verify", explode)
    assert main(["verify", str(dataset_dir), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "RuntimeError: something unforeseen" in err


def test_obs_frame_of_a_dataset_is_exactly_what_was_written(dataset_dir, tmp_path):
    back = dc.read_deltacells(dataset_dir, cache_dir=tmp_path)
    expected = small_adata().obs
    assert list(back.obs_names) == list(expected.index)
    pd.testing.assert_series_equal(back.obs["n_counts"], expected["n_counts"])


def test_obs_names_that_differ_after_a_nul_byte_verify(tmp_path):
    """pandas 2's ``is_unique`` compares object strings only up to a NUL byte (found by the
    obs shard fuzzer; pandas 3 compares them whole); verify judges uniqueness as
    ``duplicated`` does, exactly, with either."""
    import anndata as ad

    names = [f"cell\x00{i}" for i in range(6)]
    if int(pd.__version__.split(".")[0]) < 3:
        assert not pd.Series(names, dtype=object).is_unique  # the pandas behaviour in question
    adata = ad.AnnData(X=sp.csr_matrix(np.ones((6, 2))), obs=pd.DataFrame(index=names))
    dc.write_deltacells(adata, tmp_path / "d", progress=False)
    dc.open_dataset(tmp_path / "d").verify()
    assert list(dc.read_deltacells(tmp_path / "d", cache_dir=tmp_path / "c").obs_names) == names


# --- the manifest's per-tile lists, checked at once (a 100M-cell manifest lists 24,425 tiles) ---


def _per_tile_reference(cells, nnz, stored, tile_size, n_genes, version):
    """The checks one tile at a time, in the reader's order (every tile's cells, then each
    tile's nonzeros, bytes and decoded size): what the vectorised check must raise."""
    from deltacells.store import manifest as mf

    for i in range(len(cells)):
        mf._check_tile_cells(i, cells, tile_size, "m")
    for i in range(len(cells)):
        mf._check_tile_sizes(i, cells, nnz, stored, n_genes, version, "m")


def _outcome(check, *args):
    try:
        check(*args)
    except ValueError as err:  # FormatError and LimitError
        return type(err).__name__, str(err)
    return None


_VALUES = st.one_of(st.integers(0, 300), st.integers(0, 2**62), st.sampled_from(
    [0, 1, 63, 64, 65, 2**30, 2**30 + 1, 2**40, 2**40 + 1, 2**53 + 1, 2**62]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data(), n_tiles=st.integers(1, 12), tile_size=st.sampled_from([1, 64, 2**40]),
       n_genes=st.sampled_from([1, 120, 2**31]), version=st.sampled_from([1, 2]))
def test_the_tile_lists_are_checked_as_one_tile_at_a_time(data, n_tiles, tile_size, n_genes,
                                                          version):  # fmt: skip
    """The vectorised check of the manifest's tile lists raises exactly what the per-tile
    checks raise, first bad tile first, for valid lists and for hostile values (near the
    limits, past 2^40 where it hands the tile to the exact check, up to 2^62)."""
    from deltacells.store.manifest import _check_tiles

    full = st.one_of(st.just(tile_size), _VALUES)
    cells = data.draw(st.lists(full, min_size=n_tiles, max_size=n_tiles))
    nnz = [data.draw(st.one_of(st.integers(0, 20 * c + 1), _VALUES)) for c in cells]
    stored = [data.draw(st.one_of(st.integers(200, 2 * 2**20), _VALUES)) for _ in cells]
    args = (cells, nnz, stored, tile_size, n_genes, version)
    assert _outcome(_check_tiles, *args, "m") == _outcome(_per_tile_reference, *args)


def test_a_bad_tile_deep_in_a_long_manifest_is_named(tmp_path):
    """Each per-tile rule still fires for tile 300 of 1,000, and the first of two bad tiles is
    the one named."""
    from deltacells.store.manifest import _check_tiles

    cells, nnz, stored = [64] * 1000, [500] * 1000, [4000] * 1000
    cases = [
        ("cells", 63, r"tile 300 holds 63 cells"),
        ("nnz", 64 * 120 + 1, r"tile 300 claims 7681 nonzeros"),
        ("stored", 100, r"tile 300 claims 100 bytes, too few for 64 cells"),
        ("nnz_limit", 2**25, r"tile 300: 33554432 nonzeros would decode"),
    ]
    for field, value, match in cases:
        lists = {"cells": list(cells), "nnz": list(nnz), "stored": list(stored)}
        key = "nnz" if field == "nnz_limit" else field
        lists[key][300] = lists[key][700] = value
        n_genes = 2**31 if field == "nnz_limit" else 120
        with pytest.raises(ValueError, match=match):
            _check_tiles(lists["cells"], lists["nnz"], lists["stored"], 64, n_genes, 2, "m")
    _check_tiles(cells, nnz, stored, 64, 120, 2, "m")  # the untouched lists pass


@pytest.mark.parametrize("value", [True, 1.0, "1", None, -1, 2**62 + 1])
def test_a_tile_list_holding_a_non_integer_is_refused(dataset_dir, value):
    m = load_manifest(dataset_dir)
    m["tile_nnz"][-1] = value
    save_manifest(dataset_dir, m)
    with pytest.raises(dc.FormatError, match=r"'tile_nnz' must be a list of integers"):
        dc.open_dataset(dataset_dir)


@pytest.mark.parametrize("lists", [
    # The last tile empty, every other one full.
    ([64, 64, 0], [10, 10, 0], [4000] * 3, 64, 120),
    # 2^61 nonzeros in 2^30 cells of 2^31 genes: possible, but 12 bytes each overflow int64.
    ([2**30], [2**61], [2**34], 2**40, 2**31),
    # Past 2^53 bytes: float64 rounds the decoded-size budget.
    ([64], [7680], [2**53 + 1], 64, 120),
], ids=["empty last tile", "int64 overflow", "past 2^53 bytes"])  # fmt: skip
def test_the_tile_lists_edge_cases_match_the_per_tile_checks(lists):
    from deltacells.store.manifest import _check_tiles

    cells, nnz, stored, tile_size, n_genes = lists
    expected = _outcome(_per_tile_reference, cells, nnz, stored, tile_size, n_genes, 2)
    assert _outcome(_check_tiles, cells, nnz, stored, tile_size, n_genes, 2, "m") == expected
    assert expected is not None or stored[0] == 2**53 + 1
