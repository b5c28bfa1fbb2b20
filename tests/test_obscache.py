"""The local obs cache: per-column, atomic, shared by processes, self-healing."""

from __future__ import annotations

import hashlib
import multiprocessing
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from test_writer import small_adata

import deltacells as dc
from deltacells.read.obscache import ObsCache, cache_root


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("obs")
    adata = small_adata(n_cells=500)
    dc.write_deltacells(adata, root / "d", tile_size=64, obs_tiles_per_file=3, progress=False)
    return root / "d", adata


def test_columns_are_fetched_once_then_memory_mapped(written, tmp_path):
    path, adata = written
    cache = ObsCache(dc.open_dataset(path), tmp_path)
    assert cache.localize(["batch", "score"]) == ["batch", "score"]
    assert cache.localize(["batch", "score", "age"]) == ["age"]
    column = cache.column("score")
    assert column.num_chunks == dc.open_dataset(path).manifest.n_tiles
    np.testing.assert_array_equal(cache.series("score").isna(), adata.obs["score"].isna())
    assert cache.series("batch").tolist() == adata.obs["batch"].tolist()
    fingerprint = dc.open_dataset(path).manifest.obs_fingerprint
    assert cache.path("batch") == tmp_path / fingerprint / "obs" / "batch.arrow"
    with pytest.raises(KeyError):
        cache.localize(["nope"])


def test_column_names_are_url_quoted(written, tmp_path):
    path, _ = written
    cache = ObsCache(dc.open_dataset(path), tmp_path)
    assert cache.path("a/b c").name == "a%2Fb%20c.arrow"


def test_corrupt_and_stale_files_are_fetched_again(written, tmp_path):
    path, adata = written
    cache = ObsCache(dc.open_dataset(path), tmp_path)
    cache.localize(["n_counts", "cell_type"])
    target = cache.path("n_counts")
    target.write_bytes(target.read_bytes()[:100])  # truncated
    assert cache.localize(["n_counts"]) == ["n_counts"]
    np.testing.assert_array_equal(cache.series("n_counts"), adata.obs["n_counts"])
    # A file for the wrong tiling (one batch) is stale.
    other = tmp_path / "other"
    dc.write_deltacells(adata, other, tile_size=1000, progress=False)
    stale = ObsCache(dc.open_dataset(other), tmp_path / "c2")
    stale.localize(["cell_type"])
    cache.path("cell_type").write_bytes(stale.path("cell_type").read_bytes())
    assert cache.localize(["cell_type"]) == ["cell_type"]


def _localize_in_process(args):
    path, cache_dir, columns = args
    cache = ObsCache(dc.open_dataset(path), cache_dir)
    fetched = cache.localize(columns)
    digest = hashlib.sha256()
    for column in columns:
        digest.update(cache.series(column).astype(str).str.cat().encode())
    return fetched, digest.hexdigest()


def test_concurrent_processes_fetch_each_column_once(written, tmp_path):
    path, _ = written
    columns = ["batch", "cell_type", "n_counts", "barcode", "age"]
    context = multiprocessing.get_context("spawn")
    with context.Pool(4) as pool:
        results = pool.map(_localize_in_process, [(path, tmp_path, columns)] * 6)
    fetched = [c for f, _ in results for c in f]
    assert sorted(fetched) == sorted(columns)  # each column fetched by exactly one process
    assert len({digest for _, digest in results}) == 1  # and everyone reads the same data


