"""Reading through a real S3 API: moto's S3 server on 127.0.0.1, s3fs as the client."""

from __future__ import annotations

import pickle
import socket
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from faultproxy import Fault, FaultProxy
from test_writer import small_adata

import deltacells as dc
from deltacells.store.storage import StorageError, Store

moto_server = pytest.importorskip("moto.server", reason="moto[server] is a test dependency")
pytest.importorskip("s3fs", reason="s3fs is a test dependency")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory, monkeypatch_module):
    """A moto S3 server with one bucket holding a dataset; yields (url, options, adata)."""
    import boto3

    for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch_module.setenv(key, value)
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket="cells")
        adata = small_adata(n_cells=600)
        adata.X = adata.X.astype(np.float32)
        local = tmp_path_factory.mktemp("s3src") / "d"
        dc.write_deltacells(adata, local, tile_size=100, progress=False)
        for path in Path(local).rglob("*"):
            if path.is_file():
                client.upload_file(str(path), "cells", f"data/d/{path.relative_to(local)}")
        options = {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": endpoint},
                   "skip_instance_cache": True}  # fmt: skip
        yield "s3://cells/data/d", options, adata, client
    finally:
        server.stop()


@pytest.fixture(scope="module")
def proxied(s3):
    """The same bucket behind a fault-injecting HTTP proxy; the client retries nothing itself
    (botocore: one attempt) and gives up on a response after half a second, so what is
    retried is retried by deltacells."""
    url, options, adata, _ = s3
    upstream = options["client_kwargs"]["endpoint_url"].removeprefix("http://")
    with FaultProxy(upstream) as proxy:
        through = {
            **options,
            "client_kwargs": {"endpoint_url": proxy.endpoint},
            "config_kwargs": {"retries": {"total_max_attempts": 1}, "read_timeout": 0.5},
        }
        yield url, through, adata, proxy


def _expected_tile(adata, dataset, index):
    """Tile ``index`` of the fixture's dataset (100 cells per tile, stored gene order)."""
    start = index * 100
    return adata.X[start : start + 100][:, dataset.gene_order()]


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_read_slices_obs_and_to_memory_over_s3(s3, tmp_path):
    url, options, adata, _ = s3
    backed = dc.read_deltacells(url, storage_options=options, cache_dir=tmp_path)
    rows = np.array([599, 0, 250, 250, 101])
    assert (sp.csr_matrix(backed.X[rows]) != adata.X[rows]).nnz == 0
    assert (backed.X[100:350] != adata.X[100:350]).nnz == 0
    assert (backed.X.to_memory() != adata.X).nnz == 0
    assert backed.obs["batch"].tolist() == adata.obs["batch"].tolist()
    assert list(backed.obs_names) == list(adata.obs_names)
    dc.open_dataset(url, storage_options=options).verify()


def test_writing_to_s3(s3, tmp_path):
    _, options, adata, _ = s3
    dc.write_deltacells(adata[:150], "s3://cells/written", tile_size=64, progress=False,
                        storage_options=options)  # fmt: skip
    back = dc.read_deltacells("s3://cells/written", storage_options=options, cache_dir=tmp_path)
    assert (back.X.to_memory() != adata.X[:150]).nnz == 0


def test_transient_failures_are_retried(s3, monkeypatch):
    url, options, adata, _ = s3
    dataset = dc.open_dataset(url, storage_options=options)
    fs = dataset.store._fs
    real = fs.cat_file
    failures = {"left": 3, "seen": 0}

    def flaky(path, *args, **kwargs):
        if failures["left"] > 0:
            failures["left"] -= 1
            failures["seen"] += 1
            raise ConnectionError("connection reset by peer (injected)")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(fs, "cat_file", flaky)
    tile = dataset.tile(2)
    assert failures["seen"] == 3  # three failures, then success
    assert (tile.decode() != _expected_tile(adata, dataset, 2)).nnz == 0


