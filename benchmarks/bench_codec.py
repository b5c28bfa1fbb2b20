"""Tile codec benchmark: size, encode and decode speed, next to anndata and plain zstd.

    python benchmarks/bench_codec.py [--data ../shared/data/liao2020_balf.h5ad] [--repeats 7]

Writes ``benchmarks/results/codec.json`` and ``docs/_static/bench_codec.png`` and prints tables.
Everything is measured in this one run on this machine; medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import scipy.sparse as sp
import zstandard
from _common import machine, median_time, page_figure, save_figure

import deltacells as dc
from deltacells.codec import _checksum, _frames
from deltacells.codec.tile import DEFAULT_LEVEL

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "liao2020_balf.h5ad"


def anndata_x_sizes(matrix: sp.csr_matrix, workdir: Path) -> dict:
    """Stored bytes of X written by anndata as gzip h5ad and as zarr (defaults), and times."""
    adata = ad.AnnData(X=matrix)
    h5 = workdir / "x.h5ad"
    t0 = time.perf_counter()
    adata.write_h5ad(h5, compression="gzip")
    h5_time = time.perf_counter() - t0
    with h5py.File(h5) as f:
        h5_bytes = sum(f["X"][k].id.get_storage_size() for k in ("data", "indices", "indptr"))
    zarr_path = workdir / "x.zarr"
    t0 = time.perf_counter()
    adata.write_zarr(zarr_path)
    zarr_time = time.perf_counter() - t0
    zarr_bytes = sum(p.stat().st_size for p in (zarr_path / "X").rglob("*") if p.is_file())
    return {
        "h5ad_gzip_x_bytes": h5_bytes,
        "h5ad_gzip_write_s": h5_time,
        "zarr_x_bytes": zarr_bytes,
        "zarr_write_s": zarr_time,
    }


def tiles_of(matrix: sp.csr_matrix, size: int | None, level: int, n_threads: int) -> list[bytes]:
    if size is None:
        return [dc.encode_tile(matrix, level=level, n_threads=n_threads)]
    return [
        dc.encode_tile(matrix[i : i + size], level=level, n_threads=n_threads)
        for i in range(0, matrix.shape[0], size)
    ]


def interleaved_times(variants: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each variant per repeat, timed round-robin so machine noise hits all alike."""
    times: dict = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def speed_summary(seconds: dict[str, float], nnz: int) -> dict:
    """nonzeros/s of each variant, decode / zstd-only ratios and 2-thread speed-ups."""
    out = {name: nnz / s for name, s in seconds.items()}
    for n in (1, 2):
        out[f"ratio_fresh_vs_zstd_{n}t"] = out[f"decode_fresh_{n}t"] / out[f"zstd_only_{n}t"]
        out[f"ratio_reused_vs_zstd_{n}t"] = out[f"decode_reused_{n}t"] / out[f"zstd_only_{n}t"]
    out["speedup_2t_decode_fresh"] = out["decode_fresh_2t"] / out["decode_fresh_1t"]
    out["speedup_2t_decode_reused"] = out["decode_reused_2t"] / out["decode_reused_1t"]
    out["speedup_2t_zstd_only"] = out["zstd_only_2t"] / out["zstd_only_1t"]
    return out


ROUND_KEYS = ("ratio_fresh_vs_zstd_1t", "speedup_2t_decode_fresh", "speedup_2t_zstd_only")


