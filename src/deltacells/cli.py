"""The deltacells command: convert AnnData files to deltacells datasets, describe, verify."""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import sys
from collections.abc import Sequence

from deltacells.codec.format import FormatError
from deltacells.codec.tile import DEFAULT_LEVEL, DEFAULT_N_CHUNKS
from deltacells.read.dataset import open_dataset, stored_cell_order
from deltacells.spatial.genemajor import DEFAULT_BLOCK_CELLS, DEFAULT_CHUNK_GENES
from deltacells.write.defaults import DEFAULT_TILE_SIZE, JOINS

__all__ = ["main"]


def _count(n: int, noun: str) -> str:
    """``"1 tile"``, ``"2 tiles"``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _convert(args: argparse.Namespace) -> int:
    import warnings

    sources = args.src if len(args.src) > 1 else args.src[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        manifest = _write(args, sources)
    for warning in caught:  # what could not be kept, once each
        if issubclass(warning.category, UserWarning):
            print(f"deltacells convert: note: {warning.message}", file=sys.stderr)
    if not args.quiet:
        size = sum(manifest.tile_bytes)
        per_nnz = size / manifest.nnz if manifest.nnz else 0.0
        print(
            f"wrote {args.dst}: {manifest.n_cells:,} cells x {manifest.n_genes:,} genes in "
            f"{_count(manifest.n_tiles, 'tile')}, {size / 1e6:.1f} MB "
            f"({per_nnz:.3f} bytes/nonzero)"
        )
        for line in _kept(manifest):
            print(f"  {line}")
    return 0


def _kept(manifest) -> list[str]:
    """What the dataset holds besides X, one line per part."""
    meta = manifest.metadata
    lines = []
    if manifest.has_obs:
        changed = [c for c, e in (meta.get("obs_pandas") or {}).items() if "dtype" in e]
        lines.append(f"obs: kept, {_count(len(changed), 'column')} with their exact pandas "
                     "dtypes")  # fmt: skip
    record = meta.get("anndata") or {}
    layers = record.get("layers") or {}
    counts = [n for n, where in layers.items() if where != "."]
    same = [n for n, where in layers.items() if where == "."]
    if counts or same:
        lines.append("layers stored as count matrices: " + ", ".join(counts + [
            f"{n} (= X)" for n in same]))  # fmt: skip
    if record.get("raw"):
        lines.append("raw: stored as a count matrix" if record["raw"] == "raw" else "raw: is X")
    for name in record.get("elements") or []:
        what = "layers that are not counts" if name == "layers" else name
        lines.append(f"{what}: stored with anndata's element IO (anndata.zarr)")
    spatial = meta.get("spatial_index")
    if spatial:
        lines.append(_spatial_line(spatial))
    order = _order_line(stored_cell_order(meta))
    if order:
        lines.append(order)
    return lines


def _order_line(kind: str | None) -> str | None:
    """Reads give the stored cell order: say so, with the way back to the input's."""
    if kind is None:
        return None
    how = {"spatial": "by grid tile", "shuffled": "shuffled", "given": "in the given order"}
    return (f"cells stored {how.get(kind, kind)}: reads give that order; "
            "read_deltacells(..., row_order='source') gives the input's")


def _spatial_line(spatial: dict) -> str:
    nx, ny = spatial["grid_shape"]
    tx, ty = spatial["tile_size"]
    mx, my = spatial["margin"]
    return (f"spatial order: grid of {nx} x {ny} tiles of {tx:g} x {ty:g} from "
            f"({spatial['origin'][0]:g}, {spatial['origin'][1]:g}), margin ({mx:g}, {my:g})")


#: Seconds to reach a --scheduler before saying it did not answer.
SCHEDULER_TIMEOUT_S = 10.0


def _check_threads(threads: int | None) -> None:
    """``--threads -N`` that leaves no thread on this machine is a mistake, not "one"."""
    from deltacells.codec.threads import usable_cpu_count

    if threads == 0:  # before any input is read (the library would say so only later)
        raise ValueError("--threads 0 is not allowed; leave --threads out for the default "
                         "(OMP_NUM_THREADS or the usable CPUs) or pass a count >= 1")  # fmt: skip
    if threads is not None and threads < 0 and usable_cpu_count() + 1 + threads < 1:
        raise ValueError(f"--threads {threads} leaves no thread on this machine's "
                         f"{usable_cpu_count()} usable CPUs (-1 is all of them, -2 all but one); "
                         "pass a count >= 1 or leave --threads out")  # fmt: skip


