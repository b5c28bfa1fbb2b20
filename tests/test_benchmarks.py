"""Small runs of the atlas-scale benchmarks (CI runs these; the full runs are in benchmarks/).

They check that the scripts run end to end and that what they report holds (open reads the
manifest alone, conversions are byte-identical, an epoch reads every cell), not timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

# The scripts run from the first stack's environment (tools/dev.sh bench).
pytestmark = pytest.mark.first_stack


def run(script: str, *args: str) -> None:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, cwd=BENCH, check=False, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_bench_scale_quick(tmp_path):
    # A base of 5 tiles (20,480 cells, 1x and 10x): the script end to end in 20 s against
    # 33 s with the full base here (most of what is left is its seven fresh processes).
    run("bench_scale.py", "--quick", "--base-tiles", "5", "--workdir", str(tmp_path / "work"),
        "--out", str(tmp_path))  # fmt: skip
    results = json.loads((tmp_path / "scale_quick.json").read_text())
    sizes = results["sizes"]
    assert results["base_cells"] == 20_480
    assert [s["n_cells"] for s in sizes] == [20_480, 204_800]
    for size in sizes:
        assert size["open"]["reads"] == 1 and size["open"]["bytes"] == size["manifest_bytes"]
        assert size["loader"]["batches_per_epoch"] == size["n_cells"] // 4096
        fresh = size["open_fresh"]
        assert fresh["names"]["obs_names_type"] == "Index"
        assert fresh["positions"]["obs_names_type"] == "RangeIndex"
        assert size["names_limit"]["n_names"] == size["n_cells"]  # the 10M goal's limit
    assert results["targets"]["open_reads_only_the_manifest"]


def test_bench_names_quick(tmp_path):
    # 200,000 barcoded cells, one fresh process per measure: every path names every cell, and
    # the same first cell.
    run("bench_names.py", "--quick", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path))
    results = json.loads((tmp_path / "names_quick.json").read_text())
    runs = results["runs"]
    assert set(runs) == {"deltacells", "pyarrow_to_pandas", "h5ad_backed"}
    assert {run["n_names"] for run in runs.values()} == {200_000}
    assert len({run["first"] for run in runs.values()}) == 1
    assert len(runs["deltacells"]["first"]) == 18 and runs["deltacells"]["first"].endswith("-1")


def test_bench_convert_small(tmp_path):
    pytest.importorskip("distributed")
    out = tmp_path / "convert.json"
    # Two files only: each file count is three fresh processes and two clusters (~20 s here).
    run("bench_convert.py", "--cells-per-file", "3000", "--files", "2", "--out", str(out),
        "--no-plot")  # fmt: skip
    runs = json.loads(out.read_text())["runs"]
    assert [r["files"] for r in runs] == [2]
    assert all(r["byte_identical"] for r in runs)
    assert all(len(r["dask_2_workers"]["worker_peak_rss_mb"]) == 2 for r in runs)


def test_bench_remote_small(tmp_path):
    pytest.importorskip("moto.server")
    pytest.importorskip("obstore")
    out = tmp_path / "remote.json"
    run("bench_remote.py", "--cells", "9000", "--random-reads", "1", "--no-peers", "--epochs",
        "2", "--out", str(out), "--no-plot")  # fmt: skip
    results = json.loads(out.read_text())
    for name in ("loader_defaults", "loader_defaults_obstore", "loader_one_tile_at_a_time"):
        assert results["runs"][name]["cells"] == 9000
        assert results["runs"][name]["bytes"] >= results["dataset"]["tile_bytes"]
        each = results["runs"][name]["epochs_cells_per_s"]
        assert len(each) == 2 and results["runs"][name]["cells_per_s"] == min(each)
    assert results["runs"]["random_4096_ranged_chunks_512_chunks"]["cells"] == 4096


def test_bench_scanpy_small(tmp_path):
    """The chain runs in each way of reading and agrees with memory (not timings)."""
    pytest.importorskip("scanpy")
    pytest.importorskip("dask_ml")
    out = tmp_path / "scanpy.json"
    run("bench_scanpy.py", "--cells", "3000", "--workdir", str(tmp_path / "work"), "--out",
        str(out), "--docs-dir", str(tmp_path / "docs"))  # fmt: skip
    results = json.loads(out.read_text())
    assert results["same_as_memory"] == {"default": True, "dask": True}
    for mode in ("memory", "default", "dask"):
        assert results["modes"][mode]["failed"] is None
        assert set(results["modes"][mode]["steps"]) >= {"read", "pca"}
    assert (tmp_path / "docs" / "bench_scanpy.md").exists()


def _goals_module():
    sys.path.insert(0, str(BENCH))
    try:
        import goals
    finally:
        sys.path.remove(str(BENCH))
    return goals


def test_goals_table_follows_the_committed_runs(tmp_path):
    """benchmarks/goals.py on the committed JSON: every figure comes from those files and
    a goal is met only on its side of the target."""
    run("goals.py", "--out", str(tmp_path / "goals.json"), "--docs", str(tmp_path))
    rows = json.loads((tmp_path / "goals.json").read_text())["goals"]
    read = json.loads((BENCH / "results" / "read.json").read_text())
    loader = json.loads((BENCH / "results" / "loader.json").read_text())
    by_goal = {r["goal"]: r for r in rows}
    to_memory = by_goal["to_memory(), canonical CSR in source order: >= 0.8x zstd alone"]
    assert to_memory["measured"] == read["zstd_floor"]["deltacells"]["to_memory_vs_zstd"]
    steady = by_goal["Loader, later epochs: >= 3x annbatch"]
    assert steady["measured"] == loader["vs_annbatch"]["deltacells"]["paired_steady_speed_ratio"]
    assert steady["limit"] == loader["sort_floor"]["zstd_sort_vs_annbatch_steady"]
    for r in rows:
        side = (r["measured"] >= r["target"] if r["higher_is_better"]
                else r["measured"] <= r["target"])  # fmt: skip
        assert r["met"] == (side and (r["extra"] is None or r["extra"] <= r["extra_target"]))
    table = (tmp_path / "bench_goals.md").read_text()
    assert table.count("\n") == len(rows) + 2 and "read.json (" in table


def test_goals_never_round_a_miss_into_a_pass():
    goals = _goals_module()
    row = goals._goal("g", 3.0, 2.9990, "x annbatch", "run", limit=2.93, limit_what="w")
    assert row["met"] is False and row["limit_meets_goal"] is False
    assert "2.999 x annbatch" in goals.table([row]) and "missed" in goals.table([row])
    memory = goals._goal("m", 2.0, 0.08, "s", "run", higher_is_better=False, extra=1100.0,
                         extra_target=1024.0, extra_unit="MB peak")  # fmt: skip
    assert memory["met"] is False  # in time, over the memory bound
