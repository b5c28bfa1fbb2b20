"""Longer mutation fuzzing of the tile decoder than the test suite runs.

    python tools/fuzz_tiles.py [--mutants 200000] [--seed 0]

Seeds are the golden tiles, tiles of real data and edge-case tiles. Every mutant must either be
rejected with FormatError or decode to a well-formed matrix; anything else (another exception, a
crash) stops the run, and the seed and mutant index reproduce it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp

import deltacells as dc
from deltacells.testing import fuzz_tiles

ROOT = Path(__file__).resolve().parent.parent


def seed_tiles() -> list[bytes]:
    rng = np.random.default_rng(0)
    seeds = [(ROOT / "tests" / "data" / f"golden_v{v}.dct").read_bytes() for v in (1, 2)]
    wide = sp.random(20, 150_000, density=0.002, format="csr", random_state=rng)
    wide.data = np.ceil(wide.data * 70_000)  # some counts above 65535
    seeds.append(dc.encode_tile(wide, n_chunks=3))
    seeds.append(dc.encode_tile(sp.csr_matrix((4, 10), dtype=np.int32)))
    seeds.append(dc.encode_tile(sp.csr_matrix((0, 10), dtype=np.int32)))
    return seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=10_000)
    args = parser.parse_args()
    seeds = seed_tiles()
    t0 = time.perf_counter()
    rejected = decoded = 0
    for start in range(0, args.mutants, args.batch):
        n = min(args.batch, args.mutants - start)
        report = fuzz_tiles(seeds, n, seed=args.seed * 1_000_003 + start)
        rejected += report.rejected
        decoded += report.decoded
        print(
            f"{start + n:,} mutants: {rejected:,} rejected, {decoded:,} decoded well-formed "
            f"({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
