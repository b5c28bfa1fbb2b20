"""Make the golden tiles in this folder: one per format version, with the matrix it holds.

Run from the project root:  python tests/data/make_golden.py

The tiles are built by the reference encoder in ``tests/tilekit.py`` (numpy and the
``zstandard`` package, following FORMAT.md), not by deltacells' own encoder. Once committed
they never change: a reader that stops decoding them has broken old files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import scipy.sparse as sp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tilekit import reference_tile  # noqa: E402


def golden_matrices() -> dict[int, tuple[sp.csr_matrix, list[int]]]:
    rng = np.random.default_rng(20261202)
    # Version 1: counts <= 65535, 2,000 genes, empty cells, three chunks.
    v1 = sp.random(30, 2000, density=0.05, format="csr", random_state=rng)
    v1.data = np.ceil(v1.data * 300).astype(np.int64)
    v1[[3, 17]] = 0
    v1.eliminate_zeros()
    v1[0, 0] = 65535
    v1[1, 1999] = 1
    # Version 2: 140,000 genes so some gaps pass 65535 (twice in cell 9), counts up to 2^31 - 1.
    v2 = sp.random(40, 140000, density=0.001, format="csr", random_state=rng)
    v2.data = np.ceil(v2.data * 50).astype(np.int64)
    v2 = v2.tolil()
    v2[5, :] = 0
    v2[6, 0] = 7
    v2[6, 1:69999] = 0
    v2[6, 69999] = 3  # one gap of 69,999
    v2[7, 65536] = 65536
    v2[8, 10] = 2**31 - 1
    v2[8, 20] = 65535
    v2[9, 1] = 1
    v2[9, 65537] = 1
    v2[9, 139999] = 4  # cell 9: two gaps above 65535
    v2[9, 65538:139999] = 0
    v2[9, 2:65537] = 0
    v2 = v2.tocsr()
    v2.sort_indices()
    return {1: (v1.tocsr(), [0, 10, 20, 30]), 2: (v2, [0, 7, 9, 25, 40])}


def main() -> None:
    for version, (matrix, bounds) in golden_matrices().items():
        matrix = matrix.astype(np.int64)
        matrix.sort_indices()
        (HERE / f"golden_v{version}.dct").write_bytes(reference_tile(matrix, bounds, version))
        sp.save_npz(HERE / f"golden_v{version}.npz", matrix, compressed=True)
        print(f"golden_v{version}.dct: {matrix.shape}, nnz={matrix.nnz}")


if __name__ == "__main__":
    main()
