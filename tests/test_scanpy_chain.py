"""scanpy's usual chain on the default read, checked against the same chain in memory, on
each stack; the docs' table (``docs/_static/scanpy_lazy_x_<stack>.md``) is what this test
sees, not written by hand.

The lazy X answers scanpy through its dask array over tiles (:mod:`deltacells.read.outofcore`):
statistics are reduced tile by tile, in-place filters and transformations leave X a lazy dask
array. Each step records its outcome: "works" (results equal to the in-memory chain, X still
out of core afterwards), "advice" (our TypeError naming ``to_memory()``) or, for the few
functions scanpy has no dask version of, scanpy's own error. A table that differs from the
committed one is written anew and the test fails, so the docs follow scanpy's releases; a
patch release that changes no outcome leaves it as committed (its header keeps the versions
it was made with), so that a new scanpy on PyPI does not turn CI red for nothing.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
from test_writer import small_adata

import deltacells as dc

sc = pytest.importorskip("scanpy")
da = pytest.importorskip("dask.array")
pytest.importorskip("skmisc")  # seurat_v3
pytest.importorskip("dask_ml")  # scanpy's pca of a dense dask X
pytest.importorskip("leidenalg")

DOCS = Path(__file__).resolve().parent.parent / "docs" / "_static"

#: Steps that must work on the default read on every stack.
REQUIRED = (
    "pp.calculate_qc_metrics", "pp.filter_cells(min_genes=)", "pp.filter_genes(min_cells=)",
    "pp.normalize_total", "pp.log1p", "pp.highly_variable_genes(cell_ranger)",
    "pp.highly_variable_genes(seurat)", "tl.rank_genes_groups",
    "subset to the highly variable genes", "pp.scale", "pp.pca", "pp.neighbors", "tl.umap",
    "tl.leiden", "pl.umap (coloured by a gene)",
)  # fmt: skip

#: The way forward the docs give where scanpy has no dask version of a step.
WAY_FORWARD = {
    "get.obs_df (a gene)": "`sc.get.obs_df(adata[:, genes].to_memory(), genes)`",
    "pp.regress_out": "`adata = adata.to_memory()` once subset to the highly variable genes",
    "pp.highly_variable_genes(seurat_v3, layer='counts')": "run it before the in-place filters, "
    "while the counts are the lazy X (checked below)",
    "tl.rank_genes_groups(method='wilcoxon')": "`method='t-test'` runs out of core; for "
    "Wilcoxon's test, `sc.tl.rank_genes_groups(adata.to_memory(), ...)`",
    "tl.score_genes": "`adata.X = adata.X.compute()` (X in memory) first; on a fresh read's "
    "lazy X it runs tile by tile",
}


def _steps(hvg_view):
    """The chain, in order: (name, function of the AnnData). Later steps run on the
    highly variable genes, as scanpy's tutorials do."""
    return [
        ("pp.calculate_qc_metrics", lambda a: sc.pp.calculate_qc_metrics(
            a, percent_top=(10,), inplace=True)),
        ("pp.filter_cells(min_genes=)", lambda a: sc.pp.filter_cells(a, min_genes=5)),
        ("pp.filter_genes(min_cells=)", lambda a: sc.pp.filter_genes(a, min_cells=3)),
        ("pp.highly_variable_genes(seurat_v3, layer='counts')", lambda a: a.var.__setitem__(
            "hv_v3", sc.pp.highly_variable_genes(a, n_top_genes=30, flavor="seurat_v3",
                                                 layer="counts", inplace=False)[
                "highly_variable"].to_numpy())),
        ("pp.normalize_total", lambda a: sc.pp.normalize_total(a, target_sum=1e4)),
        ("pp.log1p", lambda a: sc.pp.log1p(a)),
        ("pp.highly_variable_genes(cell_ranger)", lambda a: a.var.__setitem__(
            "hv_cr", sc.pp.highly_variable_genes(a, n_top_genes=30, flavor="cell_ranger",
                                                 inplace=False)["highly_variable"].to_numpy())),
        ("pp.highly_variable_genes(seurat)", lambda a: sc.pp.highly_variable_genes(
            a, n_top_genes=30)),
        ("tl.rank_genes_groups", lambda a: sc.tl.rank_genes_groups(a, "cell_type")),
        ("tl.rank_genes_groups(method='wilcoxon')", lambda a: sc.tl.rank_genes_groups(
            a, "cell_type", method="wilcoxon", key_added="wilcoxon")),
        ("tl.score_genes", lambda a: sc.tl.score_genes(a, list(a.var_names[:5]),
                                                       random_state=0)),
        ("get.obs_df (a gene)", lambda a: a.obs.__setitem__(
            "gene0", sc.get.obs_df(a, keys=[a.var_names[0]])[a.var_names[0]].to_numpy())),
        ("subset to the highly variable genes", hvg_view),
        ("pp.regress_out", lambda a: sc.pp.regress_out(a, ["total_counts"])),
        ("pp.scale", lambda a: sc.pp.scale(a, max_value=10)),
        ("pp.pca", lambda a: sc.pp.pca(a, n_comps=5, svd_solver="auto")),
        ("pp.neighbors", lambda a: sc.pp.neighbors(a, n_neighbors=10, use_rep="X_pca")),
        ("tl.umap", lambda a: sc.tl.umap(a, random_state=0)),
        ("tl.leiden", lambda a: sc.tl.leiden(a, flavor="igraph", n_iterations=2,
                                             random_state=0)),
        ("pl.umap (coloured by a gene)", lambda a: sc.pl.umap(a, color=a.var_names[0],
                                                              show=False)),
    ]  # fmt: skip