def decode_speeds(blobs: list[bytes], repeats: int, rounds: int) -> dict:
    """nonzeros/s of decode variants and of zstd alone over all tiles, on 1 and 2 threads.

    "fresh" allocates new output arrays per call (what ``Tile.decode`` does), "reused" decodes
    into preallocated ones; ``decode_tile`` also parses and checks the tile (with or without
    the CRC). ``zstd_only`` decompresses the same frames with the same libzstd into a reused
    per-thread buffer and does nothing else: the speed limit.

    The variants are timed in ``rounds`` rounds of ``repeats`` interleaved repeats, because
    the figures of a shared machine drift between rounds a few seconds apart. Throughputs are
    medians over all repeats; each ratio and speed-up is the median of its per-round values
    (a ratio of pooled medians would mix rounds), and ``rounds`` lists the main ones per round.
    """
    tiles = [dc.Tile(b) for b in blobs]
    nnz = sum(t.nnz for t in tiles)
    frames = []
    for t in tiles:
        for c in t.layout.chunks:
            frames += [bytes(t._buf[c[4] : c[4] + c[5]]), bytes(t._buf[c[6] : c[6] + c[7]])]
    dctx = zstandard.ZstdDecompressor()
    outs = [(np.empty(t.nnz, np.int32), np.empty(t.nnz, np.float32)) for t in tiles]
    variants = {"python_zstandard_1t": lambda: [dctx.decompress(f) for f in frames]}
    for n in (1, 2):
        variants |= {
            f"zstd_only_{n}t": lambda n=n: [
                _frames.decompress_only(t._buf, t.layout.chunks, n) for t in tiles
            ],
            f"decode_fresh_{n}t": lambda n=n: [t.decode(np.float32, n_threads=n) for t in tiles],
            f"decode_reused_{n}t": lambda n=n: [
                t.decode(np.float32, n_threads=n, out=o) for t, o in zip(tiles, outs, strict=True)
            ],
            f"decode_tile_crc_{n}t": lambda n=n: [dc.decode_tile(b, n_threads=n) for b in blobs],
            f"decode_tile_nocrc_{n}t": lambda n=n: [
                dc.decode_tile(b, n_threads=n, verify_crc=False) for b in blobs
            ],
            f"crc_only_{n}t": lambda n=n: [_checksum.crc32_range(t._buf, 64, n) for t in tiles],
        }
    per_round = [interleaved_times(variants, repeats) for _ in range(rounds)]
    pooled = {name: statistics.median(t for r in per_round for t in r[name]) for name in variants}
    out = speed_summary(pooled, nnz)
    summaries = [
        speed_summary({name: statistics.median(t) for name, t in times.items()}, nnz)
        for times in per_round
    ]
    for key in out:
        if key.startswith(("ratio", "speedup")):
            out[key] = statistics.median(summary[key] for summary in summaries)
    out["rounds"] = [{key: summary[key] for key in ROUND_KEYS} for summary in summaries]
    return out


