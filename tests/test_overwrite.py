"""Writing never loses what is already there: overwrite replaces only a deltacells dataset,
only once the new one is complete, and files get the permissions the umask asks for."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest
import scipy.sparse as sp
from test_writer import assert_same_matrix, fail_third_tile, read_back, small_adata

import deltacells as dc
from deltacells.store.storage import Store
from deltacells.write import writer as writer_module


def snapshot(root) -> dict[str, bytes]:
    """Every regular file below ``root`` with its bytes."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture
def old_dataset(tmp_path):
    adata = small_adata(seed=1)
    dc.write_deltacells(adata, tmp_path / "d", tile_size=50, progress=False)
    return tmp_path / "d", adata


def _add_notes(root):
    (root / "notes.txt").write_text("my notes")


def _add_nested_folder(root):
    (root / "tiles" / "mine").mkdir()
    (root / "tiles" / "mine" / "keep.txt").write_text("keep")


def _add_other_dataset(root):
    dc.write_deltacells(small_adata(n_cells=20), root / "nested", progress=False)


def _add_symlink(root):
    (root / "link.txt").symlink_to("/etc/hostname")


def _add_fifo(root):
    os.mkfifo(root / "obs" / "pipe")


@pytest.mark.parametrize(
    "add_foreign", [_add_notes, _add_nested_folder, _add_other_dataset, _add_symlink, _add_fifo]
)
def test_overwrite_refuses_folders_holding_anything_else(old_dataset, add_foreign):
    root, _ = old_dataset
    add_foreign(root)
    before = snapshot(root)
    with pytest.raises(FileExistsError, match="not a deltacells dataset's"):
        dc.write_deltacells(small_adata(n_cells=30), root, overwrite=True, progress=False)
    assert snapshot(root) == before


def test_overwrite_refuses_dataset_shaped_folders_that_are_not_datasets(tmp_path):
    (tmp_path / "a" / "tiles").mkdir(parents=True)
    (tmp_path / "a" / "tiles" / "tile_000000.dct").write_bytes(b"my own file, same name")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "manifest.json").write_text('{"format": "something else"}')
    for root in (tmp_path / "a", tmp_path / "b"):
        before = snapshot(root)
        with pytest.raises(FileExistsError, match="not a valid deltacells dataset"):
            dc.write_deltacells(small_adata(n_cells=30), root, overwrite=True, progress=False)
        assert snapshot(root) == before


def test_target_is_checked_before_the_counts_are_read(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")

    def never(*args, **kwargs):
        raise AssertionError("the counts pass ran before the target was refused")

    monkeypatch.setattr(writer_module, "_check_and_total", never)
    with pytest.raises(FileExistsError, match="is not empty and not a deltacells dataset"):
        dc.write_deltacells(small_adata(), tmp_path / "d", progress=False)
    with pytest.raises(FileExistsError, match="even with overwrite=True"):
        dc.write_deltacells(small_adata(), tmp_path / "d", overwrite=True, progress=False)


def test_failed_overwrite_leaves_the_old_dataset(old_dataset, monkeypatch):
    root, adata = old_dataset
    before = snapshot(root)
    fail_third_tile(monkeypatch)
    with pytest.raises(RuntimeError, match="disk on fire"):
        dc.write_deltacells(small_adata(seed=2), root, tile_size=50, overwrite=True,
                            progress=False)  # fmt: skip
    assert snapshot(root) == before
    assert_same_matrix(read_back(root), adata.X)
    assert not [p for p in root.parent.iterdir() if "staging" in p.name]  # cleaned up


def test_killed_overwrite_leaves_the_old_dataset(old_dataset, tmp_path):
    """``kill -9`` in the middle of the new tile writes: the old dataset is still whole."""
    root, adata = old_dataset
    before = snapshot(root)
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(os.path.dirname(__file__))!r})
        from test_writer import small_adata
        import deltacells as dc
        from deltacells.write import tiles
        real, calls = tiles.encode_tile, []
        def encode(*args, **kwargs):
            calls.append(1)
            if len(calls) == 4:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        tiles.encode_tile = encode
        dc.write_deltacells(small_adata(seed=3), {str(root)!r}, tile_size=50,
                            overwrite=True, progress=False)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert result.returncode == -9, result.stderr.decode()
    assert snapshot(root) == before
    dc.open_dataset(root).verify()
    assert_same_matrix(read_back(root), adata.X)
    # A later overwrite succeeds (the staging folder the killed write left is not in the way).
    dc.write_deltacells(small_adata(seed=3), root, tile_size=50, overwrite=True, progress=False)
    assert_same_matrix(read_back(root), small_adata(seed=3).X)