def _outcome(step, adata) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(adata)
    except (TypeError, AttributeError) as err:
        if "read lazily" in str(err) and "to_memory()" in str(err):
            return "advice"
        return f"error ({type(err).__name__})"
    except Exception as err:
        return f"error ({type(err).__name__})"
    return "works"


def _run_chain(adata):
    """Run the chain on ``adata``; return (outcomes, X type after each step, final AnnData)."""
    box = {"adata": adata}

    def hvg_subset(a):
        box["adata"] = a[:, a.var["highly_variable"].to_numpy()].copy()

    outcomes, kinds = [], []
    for name, step in _steps(hvg_subset):
        outcome = _outcome(step, box["adata"])
        outcomes.append((name, outcome))
        kinds.append(type(box["adata"].X))
    return outcomes, kinds, box["adata"]


def _stack() -> str:
    return f"py{sys.version_info.major}{sys.version_info.minor}"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A small count matrix with its counts also as a layer, in several tiles."""
    path = tmp_path_factory.mktemp("scanpy-chain") / "d"
    source = small_adata(n_cells=400, n_genes=150)
    source.var = source.var[[]]
    source.layers["counts"] = source.X.copy()
    dc.write_deltacells(source, path, tile_size=64, progress=False)
    return path


def _dense(x):
    x = x.compute() if isinstance(x, da.Array) else x
    return x.toarray() if sp.issparse(x) else np.asarray(x)


@pytest.fixture(scope="module")
def chains(root):
    import matplotlib

    matplotlib.use("Agg")
    memory = _run_chain(dc.read_deltacells(root, elements=False).to_memory())
    lazy = _run_chain(dc.read_deltacells(root, elements=False))
    dask = _run_chain(dc.read_deltacells(root, elements=False, dask=True))
    return memory, lazy, dask


def test_every_step_works_in_memory(chains):
    (outcomes, _, _), _, _ = chains
    assert [o for o in outcomes if o[1] != "works"] == []


def test_the_default_read_runs_the_chain_out_of_core(chains):
    """Every step works on the default read except where scanpy has no dask version (the
    step fails on ``dask=True`` too), and X is never a whole matrix in memory: the lazy X
    first, then lazy dask arrays."""
    _, (outcomes, kinds, _), (dask_outcomes, _, _) = chains
    failed = {name for name, outcome in outcomes if outcome != "works"}
    assert failed.isdisjoint(REQUIRED)
    assert failed <= {name for name, outcome in dask_outcomes if outcome != "works"}
    lazy_kinds = (dc.DeltacellsCSRDataset, da.Array)
    assert all(issubclass(kind, lazy_kinds) for kind in kinds), kinds


def test_the_default_read_gives_the_in_memory_results(chains):
    (_, _, memory), (outcomes, _, lazy), _ = chains
    worked = {name for name, outcome in outcomes if outcome == "works"}
    # The final AnnData: highly variable genes, regressed out in memory only.
    assert list(lazy.obs_names) == list(memory.obs_names)
    assert list(lazy.var_names) == list(memory.var_names)
    for column in ("n_genes", "total_counts", "n_genes_by_counts", "pct_counts_in_top_10_genes"):
        np.testing.assert_allclose(lazy.obs[column].astype(float),
                                   memory.obs[column].astype(float), rtol=1e-5)  # fmt: skip
    for column in ("n_cells", "means", "dispersions", "dispersions_norm", "mean_counts"):
        np.testing.assert_allclose(lazy.var[column].astype(float),
                                   memory.var[column].astype(float), rtol=1e-4)  # fmt: skip
    for column in ("highly_variable", "hv_cr") + (
        ("hv_v3",) if "pp.highly_variable_genes(seurat_v3, layer='counts')" in worked else ()
    ):
        assert (lazy.var[column].to_numpy() == memory.var[column].to_numpy()).all(), column
    for key in ("names", "scores"):
        got, want = lazy.uns["rank_genes_groups"][key], memory.uns["rank_genes_groups"][key]
        for group in want.dtype.names:
            if key == "names":
                assert list(got[group]) == list(want[group])
            else:
                np.testing.assert_allclose(got[group], want[group], rtol=1e-4, atol=1e-5)


def test_the_chain_up_to_scale_equals_memory(root):
    """Without the step scanpy cannot do on dask, scale and pca on the default read equal
    the in-memory ones (pca up to each component's sign)."""
    results = []
    for adata in (dc.read_deltacells(root, elements=False),
                  dc.read_deltacells(root, elements=False).to_memory()):  # fmt: skip
        sc.pp.filter_cells(adata, min_genes=5)
        sc.pp.normalize_total(adata, target_sum=1e4)
        sc.pp.log1p(adata)
        sc.pp.highly_variable_genes(adata, n_top_genes=30)
        adata = adata[:, adata.var["highly_variable"].to_numpy()].copy()
        sc.pp.scale(adata, max_value=10)
        sc.pp.pca(adata, n_comps=5)
        pcs = np.asarray(adata.obsm["X_pca"].compute() if isinstance(adata.obsm["X_pca"], da.Array)
                         else adata.obsm["X_pca"])  # fmt: skip
        results.append((_dense(adata.X), pcs))
    (x_lazy, pc_lazy), (x_mem, pc_mem) = results
    np.testing.assert_allclose(x_lazy, x_mem, rtol=1e-4, atol=1e-5)
    signs = np.sign(np.sum(pc_lazy * pc_mem, axis=0))
    np.testing.assert_allclose(pc_lazy * signs, pc_mem, rtol=1e-3, atol=1e-3)


def _up_to_minor(table: str) -> str:
    """The table with each version in its header cut to major.minor."""
    header, _, rest = table.partition("\n")
    return re.sub(r"(\d+\.\d+)\.[0-9A-Za-z.+-]+", r"\1", header) + "\n" + rest


def test_versions_in_the_docs_table_compare_up_to_minor():
    # The rule above: 1.12.4 and 1.12.5 compare equal, 1.12 and 1.13 do not, rows always count.
    one = "On Python 3.12 with scanpy 1.12.4, anndata 0.13.4, pandas 3.1.1:\n\n| a | b |\n"
    assert _up_to_minor(one) == _up_to_minor(one.replace("1.12.4", "1.12.5rc1"))
    assert _up_to_minor(one) != _up_to_minor(one.replace("1.12.4", "1.13.0"))
    assert _up_to_minor(one) != _up_to_minor(one.replace("| b |", "| c |"))


def test_the_docs_table_is_what_scanpy_does_on_each_stack(chains):
    _, (outcomes, kinds, _), _ = chains
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("scanpy", "anndata", "pandas"))
    lines = [f"On Python {sys.version_info.major}.{sys.version_info.minor} with {versions}:", "",
             "| scanpy step, in order | on `read_deltacells(path)` | X afterwards |",
             "|---|---|---|"]  # fmt: skip
    for (name, outcome), kind in zip(outcomes, kinds, strict=True):
        if outcome != "works":
            way = WAY_FORWARD.get(name, "`adata.to_memory()` first")
            outcome = f"{outcome}: scanpy has no dask version here; {way}"
        shown = (
            "lazy X"
            if issubclass(kind, dc.DeltacellsCSRDataset)
            else (
                "lazy dask array" if issubclass(kind, da.Array) else f"in memory ({kind.__name__})"
            )
        )
        lines.append(f"| `{name}` | {outcome} | {shown} |")
    text = "\n".join(lines) + "\n"
    path = DOCS / f"scanpy_lazy_x_{_stack()}.md"
    # A patch release of scanpy, anndata or pandas on PyPI that changes no outcome leaves the
    # table as committed (its header names the versions it was made with); anything else in
    # the table, or a minor version, rewrites it and fails.
    if not path.exists() or _up_to_minor(path.read_text()) != _up_to_minor(text):
        path.write_text(text)
        pytest.fail(f"{path} was out of date and is written anew: commit it")
    assert len(lines) == 4 + len(outcomes)


