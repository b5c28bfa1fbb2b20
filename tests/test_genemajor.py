"""The gene-major companion: built in blocks from the CSR tiles, read one gene at a time by
ranged reads (locally and through moto's S3 server), checked by verify, refused when damaged."""

from __future__ import annotations

import json

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp
from conftest import DATA_DIR
from test_writer import small_adata

import deltacells as dc
from deltacells.cli import main
from deltacells.spatial.genemajor import add_gene_major, block_name
from deltacells.testing import reseal

LIAO = DATA_DIR / "liao2020_balf.h5ad"


@pytest.fixture(scope="module")
def liao(tmp_path_factory):
    root = tmp_path_factory.mktemp("genes") / "liao"
    dc.write_deltacells(LIAO, root, progress=False)
    record = add_gene_major(dc.open_dataset(root), block_cells=4000, chunk_genes=8)
    source = ad.read_h5ad(LIAO)
    return root, sp.csr_matrix(source.X), list(source.var_names), record


def test_blocks_and_record(liao):
    root, X, _, record = liao
    assert record["n_blocks"] == 3 and record["block_cells"] == 4000
    assert sum(record["block_nnz"]) == X.nnz
    assert sorted(p.name for p in (root / "genes").iterdir()) == [
        "block_000000.dct", "block_000001.dct", "block_000002.dct", "chunk_crc32.bin"]  # fmt: skip
    info = dc.open_dataset(root).info()["gene_major"]
    assert info["n_blocks"] == 3 and info["bytes"] == sum(record["block_bytes"])


def test_every_sampled_gene_equals_the_column(liao):
    root, X, names, _ = liao
    dataset = dc.open_dataset(root)
    rng = np.random.default_rng(0)
    totals = np.asarray(X.sum(axis=0)).ravel()
    picks = list(rng.choice(X.shape[1], 40, replace=False)) + list(np.argsort(totals)[-10:])
    for j in picks:
        column = dataset.genes(int(j), values_dtype=np.int32)
        assert column.shape == (X.shape[0], 1)
        assert (column != X[:, [j]]).nnz == 0, names[j]
    # names, several at once, repeats and order kept
    asked = ["MALAT1", "CD3E", "MALAT1", names[5]]
    got = dataset.genes(asked)
    expected = X[:, [names.index(n) for n in asked]]
    assert (got != expected).nnz == 0
    with pytest.raises(KeyError, match="no gene named 'NOT-A-GENE'"):
        dataset.genes("NOT-A-GENE")
    assert (dataset.gene("CD3E") != X[:, [names.index("CD3E")]]).nnz == 0
    adata = dc.read_deltacells(root)
    assert (sp.csr_matrix(adata[:, "CD3E"].X) != X[:, [names.index("CD3E")]]).nnz == 0


def test_one_gene_reads_a_small_part(liao):
    root, _, _, record = liao
    dataset = dc.open_dataset(root)
    dataset.genes("CD3E")
    spent = dataset.gene_major().bytes_read
    assert spent < sum(record["block_bytes"]) / 20


def test_stored_positions(liao):
    root, X, _, _ = liao
    dataset = dc.open_dataset(root)
    order = dataset.gene_order()
    got = dataset.genes([0, 1], column_order="stored", values_dtype=np.int32)
    assert (got != X[:, order[:2]]).nnz == 0


def test_lazy_anndata_columns_come_from_the_companion(liao):
    root, X, names, _ = liao
    adata = dc.read_deltacells(root)
    wanted = ["CD3E", "CD8A", "MS4A1"]
    got = adata[:, wanted].X
    assert (sp.csr_matrix(got) != X[:, [names.index(n) for n in wanted]]).nnz == 0
    assert len(adata.X._cache) == 0  # no CSR tile was decoded
    rows = adata[:100, wanted].X  # a row selection goes through the tiles
    assert (sp.csr_matrix(rows) != X[:100][:, [names.index(n) for n in wanted]]).nnz == 0
    assert len(adata.X._cache) > 0


def test_verify_checks_the_companion(liao, tmp_path, capsys):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(liao[0], root)
    assert main(["verify", "--quiet", str(root)]) == 0
    # A block from another dataset of the same shape, recorded as if it belonged here.
    other = tmp_path / "other"
    source = ad.read_h5ad(LIAO)
    source.X = sp.csr_matrix(source.X)
    source.X.data = source.X.data + 1
    dc.write_deltacells(source, other, progress=False)
    add_gene_major(dc.open_dataset(other), block_cells=4000, chunk_genes=8)
    shutil.copy(other / block_name(1), root / block_name(1))
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    theirs = json.loads((other / "manifest.json").read_text())["metadata"]["gene_major"]
    for key in ("block_bytes", "block_crc32", "block_nnz"):
        manifest["metadata"]["gene_major"][key][1] = theirs[key][1]
    # ... and its chunk checksum row, so that only the comparison with the tiles can tell.
    ours_sums, their_sums = manifest["metadata"]["gene_major"]["chunk_sums"], theirs["chunk_sums"]
    assert ours_sums["slots"] == their_sums["slots"]
    width = 4 * (ours_sums["slots"] + 2)
    rows = bytearray((root / "genes" / "chunk_crc32.bin").read_bytes())
    rows[width : 2 * width] = (other / "genes" / "chunk_crc32.bin").read_bytes()[width : 2 * width]
    (root / "genes" / "chunk_crc32.bin").write_bytes(bytes(rows))
    ours_sums["row_crc32"][1] = their_sums["row_crc32"][1]
    reseal(root, manifest)
    assert main(["verify", str(root)]) == 1
    assert "does not match the cell-major tiles of cells 4000:8000" in capsys.readouterr().err