def test_persistent_failure_names_the_url(s3, monkeypatch):
    url, options, _, _ = s3
    dataset = dc.open_dataset(url, storage_options=options)
    dataset.store.backoff = 0.001

    def broken(path, *args, **kwargs):
        raise TimeoutError("read timed out (injected)")

    monkeypatch.setattr(dataset.store._fs, "cat_file", broken)
    expected = (r"tiles/tile_000001\.dct: ranged read failed 5 times in [0-9.]+ s; "
                r"last error: TimeoutError: read timed out")
    with pytest.raises(StorageError, match=expected):
        dataset.tile(1)


def test_missing_objects_are_format_errors(s3):
    _, options, _, client = s3
    source = {"Bucket": "cells", "Key": "data/d/tiles/tile_000000.dct"}
    client.copy_object(Bucket="cells", Key="broken/d/tiles/tile_000000.dct", CopySource=source)
    with pytest.raises(dc.FormatError, match="incomplete dataset"):
        dc.open_dataset("s3://cells/broken/d", storage_options=options)
    with pytest.raises(FileNotFoundError):
        dc.open_dataset("s3://cells/nothing-here", storage_options=options)


def test_tile_of_the_wrong_size_over_s3(s3):
    # Remote tiles are read only up to one byte past the manifest's size, so an object of any
    # other size is refused without fetching it whole.
    _, options, _, client = s3
    for path in ("manifest.json", "tiles/tile_000000.dct"):
        source = {"Bucket": "cells", "Key": f"data/d/{path}"}
        client.copy_object(Bucket="cells", Key=f"sized/d/{path}", CopySource=source)
    tiles = [
        client.get_object(Bucket="cells", Key=f"data/d/tiles/tile_00000{i}.dct")["Body"].read()
        for i in (1, 2)
    ]
    longer = tiles[0] + bytes(64)
    client.put_object(Bucket="cells", Key="sized/d/tiles/tile_000001.dct", Body=longer)
    client.put_object(Bucket="cells", Key="sized/d/tiles/tile_000002.dct", Body=tiles[1][:-8])
    dataset = dc.open_dataset("s3://cells/sized/d", storage_options=options)
    size = dataset.manifest.tile_bytes[1]
    with pytest.raises(dc.FormatError, match=rf"tile_000001\.dct: more than {size} bytes, the man"):
        dataset.tile(1)
    with pytest.raises(dc.FormatError, match=r"tile_000002\.dct: \d+ bytes, the manifest says"):
        dataset.tile(2)
    assert dataset.tile(0).nnz == dataset.manifest.tile_nnz[0]


def test_s3fs_connection_pool_matches_the_io_threads(s3):
    """s3fs gets as many pooled connections as the store has I/O threads (botocore's default
    of 10 would cap the requests in flight), unless the options set it."""
    url, options, _, _ = s3
    assert Store(url, options)._fs.config_kwargs["max_pool_connections"] == 32
    assert Store(url, options, io_threads=48)._fs.config_kwargs["max_pool_connections"] == 48
    mine = {**options, "config_kwargs": {"max_pool_connections": 5}}
    assert Store(url, mine)._fs.config_kwargs["max_pool_connections"] == 5


def test_store_pickles(s3):
    import pickle

    url, options, _, _ = s3
    store = pickle.loads(pickle.dumps(Store(url, options)))
    assert store.exists("manifest.json")


def test_server_errors_are_retried_over_http(proxied):
    # The server answers 500 InternalError three times, then serves the tile.
    url, options, adata, proxy = proxied
    proxy.clear()
    dataset = dc.open_dataset(url, storage_options=options)
    proxy.add(Fault("tiles/tile_000003.dct", count=3, status=500))
    tile = dataset.tile(3)
    assert [kind for _, kind in proxy.injected] == ["error"] * 3
    assert any("tile_000003" in path for path in proxy.forwarded)
    assert (tile.decode() != _expected_tile(adata, dataset, 3)).nnz == 0


def test_slow_responses_time_out_and_are_retried_over_http(proxied, tmp_path):
    # Two responses are held back past the client's read timeout; the reads are made again
    # and the whole lazy AnnData still reads correctly.
    url, options, adata, proxy = proxied
    proxy.clear()
    backed = dc.read_deltacells(url, storage_options=options, cache_dir=tmp_path)
    proxy.add(Fault("tiles/tile_000004.dct", count=2, delay=2.0))
    rows = np.array([450, 420, 499])
    assert (sp.csr_matrix(backed.X[rows]) != adata.X[rows]).nnz == 0
    assert [kind for _, kind in proxy.injected] == ["delay"] * 2