def _write(args: argparse.Namespace, sources):
    _check_threads(args.threads)
    if args.scheduler:
        try:
            from distributed import Client
        except ImportError:
            raise ValueError("--scheduler needs dask.distributed: pip install "
                             "'deltacells[dask]'") from None  # fmt: skip
        if not args.quiet:
            print(f"connecting to the dask scheduler at {args.scheduler} (up to "
                  f"{SCHEDULER_TIMEOUT_S:g} s)", file=sys.stderr)  # fmt: skip
        try:
            client = Client(args.scheduler, timeout=SCHEDULER_TIMEOUT_S)
        except (OSError, TimeoutError) as err:
            raise ValueError(f"--scheduler {args.scheduler}: no dask scheduler answered within "
                             f"{SCHEDULER_TIMEOUT_S:g} s ({err}); start one (dask scheduler) "
                             "and its workers, check the address, or pass --workers N for a "
                             "cluster on this machine") from None  # fmt: skip
        with client:
            return _write_with(args, sources, client)
    return _write_with(args, sources, None)


def _write_with(args: argparse.Namespace, sources, client):
    # Imported here: the writer imports anndata, which `info` and `verify` do not need.
    from deltacells.write.writer import write_deltacells

    return write_deltacells(
        sources,
        args.dst,
        tile_size=args.tile_size,
        n_chunks=args.n_chunks,
        zstd_level=args.level,
        gene_order=args.gene_order,
        obs=not args.no_obs,
        var=not args.no_var,
        layer=args.layer,
        use_raw=args.raw,
        join=args.join,
        shuffle=args.shuffle,
        seed=args.seed,
        spatial_key=args.spatial_key,
        shapes=args.shapes,
        grid_tile_size=args.grid_tile_size,
        obs_exclude=args.obs_exclude,
        n_threads=args.threads,
        n_workers=args.workers,
        client=client,
        overwrite=args.overwrite,
        progress=not args.quiet,
        elements=not args.no_elements,
    )


def _info(args: argparse.Namespace) -> int:
    info = open_dataset(args.path).info()
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"{info['location']} (format version {info['version']})")
    print(f"  cells x genes    {info['n_cells']:,} x {info['n_genes']:,}")
    print(f"  tiles            {info['n_tiles']:,} of up to {info['tile_size']:,} cells, "
          f"{info['n_chunks']} chunks, zstd level {info['zstd_level']}")  # fmt: skip
    print(f"  nonzeros         {info['nnz']:,}")
    print(
        f"  tile bytes       {info['tile_bytes']:,} ({info['bytes_per_nonzero']:.3f} per nonzero)"
    )
    print(f"  genes sorted     {'by total counts' if info['gene_order'] else 'no'}")
    columns = info["obs_columns"]
    print(f"  obs columns      {len(columns):,}")
    for name, kind in columns.items():
        print(f"    {name}: {kind}")
    stored = info["stored_parts"]
    if stored["layers"] or stored["raw"] or stored["elements"]:
        print("  also stored")
        for name, where in stored["layers"].items():
            print(f"    layers[{name!r}]: {'X itself' if where == '.' else 'counts, ' + where}")
        if stored["raw"]:
            print(f"    raw: {'X itself' if stored['raw'] == '.' else 'counts, raw/'}")
        for name in stored["elements"]:
            print(f"    {'layers (not counts)' if name == 'layers' else name}: anndata.zarr")
    if info.get("spatial_index"):
        print(f"  {_spatial_line(info['spatial_index'])}")
    order = _order_line(info.get("cell_order"))
    if order:
        print(f"  {order}")
    if info.get("gene_major"):
        g = info["gene_major"]
        print(f"  gene-major       {g['n_blocks']} blocks of up to {g['block_cells']:,} cells, "
              f"{g['chunk_genes']} genes per chunk, {g['bytes']:,} bytes")  # fmt: skip
    unchecked = info["unchecked"]
    print(f"  integrity        {'every stored byte checked on read' if not unchecked else ''}")
    for part in unchecked:
        print(f"    not protected: {part}")
    return 0


def _export_spatialdata(args: argparse.Namespace) -> int:
    from deltacells.export import to_spatialdata

    out = to_spatialdata(args.path, args.out, shapes_name=args.shapes_name,
                         table_name=args.table_name, point_radius=args.point_radius,
                         overwrite=args.overwrite)  # fmt: skip
    print(f"wrote {out}: shapes/{args.shapes_name}, tables/{args.table_name}")
    return 0


