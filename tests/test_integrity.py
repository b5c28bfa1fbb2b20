"""The manifest's digest and strict schema, the file table, chunk and grid checksums, the
element store's rules, and datasets written before them (issue 22)."""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from functools import partial
from http.server import ThreadingHTTPServer

import numpy as np
import pytest
import scipy.sparse as sp
from test_http import RangeHandler
from test_tamper import everything

import deltacells as dc
from deltacells.cli import main
from deltacells.store.integrity import sealed_json
from deltacells.testing import reseal


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity") / "d"
    everything(root, n_cells=150)
    return root


@pytest.fixture
def full(pristine, tmp_path):
    import shutil

    shutil.copytree(pristine, tmp_path / "d")
    return tmp_path / "d"


ZARR_METADATA = (".zarray", ".zattrs", ".zgroup", "zarr.json")


def zarr_chunk(root, array: str):
    """A chunk file of element ``array`` (zarr format 2 or 3, whichever anndata wrote)."""
    folder = root / "anndata.zarr" / array
    return next(p for p in sorted(folder.rglob("*")) if p.is_file()
                and p.name not in ZARR_METADATA)  # fmt: skip


def zarr_array_metadata(root, array: str):
    folder = root / "anndata.zarr" / array
    return folder / ".zarray" if (folder / ".zarray").exists() else folder / "zarr.json"


def zarr_group_attributes(root, group: str):
    folder = root / "anndata.zarr" / group
    return folder / ".zattrs" if (folder / ".zattrs").exists() else folder / "zarr.json"


def manifest_text(root) -> str:
    return (root / "manifest.json").read_text()


def as_written_before(root) -> None:
    """What the writer made before manifest digests, file tables and checksums: the same
    tiles and files, without those keys and the checksum files (nested datasets too)."""
    for nested in ("raw", "layers/spliced"):
        if (root / nested / "manifest.json").exists():
            as_written_before(root / nested)
    obj = json.loads(manifest_text(root))
    for key in ("manifest_sha256", "files", "chunk_sums"):
        obj.pop(key, None)
    record = obj["metadata"].get("gene_major")
    if record:
        record.pop("chunk_sums", None)
    for name in ("tiles/chunk_crc32.bin", "genes/chunk_crc32.bin", "spatial/grid_crc32.npy"):
        if (root / name).exists():
            (root / name).unlink()
    (root / "manifest.json").write_text(json.dumps(obj, indent=1))


# -- the manifest ---------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["has_gene_order", "has_obs", "metadata", "tile_crc32"])
@pytest.mark.parametrize("sealed", [True, False])
def test_a_key_renamed_by_one_bit_is_refused_by_name(full, key, sealed):
    if not sealed:
        as_written_before(full)
    text = manifest_text(full)
    renamed = key[:-1] + chr(ord(key[-1]) ^ 1)
    assert text.count(f'"{key}"') == 1
    (full / "manifest.json").write_text(text.replace(f'"{key}"', f'"{renamed}"'))
    with pytest.raises(dc.FormatError, match=re.escape(f"unknown manifest keys ['{renamed}']")):
        dc.open_dataset(full)
    assert main(["verify", "--json", str(full)]) == 1


def test_a_changed_value_is_refused_by_the_digest(full):
    text = manifest_text(full)
    (full / "manifest.json").write_text(text.replace('"has_gene_order": true',
                                                     '"has_gene_order": false'))  # fmt: skip
    with pytest.raises(dc.FormatError, match="bytes do not match its manifest_sha256"):
        dc.open_dataset(full)


