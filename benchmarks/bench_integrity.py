"""What checking every stored byte costs: each read path and the conversion with the integrity
checks on (the default) and off, in one run, on the same data.

    python benchmarks/bench_integrity.py [--repeats 15] [--write-repeats 7]

"Off" patches out what issue 22 added (the manifest digest, the file table's SHA-256, the chunk
checksums of ranged and gene-major reads, the grid checksums of box queries; on the write side
the checksum rows and file hashes), keeping everything else; the tiles' own CRC-32 stays on in
both. Data: liao2020_balf.h5ad (10,706 cells) with an obsm, written with the gene-major
companion; visium_multisample.h5ad in spatial order for box queries; a 10M-cell atlas of
repeated liao tiles for opening. On and off take turns within each repeat; medians of
``--repeats``. Writes ``benchmarks/results/integrity.json``, ``docs/_static/bench_integrity.png``
and the docs table ``docs/_static/bench_integrity.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import anndata as ad
import numpy as np
import scipy.sparse as sp
from _common import machine, page_figure, save_figure

import deltacells as dc
from deltacells.store import ranged
from deltacells.testing import repeat_tiles

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
RESULTS = ROOT / "benchmarks" / "results" / "integrity.json"
FIGURE = ROOT / "docs" / "_static" / "bench_integrity.png"
TABLE = ROOT / "docs" / "_static" / "bench_integrity.md"
#: The budget issue 22 sets for the checks, as a ratio to the unchecked path.
BUDGET = 1.05


@contextlib.contextmanager
def checks_off():
    """The read and write paths without the checks issue 22 added (the tiles' CRC stays)."""
    original_init = ranged.RangedTile.__init__

    def unchecked_init(self, *args, checksums=None, **kwargs):
        original_init(self, *args, **kwargs)

    fake = {"bytes": 0, "sha256": "0" * 64}
    with contextlib.ExitStack() as stack:
        for target, value in (
            ("deltacells.store.manifest.check_seal", lambda *a: None),
            ("deltacells.store.integrity.FileTable.check", lambda *a, **k: None),
            ("deltacells.store.ranged.RangedTile.__init__", unchecked_init),
            ("deltacells.spatial.query._GridSums.check", lambda *a, **k: None),
            ("deltacells.spatial.query._GridSums.check_header", lambda *a, **k: None),
            ("deltacells.write.writer.tile_checksum_row", lambda blob: np.zeros(2, np.uint32)),
            ("deltacells.write.writer.file_record", lambda data: dict(fake, bytes=len(data))),
            ("deltacells.spatial.genemajor.tile_checksum_row", lambda blob: np.zeros(2, np.uint32)),
        ):
            stack.enter_context(mock.patch(target, value))
        yield


def paired(fn, repeats: int) -> dict:
    """Medians of ``fn`` with checks on and off, taking turns, after one untimed call each."""
    times: dict[str, list[float]] = {"on": [], "off": []}
    with checks_off():
        fn()
    fn()
    for _ in range(repeats):
        for mode in ("on", "off"):
            with checks_off() if mode == "off" else contextlib.nullcontext():
                t0 = time.perf_counter()
                fn()
                times[mode].append(time.perf_counter() - t0)
    on, off = statistics.median(times["on"]), statistics.median(times["off"])
    return {"on_s": on, "off_s": off, "ratio": on / off, "on_runs": times["on"],
            "off_runs": times["off"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--write-repeats", type=int, default=7)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    liao = ad.read_h5ad(DATA / "liao2020_balf.h5ad")
    liao.X = sp.csr_matrix(liao.X)
    rng = np.random.default_rng(0)
    liao.obsm["X_pca"] = rng.random((liao.n_obs, 50), dtype=np.float32)
    rows = np.sort(rng.choice(liao.n_obs, 4096, replace=False))
    few = np.sort(rng.choice(liao.n_obs, 64, replace=False))
    results: dict = {"machine": machine(), "command": "python benchmarks/bench_integrity.py",
                     "repeats": args.repeats, "write_repeats": args.write_repeats,
                     "n_cells": liao.n_obs, "budget_ratio": BUDGET, "cases": {}}  # fmt: skip
    cases = results["cases"]
    with tempfile.TemporaryDirectory(prefix="bench-integrity-") as tmp:
        tmp = Path(tmp)
        root = tmp / "liao.dc"
        cache = tmp / "cache"
        dc.write_deltacells(liao, root, gene_major=True, progress=False)
        n_tiles = dc.open_dataset(root).manifest.n_tiles
        atlas_base = tmp / "base.dc"
        dc.write_deltacells(liao[: 8 * 1024], atlas_base, tile_size=1024, obs=False,
                            progress=False)  # fmt: skip
        atlas = repeat_tiles(atlas_base, tmp / "atlas.dc", 9760)  # ~10M cells
        visium = ad.read_h5ad(DATA / "visium_multisample.h5ad")
        dc.write_deltacells(visium, tmp / "visium.dc", spatial_key="spatial", progress=False)
        spatial = dc.open_dataset(tmp / "visium.dc").spatial_index()
        (ox, oy), (tx, ty) = spatial.origin, spatial.tile_size
        box = (ox + tx, oy + ty, ox + 2.5 * tx, oy + 2.5 * ty)

        def read_open():
            return dc.read_deltacells(root, cache_dir=cache)

        def whole():
            return dc.read_deltacells(root, cache_dir=cache, elements=False).X.to_memory()

        lazy = dc.read_deltacells(root, cache_dir=cache, elements=False)
        ranged_reads = dc.read_deltacells(root, cache_dir=cache, elements=False,
                                          ranged_reads=True)  # fmt: skip

        def epoch():
            for _ in dc.Loader(root, batch_size=4096, seed=0, cache_dir=cache):
                pass

        genes = [int(g) for g in rng.choice(liao.n_vars, 20, replace=False)]
        jobs = {
            "open_10M_cells": lambda: dc.open_dataset(atlas),
            "read_deltacells_open": read_open,
            "to_memory": whole,
            "random_4096_cells": lambda: lazy.X[rows],
            "ranged_64_cells": lambda: ranged_reads.X[few],
            "loader_epoch": epoch,
            "genes_20": lambda: dc.open_dataset(root).genes(genes),
            "box_query": lambda: dc.open_dataset(tmp / "visium.dc").query_bbox(box),
        }
        for name, job in jobs.items():
            cases[name] = paired(job, args.repeats)
            print(f"{name:22s} on {cases[name]['on_s'] * 1e3:8.1f} ms  off "
                  f"{cases[name]['off_s'] * 1e3:8.1f} ms  ratio {cases[name]['ratio']:.3f}",
                  flush=True)  # fmt: skip
        counter = iter(range(10**6))

        def convert():
            dc.write_deltacells(liao, tmp / f"w{next(counter)}", progress=False)

        cases["conversion"] = paired(convert, args.write_repeats)
        print(f"{'conversion':22s} on {cases['conversion']['on_s']:8.2f} s   off "
              f"{cases['conversion']['off_s']:8.2f} s   ratio "
              f"{cases['conversion']['ratio']:.3f}")  # fmt: skip
        results["liao_tiles"] = n_tiles
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    draw(results)


def draw(results: dict) -> None:
    """The plot and the docs table from ``results``."""
    cases = results["cases"]
    names = list(cases)
    fig, (ax,) = page_figure(1, 3.2)
    ratios = [cases[n]["ratio"] for n in names]
    ax.barh(names, ratios, color=["#4c72b0" if r <= BUDGET else "#dd8452" for r in ratios])
    ax.axvline(1.0, color="black", lw=0.8)
    ax.axvline(BUDGET, color="grey", ls="--", lw=0.8, label=f"budget {BUDGET:.2f}x")
    ax.set_xlabel("time with checks / without (median)")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    save_figure(fig, FIGURE, "Cost of checking every stored byte", results)
    lines = ["| path | with checks | without | ratio |", "|---|---|---|---|"]
    for name in names:
        c = cases[name]
        unit, scale = ("s", 1.0) if c["off_s"] >= 1 else ("ms", 1e3)
        lines.append(f"| {name.replace('_', ' ')} | {c['on_s'] * scale:.1f} {unit} | "
                     f"{c['off_s'] * scale:.1f} {unit} | {c['ratio']:.3f} |")  # fmt: skip
    m = results["machine"]
    lines.append("")
    lines.append(f"Medians of {results['repeats']} runs each ({results['write_repeats']} for "
                 f"the conversion), taking turns; {m['cpu']}, {m['usable_cpus']} CPUs; "
                 f"`{results['command']}`.")  # fmt: skip
    TABLE.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
