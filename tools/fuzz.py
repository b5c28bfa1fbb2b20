"""Longer mutation fuzzing than the test suite runs: tiles, frame contents, manifests, obs.

    python tools/fuzz.py [--target all] [--seconds 600 | --mutants N] [--seed 0]

Targets (each run in rounds of ``--batch`` mutants until the time or count is reached):

* ``tiles``: bit flips, random bytes, boundary values in header and chunk-table fields,
  truncation, extension, copied ranges; half with the CRC corrected. Only ``FormatError`` or a
  well-formed matrix may come out.
* ``frames``: frame contents decompressed, damaged and compressed again (valid zstd), so the
  outcome cannot depend on how a libzstd version decodes a broken frame; the decoder must agree
  exactly with ``deltacells.testing.reference_decode`` (reject the same tiles, decode the others
  to the same matrix, on 1 and 2 threads, whole and by gathering).
* ``manifests``: values, keys and lists of a dataset's manifest changed, duplicate keys,
  truncation; everything is read back (tiles, genes, obs, the lazy AnnData, verify).
* ``obs``: an obs shard damaged and its size, hash and fingerprint recorded anew, so pyarrow's
  parquet reader is reached; everything is read back.
* ``tamper``: a dataset with every part (layers, raw, elements, spatial order, companion);
  each of its files gets bit flips and truncations in turn and is read through every user
  path (``deltacells.tamper``): no path may return a changed result without an error, and
  ``verify`` must see every damage.

Seeds are the golden tiles, tiles of the real data in ../shared/data and edge cases. Any other
outcome stops the run with the target, seed and mutant index that reproduce it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import anndata as ad
import numpy as np
import scipy.sparse as sp

import deltacells as dc
from deltacells.tamper import tamper_dataset
from deltacells.testing import (
    FuzzReport,
    fuzz_frame_contents,
    fuzz_manifests,
    fuzz_obs_shards,
    fuzz_tiles,
)

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
TARGETS = ("tiles", "frames", "manifests", "obs", "tamper")


def seed_tiles() -> list[bytes]:
    """Golden tiles, tiles of real data (when ../shared/data is there) and edge cases."""
    rng = np.random.default_rng(0)
    seeds = [(ROOT / "tests" / "data" / f"golden_v{v}.dct").read_bytes() for v in (1, 2)]
    wide = sp.random(20, 150_000, density=0.002, format="csr", random_state=rng)
    wide.data = np.ceil(wide.data * 70_000)  # some counts and gaps above 65535
    seeds.append(dc.encode_tile(wide, n_chunks=3))
    for name, rows in (("liao2020_balf", 60), ("chung2017_smartseq2", 12)):
        path = DATA / f"{name}.h5ad"
        if path.exists():
            X = sp.csr_matrix(ad.read_h5ad(path).X[:rows])
            seeds.append(dc.encode_tile(X, n_chunks=4))
    seeds.append(dc.encode_tile(sp.csr_matrix((4, 10), dtype=np.int32)))
    seeds.append(dc.encode_tile(sp.csr_matrix((0, 10), dtype=np.int32)))
    return seeds


def seed_dataset(where: Path) -> Path:
    """A small dataset with every obs kind, several tiles and two obs shards."""
    rng = np.random.default_rng(0)
    X = sp.random(300, 80, density=0.1, format="csr", random_state=rng)
    X.data = np.ceil(X.data * 30)
    import pandas as pd

    obs = pd.DataFrame(
        {
            "kind": pd.Categorical(rng.choice(["a", "b", None], 300)),
            "score": rng.random(300),
            "flag": rng.random(300) < 0.5,
            "barcode": [f"BC{i}" for i in range(300)],
        },
        index=[f"c{i}" for i in range(300)],
    )
    adata = ad.AnnData(X=X, obs=obs, var=pd.DataFrame(index=[f"g{j}" for j in range(80)]))
    dc.write_deltacells(adata, where, tile_size=64, obs_tiles_per_file=2, max_categories=100,
                        progress=False)  # fmt: skip
    return where


def tamper_round(tmp: Path, n: int, seed: int) -> FuzzReport:
    """``n`` rounds over every file of a dataset with every part; stops at the first silent
    change, missed damage or crash (naming it and the seed)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_tamper import everything

    root = tmp / "everything"
    if not root.exists():
        everything(root)
    out = FuzzReport()
    for k in range(n):
        report = tamper_dataset(root, flips_per_file=3, truncate=1.0, seed=seed + k, processes=2)
        bad = report.silent + report.missed + report.crashed
        if bad:
            raise SystemExit(f"tamper seed {seed + k}: " + "\n".join(bad[:20]))
        out.rejected += report.refused
        out.decoded += report.damages
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=(*TARGETS, "all"), default="all")
    parser.add_argument("--seconds", type=float, default=None, help="per target")
    parser.add_argument("--mutants", type=int, default=None, help="per target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=2_000)
    args = parser.parse_args()
    if args.seconds is None and args.mutants is None:
        args.seconds = 60.0
    warnings.simplefilter("ignore")  # anndata's notes on damaged obs names, not failures
    tiles = seed_tiles()
    targets = TARGETS if args.target == "all" else (args.target,)
    with tempfile.TemporaryDirectory(prefix="deltacells-fuzz-seed-") as tmp:
        dataset = seed_dataset(Path(tmp) / "d")
        runners = {
            "tiles": lambda n, seed: fuzz_tiles(tiles, n, seed=seed),
            "frames": lambda n, seed: fuzz_frame_contents(tiles, n, seed=seed),
            "manifests": lambda n, seed: fuzz_manifests(dataset, n, seed=seed),
            "obs": lambda n, seed: fuzz_obs_shards(dataset, n, seed=seed),
            "tamper": lambda n, seed: tamper_round(Path(tmp), n, seed),
        }
        for target in targets:
            t0 = time.perf_counter()
            done = rejected = decoded = 0
            batch = args.batch if target in ("tiles", "frames") else max(1, args.batch // 10)
            if target == "tamper":
                batch = 1  # one round: every file of the dataset damaged in turn
            while True:
                if args.mutants is not None and done >= args.mutants:
                    break
                if args.seconds is not None and time.perf_counter() - t0 >= args.seconds:
                    break
                n = batch if args.mutants is None else min(batch, args.mutants - done)
                seed = args.seed * 1_000_003 + done
                report = runners[target](n, seed)
                done += n
                rejected += report.rejected
                decoded += report.decoded
            print(f"{target}: {done:,} mutants, {rejected:,} rejected, {decoded:,} read back "
                  f"well-formed, {time.perf_counter() - t0:.0f} s (seed {args.seed})",
                  flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
