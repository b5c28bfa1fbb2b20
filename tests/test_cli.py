"""The deltacells command: convert, info, verify and their exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from conftest import DATA_DIR

import deltacells as dc
from deltacells.cli import main


def test_convert_info_verify(tmp_path, capsys):
    out = tmp_path / "visium"
    assert main(["convert", str(DATA_DIR / "visium_multisample.h5ad"), str(out),
                 "--tile-size", "500", "--quiet"]) == 0  # fmt: skip
    assert dc.open_dataset(out).manifest.n_cells == 2327
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["n_cells"] == 2327 and info["n_tiles"] == 5
    assert info["obs_columns"]["list_ID"] == "category"
    assert info["obs_columns"]["in_tissue"] == "numeric"
    assert main(["info", str(out)]) == 0
    assert "bytes" in capsys.readouterr().out
    assert main(["verify", str(out), "--quiet"]) == 0


def test_verify_fails_on_a_corrupted_tile(tmp_path, capsys):
    out = tmp_path / "d"
    main(["convert", str(DATA_DIR / "visium_multisample.h5ad"), str(out), "--tile-size", "500",
          "--quiet"])  # fmt: skip
    tile = out / "tiles" / "tile_000002.dct"
    data = bytearray(tile.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tile.write_bytes(bytes(data))
    assert main(["verify", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "tile_000002.dct" in err and "CRC-32 mismatch" in err


def test_verify_fails_on_a_wrong_obs_shard(tmp_path, capsys):
    out = tmp_path / "d"
    main(["convert", str(DATA_DIR / "visium_multisample.h5ad"), str(out), "--quiet"])
    shard = out / "obs" / "obs_0000.parquet"
    shard.write_bytes(shard.read_bytes() + b"x")
    assert main(["verify", str(out), "--quiet"]) == 1
    assert "obs_0000.parquet" in capsys.readouterr().err


def test_errors_exit_1_with_a_message(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nothing")]) == 1
    assert "no deltacells dataset" in capsys.readouterr().err
    (tmp_path / "partial" / "tiles").mkdir(parents=True)
    (tmp_path / "partial" / "tiles" / "tile_000000.dct").write_bytes(b"x")
    assert main(["verify", str(tmp_path / "partial")]) == 1
    assert "incomplete dataset" in capsys.readouterr().err


def test_console_script_runs(tmp_path):
    source = str(DATA_DIR / "visium_multisample.h5ad")
    command = [sys.executable, "-m", "deltacells.cli", "convert", source, str(tmp_path / "d"),
               "--shuffle", "--seed", "3", "--quiet"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    order = np.load(tmp_path / "d" / "cell_order.npy")
    assert len(order) == 2327
