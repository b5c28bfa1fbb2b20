"""The main job on real data: convert an .h5ad to a deltacells dataset, read it back, slice it.

    python tools/demo.py [H5AD] [--tile-size N] [--level N] [--keep DIR]

Prints sizes (next to the .h5ad file) and the speeds of conversion, of ``read_deltacells``
(opening, whole-matrix decode, 4,096 random cells) and of one ``Loader`` epoch, and checks that
every decoded cell equals the source. The dataset goes to a temporary folder unless ``--keep``.
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
from deltacells import _kernels

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"


def run(h5ad: Path, out: Path, tile_size: int, level: int) -> None:
    source = ad.read_h5ad(h5ad)
    X = sp.csr_matrix(source.X)
    print(f"{h5ad.name}: {X.shape[0]:,} cells x {X.shape[1]:,} genes, {X.nnz:,} nonzeros")
    print(f"deltacells {dc.__version__}, libzstd {_kernels.zstd_version()}, "
          f"OpenMP {'on' if _kernels.openmp_enabled() else 'off'}, "
          f"CRC-32 by {_kernels.crc_backend()}")  # fmt: skip

    t0 = time.perf_counter()
    manifest = dc.write_deltacells(h5ad, out, tile_size=tile_size, zstd_level=level,
                                   overwrite=True, progress=False)  # fmt: skip
    convert_s = time.perf_counter() - t0
    size = sum(manifest.tile_bytes)
    print(f"converted in {convert_s:.2f} s: {manifest.n_tiles} tiles, {size / 1e6:.1f} MB of "
          f"tiles = {size / manifest.nnz:.3f} bytes/nonzero ({size / h5ad.stat().st_size:.2f} x "
          f"the .h5ad file)")  # fmt: skip

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
    cells = rng.choice(X.shape[0], 4096, replace=False)
    fresh = dc.read_deltacells(out, obs=False)
    t0 = time.perf_counter()
    some = fresh.X[cells]
    gather_s = time.perf_counter() - t0
    assert (some != X[cells]).nnz == 0
    print(f"adata.X[4,096 random cells] from a fresh handle in {gather_s * 1e3:.1f} ms "
          f"({4096 / gather_s:,.0f} cells/s); equal to the source: yes")  # fmt: skip

    loader = dc.Loader(out, batch_size=1024, seed=0, obs=["sample"])
    t0 = time.perf_counter()
    seen = np.concatenate([batch.cells for batch in loader])
    epoch_s = time.perf_counter() - t0
    assert np.array_equal(np.sort(seen), np.arange(X.shape[0]))
    print(f"Loader: one shuffled epoch of 1,024-cell batches in {epoch_s * 1e3:.0f} ms "
          f"({X.shape[0] / epoch_s:,.0f} cells/s), every cell once: yes")  # fmt: skip

    dataset = dc.open_dataset(out)
    obs = dataset.read_obs()
    assert list(obs["_index"]) == list(source.obs_names)
    samples = obs["sample"].astype(str).to_numpy()
    assert (samples == source.obs["sample"].astype(str).to_numpy()).all()
    assert list(dataset.var_names()) == list(source.var_names[dataset.gene_order()])
    assert list(adata.obs_names) == list(source.obs_names)
    assert list(adata.var_names) == list(source.var_names)  # source gene order restored
    print(f"obs ({', '.join(dataset.obs_schema().names)}) and var restored: yes")
    dataset.verify()
    print(f"deltacells verify {out}: OK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("h5ad", nargs="?", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tile-size", type=int, default=4096)
    parser.add_argument("--level", type=int, default=dc.DEFAULT_LEVEL)
    parser.add_argument("--keep", type=Path, help="write the dataset here and keep it")
    args = parser.parse_args()
    if args.keep:
        run(args.h5ad, args.keep, args.tile_size, args.level)
        return
    with tempfile.TemporaryDirectory(prefix="deltacells-demo-") as tmp:
        run(args.h5ad, Path(tmp) / "dataset", args.tile_size, args.level)


if __name__ == "__main__":
    main()