def test_persistent_server_errors_name_the_url_over_http(proxied):
    url, options, _, proxy = proxied
    proxy.clear()
    dataset = dc.open_dataset(url, storage_options=options)
    dataset.store.backoff = 0.001
    proxy.add(Fault("tiles/tile_000005.dct", count=-1, status=500))
    with pytest.raises(StorageError, match=r"tiles/tile_000005\.dct: ranged read failed 5 times"):
        dataset.tile(5)
    assert len(proxy.injected) == 5  # one request per attempt: the retries are ours


def test_whole_anndata_through_s3(s3, tmp_path):
    from test_whole_anndata import assert_round_trip, processed

    _, options, _, _ = s3
    source = processed(n_cells=150, seed=11)
    url = "s3://cells/whole/d"
    dc.write_deltacells(source, url, tile_size=64, storage_options=options, progress=False)
    back = dc.read_deltacells(url, storage_options=options, cache_dir=tmp_path)
    assert_round_trip(source, back)
    pytest.importorskip("dask")  # the lazy elements are dask arrays (an optional extra)
    lazy = dc.read_deltacells(url, storage_options=options, cache_dir=tmp_path, elements="lazy")
    np.testing.assert_array_equal(lazy.obsm["spatial"].compute(), source.obsm["spatial"])
    dc.open_dataset(url, storage_options=options).verify()


def test_network_emulation_latency_and_bandwidth(s3):
    """The proxy as a network: each response waits ``latency`` before its first byte and bodies
    flow at most at the given rate; what the reader sees follows (and matches the data)."""
    import time

    url, options, adata, client = s3
    upstream = options["client_kwargs"]["endpoint_url"].removeprefix("http://")
    client.put_object(Bucket="cells", Key="blob.bin", Body=bytes(2_000_000))
    with FaultProxy(upstream, latency=0.05, per_connection=4e6, total=8e6) as proxy:
        through = {**options, "client_kwargs": {"endpoint_url": proxy.endpoint}}
        store = Store("s3://cells", through)
        t0 = time.perf_counter()
        assert store.read_bytes("blob.bin") == bytes(2_000_000)
        elapsed = time.perf_counter() - t0
        assert elapsed >= 0.05 + 2_000_000 / 4e6 * 0.9
        assert proxy.bytes_sent >= 2_000_000 and proxy.requests >= 1
        dataset = dc.open_dataset(url, storage_options=through)
        assert (dataset.tile(0).decode(np.float32) != _expected_tile(adata, dataset, 0)).nnz == 0


def test_ranged_reads_over_s3(s3):
    """ranged_reads=True on S3: the concurrent rounds (header, indptr, frames) over several
    tiles give the rows asked, in the order asked."""
    url, options, adata, _ = s3
    X = dc.read_deltacells(url, storage_options=options, elements=False, ranged_reads=True).X
    rows = np.array([599, 5, 140, 141, 320, 5, 480, 250])
    assert (X[rows] != adata.X[rows]).nnz == 0


RANK_SCRIPT = """
import json, sys
import torch
import deltacells as dc

url, options = sys.argv[1], json.loads(sys.argv[2])
dataset = dc.TorchIterableDataset(url, storage_options=options, batch_size=32, seed=7)
loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                     multiprocessing_context="fork")
print(json.dumps([b["cells"].tolist() for b in loader]))
"""