def _add_gene_major(args: argparse.Namespace) -> int:
    from deltacells.spatial.genemajor import add_gene_major

    dataset = open_dataset(args.path)
    progress = None
    if not args.quiet:
        from deltacells.write.progress import progress as progress_of

        def progress(blocks):
            return progress_of(blocks, desc="gene-major blocks", unit="block")

    _check_threads(args.threads)
    record = add_gene_major(dataset, block_cells=args.block_cells, chunk_genes=args.chunk_genes,
                            n_threads=args.threads, progress=progress)  # fmt: skip
    if not args.quiet:
        print(f"{args.path}: gene-major companion of {record['n_blocks']} blocks, "
              f"{sum(record['block_bytes']) / 1e6:.1f} MB")  # fmt: skip
    return 0


def _verify(args: argparse.Namespace) -> int:
    if args.json:
        problems: list[str] = []
        unchecked: list[str] = []
        n_tiles = None
        try:
            dataset = open_dataset(args.path)
            n_tiles = dataset.manifest.n_tiles
            unchecked = dataset.unchecked_parts()
            problems = dataset.problems()
        except (FormatError, FileNotFoundError, OSError) as err:
            problems.append(str(err))
        # "error" (the first problem) is kept for scripts written before "problems".
        print(json.dumps({"path": args.path, "ok": not problems,
                          "error": problems[0] if problems else None, "problems": problems,
                          "unchecked": unchecked, "n_tiles": n_tiles}))  # fmt: skip
        return 1 if problems else 0
    dataset = open_dataset(args.path)
    progress = None
    if not args.quiet:
        from deltacells.write.progress import progress as progress_of

        def progress(tiles):
            return progress_of(tiles, desc="verifying tiles", unit="tile")

    dataset.verify(progress)
    if not args.quiet:
        print(f"{args.path}: OK ({_count(dataset.manifest.n_tiles, 'tile')}, CRC and full "
              "decode; every file against the manifest)")
        for part in dataset.unchecked_parts():
            print(f"  not protected (written before it could be): {part}")
    return 0


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help (where it has one worth showing); epilogs
    (examples, exit codes) kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        trivial = default is None or default is False or default == [] or default == "==SUPPRESS=="
        if not trivial and "default" not in text:
            text += " (default: %(default)s)"
        return text


EXIT_CODES = """exit status:
  0  success
  1  invalid data or a request the library refuses (the message names the file and problem)
  2  command-line usage error"""

