"""Shared fixtures: the real datasets in ../shared/data, loaded once per session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

DATA_DIR = TESTS.parent.parent / "shared" / "data"
DATASETS = ("liao2020_balf", "chung2017_smartseq2", "visium_multisample")


def pytest_collection_modifyitems(config, items):
    """In ``tools/dev.sh test`` (CI), tests marked ``first_stack`` run on the first stack only:
    they check tools run from that environment (the benchmark scripts, which
    ``tools/dev.sh bench`` runs there; the repaired wheel), or deltacells' own byte checks
    whatever the stack (the tamper sweeps: checksums are compared before anything is parsed),
    and would add minutes to CI twice. ``tools/dev.sh test-newest`` runs them on the second
    stack too."""
    if os.environ.get("DELTACELLS_SECOND_STACK") != "1":
        return
    skip = pytest.mark.skip(reason="first stack only in the two-stack run (tools/dev.sh "
                                   "test-newest runs it here)")  # fmt: skip
    for item in items:
        if item.get_closest_marker("first_stack"):
            item.add_marker(skip)


@pytest.fixture(
    scope="module",
    params=["simd16", "simd16-scalar", "simd", "bitmap", "bitmap-scalar", "radix"],
)
def row_sort(request):
    """Every way the kernels sort renumbered rows (numpy's quicksort of 16-bit columns with
    its loops sixteen entries at a time where the CPU has AVX-512F or one at a time, numpy's
    quicksort of 32-bit keys, the bitmap of output columns renumbered eight entries at a time
    where the CPU has AVX2 or one at a time, or the radix sort of 64-bit keys), for the tests
    that compare them."""
    from deltacells.codec import _sortchoice

    before = _sortchoice._use_row_sort(request.param.removesuffix("-scalar"))
    vector_before = _sortchoice._use_vector_loops(not request.param.endswith("-scalar"))
    yield request.param
    _sortchoice._use_row_sort(before)
    _sortchoice._use_vector_loops(vector_before)


def spatial_counts(n_cells: int, n_genes: int, *, extent: float, max_count: int, seed: int,
                   prefix: str = "c") -> ad.AnnData:  # fmt: skip
    """Random int32 counts (30% nonzero, 1 to ``max_count - 1``) of cells named
    ``<prefix><i>`` at uniform positions in ``[0, extent)^2`` (``obsm["spatial"]``)."""
    rng = np.random.default_rng(seed)
    X = sp.random(n_cells, n_genes, density=0.3, format="csr", random_state=seed,
                  data_rvs=lambda k: rng.integers(1, max_count, k)).astype(np.int32)  # fmt: skip
    adata = ad.AnnData(X=X)
    adata.obs_names = [f"{prefix}{i}" for i in range(n_cells)]
    adata.obsm["spatial"] = rng.uniform(0, extent, (n_cells, 2))
    return adata


def load_counts(name: str) -> sp.csr_matrix:
    """X of a real dataset as int32 CSR (fails loudly if ../shared/data is missing)."""
    path = DATA_DIR / f"{name}.h5ad"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: the tests need ../shared/data beside the repo")
    return sp.csr_matrix(ad.read_h5ad(path).X)


def sort_genes_by_total(matrix: sp.csr_matrix) -> tuple[sp.csr_matrix, np.ndarray]:
    """Columns by decreasing total counts (stable), as the converter stores them."""
    totals = np.asarray(matrix.sum(axis=0)).ravel()
    order = np.argsort(-totals, kind="stable")
    return sp.csr_matrix(matrix[:, order]), order


@pytest.fixture(scope="session")
def real_counts() -> dict[str, sp.csr_matrix]:
    return {name: load_counts(name) for name in DATASETS}


@pytest.fixture(scope="session")
def liao(real_counts) -> sp.csr_matrix:
    return real_counts["liao2020_balf"]


@pytest.fixture(autouse=True, scope="session")
def _isolated_obs_cache(tmp_path_factory):
    """Tests never touch the user's ~/.cache: the obs cache lives in a session folder."""
    import os

    old = os.environ.get("DELTACELLS_CACHE")
    os.environ["DELTACELLS_CACHE"] = str(tmp_path_factory.mktemp("obs-cache"))
    yield
    if old is None:
        os.environ.pop("DELTACELLS_CACHE", None)
    else:
        os.environ["DELTACELLS_CACHE"] = old
