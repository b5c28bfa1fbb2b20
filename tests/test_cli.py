"""The deltacells command: convert, info, verify and their exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
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
    assert info["cell_order"] is None  # stored in the input's order
    assert main(["info", str(out)]) == 0
    shown = capsys.readouterr().out
    assert "bytes" in shown and "cells stored" not in shown
    assert main(["verify", str(out), "--quiet"]) == 0


def test_a_reader_that_stops_early_ends_info_quietly(tmp_path):
    # `deltacells info ... | head`: the pipe closes before the output is written. The command
    # ends with 128 + SIGPIPE and nothing on stderr, not an error line.
    out = tmp_path / "visium"
    assert main(["convert", str(DATA_DIR / "visium_multisample.h5ad"), str(out),
                 "--quiet"]) == 0  # fmt: skip
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before anything is written
    try:
        done = subprocess.run([sys.executable, "-m", "deltacells.cli", "info", str(out)],
                              stdout=write_end, stderr=subprocess.PIPE, text=True,
                              check=False)  # fmt: skip
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == 141


def test_messages_count_tiles_in_words(tmp_path, capsys):
    """One tile is "1 tile", more are "N tiles"."""
    out = tmp_path / "visium"
    for size, words in (("5000", "1 tile,"), ("500", "5 tiles,")):
        assert main(["convert", str(DATA_DIR / "visium_multisample.h5ad"), str(out),
                     "--tile-size", size, "--overwrite"]) == 0  # fmt: skip
        assert f"in {words}" in capsys.readouterr().out
        assert main(["verify", str(out)]) == 0
        assert f"OK ({words}" in capsys.readouterr().out


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


def test_convert_says_reads_give_the_shuffled_order_and_the_way_back(tmp_path, capsys):
    out = tmp_path / "d"
    assert main(["convert", str(DATA_DIR / "visium_multisample.h5ad"), str(out),
                 "--shuffle"]) == 0  # fmt: skip
    shown = capsys.readouterr().out
    assert "cells stored shuffled: reads give that order" in shown
    assert "row_order='source'" in shown
    assert main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cell_order"] == "shuffled"


def test_help_documents_every_option(capsys):
    import pytest

    from deltacells.cli import build_parser

    parser = build_parser()
    for command in ("convert", "info", "verify"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "examples:" in text and "exit status:" in text
        sub = parser._subparsers._group_actions[0].choices[command]
        for action in sub._actions:
            assert action.help, f"{command} {action.option_strings or action.dest} has no help"
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = capsys.readouterr().out
    assert "(default: 4096, fewer" in text and "(default: 0)" in text and "(default: same)" in text
    assert "``" not in text  # no raw reStructuredText
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out


def test_errors_speak_in_flags(tmp_path, capsys):
    source = str(DATA_DIR / "visium_multisample.h5ad")
    assert main(["convert", source, str(tmp_path / "d"), "--quiet"]) == 0
    assert main(["convert", source, str(tmp_path / "d"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "pass --overwrite" in err and "overwrite=True" not in err
    import anndata as ad

    other = ad.read_h5ad(source)[:, :100].copy()
    other.write_h5ad(tmp_path / "other.h5ad")
    assert main(["convert", source, str(tmp_path / "other.h5ad"), str(tmp_path / "atlas"),
                 "--quiet"]) == 1  # fmt: skip
    err = capsys.readouterr().err
    assert "--join inner or --join outer" in err and "join=" not in err


def test_wrong_kinds_of_path_are_named(tmp_path, capsys):
    assert main(["info", str(DATA_DIR / "visium_multisample.h5ad")]) == 1
    assert "an .h5ad (HDF5) file, not a deltacells dataset" in capsys.readouterr().err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    assert main(["info", str(tmp_path / "notes")]) == 1
    err = capsys.readouterr().err
    assert "not a deltacells dataset (no manifest.json, no tiles/)" in err
    assert "incomplete" not in err


def test_info_lists_stored_parts_and_verify_json(tmp_path, capsys):
    from test_whole_anndata import processed

    processed(seed=30).write_h5ad(tmp_path / "in.h5ad")
    assert main(["convert", str(tmp_path / "in.h5ad"), str(tmp_path / "d"), "--quiet"]) == 0
    assert main(["info", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert "layers['counts']: counts, layers/counts" in out and "obsm: anndata.zarr" in out
    assert main(["verify", str(tmp_path / "d"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["error"] is None
    (tmp_path / "d" / "tiles" / "tile_000000.dct").write_bytes(b"broken")
    assert main(["verify", str(tmp_path / "d"), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and "tile_000000.dct" in report["error"]


def test_single_input_without_genes(tmp_path, capsys):
    import anndata as ad
    import scipy.sparse as sp

    ad.AnnData(X=sp.csr_matrix((5, 0))).write_h5ad(tmp_path / "empty.h5ad")
    assert main(["convert", str(tmp_path / "empty.h5ad"), str(tmp_path / "d"), "--quiet"]) == 1
    assert "empty.h5ad: the input has no genes" in capsys.readouterr().err


def test_progress_bars_end_complete(tmp_path, capsys):
    source = str(DATA_DIR / "visium_multisample.h5ad")
    assert main(["convert", source, str(tmp_path / "d"), "--tile-size", "1000"]) == 0
    lines = capsys.readouterr().err.replace("\r", "\n").splitlines()
    for desc in ("checking counts", "encoding tiles"):
        last = [line for line in lines if line.startswith(desc)][-1]
        assert "100%" in last and "3/3" in last, last


VISIUM = DATA_DIR / "visium_multisample.h5ad"

#: Bad convert invocations: the flags, what the one-line error must say, and nothing left.
BAD_CONVERTS = [
    (["--level", "99"], "--level 99 is outside zstd's"),
    (["--layer", "counts", "--raw"], "--layer counts and --raw both say where the counts are"),
    (["--no-obs", "--obs-exclude", "in_tissue"], "--no-obs stores no obs, so --obs-exclude"),
    (["--grid-tile-size", "5"], "--grid-tile-size and --origin shape the spatial order, which "
                                "needs --spatial-key or --shapes"),
    (["--spatial-key", "spatial", "--shapes", "x.parquet"],
     "--spatial-key and --shapes both give the cells' positions"),
    (["--shapes", "missing.parquet"], "shapes file missing.parquet: not found"),
    (["--threads", "-3"], "leaves no thread on this machine's"),
    (["--threads", "0"], "--threads 0 is not allowed; leave --threads out for the default"),
    (["--n-chunks", "100000"], "--n-chunks 100000 is more than the 4,096 cells of a tile"),
    (["--spatial-key", "spatial", "--grid-tile-size", "0"], "--grid-tile-size must be a "
                                                            "positive number"),
    (["--spatial-key", "nothere"], "has no obsm['nothere'] to order cells by"),
    (["--obs-exclude", "In_tissue"], "--obs-exclude names In_tissue but no input's obs has that "
                                     "column; check the spelling"),
    (["--shuffle", "--seed", "-1"], "--seed must be >= 0, not -1"),
    (["--workers", "0"], "--workers must be >= 1, not 0"),
]  # fmt: skip


def _usable_cpus() -> int:
    from deltacells.codec.threads import usable_cpu_count

    return usable_cpu_count()


@pytest.mark.parametrize(("flags", "message"), BAD_CONVERTS)
def test_bad_flags_are_named_and_leave_nothing(tmp_path, capsys, flags, message, monkeypatch):
    if flags == ["--threads", "-3"] and _usable_cpus() > 2:
        flags = ["--threads", str(-(_usable_cpus() + 1))]
    if flags[0] == "--shapes":
        pytest.importorskip("geopandas")
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "out.dc"
    assert main(["convert", str(VISIUM), str(target), "--quiet", *flags]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert not target.exists()


def test_bad_targets_are_named(tmp_path, capsys):
    cases = [(tmp_path / "out.h5ad", "a deltacells dataset is a folder, and this name is an "
              "AnnData file's; pick another (e.g. out.dc)")]  # fmt: skip
    (tmp_path / "afile").write_text("mine")
    cases += [(tmp_path / "afile", "a file is there; a dataset is a folder"),
              (tmp_path / "afile" / "sub", "is a file, not a folder")]  # fmt: skip
    for target, message in cases:
        assert main(["convert", str(VISIUM), str(target), "--quiet"]) == 1
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out.h5ad").exists() and (tmp_path / "afile").read_text() == "mine"


def test_a_failed_write_into_an_empty_folder_leaves_it_empty(tmp_path):
    import anndata as ad

    bad = ad.read_h5ad(VISIUM)
    bad.X = bad.X.astype(np.float32)
    bad.X[3, 5] = 0.5  # found while checking counts, after the target was prepared
    (tmp_path / "empty").mkdir()
    with pytest.raises(dc.CountError):
        dc.write_deltacells(bad, tmp_path / "empty", progress=False)
    assert list((tmp_path / "empty").iterdir()) == []


def test_version_and_info_without_the_names_column(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("deltacells ")
    dc.write_deltacells(VISIUM, tmp_path / "d", progress=False)
    assert main(["info", "--json", str(tmp_path / "d")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "_index" not in info["obs_columns"] and "in_tissue" in info["obs_columns"]


def _bad_sources(tmp_path: Path) -> list[tuple[list[str], str]]:
    """Sources a user may give by mistake: (convert arguments, what the error must say)."""
    (tmp_path / "text.h5ad").write_text("not hdf5")
    (tmp_path / "plain.zarr").mkdir()
    dc.write_deltacells(VISIUM, tmp_path / "made.dc", progress=False)
    return [
        ([str(tmp_path / "text.h5ad")], "text.h5ad: not an HDF5 file, so not an .h5ad"),
        ([str(tmp_path / "plain.zarr")], "plain.zarr: not an AnnData .zarr store"),
        ([str(tmp_path / "made.dc")], "made.dc: a deltacells dataset, not an AnnData input: "
                                      "the source comes first, then the target"),
        ([str(tmp_path / "nothing.h5ad")], "nothing.h5ad: no such file"),
    ]  # fmt: skip


def test_bad_sources_are_named_and_leave_nothing(tmp_path, capsys):
    for sources, message in _bad_sources(tmp_path):
        target = tmp_path / "out.dc"
        assert main(["convert", *sources, str(target), "--quiet"]) == 1, sources
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err
        assert not target.exists()


def test_an_unreachable_scheduler_is_named_with_the_way_forward(tmp_path, capsys, monkeypatch):
    pytest.importorskip("distributed")
    import deltacells.cli as cli

    monkeypatch.setattr(cli, "SCHEDULER_TIMEOUT_S", 1.0)
    target = tmp_path / "out.dc"
    assert main(["convert", str(VISIUM), str(target), "--scheduler", "tcp://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert "--scheduler tcp://127.0.0.1:9: no dask scheduler answered within 1 s" in err
    assert "--workers N" in err and not target.exists()


def test_progress_in_a_log_is_lines_not_carriage_returns(tmp_path, capsys):
    assert main(["convert", str(VISIUM), str(tmp_path / "d")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "encoding tiles: 100% 1/1 tiles in" in err


def test_gene_major_blocks_adapt_to_many_large_counts(tmp_path, capsys):
    """A STARmap-like panel: 4,000 cells x 28 genes with 1,608 counts above 65535."""
    rng = np.random.default_rng(0)
    X = rng.poisson(50, (4000, 28)).astype(np.int32)
    X.flat[rng.choice(X.size, 1608, replace=False)] = rng.integers(65536, 300000, 1608)
    import anndata as ad
    import scipy.sparse as sp

    ad.AnnData(X=sp.csr_matrix(X)).write_h5ad(tmp_path / "panel.h5ad")
    root = tmp_path / "panel.dc"
    assert main(["convert", str(tmp_path / "panel.h5ad"), str(root), "--quiet"]) == 0
    assert main(["add-gene-major", str(root), "--block-cells", "4096", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "--block-cells 4096: cells 0..4,000 hold 1,608 counts above 65535" in err
    assert main(["add-gene-major", str(root), "--quiet"]) == 0
    genes = dc.open_dataset(root).genes(list(range(28)), values_dtype=np.int32)
    assert (sp.csr_matrix(genes) != sp.csr_matrix(X)).nnz == 0
