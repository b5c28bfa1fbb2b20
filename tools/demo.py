"""The main job on real data: encode a count matrix into tiles, read it back, slice it.

    python tools/demo.py [H5AD] [--tile-size 10000] [--level N]

Prints sizes (next to the .h5ad file) and encode/decode/gather speeds, and checks that every
decoded cell equals the source. Tiles are written to a temporary folder and removed afterwards.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("h5ad", nargs="?", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--tile-size", type=int, default=10_000)
    parser.add_argument("--level", type=int, default=dc.DEFAULT_LEVEL)
    args = parser.parse_args()

    t0 = time.perf_counter()
    matrix = sp.csr_matrix(ad.read_h5ad(args.h5ad).X)
    load_s = time.perf_counter() - t0
    n_cells, n_genes = matrix.shape
    print(
        f"{args.h5ad.name}: {n_cells:,} cells x {n_genes:,} genes, {matrix.nnz:,} nonzeros "
        f"(read in {load_s:.2f} s)"
    )
    print(
        f"deltacells {dc.__version__}, libzstd {_kernels.zstd_version()}, "
        f"OpenMP {'on' if _kernels.openmp_enabled() else 'off'}"
    )

    # Genes by decreasing total counts make the gaps small (what the converter will do).
    totals = np.asarray(matrix.sum(axis=0)).ravel()
    gene_order = np.argsort(-totals, kind="stable")
    stored = sp.csr_matrix(matrix[:, gene_order])
    stored.sort_indices()

    with tempfile.TemporaryDirectory(prefix="deltacells-demo-") as tmp:
        t0 = time.perf_counter()
        paths = []
        for i, start in enumerate(range(0, n_cells, args.tile_size)):
            path = Path(tmp) / f"tile_{i:06d}.dct"
            path.write_bytes(
                dc.encode_tile(stored[start : start + args.tile_size], level=args.level)
            )
            paths.append(path)
        encode_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in paths)
        h5ad_size = args.h5ad.stat().st_size
        print(
            f"encoded {len(paths)} tiles at zstd level {args.level} in {encode_s:.2f} s: "
            f"{size / 1e6:.1f} MB, {size / matrix.nnz:.3f} bytes/nonzero "
            f"({size / h5ad_size:.2f} x the whole .h5ad file of {h5ad_size / 1e6:.1f} MB)"
        )

        t0 = time.perf_counter()
        tiles = [dc.Tile(p.read_bytes(), name=p.name) for p in paths]
        decoded = sp.vstack([t.decode(np.float32) for t in tiles], format="csr")
        decode_s = time.perf_counter() - t0
        assert (decoded != stored).nnz == 0, "decoded matrix differs from the source"
        print(
            f"read + CRC + decoded everything in {decode_s * 1e3:.0f} ms "
            f"({matrix.nnz / decode_s / 1e6:.0f} M nonzeros/s); equal to the source: yes"
        )

        rng = np.random.default_rng(0)
        cells = rng.choice(n_cells, 4096, replace=False)
        t0 = time.perf_counter()
        limits = np.cumsum([t.shape[0] for t in tiles])
        which = np.searchsorted(limits, cells, side="right")
        parts = []
        for k, tile in enumerate(tiles):
            mine = np.flatnonzero(which == k)
            local = cells[mine] - (limits[k - 1] if k else 0)
            parts.append((mine, tile.gather(local)))
        gathered = sp.vstack([p for _, p in parts], format="csr")[
            np.argsort(np.concatenate([m for m, _ in parts]))
        ]
        gather_s = time.perf_counter() - t0
        assert (gathered != stored[cells]).nnz == 0, "gathered cells differ from the source"
        print(
            f"gathered 4,096 random cells in {gather_s * 1e3:.1f} ms "
            f"({4096 / gather_s:,.0f} cells/s); equal to the source: yes"
        )
        back = gathered[:, np.argsort(gene_order)]
        assert (back != matrix[cells]).nnz == 0
        print("restored the source gene order for the slice: equal to the .h5ad X: yes")


if __name__ == "__main__":
    main()