def test_successful_overwrite_replaces_the_dataset(old_dataset):
    root, _ = old_dataset
    new = small_adata(n_cells=120, seed=4)
    dc.write_deltacells(new, root, tile_size=50, overwrite=True, progress=False)
    assert_same_matrix(read_back(root), new.X)
    assert dc.open_dataset(root).manifest.n_cells == 120
    assert not (root / "tiles" / "tile_000005.dct").exists()  # the old dataset's extra tiles
    assert not [p for p in root.parent.iterdir() if "deltacells-" in p.name]


def test_overwrite_without_renameat2_uses_two_renames(old_dataset, monkeypatch):
    from deltacells.store import storage

    monkeypatch.setattr(storage, "_renameat2_exchange", lambda a, b: False)
    root, _ = old_dataset
    new = small_adata(n_cells=80, seed=5)
    dc.write_deltacells(new, root, tile_size=50, overwrite=True, progress=False)
    assert_same_matrix(read_back(root), new.X)
    assert not [p for p in root.parent.iterdir() if "deltacells-" in p.name]


def test_overwrite_on_an_object_store_keeps_only_the_new_dataset():
    url = "memory://overwrite-test/d"
    dc.write_deltacells(small_adata(seed=1), url, tile_size=50, progress=False)
    new = small_adata(n_cells=80, seed=6)
    dc.write_deltacells(new, url, tile_size=50, overwrite=True, progress=False)
    assert_same_matrix(read_back(url), new.X)
    names = Store(url).list()
    assert "tiles/tile_000005.dct" not in names  # the old dataset's sixth tile is gone
    assert not Store("memory://overwrite-test").list("d.deltacells-staging")  # staging removed


def test_float32_count_of_two_to_the_31_is_refused_in_the_first_pass(old_dataset):
    root, _ = old_dataset
    before = snapshot(root)
    adata = small_adata(seed=7)
    X = adata.X.astype(np.float32).tolil()
    X[57, 3] = np.float32(2**31)
    adata.X = X.tocsr()
    with pytest.raises(dc.CountError, match=r"count >= 2\^31 at cell 57 \('cell57'\), gene 3"):
        dc.write_deltacells(adata, root, overwrite=True, progress=False)
    assert snapshot(root) == before
    # The largest float32 below 2^31 is a valid count... only if it is below 2^31 - 1.
    with pytest.raises(dc.CountError, match="count >= 2"):
        dc.encode_tile(sp.csr_matrix(np.array([[np.float64(2**31)]])))
    assert dc.decode_tile(dc.encode_tile(sp.csr_matrix([[2**31 - 1]])), values_dtype=np.int32
                          )[0, 0] == 2**31 - 1  # fmt: skip


def test_count_errors_name_the_place_once(tmp_path):
    adata = small_adata()
    X = adata.X.tolil()
    X[4, 9] = -1
    adata.X = X.tocsr()
    with pytest.raises(dc.CountError) as info:
        dc.write_deltacells(adata, tmp_path / "d", progress=False)
    message = str(info.value)
    place = "<AnnData>: negative count at cell 4 ('cell4'), gene 9 ('G9')"
    # The place once, then what deltacells stores (no layer or raw holds counts here).
    assert message.startswith(place + "; deltacells stores raw counts")
    assert message.count("cell 4") == 1
    assert (info.value.cell, info.value.gene) == (4, 9)


@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_files_and_folders_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        dc.write_deltacells(small_adata(), tmp_path / "d", tile_size=100, progress=False)
        dc.write_deltacells(small_adata(seed=2), tmp_path / "d", tile_size=100, overwrite=True,
                            progress=False)  # fmt: skip
    finally:
        os.umask(old)
    root = tmp_path / "d"
    paths = [root, *root.rglob("*")]
    assert len(paths) > 5
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert mode == expected, (path, oct(mode), oct(expected))


def test_obs_column_names_that_collide_as_strings_are_refused(tmp_path):
    adata = small_adata(n_cells=20)
    adata.obs = pd.DataFrame({0: np.arange(20), "0": np.arange(20.0)}, index=adata.obs_names)
    with pytest.raises(ValueError, match=r"would all be stored as '0'"):
        dc.write_deltacells(adata, tmp_path / "d", progress=False)
    assert not (tmp_path / "d").exists()