@pytest.fixture
def small(tmp_path):
    adata = small_adata(n_cells=500, n_genes=70)
    root = tmp_path / "d"
    dc.write_deltacells(adata, root, gene_major=True, tile_size=128, progress=False)
    return root, adata


def test_write_with_gene_major(small):
    root, adata = small
    dataset = dc.open_dataset(root)
    got = dataset.genes(list(range(70)))
    assert (got != adata.X).nnz == 0
    dataset.verify()


@pytest.mark.parametrize(("key", "value", "match"), [
    ("n_blocks", 7, "n_blocks must be 1"),
    ("block_cells", 0, "block_cells"),
    ("block_cells", 70_000, "block_cells"),
    ("block_bytes", [], "block_bytes"),
    ("block_nnz", [1], "nonzeros"),
    ("format", "x", "gene_major is not"),
])  # fmt: skip
def test_bad_records(small, key, value, match):
    root, _ = small
    path = root / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["metadata"]["gene_major"][key] = value
    reseal(root, manifest)
    with pytest.raises(dc.FormatError, match=match):
        dc.open_dataset(root).genes(0)


def test_damaged_blocks(small):
    root, _ = small
    block = root / block_name(0)
    data = bytearray(block.read_bytes())
    block.write_bytes(bytes(data[:-10]))  # truncated: the last genes' frames are cut
    last = dc.open_dataset(root).gene_order()[-1]  # the source gene stored last
    shorter = r"block_000000\.dct: bytes .* read \(the object is shorter"
    with pytest.raises(dc.FormatError, match=shorter):
        dc.open_dataset(root).genes(int(last))
    with pytest.raises(dc.FormatError, match=r"block_000000\.dct"):
        dc.open_dataset(root).verify()
    data[200] ^= 0xFF  # damage inside the indptr or a frame
    block.write_bytes(bytes(data))
    with pytest.raises(dc.FormatError, match=r"block_000000\.dct"):
        dc.open_dataset(root).verify()


def test_no_companion_says_how_to_add_one(tmp_path, capsys):
    root = tmp_path / "d"
    dc.write_deltacells(small_adata(), root, progress=False)
    with pytest.raises(ValueError, match="deltacells add-gene-major"):
        dc.open_dataset(root).genes(0)
    assert main(["add-gene-major", "--quiet", str(root)]) == 0
    assert dc.open_dataset(root).gene_major().n_blocks == 1
    capsys.readouterr()
    assert main(["info", str(root)]) == 0
    assert "gene-major       1 blocks" in capsys.readouterr().out


moto_server = pytest.importorskip("moto.server")


def test_one_gene_from_s3_by_ranged_reads(liao, monkeypatch):
    import boto3
    from test_s3 import free_port

    root, X, names, record = liao
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        for key, value in {"AWS_ACCESS_KEY_ID": "t", "AWS_SECRET_ACCESS_KEY": "t",
                           "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
            monkeypatch.setenv(key, value)
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="genes")
        for path in root.rglob("*"):
            if path.is_file():
                client.upload_file(str(path), "genes", f"liao/{path.relative_to(root)}")
        options = {"client_kwargs": {"endpoint_url": endpoint}, "skip_instance_cache": True}
        dataset = dc.open_dataset("s3://genes/liao", storage_options=options)
        got = dataset.genes(["CD3E", "LYZ"])
        assert (got != X[:, [names.index("CD3E"), names.index("LYZ")]]).nnz == 0
        assert dataset.gene_major().bytes_read < sum(record["block_bytes"]) / 10
    finally:
        server.stop()


def test_ranged_reads_of_damaged_blocks_raise_only_format_errors(small):
    """Ranged reads cannot check the block's CRC (it covers the whole block); every other
    check runs on the pieces, so damage gives a FormatError, never a crash or a hang."""
    root, adata = small
    block = root / block_name(0)
    clean = block.read_bytes()
    rng = np.random.default_rng(11)
    outcomes = {"error": 0, "same": 0, "other": 0}
    for _ in range(150):
        data = bytearray(clean)
        at = int(rng.integers(0, len(data)))
        data[at] ^= 1 << int(rng.integers(0, 8))
        block.write_bytes(bytes(data))
        try:
            got = dc.open_dataset(root).genes(list(range(70)))
        except dc.FormatError:
            outcomes["error"] += 1
            continue
        outcomes["same" if (got != adata.X).nnz == 0 else "other"] += 1
    block.write_bytes(clean)
    assert outcomes["error"] > 50
    assert sum(outcomes.values()) == 150


def test_default_block_size_follows_the_nonzeros_per_cell(tmp_path, monkeypatch):
    import deltacells.spatial.genemajor as genemajor

    adata = small_adata(n_cells=3000, n_genes=100, seed=2)  # about 10 nonzeros per cell
    root = tmp_path / "d"
    dc.write_deltacells(adata, root, progress=False)
    assert add_gene_major(dc.open_dataset(root))["block_cells"] == 65_536
    monkeypatch.setattr(genemajor, "BLOCK_NNZ_BUDGET", 20_000)  # ~2,000 cells' nonzeros
    record = add_gene_major(dc.open_dataset(root))
    assert record["block_cells"] == 1024 and record["n_blocks"] == 3
    assert (dc.open_dataset(root).genes(list(range(100))) != adata.X).nnz == 0


def test_a_gene_position_must_be_an_integer(small):
    root, _ = small
    dataset = dc.open_dataset(root)
    for bad in (3.7, True, [1.0]):
        with pytest.raises(TypeError, match="names or integer positions"):
            dataset.genes(bad)
    assert dataset.gene(np.int64(3)).shape == (500, 1)