def test_missing_and_stray_keys_are_named(full):
    as_written_before(full)
    obj = json.loads(manifest_text(full))
    del obj["has_var_table"]
    (full / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(dc.FormatError, match=re.escape("keys ['has_var_table'] are missing")):
        dc.open_dataset(full)
    obj["has_var_table"], obj["has_obs"] = True, False
    (full / "manifest.json").write_text(json.dumps(obj))
    with pytest.raises(dc.FormatError, match="belong to a dataset with obs"):
        dc.open_dataset(full)


def test_every_byte_of_the_manifest_counts(full):
    obj = json.loads(manifest_text(full))
    (full / "manifest.json").write_text(json.dumps(obj))  # the same content, other spacing
    with pytest.raises(dc.FormatError, match="bytes do not match its manifest_sha256"):
        dc.open_dataset(full)
    text = manifest_text(full).replace(obj["manifest_sha256"], "0" * 64)
    (full / "manifest.json").write_text(text)
    with pytest.raises(dc.FormatError, match="bytes do not match"):
        dc.open_dataset(full)


def test_the_digest_is_the_hash_of_the_bytes_with_its_digits_zeroed(full):
    import hashlib

    data = (full / "manifest.json").read_bytes()
    digest = json.loads(data)["manifest_sha256"]
    assert hashlib.sha256(data.replace(digest.encode(), b"0" * 64)).hexdigest() == digest


@pytest.mark.parametrize("entry", [{"bytes": -1, "sha256": "0" * 64}, {"bytes": 1},
                                   {"bytes": 1, "sha256": "xyz"}])  # fmt: skip
def test_malformed_file_table_entries(full, entry):
    obj = json.loads(manifest_text(full))
    obj["files"]["var.parquet"] = entry
    (full / "manifest.json").write_text(sealed_json(obj))
    with pytest.raises(dc.FormatError, match=r"file table entry 'var\.parquet'"):
        dc.open_dataset(full)


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", "a//b", "x/./y"])
def test_file_table_names_stay_inside_the_dataset(full, name):
    obj = json.loads(manifest_text(full))
    obj["files"][name] = {"bytes": 1, "sha256": "0" * 64}
    (full / "manifest.json").write_text(sealed_json(obj))
    with pytest.raises(dc.FormatError, match="not a relative path inside the dataset"):
        dc.open_dataset(full)


def test_a_file_missing_from_the_table_is_refused(full):
    obj = json.loads(manifest_text(full))
    del obj["files"]["var_names.txt"]
    reseal(full, obj)
    with pytest.raises(dc.FormatError, match=r"var_names\.txt: not in the manifest's file table"):
        dc.open_dataset(full).var_names()


def test_nested_manifests_are_tied_to_the_parent(full):
    obj = json.loads((full / "raw" / "manifest.json").read_text())
    obj["metadata"]["writer"] = "someone else"
    reseal(full / "raw", obj)  # a valid manifest of its own, but not the one the parent lists
    with pytest.raises(dc.FormatError,
                       match=r"raw/manifest\.json: (.*SHA-256|\d+ bytes, the manifest)"):
        dc.read_deltacells(full)


# -- elements -------------------------------------------------------------------------------------


@pytest.mark.parametrize("old", [False, True])
def test_a_link_out_of_the_root_inside_the_elements_is_refused(full, tmp_path, old):
    if old:
        as_written_before(full)
    chunk = zarr_chunk(full, "obsm/X_pca")
    outside = tmp_path / "elsewhere"
    outside.write_bytes(chunk.read_bytes())
    chunk.unlink()
    os.symlink(outside, chunk)
    with pytest.raises(dc.FormatError, match="leading out of the dataset's root"):
        dc.read_deltacells(full)
    assert main(["verify", "--json", str(full)]) == 1


@pytest.mark.parametrize("old", [False, True])
def test_a_fifo_inside_the_elements_does_not_block(full, old):
    if old:
        as_written_before(full)
    chunk = zarr_chunk(full, "uns/title")
    chunk.unlink()
    os.mkfifo(chunk)
    outcome: list = []

    def read() -> None:
        try:
            dc.read_deltacells(full)
        except dc.FormatError as err:
            outcome.append(err)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "blocked on the FIFO"
    assert outcome and "not a regular file" in str(outcome[0])


def test_a_declared_shape_out_of_proportion_is_refused(full):
    as_written_before(full)  # without the file table, only the limits stand in the way
    path = zarr_array_metadata(full, "obsm/X_pca")
    meta = json.loads(path.read_text())
    meta["shape"] = [2**31, meta["shape"][1]]
    path.write_text(json.dumps(meta))
    with pytest.raises(dc.LimitError, match=r"X_pca.*declared as \(2147483648, 10\)"):
        dc.read_deltacells(full)


def test_damaged_element_metadata_is_a_format_error_naming_the_file(full):
    path = zarr_group_attributes(full, "uns")
    path.write_bytes(b"\xff\xfe" + path.read_bytes()[2:])
    with pytest.raises(dc.FormatError, match=rf"anndata\.zarr/uns/{re.escape(path.name)}: .*SHA"):
        dc.read_deltacells(full)


# -- datasets written before --------------------------------------------------------------------


def test_datasets_written_before_still_read_and_say_what_is_unchecked(full, capsys):
    expected = dc.read_deltacells(full)
    X = expected.X.to_memory()
    as_written_before(full)
    dataset = dc.open_dataset(full)
    unchecked = dataset.unchecked_parts()
    assert len(unchecked) == 4 and any("gene-major" in u for u in unchecked)
    back = dc.read_deltacells(full)
    assert (back.X.to_memory() != X).nnz == 0
    assert set(back.obsm) == set(expected.obsm) and set(back.uns) == set(expected.uns)
    np.testing.assert_array_equal(back.obsm["X_pca"], expected.obsm["X_pca"])
    ranged = dc.read_deltacells(full, ranged_reads=True)  # whole tiles: the only check there is
    rows = [0, 77, 149]
    assert (sp.csr_matrix(ranged.X[rows]) != X[rows]).nnz == 0
    assert dataset.genes([0, 3]).shape == (150, 2)
    assert dataset.query_bbox((-1e9, -1e9, 1e9, 1e9)).rows.size == 150
    dataset.verify()
    assert main(["info", str(full)]) == 0
    assert "not protected" in capsys.readouterr().out
    assert main(["verify", "--json", str(full)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and len(report["unchecked"]) == 4


def test_default_gene_names_are_bounded_by_the_stored_bytes(tmp_path):
    from test_writer import small_adata

    adata = small_adata(n_cells=50, n_genes=20)
    root = tmp_path / "d"
    dc.write_deltacells(adata, root, var=False, gene_order="none", progress=False)
    obj = json.loads(manifest_text(root))
    obj["n_genes"] = 2**31
    reseal(root, obj)
    with pytest.raises(dc.LimitError, match="2147483648 genes without stored names"):
        dc.read_deltacells(root)


# -- verify ---------------------------------------------------------------------------------------


def test_verify_json_lists_every_problem(full, capsys):
    umap = str(zarr_chunk(full, "obsm/X_umap").relative_to(full))
    for name in ("var.parquet", umap, "spatial/centroids.npy", "raw/var.parquet"):
        path = full / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    assert main(["verify", "--json", str(full)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["error"] == report["problems"][0]
    text = "\n".join(report["problems"])
    for name in ("var.parquet", umap, "centroids.npy", "raw/var.parquet"):
        assert name in text, (name, text)


def test_verify_checks_the_cell_order_and_checksum_files(full):
    order = full / "cell_order.npy"
    data = bytearray(order.read_bytes())
    data[-3] ^= 1
    order.write_bytes(bytes(data))
    sums = full / "tiles" / "chunk_crc32.bin"
    data = bytearray(sums.read_bytes())
    data[-1] ^= 1  # an unused slot of the last row
    sums.write_bytes(bytes(data))
    problems = dc.open_dataset(full).problems()
    assert any("cell_order.npy" in p for p in problems)
    assert any("chunk_crc32.bin" in p for p in problems)


# -- plain HTTP -----------------------------------------------------------------------------------


class NoListingHandler(RangeHandler):
    """A static server without directory listings that answers 503 to the first request for
    each path in ``flaky`` (a server or proxy under load)."""

    flaky: set[str] = set()  # noqa: RUF012 - shared by the server's handler instances
    failed: set[str] = set()  # noqa: RUF012

    def do_GET(self) -> None:
        if os.path.isdir(self.translate_path(self.path)):
            self.send_error(404)
            return
        name = self.path.split("/d/", 1)[-1]
        if name in NoListingHandler.flaky and name not in NoListingHandler.failed:
            NoListingHandler.failed.add(name)
            self.send_error(503)
            return
        super().do_GET()


def test_plain_http_without_listings_and_with_503s(pristine, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 partial(NoListingHandler, directory=str(pristine.parent)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    NoListingHandler.flaky = {"manifest.json", "obs/schema.json", "var.parquet",
                              str(zarr_group_attributes(pristine, "uns").relative_to(pristine))}
    NoListingHandler.failed = set()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/d"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            back = dc.read_deltacells(url, cache_dir=tmp_path)
            local = dc.read_deltacells(pristine, cache_dir=tmp_path / "l")
        assert set(back.obsm) == set(local.obsm) and set(back.uns) == set(local.uns)
        np.testing.assert_array_equal(back.obsm["X_pca"], local.obsm["X_pca"])
        assert back.uns["title"] == local.uns["title"]
        assert (back.layers["spliced"].to_memory() != local.layers["spliced"].to_memory()).nnz == 0
        assert NoListingHandler.failed == NoListingHandler.flaky  # each answered 503 once
    finally:
        server.shutdown()
        server.server_close()


class SilentOrFailingHandler(NoListingHandler):
    """Elements that never answer (``silent``) or always fail with 500 (``failing``)."""

    silent: tuple[str, ...] = ()
    failing: tuple[str, ...] = ()

    def do_GET(self) -> None:
        name = self.path.split("/d/", 1)[-1]
        if name.startswith(SilentOrFailingHandler.silent):
            import time

            time.sleep(20)
            return
        if name.startswith(SilentOrFailingHandler.failing):
            self.send_error(500)
            return
        super().do_GET()


@pytest.mark.parametrize("fault", ["silent", "failing"])
def test_element_reads_keep_the_deadline_and_name_the_cause(pristine, tmp_path, fault):
    import time

    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 partial(SilentOrFailingHandler, directory=str(pristine.parent)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    NoListingHandler.flaky = set()
    SilentOrFailingHandler.silent = ("anndata.zarr/obsm",) if fault == "silent" else ()
    SilentOrFailingHandler.failing = ("anndata.zarr/obsm",) if fault == "failing" else ()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/d"
        t0 = time.monotonic()
        with pytest.raises(dc.FormatError, match=r"anndata\.zarr/obsm/") as info:
            dc.read_deltacells(url, cache_dir=tmp_path, timeout=0.5, deadline=2)
        assert time.monotonic() - t0 < 15
        cause = str(info.value)
        assert ("no answer within" in cause) if fault == "silent" else ("500" in cause)
    finally:
        SilentOrFailingHandler.silent = SilentOrFailingHandler.failing = ()
        server.shutdown()
        server.server_close()
