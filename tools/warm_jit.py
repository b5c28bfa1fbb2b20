"""Compile scanpy's numba code into this environment's caches before the test suite needs it.

On a fresh environment, the first call of ``sc.pp.neighbors``, ``sc.tl.umap`` or
``sc.tl.rank_genes_groups`` compiles their numba kernels (pynndescent, umap, scanpy), and
numba caches the machine code beside their sources. ``tests/test_scanpy_chain.py`` then took
about 80 s a stack in CI against 28 s with the caches warm. ``tools/dev.sh test`` runs this
script in the background, at a low priority, while the suite runs the tests before it, so the
compiling happens on the core the mostly single-threaded suite leaves free.

It runs the test's own chain (in memory, on the default read, and on ``dask=True``) on the
test's small matrix, and leaves nothing behind but the caches. Without scanpy (or the chain's
other optional packages) it does nothing. Not a test: it checks no result.

    python tools/warm_jit.py
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def main() -> int:
    sys.path.insert(0, str(TESTS))
    began = time.perf_counter()
    import pytest

    try:
        import matplotlib

        matplotlib.use("Agg")
        from test_scanpy_chain import _run_chain
        from test_writer import small_adata
    except (ImportError, pytest.skip.Exception) as err:  # the module's importorskip
        print(f"warm_jit: nothing to warm ({type(err).__name__}: {err})")
        return 0

    import deltacells as dc

    with tempfile.TemporaryDirectory(prefix="deltacells-warm-") as tmp:
        # The test fixture's matrix (test_scanpy_chain.root), so the same kernels compile.
        source = small_adata(n_cells=400, n_genes=150)
        source.var = source.var[[]]
        source.layers["counts"] = source.X.copy()
        path = Path(tmp) / "d"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dc.write_deltacells(source, path, tile_size=64, progress=False)
            _run_chain(dc.read_deltacells(path, elements=False).to_memory())
            _run_chain(dc.read_deltacells(path, elements=False))
            _run_chain(dc.read_deltacells(path, elements=False, dask=True))
    print(f"warm_jit: scanpy's chain compiled and cached in {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
