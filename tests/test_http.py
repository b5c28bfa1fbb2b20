"""Reading a dataset over plain HTTP with ranged requests (fsspec's http filesystem)."""

from __future__ import annotations

import os
import re
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import numpy as np
import pytest
import scipy.sparse as sp
from test_writer import small_adata

import deltacells as dc

pytest.importorskip("aiohttp", reason="fsspec's http filesystem needs aiohttp")


class RangeHandler(SimpleHTTPRequestHandler):
    """A static file server that answers ``Range: bytes=a-b`` with 206, as object stores and
    web servers do (Python's own handler ignores ranges), and records each range asked for."""

    ranges: ClassVar[list[tuple[str, str]]] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if wanted is None or not os.path.isfile(path):
            return super().do_GET()
        RangeHandler.ranges.append((self.path, wanted.group(0)))
        size = os.path.getsize(path)
        start = int(wanted.group(1))
        stop = min(size, int(wanted.group(2)) + 1) if wanted.group(2) else size
        with open(path, "rb") as f:
            f.seek(start)
            body = f.read(max(0, stop - start))
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{size}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("http")
    adata = small_adata(n_cells=450)
    dc.write_deltacells(adata, root / "d", tile_size=100, progress=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(RangeHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/d", adata
    finally:
        server.shutdown()
        server.server_close()


def test_read_over_http(served, tmp_path):
    url, adata = served
    RangeHandler.ranges.clear()
    backed = dc.read_deltacells(url, cache_dir=tmp_path)
    rows = np.array([449, 3, 200, 200, 101])
    assert (sp.csr_matrix(backed.X[rows]) != adata.X[rows]).nnz == 0
    assert (backed.X.to_memory() != adata.X).nnz == 0
    assert backed.obs["batch"].tolist() == adata.obs["batch"].tolist()
    assert list(backed.var_names) == list(adata.var_names)
    # Tiles are fetched with ranged requests capped one byte past the manifest's size.
    tile_ranges = [r for path, r in RangeHandler.ranges if "tiles/" in path]
    assert tile_ranges and all(r.startswith("bytes=0-") for r in tile_ranges)
    dc.open_dataset(url).verify()
