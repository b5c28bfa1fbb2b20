"""The main job on real data: convert an .h5ad to a deltacells dataset, read it back, slice it.

    python tools/demo.py [FILE.h5ad] [--tile-size N] [--level N] [--keep DIR]

Without a file it uses ``../shared/data/liao2020_balf.h5ad`` (real 10x data the project keeps
beside the repository); without that either, it generates a count matrix of 20,000 cells and
says so. Any AnnData file with integer counts in X works (a ``layers["counts"]`` or ``raw`` is
used when X is not counts). Prints sizes (next to the file) and the speeds of conversion, of
``read_deltacells`` (opening, whole-matrix decode, a random sample of cells: 4,096 or a third of
them, whichever is fewer) and of two ``Loader`` epochs (the first, which sets up the loader's
thread and memory, and the next), and checks that every decoded cell equals
the source. The dataset goes to a temporary folder unless ``--keep``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp

import deltacells as dc
from deltacells.codec import _checksum, _decode, _encode

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"


def generated(where: Path) -> Path:
    """A 20,000-cell count matrix with a few obs columns, written as .h5ad (no real data)."""
    rng = np.random.default_rng(0)
    n_cells, n_genes = 20_000, 2_000
    # Genes with log-normal mean expression, counts Poisson: sparse like 10x data.
    means = np.exp(rng.normal(-2.5, 1.5, n_genes))
    X = sp.random(n_cells, n_genes, density=0.08, format="csr", random_state=rng)
    X.data = rng.poisson(1 + 20 * means[X.indices]).astype(np.float32) + 1
    import pandas as pd

    obs = pd.DataFrame(
        {"sample": pd.Categorical(rng.choice(["s1", "s2", "s3"], n_cells))},
        index=[f"cell{i}" for i in range(n_cells)],
    )
    var = pd.DataFrame(index=[f"gene{j}" for j in range(n_genes)])
    path = where / "generated.h5ad"
    ad.AnnData(X=X, obs=obs, var=var).write_h5ad(path, compression="gzip")
    return path


def counts_of(source: ad.AnnData) -> tuple[sp.csr_matrix, dict]:
    """The counts to convert and how to ask write_deltacells for them."""
    candidates = [(source.X, {})]
    if "counts" in source.layers:
        candidates.append((source.layers["counts"], {"layer": "counts"}))
    if source.raw is not None:
        candidates.append((source.raw.X, {"use_raw": True}))
    for matrix, how in candidates:
        if matrix is None:
            continue
        csr = sp.csr_matrix(matrix)
        if not csr.nnz or (np.array_equal(csr.data, np.round(csr.data)) and csr.data.min() >= 0):
            return csr, how
    raise SystemExit("demo: this file has no integer counts in X, layers['counts'] or raw")


def run(h5ad: Path, out: Path, tile_size: int | None, level: int) -> None:
    source = ad.read_h5ad(h5ad)
    X, how = counts_of(source)
    if how:
        print(f"X is not counts; using {'raw.X' if 'use_raw' in how else 'layers[counts]'}")
        if "use_raw" in how:
            source = ad.AnnData(X=X, obs=source.obs, var=source.raw.var)
    print(f"{h5ad.name}: {X.shape[0]:,} cells x {X.shape[1]:,} genes, {X.nnz:,} nonzeros")
    print(f"deltacells {dc.__version__}, libzstd {_encode.zstd_version()}, "
          f"OpenMP {'on' if _decode.openmp_enabled() else 'off'}, "
          f"CRC-32 by {_checksum.crc_backend()}")  # fmt: skip

    t0 = time.perf_counter()
    manifest = dc.write_deltacells(h5ad, out, tile_size=tile_size, zstd_level=level,
                                   overwrite=True, progress=False, **how)  # fmt: skip
    convert_s = time.perf_counter() - t0
    size = sum(manifest.tile_bytes)
    per_nonzero = f" = {size / manifest.nnz:.3f} bytes/nonzero" if manifest.nnz else ""
    print(f"converted in {convert_s:.2f} s: {manifest.n_tiles} tiles of up to "
          f"{manifest.tile_size:,} cells, {size / 1e6:.1f} MB of tiles{per_nonzero} "
          f"({size / h5ad.stat().st_size:.2f} x the .h5ad file)")  # fmt: skip
    if X.shape[0] == 0 or manifest.nnz == 0:
        adata = dc.read_deltacells(out)
        assert adata.shape == X.shape
        dc.open_dataset(out).verify()
        print(f"read back: {adata.n_obs:,} x {adata.n_vars:,}, no nonzeros to decode, slice or "
              f"load; deltacells verify {out}: OK")  # fmt: skip
        return

    t0 = time.perf_counter()
    adata = dc.read_deltacells(out)
    open_s = time.perf_counter() - t0
    columns = ", ".join(adata.obs.columns)
    print(f"read_deltacells: {adata.n_obs:,} x {adata.n_vars:,} AnnData with obs ({columns}) "
          f"and var in {open_s * 1e3:.0f} ms; X stays lazy")  # fmt: skip

    t0 = time.perf_counter()
    whole = adata.X.to_memory()
    decode_s = time.perf_counter() - t0
    assert (whole != X).nnz == 0, "decoded matrix differs from the source"
    speed = manifest.nnz / decode_s / 1e6
    print(f"X.to_memory(): every tile read, CRC-checked and decoded in {decode_s * 1e3:.0f} ms "
          f"({speed:.0f} M nonzeros/s); equal to the .h5ad X: yes")  # fmt: skip

    rng = np.random.default_rng(0)
    n_sample = max(1, min(4096, X.shape[0] // 3))
    cells = rng.choice(X.shape[0], n_sample, replace=False)
    fresh = dc.read_deltacells(out, obs=False)
    t0 = time.perf_counter()
    some = fresh.X[cells]
    gather_s = time.perf_counter() - t0
    assert (some != X[cells]).nnz == 0
    print(f"adata.X[{n_sample:,} random cells] from a fresh handle in {gather_s * 1e3:.1f} ms "
          f"({n_sample / gather_s:,.0f} cells/s); equal to the source: yes")  # fmt: skip

    batch_size = max(1, min(1024, X.shape[0] // 4))
    loader = dc.Loader(out, batch_size=batch_size, seed=0)
    epochs_s = []
    for epoch in range(2):  # the first pays for the loader's thread and its first memory
        loader.set_epoch(epoch)
        t0 = time.perf_counter()
        seen = np.concatenate([batch.cells for batch in loader])
        epochs_s.append(time.perf_counter() - t0)
        assert np.array_equal(np.sort(seen), np.arange(X.shape[0]))
    first, second = epochs_s
    print(f"Loader: shuffled epochs of {batch_size:,}-cell batches, the first in "
          f"{first * 1e3:.0f} ms ({X.shape[0] / first:,.0f} cells/s), the next in "
          f"{second * 1e3:.0f} ms ({X.shape[0] / second:,.0f} cells/s); every cell once "
          "in each: yes")  # fmt: skip

    dataset = dc.open_dataset(out)
    assert list(adata.obs_names) == list(source.obs_names)
    assert list(adata.var_names) == list(source.var_names)  # source gene order restored
    for column in source.obs.columns:
        left, right = adata.obs[column], source.obs[column]
        assert left.astype(str).tolist() == right.astype(str).tolist(), column
    columns = ", ".join(map(str, source.obs.columns)) or "none"
    print(f"obs (columns: {columns}) and var restored: yes")
    dataset.verify()
    print(f"deltacells verify {out}: OK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("h5ad", nargs="?", type=Path, default=None,
                        help=f"an AnnData .h5ad file (default: {DEFAULT_DATA}, or generated data "
                        "when it is missing)")  # fmt: skip
    parser.add_argument("--tile-size", type=int, default=None,
                        help="cells per tile (default: the writer's choice, as deltacells "
                        "convert makes it)")  # fmt: skip
    parser.add_argument("--level", type=int, default=dc.DEFAULT_LEVEL)
    parser.add_argument("--keep", type=Path, help="write the dataset here and keep it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deltacells-demo-") as tmp:
        h5ad = args.h5ad
        if h5ad is None:
            if DEFAULT_DATA.exists():
                h5ad = DEFAULT_DATA
            else:
                print(f"{DEFAULT_DATA} is not there (the project's real data lives in ../shared "
                      "beside the repository); generating 20,000 cells of counts instead")
                h5ad = generated(Path(tmp))
        elif not h5ad.exists():
            raise SystemExit(f"demo: {h5ad}: no such file")
        try:
            run(h5ad, args.keep or Path(tmp) / "dataset", args.tile_size, args.level)
        except (dc.FormatError, ValueError, OSError) as err:  # the library's own message
            raise SystemExit(f"demo: {err}") from None


if __name__ == "__main__":
    main()
