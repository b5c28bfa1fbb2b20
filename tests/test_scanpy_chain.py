"""scanpy's usual chain on the default read, observed on each stack: the docs' table
(``docs/_static/scanpy_lazy_x_<stack>.md``) is what this test sees, not written by hand.

Each step runs on a fresh ``read_deltacells(path)`` of a small count matrix and its outcome is
recorded:
"works", "advice" (the lazy X's TypeError naming ``to_memory()`` and ``dask=True``) or the
error scanpy raised. A table that differs from the committed one is written anew and the test
fails, so the docs follow scanpy's and anndata's releases.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from test_writer import small_adata

import deltacells as dc

sc = pytest.importorskip("scanpy")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "_static"


STEPS = {
    "pp.calculate_qc_metrics": lambda a: sc.pp.calculate_qc_metrics(a, percent_top=(10,),
                                                                     inplace=True),
    "pp.filter_cells(min_counts=)": lambda a: sc.pp.filter_cells(a, min_counts=10),
    "pp.filter_cells(min_genes=)": lambda a: sc.pp.filter_cells(a, min_genes=5),
    "pp.filter_genes(min_cells=)": lambda a: sc.pp.filter_genes(a, min_cells=3),
    "pp.normalize_total": lambda a: sc.pp.normalize_total(a, target_sum=1e4),
    "pp.log1p": lambda a: sc.pp.log1p(a),
    "pp.highly_variable_genes": lambda a: sc.pp.highly_variable_genes(a, n_top_genes=20),
    "pp.pca": lambda a: sc.pp.pca(a, n_comps=5),
    "pp.scale": lambda a: sc.pp.scale(a),
    "get.obs_df (a gene)": lambda a: sc.get.obs_df(a, keys=[a.var_names[0]]),
}  # fmt: skip


def _outcome(step) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step()
    except (TypeError, AttributeError) as err:
        if "read lazily" in str(err) and "dask=True" in str(err):
            return "advice"
        return f"error ({type(err).__name__})"
    except Exception as err:
        return f"error ({type(err).__name__})"
    return "works"


def _stack() -> str:
    return f"py{sys.version_info.major}{sys.version_info.minor}"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A small count matrix as a dataset of several tiles."""
    path = tmp_path_factory.mktemp("scanpy-chain") / "d"
    source = small_adata(n_cells=300, n_genes=120)
    source.var = source.var[[]]
    dc.write_deltacells(source, path, tile_size=64, progress=False)
    return path


def test_the_docs_table_is_what_scanpy_does_on_each_stack(root):
    rows = []
    for name, step in STEPS.items():
        lazy = dc.read_deltacells(root, elements=False)
        rows.append((name, _outcome(lambda s=step, a=lazy: s(a))))
    # Sanity: the same steps work in memory (what the advice points to).
    memory = dc.read_deltacells(root, elements=False).to_memory()
    for name, step in STEPS.items():
        copy = memory.copy()
        assert _outcome(lambda s=step, a=copy: s(a)) == "works", name
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("scanpy", "anndata", "pandas"))
    lines = [f"On Python {sys.version_info.major}.{sys.version_info.minor} with {versions}:", "",
             "| scanpy step | on `read_deltacells(path)` |", "|---|---|"]  # fmt: skip
    lines += [f"| `{name}` | {outcome} |" for name, outcome in rows]
    text = "\n".join(lines) + "\n"
    path = DOCS / f"scanpy_lazy_x_{_stack()}.md"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
        pytest.fail(f"{path} was out of date and is written anew: commit it")
    assert all(outcome for _, outcome in rows)


def test_dask_and_memory_agree_on_the_chain(root):
    """The way the advice points to: the same chain on ``dask=True`` equals the in-memory one."""
    results = []
    for adata in (dc.read_deltacells(root, elements=False, dask=True),
                  dc.read_deltacells(root, elements=False).to_memory()):  # fmt: skip
        sc.pp.filter_cells(adata, min_counts=10)
        sc.pp.normalize_total(adata, target_sum=1e4)
        sc.pp.log1p(adata)
        X = adata.X.compute() if hasattr(adata.X, "compute") else adata.X
        results.append(sp.csr_matrix(X).toarray())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-5)