EXAMPLES = {
    "convert": """examples:
  deltacells convert pbmc.h5ad pbmc.dc
  deltacells convert a.h5ad b.h5ad atlas.dc --join inner --shuffle
  deltacells convert processed.h5ad out.dc --layer counts     # X from layers["counts"]
  deltacells convert visium.h5ad visium.dc --spatial-key spatial  # for box queries
  deltacells convert a.h5ad b.h5ad c.h5ad s3://bucket/atlas.dc --join inner --workers 8
  deltacells convert in.h5ad s3://bucket/out.dc --overwrite""",
    "info": """examples:
  deltacells info pbmc.dc
  deltacells info s3://bucket/atlas.dc --json""",
    "add-gene-major": """examples:
  deltacells add-gene-major pbmc.dc
  deltacells add-gene-major s3://bucket/atlas.dc --block-cells 65536""",
    "export-spatialdata": """examples:
  deltacells export-spatialdata cells.dc cells.sdata.zarr
  deltacells export-spatialdata visium.dc visium.sdata.zarr --point-radius 27.5""",
    "verify": """examples:
  deltacells verify pbmc.dc
  deltacells verify atlas.dc --json""",
}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltacells")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``deltacells`` command."""
    parser = argparse.ArgumentParser(
        prog="deltacells", description=__doc__, formatter_class=_HelpFormatter,
        epilog="Run 'deltacells COMMAND --help' for a command's options.\n\n" + EXIT_CODES,
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"deltacells {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_text, description=help_text,
                              epilog=EXAMPLES[name] + "\n\n" + EXIT_CODES,
                              formatter_class=_HelpFormatter)  # fmt: skip

    convert = command("convert", "write .h5ad/.zarr inputs as a deltacells dataset")
    convert.add_argument("src", nargs="+", help="input .h5ad or .zarr (several: an atlas)")
    convert.add_argument("dst", help="target directory or fsspec URL (s3://, gs://, ...)")
    convert.add_argument("--tile-size", type=int, default=None,
                         help=f"cells per tile, one object each (default: {DEFAULT_TILE_SIZE}, "
                         "fewer for data with many counts above 65535)")
    convert.add_argument("--n-chunks", type=int, default=None,
                         help=f"independently decodable chunks per tile (default: "
                         f"{DEFAULT_N_CHUNKS}, or tile-size / 64 with --spatial-key/--shapes); "
                         "about tile-size / 8 for fast random-cell access")
    convert.add_argument("--level", type=int, default=DEFAULT_LEVEL,
                         help="zstd level (19: smallest, slowest to write)")
    convert.add_argument("--gene-order", choices=["total_counts", "none"], default="total_counts",
                         help="store genes by decreasing total counts (smallest files) or as given")
    convert.add_argument("--layer", help="take counts from this layer instead of X")
    convert.add_argument("--raw", action="store_true", help="take counts from .raw")
    convert.add_argument("--join", choices=JOINS, default="same",
                         help="several inputs: identical genes (same), genes in all (inner) or "
                         "in any (outer)")
    convert.add_argument("--shuffle", action="store_true",
                         help="write cells in a seeded random order (for training)")
    convert.add_argument("--seed", type=int, default=0, help="seed of --shuffle")
    convert.add_argument("--spatial-key", metavar="KEY",
                         help="store cells in spatial order by the grid tile of obsm[KEY] "
                              "(x, y), for box queries (see docs/spatial.md)")  # fmt: skip
    convert.add_argument("--shapes", metavar="GEOPARQUET",
                         help="order by these cell shapes instead (one per obs name: points, "
                              "circles with a radius column, polygons)")  # fmt: skip
    convert.add_argument("--grid-tile-size", type=float, default=None, metavar="SIZE",
                         help="side of the spatial grid's square tiles, in the coordinates' "
                              "units (default: about 250 cells per tile)")  # fmt: skip
    convert.add_argument("--obs-exclude", nargs="*", default=[], metavar="COLUMN",
                         help="obs columns to leave out")
    convert.add_argument("--no-obs", action="store_true", help="do not write obs")
    convert.add_argument("--no-var", action="store_true", help="do not write var")
    convert.add_argument("--no-elements", action="store_true",
                         help="store X, obs and var only (not layers, raw, obsm, uns, ...)")
    convert.add_argument("--threads", type=int, default=None,
                         help="compression threads (default: OMP_NUM_THREADS or usable CPUs)")
    convert.add_argument("--workers", type=int, default=1,
                         help="encode tiles on a dask LocalCluster of this many processes")
    convert.add_argument("--scheduler", metavar="ADDRESS",
                         help="encode tiles on this dask.distributed cluster (e.g. "
                         "tcp://host:8786); DST must be reachable from its workers")  # fmt: skip
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a deltacells dataset at DST (nothing else is ever deleted)")
    convert.add_argument("--quiet", action="store_true", help="no progress bars or summary")
    convert.set_defaults(run=_convert)

    info = command("info", "summarise a dataset: size, tiles, obs columns, stored parts")
    info.add_argument("path", help="dataset directory or URL")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    info.set_defaults(run=_info)

    verify = command("verify", "check every tile, shard, stored part and the manifest")
    verify.add_argument("path", help="dataset directory or URL")
    verify.add_argument("--json", action="store_true",
                        help='print {"ok": ..., "error": ...} as JSON')
    verify.add_argument("--quiet", action="store_true", help="no progress bar or OK line")
    verify.set_defaults(run=_verify)

    genes = command("add-gene-major", "add the gene-major companion (one gene for all cells in "
                    "a few small reads)")  # fmt: skip
    genes.add_argument("path", help="dataset directory or URL (written to in place)")
    genes.add_argument("--block-cells", type=int, default=DEFAULT_BLOCK_CELLS,
                       help="cells per block (1..65536; default: the most whose nonzeros fit "
                       "about 33M, so memory stays under about 0.8 GB)")  # fmt: skip
    genes.add_argument("--chunk-genes", type=int, default=DEFAULT_CHUNK_GENES,
                       help="genes per chunk: what reading one gene decompresses")
    genes.add_argument("--threads", type=int, default=None,
                       help="compression threads (default: OMP_NUM_THREADS or usable CPUs)")
    genes.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    genes.set_defaults(run=_add_gene_major)

    export = command("export-spatialdata", "write a spatially ordered dataset as a SpatialData "
                     "zarr store (RFC 4: shapes in tile order, table as CSR and CSC)")  # fmt: skip
    export.add_argument("path", help="dataset directory or URL (written with --spatial-key or "
                        "--shapes)")  # fmt: skip
    export.add_argument("out", help="the SpatialData .zarr directory to write")
    export.add_argument("--shapes-name", default="cells", help="name of the shapes element")
    export.add_argument("--table-name", default="table", help="name of the table")
    export.add_argument("--point-radius", type=float, default=None, metavar="R",
                        help="circle radius for cells stored as points (required for them: "
                        "spatialdata has no radius-0 shapes)")  # fmt: skip
    export.add_argument("--overwrite", action="store_true", help="replace OUT")
    export.set_defaults(run=_export_spatialdata)
    return parser


