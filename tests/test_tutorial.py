"""docs/tutorial.md runs as written: its python blocks, in order, against a moto S3 server and
the real files in ../shared/data."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from test_s3 import free_port

moto_server = pytest.importorskip("moto.server", reason="moto[server] is a test dependency")
pytest.importorskip("s3fs", reason="s3fs is a test dependency")
pytest.importorskip("scanpy")
pytest.importorskip("dask")

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
TUTORIAL = ROOT / "docs" / "tutorial.md"


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", markdown, flags=re.S | re.M)


@pytest.mark.skipif(not (SHARED / "data" / "liao2020_balf.h5ad").exists(),
                    reason="needs ../shared/data")  # fmt: skip
def test_tutorial_runs(tmp_path, monkeypatch, capsys):
    import boto3

    blocks = python_blocks(TUTORIAL.read_text())
    assert len(blocks) == 4, "the tutorial's four steps"
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    try:
        endpoint = f"http://127.0.0.1:{port}"
        for key, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                           "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_ENDPOINT_URL": endpoint}.items():  # fmt: skip
            monkeypatch.setenv(key, value)
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="tutorial-atlas")
        # The page's paths are relative to the project root, with ../shared beside it.
        work = tmp_path / "project"
        work.mkdir()
        os.symlink(SHARED, tmp_path / "shared")
        monkeypatch.chdir(work)
        namespace: dict = {"__name__": "tutorial"}
        for block in blocks:
            exec(compile(block, str(TUTORIAL), "exec"), namespace)
    finally:
        server.stop()
    out = capsys.readouterr().out
    assert "11269 cells" in out  # 10,706 + 563
    assert "cells seen in 2 epochs: 22538" in out
    assert namespace["adata"].n_vars == namespace["info"]["n_genes"] == 17542