def test_cache_root_order(monkeypatch, tmp_path):
    monkeypatch.setenv("DELTACELLS_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"
    assert cache_root() == tmp_path / "a"
    monkeypatch.delenv("DELTACELLS_CACHE")
    assert cache_root() == tmp_path / "x" / "deltacells"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "deltacells"


def test_a_cache_folder_that_cannot_be_written(written, tmp_path, monkeypatch):
    path, adata = written
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    # Chosen by the user: their mistake, named with the way out.
    with pytest.raises(OSError, match=r"cache_dir .*file/cache: cannot hold the obs cache .*pass a "
                                      r"writable folder as cache_dir="):
        dc.read_deltacells(path, cache_dir=not_a_folder / "cache")
    monkeypatch.setenv("DELTACELLS_CACHE", str(not_a_folder / "cache"))
    with pytest.raises(OSError, match=r"\$DELTACELLS_CACHE .*: cannot hold the obs cache"):
        dc.read_deltacells(path)
    # The default folder (under the home folder) read-only: a temporary one serves, with one
    # warning per process, and the obs comes back right.
    from deltacells.read import obscache

    monkeypatch.delenv("DELTACELLS_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(not_a_folder))
    monkeypatch.setattr(obscache.tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(obscache, "_fallback_warned", False)
    (tmp_path / "tmp").mkdir()
    with pytest.warns(UserWarning, match=r"default folder .* cannot be written .* using "):
        backed = dc.read_deltacells(path, obs=["batch"])
    assert list(backed.obs["batch"]) == list(adata.obs["batch"])
    assert list((tmp_path / "tmp").glob("deltacells-cache-*/*/obs/batch.arrow"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        dc.read_deltacells(path, obs=["batch"])


def test_read_deltacells_uses_the_cache(written, tmp_path):
    path, adata = written
    backed = dc.read_deltacells(path, obs=["cell_type", "age"], cache_dir=tmp_path)
    fingerprint = dc.open_dataset(path).manifest.obs_fingerprint
    cached = sorted(p.name for p in (tmp_path / fingerprint / "obs").glob("*.arrow"))
    assert cached == ["_index.arrow", "age.arrow", "cell_type.arrow"]
    assert (
        backed.obs["cell_type"]
        .astype(object)
        .equals(
            adata.obs["cell_type"].astype(object).reset_index(drop=True).set_axis(backed.obs_names)
        )
    )


def _strings(offsets, data, offset_type=np.int32, kind=None):
    """An Arrow string array straight from buffers, unchecked (as a memory-mapped file gives)."""
    kind = kind or (pa.large_string() if offset_type == np.int64 else pa.string())
    offsets = np.asarray(offsets, dtype=offset_type)
    return pa.Array.from_buffers(kind, len(offsets) - 1,
                                 [None, pa.py_buffer(offsets), pa.py_buffer(data)])  # fmt: skip


@pytest.fixture
def named(tmp_path):
    """A dataset whose obs names mix ASCII, accented, CJK and empty-looking names."""
    import anndata as ad
    import scipy.sparse as sp

    rng = np.random.default_rng(5)
    names = [f"AC{i:05d}-1" for i in range(300)]
    names[3], names[150], names[299] = "zelle_ü_3", "细胞150", " "
    counts = sp.random(300, 20, density=0.2, format="csr", dtype=np.float32, random_state=rng)
    counts.data = np.ceil(counts.data * 10)
    adata = ad.AnnData(counts, obs=pd.DataFrame({"n": np.arange(300)}, index=names))
    dc.write_deltacells(adata, tmp_path / "d", tile_size=64, progress=False)
    return tmp_path / "d", adata


def test_stored_names_equal_pyarrows_strings(named, tmp_path):
    """Stored obs names become an index of strings without pyarrow's to_pandas (pandas 2:
    Python strings from the buffers; pandas 3: its Arrow-backed str): the same names, for
    every cell and for a selection in any order, through read_deltacells and read_obs_names."""
    path, adata = named
    read = dc.read_deltacells(path, cache_dir=tmp_path / "c")
    assert read.obs_names.tolist() == adata.obs_names.tolist()
    assert read.obs_names.dtype == pd.Index(["x"]).dtype
    rows = np.array([299, 3, 150, 0, 3], dtype=np.int64)
    picked = dc.read_obs_names(path, rows, cache_dir=tmp_path / "c")
    assert picked.tolist() == adata.obs_names[rows].tolist()
    # Sliced chunks, large_string, an empty chunk, and nulls (which go through pandas).
    cache = ObsCache(dc.open_dataset(path), tmp_path / "c")
    text = "abcdé细胞xyz".encode()
    cases = {
        "sliced": pa.chunked_array([_strings([0, 1, 3, 6, 9], text).slice(1, 2),
                                    _strings([0, 0], b"")]),
        "large": pa.chunked_array([_strings([0, 2, 2, 12], text, np.int64)]),
        "nulls": pa.chunked_array([pa.array(["a", None, "c"])]),
    }
    for name, values in cases.items():
        cache.column = lambda column, values=values: values
        expected = pd.Index(values.to_pandas().astype(str).to_numpy()).tolist()
        assert cache.names("n").tolist() == expected, name
        assert cache.names("n", np.array([1, 0])).tolist() == expected[1::-1], name


def _tampered(strings, offsets):
    """A string column as read from an Arrow IPC file whose offsets were overwritten: the IPC
    reader does not check them (pyarrow's constructors would)."""
    table = pa.table({"n": pa.array(strings)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    raw = bytearray(sink.getvalue().to_pybytes())
    good = np.frombuffer(table.column(0).chunk(0).buffers()[1], np.int32)[:len(strings) + 1]
    at = raw.find(good.tobytes())
    raw[at:at + good.nbytes] = np.asarray(offsets, dtype=np.int32).tobytes()
    return pa.ipc.open_file(pa.BufferReader(bytes(raw))).read_all().column(0)


@pytest.mark.parametrize("strings, offsets, match", [
    (["ab", "cd", "ef"], [0, 5, 2, 6], "outside|non-monotonic"),  # out of order
    (["ab", "cd", "ef"], [0, 2, 4, 60], "outside|larger than|out of bounds"),  # past the data
    (["ab", "cd", "ef"], [-2, 2, 4, 6], "do not fit|[Nn]egative"),  # before the data
    (["ab", "cd", "\u00e9f"], [0, 2, 4, 5], "utf-8|UTF8|UTF-8"),  # half of a UTF-8 character
])  # fmt: skip
def test_hostile_stored_names_are_refused(named, tmp_path, strings, offsets, match):
    """Names from a tampered cache file: a FormatError naming the file and column, never
    strings read from outside their buffers or bytes that are not UTF-8."""
    path, _ = named
    cache = ObsCache(dc.open_dataset(path), tmp_path / "c")
    values = _tampered(strings, offsets)
    cache.column = lambda column: values
    with pytest.raises(dc.FormatError, match=match) as info:
        cache.names("n")
    assert str(cache.path("n")) in str(info.value) and "'n'" in str(info.value)


@pytest.mark.skipif(not isinstance(pd.Index(["x"]).dtype, np.dtype),
                    reason="pandas 3 checks the column with pyarrow's full validation")
def test_short_offsets_buffer_is_refused(named, tmp_path):
    """A string chunk claiming more strings than its offsets buffer holds (pandas 2's path
    reads the buffers itself)."""
    path, _ = named
    cache = ObsCache(dc.open_dataset(path), tmp_path / "c")
    offsets = pa.py_buffer(np.array([0, 1, 2], np.int32))

    class Chunk:  # pyarrow's constructors refuse this, an unchecked file does not
        offset = 0

        def __len__(self):
            return 5

        def buffers(self):
            return [None, offsets, pa.py_buffer(b"ab")]

    class Column:
        type, null_count, chunks = pa.string(), 0, [Chunk()]

    cache.column = lambda column: Column()
    with pytest.raises(dc.FormatError, match="3 string offsets for 5 strings"):
        cache.names("n")
