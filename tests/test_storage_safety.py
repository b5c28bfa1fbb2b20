"""Local files stay inside the dataset and are regular files; remote reads have deadlines."""

from __future__ import annotations

import os
import re
import shutil
import socket
import threading
import time

import numpy as np
import pytest
from test_writer import small_adata

import deltacells as dc
from deltacells.cli import main
from deltacells.store.storage import StorageError, Store


@pytest.fixture
def dataset_dir(tmp_path):
    root = tmp_path / "d"
    dc.write_deltacells(small_adata(n_cells=200), root, tile_size=100, progress=False)
    return root


def finishes(call, seconds: float = 20.0):
    """Run ``call`` in a thread; the outcome (value or exception), or fail if it hangs."""
    outcome: list = []

    def run():
        try:
            outcome.append(call())
        except BaseException as err:
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call} still blocked after {seconds} s"
    return outcome[0]


def test_links_leading_out_of_the_root_are_refused(dataset_dir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-CONTENT " * 100)
    tile = dataset_dir / "tiles" / "tile_000001.dct"
    tile.unlink()
    tile.symlink_to(secret)
    dataset = dc.open_dataset(dataset_dir)
    with pytest.raises(dc.FormatError, match="symbolic link leading out") as info:
        dataset.tile(1)
    assert "SECRET" not in str(info.value)
    with pytest.raises(dc.FormatError, match="symbolic link leading out"):
        dataset.verify()
    # Opting in reads it, and the format checks then refuse it as what it is.
    followed = dc.open_dataset(dataset_dir, follow_external_links=True)
    with pytest.raises(dc.FormatError, match="bytes, the manifest says"):
        followed.tile(1)


def test_links_inside_the_root_and_to_copies_outside_on_request(dataset_dir, tmp_path):
    tile = dataset_dir / "tiles" / "tile_000001.dct"
    expected = dc.open_dataset(dataset_dir).tile(1).decode(np.int32)
    inside = dataset_dir / "tiles" / "elsewhere.bin"
    shutil.copy(tile, inside)
    tile.unlink()
    tile.symlink_to(inside)
    assert (dc.open_dataset(dataset_dir).tile(1).decode(np.int32) != expected).nnz == 0
    outside = tmp_path / "copy.dct"
    shutil.move(inside, outside)
    tile.unlink()
    tile.symlink_to(outside)
    followed = dc.open_dataset(dataset_dir, follow_external_links=True)
    assert (followed.tile(1).decode(np.int32) != expected).nnz == 0


def test_a_linked_dataset_root_is_fine(dataset_dir, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(dataset_dir)
    dc.open_dataset(link).verify()


@pytest.mark.parametrize("victim", ["tiles/tile_000000.dct", "obs/obs_0000.parquet",
                                    "manifest.json", "gene_order.npy"])  # fmt: skip
def test_fifos_are_refused_not_waited_on(dataset_dir, victim):
    path = dataset_dir / victim
    path.unlink()
    os.mkfifo(path)

    def open_and_verify():
        dc.open_dataset(dataset_dir).verify()

    err = finishes(open_and_verify)
    assert isinstance(err, dc.FormatError) and "not a regular file" in str(err)
    assert finishes(lambda: main(["verify", str(dataset_dir), "--quiet"])) == 1


def test_store_refuses_directories_where_files_belong(dataset_dir):
    (dataset_dir / "tiles" / "tile_000000.dct").unlink()
    (dataset_dir / "tiles" / "tile_000000.dct").mkdir()
    with pytest.raises(dc.FormatError, match="a directory"):
        dc.open_dataset(dataset_dir).tile(0)


class SilentServer:
    """Accepts TCP connections and never answers (a hung server or a black-holed route)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent():
    server = SilentServer()
    yield server
    server.close()


def test_http_reads_give_up_at_the_deadline(silent):
    pytest.importorskip("aiohttp")
    url = f"http://127.0.0.1:{silent.port}/d"
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        dc.read_deltacells(url, timeout=0.3, deadline=1.5)
    elapsed = time.monotonic() - start
    assert elapsed < 5, elapsed
    message = str(info.value)
    assert f"{url}/manifest.json" in message
    assert "failed" in message and "times in" in message and "deadline 1.5 s" in message
    assert re.search(r"last error: RequestTimeout: no answer within 0\.\d\d s$", message)


def test_s3_reads_give_up_at_the_deadline(silent, monkeypatch):
    pytest.importorskip("s3fs")
    monkeypatch.setenv("DELTACELLS_TIMEOUT", "0.3")
    monkeypatch.setenv("DELTACELLS_DEADLINE", "1.5")
    options = {"key": "k", "secret": "s", "skip_instance_cache": True,
               "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{silent.port}",
                                 "region_name": "us-east-1"}}  # fmt: skip
    start = time.monotonic()
    with pytest.raises(StorageError, match=r"s3://bucket/d/manifest\.json: exists failed \d+ "
                                           r"times in [0-9.]+ s \(deadline 1\.5 s\); last "
                                           r"error: \S+"):  # fmt: skip
        dc.open_dataset("s3://bucket/d", storage_options=options)
    assert time.monotonic() - start < 5


def test_timeouts_survive_pickling():
    import pickle

    store = Store("memory://x/d", timeout=1.5, deadline=7)
    clone = pickle.loads(pickle.dumps(store))
    assert (clone.timeout, clone.deadline) == (1.5, 7.0)


def test_bad_timeout_settings(monkeypatch):
    with pytest.raises(ValueError, match="> 0"):
        Store("memory://x/d", deadline=0)
    monkeypatch.setenv("DELTACELLS_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="DELTACELLS_TIMEOUT"):
        Store("memory://x/d")