def test_two_ranks_of_two_workers_share_an_epoch_over_the_emulated_store(s3, tmp_path):
    """Two rank processes (RANK / WORLD_SIZE), each a torch DataLoader of two workers, read
    one epoch from the bucket through a 10 ms, 20 MB/s link: every cell exactly once, as many
    batches on each rank, the batches the documented (seed, epoch) plan gives, and each
    worker fetches only the tiles of its own batches' buffers."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("torch")
    from deltacells.train.loader import BatchRuns, EpochPlan

    url, options, _, _ = s3
    upstream = options["client_kwargs"]["endpoint_url"].removeprefix("http://")
    with FaultProxy(upstream, latency=0.01, per_connection=20e6, total=20e6) as proxy:
        through = {**options, "client_kwargs": {"endpoint_url": proxy.endpoint}}
        command = [sys.executable, "-c", RANK_SCRIPT, url, json.dumps(through)]
        environments = [{**os.environ, "RANK": str(rank), "WORLD_SIZE": "2"} for rank in (0, 1)]
        ranks = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
                 for env in environments]  # fmt: skip
        batches = [json.loads(p.communicate(timeout=300)[0]) for p in ranks]
        assert all(p.returncode == 0 for p in ranks)
        fetched = [path.rsplit("/", 1)[-1] for path in proxy.forwarded if "/tiles/" in path]
    assert len(batches[0]) == len(batches[1]) == -(-300 // 32)
    cells = np.concatenate([np.array(b) for rank in batches for b in rank])
    np.testing.assert_array_equal(np.sort(cells), np.arange(600))
    plan = EpochPlan([100] * 6, shuffle="tiles", buffer_tiles=2, seed=7, epoch=0)
    needed: list[str] = []
    for rank, got in enumerate(batches):
        expected = []
        for w in range(2):
            runs = BatchRuns(plan, 32, rank=rank, world_size=2, worker=(w, 2))
            expected += [b.tolist() for b in runs]
            needed += sorted({f"tile_{t:06d}.dct" for i in range(len(runs))
                              for t in plan.tiles_at(*runs.bounds(i))})  # fmt: skip
        assert sorted(got) == sorted(expected)
    # 12 fetches of 6 tiles (a buffer shared by two workers is fetched by both); without
    # sharding every worker would fetch all 6.
    assert sorted(fetched) == sorted(needed) and len(fetched) == 12


def with_obstore(options: dict) -> dict:
    pytest.importorskip("obstore", reason="obstore is a dev dependency")
    return {**options, "client": "obstore"}


def test_obstore_client_reads_writes_and_loads(s3, tmp_path):
    """The same bucket through obstore: slices, obs, ranged reads and a loader epoch equal
    the data; a dataset written through it reads back; the Store says which client it is."""
    url, options, adata, _ = s3
    options = with_obstore(options)
    dataset = dc.open_dataset(url, storage_options=options)
    assert dataset.store.client == "obstore"
    back = dc.read_deltacells(url, storage_options=options, elements=False)
    assert (back.X[100:350] != adata.X[100:350]).nnz == 0
    assert list(back.obs["cell_type"].astype(str)) == list(adata.obs["cell_type"].astype(str))
    ranged = dc.read_deltacells(url, storage_options=options, ranged_reads=True, elements=False)
    rows = np.array([599, 5, 140, 141, 320])
    assert (ranged.X[rows] != adata.X[rows]).nnz == 0
    cells = [b.cells for b in dc.Loader(url, storage_options=options, batch_size=128, seed=2)]
    np.testing.assert_array_equal(np.sort(np.concatenate(cells)), np.arange(600))
    target = "s3://cells/data/written-by-obstore"
    dc.write_deltacells(adata, target, storage_options=options, tile_size=150, progress=False)
    again = dc.read_deltacells(target, storage_options=options, elements=False)
    assert (again.X[:] != adata.X).nnz == 0


def test_obstore_client_errors(s3, proxied, monkeypatch):
    """Missing objects are FormatErrors, server errors are retried then name the URL, and
    options it cannot use are refused by name."""
    url, options, _, _ = s3
    with pytest.raises(dc.FormatError, match="missing"):
        Store(url, with_obstore(options)).read_bytes("nope.bin")
    with pytest.raises(ValueError, match="config_kwargz"):
        Store(url, with_obstore({**options, "config_kwargz": {}}))
    with pytest.raises(ValueError, match="client must be one of"):
        Store(url, {**options, "client": "boto"})
    with pytest.raises(ValueError, match="not http://"):
        Store("http://127.0.0.1:9/d", {"client": "obstore"})
    monkeypatch.setenv("DELTACELLS_CLIENT", "obstore")
    chosen = Store(url, options)
    assert chosen.client == "obstore"
    monkeypatch.delenv("DELTACELLS_CLIENT")
    # A pickled store (a dask task's) keeps the client the environment chose.
    assert pickle.loads(pickle.dumps(chosen)).client == "obstore"
    assert Store(url, options).client == "fsspec"
    url, through, _, proxy = proxied
    proxy.clear()
    proxy.add(Fault(match="manifest.json", status=500, count=2))
    try:
        assert dc.open_dataset(url, storage_options=with_obstore(through)).shape == (600, 120)
        assert len(proxy.injected) == 2
        proxy.add(Fault(match="manifest.json", status=500, count=-1))
        with pytest.raises(StorageError, match=r"manifest\.json"):
            dc.open_dataset(url, storage_options=with_obstore(through), deadline=2)
    finally:
        proxy.clear()


def test_obstore_client_refuses_tiles_of_the_wrong_size(s3):
    """Through obstore too, a tile longer, shorter or empty against the manifest is a
    FormatError naming it (an empty object answers a ranged GET with 416)."""
    _, options, _, client = s3
    source = {"Bucket": "cells", "Key": "data/d/manifest.json"}
    client.copy_object(Bucket="cells", Key="sized2/d/manifest.json", CopySource=source)
    tiles = [client.get_object(Bucket="cells", Key=f"data/d/tiles/tile_00000{i}.dct")["Body"]
             .read() for i in range(3)]  # fmt: skip
    bodies = [tiles[0] + bytes(64), tiles[1][:-8], b""]
    for i, body in enumerate(bodies):
        client.put_object(Bucket="cells", Key=f"sized2/d/tiles/tile_00000{i}.dct", Body=body)
    dataset = dc.open_dataset("s3://cells/sized2/d", storage_options=with_obstore(options))
    size = dataset.manifest.tile_bytes[0]
    with pytest.raises(dc.FormatError, match=rf"tile_000000\.dct: more than {size} bytes"):
        dataset.tile(0)
    with pytest.raises(dc.FormatError, match=r"tile_000001\.dct: \d+ bytes, the manifest says"):
        dataset.tile(1)
    with pytest.raises(dc.FormatError, match=r"tile_000002\.dct: 0 bytes, the manifest says"):
        dataset.tile(2)


def test_client_errors_retrying_cannot_mend_say_what_to_do(s3, monkeypatch, tmp_path):
    # botocore's own errors came out bare (NoCredentialsError, EndpointConnectionError).
    url, options, _, _ = s3
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    no_keys = {k: v for k, v in options.items() if k not in ("key", "secret")}
    with pytest.raises(StorageError, match=r"manifest\.json: exists failed: NoCredentialsError"
                                           r".*storage_options=\{'anon': True\}"):
        dc.read_deltacells(url, storage_options=no_keys, cache_dir=tmp_path)
    # Nothing listens on port 1: the connection is refused (botocore's one attempt).
    nowhere = {**options, "client_kwargs": {"endpoint_url": "http://127.0.0.1:1"},
               "config_kwargs": {"retries": {"total_max_attempts": 1}}}  # fmt: skip
    with pytest.raises(StorageError, match=r"EndpointConnectionError.*check the URL, the "
                                           r"endpoint"):
        dc.read_deltacells(url, storage_options=nowhere, cache_dir=tmp_path)


def test_a_loader_fetches_a_dataset_that_fits_once(s3, monkeypatch):
    url, options, adata, _ = s3
    loader = dc.Loader(url, storage_options=options, batch_size=128, seed=5)
    fetched: list[str] = []
    real = Store.read_buffer
    monkeypatch.setattr(Store, "read_buffer",
                        lambda store, name, *a, **k: fetched.append(name) or real(store, name,
                                                                                 *a, **k))
    n_tiles = loader.dataset.manifest.n_tiles
    for epoch in range(3):
        fetched.clear()
        loader.set_epoch(epoch)
        batches = list(loader)
        tiles = sorted(n for n in fetched if n.startswith("tiles/"))
        assert len(tiles) == (n_tiles if epoch < 2 else 0), (epoch, tiles)  # kept from epoch 1
        for batch in batches:
            assert (batch.X != adata.X[batch.cells]).nnz == 0