def test_a_function_that_needs_memory_names_the_way_forward(root):
    """Where nothing out of core exists (a dense numpy copy of X), the lazy X says what to
    do instead of failing inside numpy."""
    lazy = dc.read_deltacells(root, elements=False)
    with pytest.raises(TypeError, match=r"read lazily.*to_memory\(\).*dask=True"):
        np.asarray(lazy.X)
    with pytest.raises(TypeError, match=r"into X \(out=X\)"):
        np.log1p(lazy.X, out=lazy.X)


def test_score_genes_on_the_lazy_x_equals_memory(root):
    """scanpy's score_genes takes ``np.nanmean`` of an X it does not know: on the lazy X that
    is the tile-by-tile mean (stored counts are never NaN), shaped as numpy's, and the
    scores equal the in-memory ones."""
    lazy = dc.read_deltacells(root, elements=False)
    memory = dc.read_deltacells(root, elements=False).to_memory()
    dense = memory.X.toarray()
    for axis in (None, 0, 1):
        for func in (np.nanmean, np.nansum):
            got, want = func(lazy.X, axis=axis), func(dense, axis=axis)
            assert np.shape(got) == np.shape(want), (func, axis)
            np.testing.assert_allclose(got, want, rtol=1e-6)
        # keepdims (scanpy's Pearson residuals ask for it): numpy's 2-D shapes, not matrices.
        for func in (np.sum, np.mean, np.nanmean, np.nansum):
            got = func(lazy.X, axis=axis, keepdims=True)
            want = func(dense, axis=axis, keepdims=True)
            assert type(got) is np.ndarray and got.shape == want.shape, (func, axis)
            np.testing.assert_allclose(got, want, rtol=1e-6)
    out = np.zeros(lazy.n_obs)
    assert np.nanmean(lazy.X, axis=1, out=out) is out
    np.testing.assert_allclose(out, dense.mean(axis=1), rtol=1e-6)
    genes = list(lazy.var_names[:5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sc.tl.score_genes(lazy, genes, random_state=0)
        sc.tl.score_genes(memory, genes, random_state=0)
    assert isinstance(lazy.X, dc.DeltacellsCSRDataset)
    np.testing.assert_allclose(lazy.obs["score"], memory.obs["score"], rtol=1e-5, atol=1e-7)


def test_pearson_residuals_on_the_lazy_x_equal_memory(root):
    """scanpy's Pearson residuals take ``np.sum(X, axis, keepdims=True)``: on the lazy X the
    residuals (dense, as in memory) equal the in-memory ones."""
    lazy = dc.read_deltacells(root, elements=False)
    memory = dc.read_deltacells(root, elements=False).to_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = sc.experimental.pp.normalize_pearson_residuals(lazy, inplace=False)["X"]
        want = sc.experimental.pp.normalize_pearson_residuals(memory, inplace=False)["X"]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


PEARSON_GENES = """
import sys, warnings
import numpy as np, scanpy as sc, deltacells as dc
warnings.simplefilter("ignore")
lazy = dc.read_deltacells(sys.argv[1], elements=False)
memory = dc.read_deltacells(sys.argv[1], elements=False).to_memory()
got = sc.experimental.pp.highly_variable_genes(lazy, n_top_genes=30, inplace=False)
want = sc.experimental.pp.highly_variable_genes(memory, n_top_genes=30, inplace=False)
assert (got["highly_variable"].to_numpy() == want["highly_variable"].to_numpy()).all()
np.testing.assert_allclose(got["residual_variances"], want["residual_variances"], rtol=1e-5)
print("equal")
"""


SCANPY_AFTER_THE_READ = """
import sys, warnings
import numpy as np, deltacells as dc
warnings.simplefilter("ignore")
lazy = dc.read_deltacells(sys.argv[1], elements=False)
memory = dc.read_deltacells(sys.argv[1], elements=False).to_memory()
assert "scanpy" not in sys.modules
import scanpy as sc
for adata in (lazy, memory):
    sc.pp.calculate_qc_metrics(adata, percent_top=None, inplace=True)
    sc.pp.normalize_total(adata, target_sum=1e4)
    sc.pp.log1p(adata)
    sc.pp.highly_variable_genes(adata, n_top_genes=30)
assert isinstance(lazy.X, __import__("dask.array").array.Array)
np.testing.assert_allclose(lazy.obs["total_counts"], memory.obs["total_counts"], rtol=1e-6)
assert (lazy.var["highly_variable"] == memory.var["highly_variable"]).all()
print("equal")
"""


def _in_a_fresh_process(script: str, root) -> None:
    import subprocess

    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "equal", done.stderr[-2000:]


def test_pearson_residual_genes_on_the_lazy_x_equal_memory(root):
    """scanpy's ``experimental.pp.highly_variable_genes`` reaches fast_array_utils' ``power``,
    whose module is imported on first use: joined at read time all the same, it runs on the
    lazy X (on its dask array) and picks the in-memory genes. In a fresh process, where
    nothing has imported that module before the read."""
    _in_a_fresh_process(PEARSON_GENES, root)


def test_scanpy_imported_after_the_read_runs_out_of_core(root):
    """A dataset read before scanpy is imported (a notebook importing scanpy later): scanpy's
    dispatchers take the lazy X all the same, and the results equal memory's."""
    _in_a_fresh_process(SCANPY_AFTER_THE_READ, root)


def test_gene_plots_on_the_lazy_x_equal_memory(root):
    """Gene plots take the genes' values through ``sc.get.obs_df``: on a fresh read's lazy X
    a dot plot's means and fractions equal the in-memory ones, and X stays lazy."""
    import matplotlib

    matplotlib.use("Agg")
    lazy = dc.read_deltacells(root, elements=False)
    memory = dc.read_deltacells(root, elements=False).to_memory()
    genes = list(lazy.var_names[[3, 0, 7]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = sc.pl.dotplot(lazy, genes, groupby="cell_type", return_fig=True)
        want = sc.pl.dotplot(memory, genes, groupby="cell_type", return_fig=True)
    assert isinstance(lazy.X, dc.DeltacellsCSRDataset)
    np.testing.assert_allclose(got.dot_color_df, want.dot_color_df, rtol=1e-6)
    np.testing.assert_allclose(got.dot_size_df, want.dot_size_df, rtol=1e-6)


def test_seurat_v3_on_the_lazy_counts_equals_memory(root):
    """The way forward the table gives where scanpy's seurat_v3 fails on a dask X (scanpy
    1.11): on the lazy X itself, before any filter, it works and equals the in-memory result."""
    lazy = dc.read_deltacells(root, elements=False)
    memory = dc.read_deltacells(root, elements=False).to_memory()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = sc.pp.highly_variable_genes(lazy, n_top_genes=30, flavor="seurat_v3", inplace=False)
        want = sc.pp.highly_variable_genes(memory, n_top_genes=30, flavor="seurat_v3",
                                           inplace=False)  # fmt: skip
    assert isinstance(lazy.X, dc.DeltacellsCSRDataset)
    assert (got["highly_variable"].to_numpy() == want["highly_variable"].to_numpy()).all()


def test_a_failed_join_never_fails_a_read_or_scanpys_import(root, monkeypatch):
    """If scanpy's or fast_array_utils' internals change so that joining them raises, reads
    (and the hook inside ``import scanpy``) still work, with one warning giving the way
    forward."""
    from deltacells.read import integrations

    def changed(*args):
        raise TypeError("internals changed")

    monkeypatch.setattr(integrations, "_register_tile_statistics", changed)
    monkeypatch.setattr(integrations, "_join_failed", False)
    with pytest.warns(RuntimeWarning, match=r"internals changed.*to_memory\(\)") as caught:
        lazy = dc.read_deltacells(root, elements=False)
        dc.read_deltacells(root, elements=False)
        integrations._on_scanpy_import(sc)
    assert len([w for w in caught if "could not hand" in str(w.message)]) == 1
    assert lazy.X.to_memory().nnz == dc.open_dataset(root).manifest.nnz
