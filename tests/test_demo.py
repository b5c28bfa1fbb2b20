"""The README's first command: the demo runs on real files of any size and without ../shared."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import DATA_DIR

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import demo


def run_demo(monkeypatch, capsys, *argv: str) -> str:
    monkeypatch.setattr(sys, "argv", ["demo.py", *argv])
    demo.main()
    return capsys.readouterr().out


@pytest.mark.parametrize("name", ["chung2017_smartseq2", "visium_multisample"])
def test_demo_on_small_real_files(monkeypatch, capsys, name):
    out = run_demo(monkeypatch, capsys, str(DATA_DIR / f"{name}.h5ad"))
    assert "equal to the source: yes" in out and "verify" in out and out.rstrip().endswith("OK")
    assert "the next in" in out and "every cell once in each: yes" in out  # two epochs


def test_demo_without_shared_data_generates_its_own(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(demo, "DEFAULT_DATA", tmp_path / "missing.h5ad")
    out = run_demo(monkeypatch, capsys)
    assert "generating 20,000 cells of counts instead" in out
    assert "generated.h5ad: 20,000 cells" in out and out.rstrip().endswith("OK")


def test_demo_names_a_missing_file(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        run_demo(monkeypatch, capsys, str(tmp_path / "nope.h5ad"))