def memory_copy_speeds(n_bytes: int, repeats: int) -> dict:
    """GB/s moved (read + write) by numpy copying ``n_bytes`` on 1 thread and on 2 threads.

    A probe of how this machine's memory bandwidth grows with the second core. Decoding must
    write its output (8 bytes per nonzero) to memory, which zstd alone does not, so its 2-thread
    speed-up is held to something between zstd's and this one.
    """
    src = np.ones(n_bytes // 4, np.float32)
    dst = np.zeros_like(src)
    middle = len(src) // 2
    halves = [(dst[:middle], src[:middle]), (dst[middle:], src[middle:])]

    def two_threads() -> None:  # numpy releases the GIL while copying
        threads = [threading.Thread(target=np.copyto, args=half) for half in halves]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    seconds = interleaved_times({"1t": lambda: np.copyto(dst, src), "2t": two_threads}, repeats)
    out = {f"copy_gb_per_s_{n}": 2 * src.nbytes / statistics.median(t) / 1e9
           for n, t in seconds.items()}  # fmt: skip
    out["speedup_2t"] = out["copy_gb_per_s_2t"] / out["copy_gb_per_s_1t"]
    return out


def level_table(matrix: sp.csr_matrix, levels: list[int], repeats: int) -> list[dict]:
    rows = []
    nnz = matrix.nnz
    for level in levels:
        reps = repeats if level < 15 else 1  # the highest levels take seconds per encode
        blob = dc.encode_tile(matrix, level=level)
        encode_s = median_time(lambda level=level: dc.encode_tile(matrix, level=level), reps)
        tile = dc.Tile(blob)
        decode_s = median_time(lambda tile=tile: tile.decode(np.float32), repeats)
        rows.append({
            "level": level,
            "bytes_per_nnz": len(blob) / nnz,
            "encode_s": encode_s,
            "encode_mnnz_per_s": nnz / encode_s / 1e6,
            "decode_mnnz_per_s": nnz / decode_s / 1e6,
        })  # fmt: skip
        print(
            f"  level {level:2d}: {rows[-1]['bytes_per_nnz']:.4f} B/nnz, encode "
            f"{encode_s:.3f} s, decode {rows[-1]['decode_mnnz_per_s']:.0f} Mnnz/s",
            flush=True,
        )
    return rows


def plot(results: dict, path: Path) -> None:
    fig, axes = page_figure(3, panel_height=2.6)
    sizes = results["sizes_bytes_per_nnz"]
    names = list(sizes)
    axes[0].barh(names, [sizes[n] for n in names], color="tab:blue")
    axes[0].set_xlabel("bytes per nonzero (smaller is better)")
    axes[0].set_title("Size of X")
    speeds = results["decode"]["10k-cell tiles"]
    keys = [k for k in speeds if not k.startswith(("ratio", "speedup", "crc", "rounds"))]
    axes[1].barh(keys, [speeds[k] / 1e6 for k in keys], color="tab:green")
    axes[1].set_xlabel("million nonzeros / s (higher is better)")
    axes[1].set_title("Decode, 10k-cell tiles")
    table = results["levels"]
    axes[2].plot([r["encode_mnnz_per_s"] for r in table], [r["bytes_per_nnz"] for r in table], "o-")
    for r in table:
        axes[2].annotate(str(r["level"]), (r["encode_mnnz_per_s"], r["bytes_per_nnz"]))
    axes[2].set_xscale("log")
    axes[2].set_xlabel("encode Mnnz/s (log)")
    axes[2].set_ylabel("bytes per nonzero")
    axes[2].set_title("zstd level trade-off (labels: level)")
    save_figure(fig, path, f"deltacells codec on {results['data']}", results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3, help="decode timing rounds (see JSON)")
    parser.add_argument("--levels", default="1,2,3,5,7,9,12,15,19")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "codec.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "_static" / "bench_codec.png")
    args = parser.parse_args()

    matrix = sp.csr_matrix(ad.read_h5ad(args.data).X).astype(np.int32)
    totals = np.asarray(matrix.sum(axis=0)).ravel()
    sorted_matrix = sp.csr_matrix(matrix[:, np.argsort(-totals, kind="stable")])
    sorted_matrix.sort_indices()
    nnz = matrix.nnz
    print(f"{args.data.name}: {matrix.shape[0]} cells x {matrix.shape[1]} genes, {nnz} nonzeros")
    results: dict = {"data": args.data.name, "shape": list(matrix.shape), "nnz": nnz,
                     "machine": machine(), "repeats": args.repeats, "rounds": args.rounds,
                     "default_level": DEFAULT_LEVEL,
                     "command": "python benchmarks/bench_codec.py"}  # fmt: skip

    workdir = Path(tempfile.mkdtemp(prefix="dc-bench-"))
    try:
        reference = anndata_x_sizes(matrix, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    results["anndata"] = reference
    sizes = {
        "anndata h5ad gzip": reference["h5ad_gzip_x_bytes"] / nnz,
        "anndata zarr": reference["zarr_x_bytes"] / nnz,
    }
    print("sizes (bytes per nonzero):")
    for level in sorted({3, 9, 19, DEFAULT_LEVEL}):
        for label, m in (("sorted", sorted_matrix), ("unsorted", matrix)):
            for layout, size in (("one tile", None), ("10k-cell tiles", 10_000)):
                total = sum(len(t) for t in tiles_of(m, size, level, 2))
                key = f"deltacells L{level} {label}, {layout}"
                sizes[key] = total / nnz
                print(f"  {key}: {total / nnz:.4f}", flush=True)
    results["sizes_bytes_per_nnz"] = sizes
    default_sorted = sizes[f"deltacells L{DEFAULT_LEVEL} sorted, 10k-cell tiles"]
    results["size_ratios_default_level_sorted"] = {
        "vs_h5ad_gzip": default_sorted / sizes["anndata h5ad gzip"],
        "vs_zarr": default_sorted / sizes["anndata zarr"],
    }

    results["decode"] = {}
    for layout, size in (("one tile", None), ("10k-cell tiles", 10_000)):
        print(f"decode ({layout}, default level, sorted genes):")
        blobs = tiles_of(sorted_matrix, size, DEFAULT_LEVEL, 2)
        speeds = decode_speeds(blobs, args.repeats, args.rounds)
        results["decode"][layout] = speeds
        for key, value in speeds.items():
            if key == "rounds":
                for i, r in enumerate(value):
                    print(f"  round {i + 1}: " + ", ".join(f"{k} {r[k]:.3f}" for k in ROUND_KEYS))
            elif key.startswith(("ratio", "speedup")):
                print(f"  {key}: {value:.3f}")
            else:
                print(f"  {key}: {value / 1e6:,.1f} M nnz/s")

    copy = memory_copy_speeds(8 * nnz, args.repeats)
    results["memory_copy_of_decoded_size"] = copy
    print(f"numpy copy of {8 * nnz / 1e6:.0f} MB (the decoded size): "
          f"{copy['copy_gb_per_s_1t']:.1f} GB/s on 1 thread, {copy['copy_gb_per_s_2t']:.1f} on 2 "
          f"(speed-up {copy['speedup_2t']:.2f})")  # fmt: skip

    print("encode of the same data (2 threads):")
    encode_s = median_time(lambda: dc.encode_tile(sorted_matrix, n_threads=2), 3)
    results["encode_default_s"] = encode_s
    results["encode_vs_h5ad_gzip_write"] = encode_s / reference["h5ad_gzip_write_s"]
    h5ad_s = reference["h5ad_gzip_write_s"]
    print(f"  default level: {encode_s:.3f} s; anndata gzip h5ad write {h5ad_s:.3f} s")

    print("level table (sorted genes, one tile):")
    levels = [int(x) for x in args.levels.split(",")]
    results["levels"] = level_table(sorted_matrix, levels, args.repeats)

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))
    plot(results, args.plot)
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