#: Library phrasing -> the flags a command-line user types.
_FLAG_LANGUAGE = (
    (re.compile(r"pass overwrite=True \(deltacells convert --overwrite\)"), "pass --overwrite"),
    (re.compile(r"pass layer='([^']+)' \(deltacells convert --layer [^)]+\)"), r"pass --layer \1"),
    (re.compile(r"pass use_raw=True \(deltacells convert --raw\)"), "pass --raw"),
    (re.compile(r"overwrite=True"), "--overwrite"),
    (re.compile(r"join='(\w+)'"), r"--join \1"),
    (re.compile(r"\bobs_exclude names \[([^\]]*)\]"),
     lambda m: "--obs-exclude names " + m.group(1).replace("'", "").replace(",", "")),
    (re.compile(r"\bseed must\b"), "--seed must"),
    (re.compile(r"\bn_workers must\b"), "--workers must"),
    (re.compile(r"obs_exclude=\[([^\]]*)\]"),
     lambda m: "--obs-exclude " + m.group(1).replace("'", "").replace(",", "")),
    (re.compile(r"use_raw=True"), "--raw"),
    (re.compile(r"\bspatial_key= or shapes="), "--spatial-key or --shapes"),
    (re.compile(r"\bzstd_level=(\S+) is outside"), r"--level \1 is outside"),
    (re.compile(r"\blayer='([^']+)' and"), r"--layer \1 and"),
    (re.compile(r"\bobs=False\b"), "--no-obs"),
    (re.compile(r"\bobs_exclude="), "--obs-exclude"),
    (re.compile(r"\bspatial_key="), "--spatial-key"),
    (re.compile(r"\bshapes="), "--shapes"),
    (re.compile(r"\bgrid_tile_size="), "--grid-tile-size"),
    (re.compile(r"\bgrid_tile_size must\b"), "--grid-tile-size must"),
    (re.compile(r"\borigin must\b"), "--origin must"),
    (re.compile(r"\borigin="), "--origin"),
    (re.compile(r"\bpoint_radius\b"), "--point-radius"),
    (re.compile(r"\bn_chunks=(-?\d+)"), r"--n-chunks \1"),
    (re.compile(r"\bn_threads=(-?\d+)"), r"--threads \1"),
    (re.compile(r"use None for the default"), "leave --threads out for the default"),
    (re.compile(r"\bblock_cells=(\d+)"), r"--block-cells \1"),
    (re.compile(r"\bblock_cells\b"), "--block-cells"),
    (re.compile(r"\btile_size\b"), "--tile-size"),
    (re.compile(r"\bn_chunks\b"), "--n-chunks"),
)


def _in_flag_language(message: str) -> str:
    for pattern, replacement in _FLAG_LANGUAGE:
        message = pattern.sub(replacement, message)
    return message


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (1 for invalid data, 2 for usage)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (FormatError, FileNotFoundError, FileExistsError, ValueError, KeyError) as err:
        text = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
        print(f"deltacells {args.command}: error: {_in_flag_language(text)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"deltacells {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as err:
        if not _stdout_is_closed():
            return _unexpected(args, err)
        # Whoever read our output stopped (`deltacells info ... | head`): end quietly, as
        # other command-line tools do (128 + SIGPIPE), with nothing left to flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as err:  # one line, never a traceback (unless asked for)
        return _unexpected(args, err)


def _unexpected(args: argparse.Namespace, err: Exception) -> int:
    if os.environ.get("DELTACELLS_DEBUG"):
        raise err
    print(f"deltacells {args.command}: error: {type(err).__name__}: {err} (set "
          "DELTACELLS_DEBUG=1 for the traceback)", file=sys.stderr)  # fmt: skip
    return 1


def _stdout_is_closed() -> bool:
    """Whether the broken pipe is our standard output (not, say, a remote store's socket):
    a pipe whose reader has gone polls as an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll here, or no real stdout
        return False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
