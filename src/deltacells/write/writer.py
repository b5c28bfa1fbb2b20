"""Write AnnData (in memory, backed, or .h5ad / .zarr files, or a list of them) as a dataset.

Two passes over the counts, each in row blocks so X is never loaded whole: the first checks
every value and adds up gene totals (for the gene order), the second encodes tiles. Nothing is
written before the first pass succeeds. Tiles and shards appear atomically, the manifest last.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from deltacells.codec import _encode
from deltacells.codec.arguments import check_flags, check_ints
from deltacells.codec.format import MAGIC, FormatError
from deltacells.codec.npy import npy_bytes
from deltacells.codec.tile import (
    DEFAULT_LEVEL,
    DEFAULT_N_CHUNKS,
)
from deltacells.read.matrix_part import CELL_ORDER_FILE
from deltacells.store.elements import ANNDATA_GROUP, layer_names
from deltacells.store.integrity import chunk_sums_record, file_record
from deltacells.store.manifest import (
    GENE_ORDER_NAME,
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    METADATA_KEYS,
    OBS_INDEX_COLUMN,
    OBS_SCHEMA_NAME,
    TILE_SUMS_NAME,
    VAR_NAMES_NAME,
    VAR_TABLE_NAME,
    Manifest,
    StoredParts,
)
from deltacells.store.storage import Store, open_store
from deltacells.write.defaults import DEFAULT_TILE_SIZE
from deltacells.write.inputs import (
    _open_group,
    _open_part,
    _Part,
)
from deltacells.write.obs import ObsInputs, plan_obs, write_obs
from deltacells.write.plan import (
    _align_genes,
    _check_and_total,
    _check_and_total_distributed,
    _obs_summaries_distributed,
    _Plan,
    _resolve_gene_order,
    _Settings,
    _settle_tile_size,
    _tile_rows,
)
from deltacells.write.tiles import (
    _local_client,
    _write_tiles,
    _write_tiles_distributed,
)

__all__ = ["DEFAULT_TILE_SIZE", "OBS_INDEX_COLUMN", "write_deltacells"]

CELL_ORDER_NAME = CELL_ORDER_FILE
#: Cells per chunk by default when writing in spatial order.
SPATIAL_CELLS_PER_CHUNK = 64


def _progress_factory(progress: bool) -> Callable:
    if not progress:
        return lambda iterable, **_: iterable
    from deltacells.write.progress import progress as progress_of

    # The bars stay as a one-line summary of each pass once it is done.
    return lambda iterable, **kwargs: progress_of(iterable, **{"unit": "tile", **kwargs})


#: Names a dataset written by this package may hold (FORMAT.md's layout plus the writer's
#: own files and the temporary files of an interrupted atomic write).
_OWN_FILE = re.compile(
    r"((layers/[^/]+|raw)/)?"  # count layers and raw are datasets of their own
    r"(manifest\.json|gene_order\.npy|var_names\.txt|var\.parquet|cell_order\.npy"
    r"|spatial/(tile_offsets|centroids|shapes|geometry_offsets)\.npy|spatial/geometry\.wkb"
    r"|genes/block_\d{6}\.dct|(tiles|genes)/chunk_crc32\.bin|spatial/grid_crc32\.npy"
    r"|obs/schema\.json|tiles/tile_\d{6}\.dct|obs/obs_\d{4}\.parquet"
    r"|((tiles|obs|spatial|genes)/)?\.[^/]+\.tmp)"
    r"|anndata\.zarr/.+"  # anndata's element IO
)
_OWN_DIRS = re.compile(
    r"((layers/[^/]+|raw)/)?(tiles|obs)|layers(/[^/]+)?|raw|spatial|genes|anndata\.zarr(/.+)?"
)


def _check_target(store: Store, overwrite: bool) -> bool:
    """Whether writing to ``store`` replaces a dataset (raises if it must not be written).

    Overwrite only replaces what is provably a deltacells dataset: every entry has a name of
    the format's layout (no other files, no links, FIFOs or extra folders), and either the
    manifest is valid or, for an interrupted write without one, every tile starts with the
    tile magic. Anything else is refused and nothing is deleted.
    """
    entries = store.entries()
    if not entries:
        return False
    foreign = [
        name
        for name, kind in entries
        if not ((kind == "file" and _OWN_FILE.fullmatch(name)) or
                (kind == "dir" and _OWN_DIRS.fullmatch(name)))
    ]  # fmt: skip
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        if not overwrite:  # overwrite would not help: say so, not "pass overwrite=True"
            raise FileExistsError(
                f"{store.describe()} is not empty and not a deltacells dataset (it holds "
                f"{shown}); write into a new or empty folder"
            )
        raise FileExistsError(
            f"{store.describe()} holds entries that are not a deltacells dataset's ({shown}); "
            "refusing to replace it even with overwrite=True"
        )
    if not overwrite:
        raise FileExistsError(
            f"{store.describe()} is not empty; pass overwrite=True (deltacells convert "
            "--overwrite) to replace the deltacells dataset there"
        )
    names = {name for name, kind in entries if kind == "file"}
    try:
        if MANIFEST_NAME in names:
            Manifest.from_json_text(store.read_bytes(MANIFEST_NAME, max_size=MAX_MANIFEST_BYTES))
        else:
            for name in sorted(n for n in names if n.startswith("tiles/tile_")):
                if store.read_range(name, 0, len(MAGIC)) != MAGIC:
                    raise FormatError(f"{store.describe(name)}: not a deltacells tile")
    except FormatError as err:
        raise FileExistsError(
            f"{store.describe()} is not a valid deltacells dataset ({err}); refusing to "
            "replace it even with overwrite=True"
        ) from None
    return True


def write_deltacells(
    source: Any,
    path: str | os.PathLike,
    *,
    tile_size: int | None = None,
    n_chunks: int | None = None,
    zstd_level: int = DEFAULT_LEVEL,
    gene_order: str | Sequence[int] | np.ndarray = "total_counts",
    obs: bool = True,
    var: bool = True,
    layer: str | None = None,
    use_raw: bool = False,
    join: str = "same",
    shuffle: bool = False,
    seed: int = 0,
    cell_order: Sequence[int] | np.ndarray | None = None,
    spatial_key: str | None = None,
    shapes: Any = None,
    grid_tile_size: float | tuple[float, float] | None = None,
    origin: tuple[float, float] | None = None,
    gene_major: bool = False,
    obs_exclude: Sequence[str] | str = (),
    max_categories: int = 20_000,
    obs_tiles_per_file: int = 1000,
    n_threads: int | None = None,
    n_workers: int = 1,
    client: Any = None,
    overwrite: bool = False,
    progress: bool = True,
    storage_options: dict | None = None,
    metadata: dict | None = None,
    cache_bytes: int = 2**28,
    elements: bool = True,
) -> Manifest:
    """Write an AnnData (counts, obs, var and the rest) as a deltacells dataset.

    Parameters
    ----------
    source
        An :class:`~anndata.AnnData` (in memory, with X as CSR, CSC or dense, or backed), a path
        to a ``.h5ad`` file or ``.zarr`` store, or a list of these (an atlas: cells
        concatenated in order, genes aligned by name). Files and backed data are read in row
        blocks; X is never loaded whole.
    path
        Target directory or fsspec URL. It must be empty unless ``overwrite=True`` (which only
        replaces an existing deltacells dataset).
    tile_size
        Cells per tile. ``None`` (default): :data:`.DEFAULT_TILE_SIZE`, or fewer for data with
        many counts above 65535 (each such count is an exception, and a tile may hold at most
        ``max(1024, nnz / 200)``): the writer then picks the largest size that fits and warns.
        An explicit size that cannot hold the data is refused naming the size that would.
    n_chunks
        Independently decodable chunks per tile: the unit a row selection decompresses. The
        default is 8, or one chunk per 64 cells for spatial order (a box's cells are a few
        short runs of rows, so small chunks are what it decodes and, with
        ``ranged_reads``, fetches). 8 (about 512 cells per chunk with 4,096-cell tiles) keeps
        files smallest and
        whole-tile decoding fastest; random cell access (``X[random_rows]``,
        ``Loader(shuffle="cells")``) decompresses every chunk a selected cell lives in, so for
        it write ``n_chunks=tile_size // 8`` or so, at a cost of a few percent in size and
        slower whole-tile decoding (the read benchmark compares both layouts).
    zstd_level
        zstd level; the default balances size and speed (see the codec benchmark), 19 is the
        smallest.
    gene_order
        ``"total_counts"`` (genes by decreasing total counts over all cells, ties in source
        order; smallest files), ``"none"``, or a permutation (stored column ``j`` is source
        column ``gene_order[j]``).
    obs, var
        Write the obs table / the var table and gene names.
    layer, use_raw
        Take counts from ``layers[layer]`` or from ``.raw`` instead of X.
    join
        For a list of inputs: ``"same"`` (identical gene sets, the default), ``"inner"``
        (genes in all inputs) or ``"outer"`` (genes in any input, zeros where absent).
    shuffle, seed
        Write cells in a seeded random order (recorded in ``cell_order.npy``), so contiguous
        reads are random samples for training. Reads then give the stored order;
        ``read_deltacells(..., row_order="source")`` gives the input's (likewise for
        ``cell_order`` and ``spatial_key``).
    cell_order
        Write cells in this order instead: stored row ``i`` is source row ``cell_order[i]``
        (a permutation; recorded in ``cell_order.npy``).
    spatial_key, shapes, grid_tile_size, origin
        Spatial order (RFC 4, see ``docs/spatial.md``): cells stably sorted by the grid tile of
        their centroid, taken from ``obsm[spatial_key]`` (x, y) or from ``shapes``, a
        GeoDataFrame or GeoParquet path with one shape per cell indexed by obs name (points,
        points with a ``radius`` column for circles, polygons, multipolygons). The grid has
        square tiles of ``grid_tile_size`` from ``origin`` (default: the centroids' lower-left
        corner and tiles holding about 250 cells on average). Stores the grid, the margin,
        ``spatial/tile_offsets.npy``, the centroids and shapes in stored order, and the cell
        order; :meth:`Dataset.query_bbox` and ``read_deltacells(..., bbox=...)`` use them.
        A single input only; not with ``shuffle`` or ``cell_order``.
    gene_major
        Also build the gene-major companion (``genes/``: each block of up to 65,536 cells
        transposed, same codec; block size chosen from the data), so that one gene for every
        cell is a few small reads (:meth:`Dataset.genes`, ``adata[:, ["CD3E"]].X``). Adds
        about as many bytes as the tiles; it can be added later with
        ``deltacells add-gene-major``.
    obs_exclude
        obs columns to leave out (e.g. datetimes, which the format does not store): a list
        of names, or one name. A name that no input's obs has is refused (a typo would keep
        the column it meant).
    max_categories
        Categorical or string obs columns with more distinct values are stored as strings.
    obs_tiles_per_file
        Tiles (row groups) per obs parquet shard.
    n_threads
        Threads compressing chunks of a tile; ``None`` resolves like scikit-learn.
    n_workers, client
        Encode tiles on dask.distributed (``pip install 'deltacells[dask]'``): with a
        ``client``, on its cluster; else with ``n_workers > 1``, on a ``LocalCluster`` of that
        many worker processes started for this write. Each task opens the input files on its
        worker (in-memory AnnData are scattered once) and writes its tiles to ``path``, which
        all workers must reach (a shared directory or an object store). When every input is a
        file, the first pass (checks, gene totals, a summary of each input's obs) runs as
        tasks too; obs, the var table and the manifest are written by this process. 1 and no
        client: everything here.
    overwrite
        Replace an existing dataset at ``path``.
    progress
        Show tqdm progress bars.
    storage_options
        fsspec options for URL targets.
    metadata
        Extra JSON-serialisable entries for the manifest's ``metadata`` (not named as the
        writer's own entries, :data:`deltacells.store.manifest.METADATA_KEYS`).
    cache_bytes
        Input read from files is checked in a first pass and encoded in a second; up to this
        many bytes of checked blocks are kept between the passes so that small inputs are read
        once. Larger inputs are read twice and memory stays bounded by a few tiles.
    elements
        Also store the rest of a single input: layers and raw whose values are counts as
        deltacells matrices of their own (``layers/<name>/``, ``raw/``; sliced lazily like
        X), other layers and obsm, varm, obsp, varp and uns with anndata's element IO in the
        ``anndata.zarr`` group. Per-cell elements follow the stored cell order. Lists of
        inputs store X, obs and var only (with a warning if the inputs have more).

    Returns
    -------
    Manifest
        The manifest written last.

    Raises
    ------
    CountError
        For a value that is not a count, naming the file, cell and gene.
    ValueError
        For unsupported obs columns, mismatched genes and bad arguments.
    FileExistsError
        If ``path`` is not empty and ``overwrite`` is false.

    Notes
    -----
    The output is byte-identical for any ``n_threads`` and ``n_workers`` and for in-memory or
    on-disk input of the same data.

    For a list of files, memory does not grow with the atlas beyond a few bytes per cell:
    input files are open only while their counts are read, their obs is read one input at a
    time (once to plan the schema, once to write it) and a hash of each obs name is kept.
    Writing in another cell order (``shuffle``, ``cell_order``), where any tile may hold cells
    of any input, goes through a temporary Arrow file of the encoded obs, memory-mapped (in
    the directory ``TMPDIR`` names, about the size of the encoded obs), and keeps the cell
    order (8 bytes per cell).
    """
    # "~/data.h5ad" as pandas and fsspec take it (the target is not a folder named "~").
    path = _expand_user(path)
    source = [_expand_user(s) for s in source] if isinstance(source, list | tuple) \
        else _expand_user(source)  # fmt: skip
    obs_exclude = [obs_exclude] if isinstance(obs_exclude, str) else list(obs_exclude)
    check_ints({"tile_size": tile_size, "n_chunks": n_chunks, "zstd_level": zstd_level,
                "seed": seed, "max_categories": max_categories,
                "obs_tiles_per_file": obs_tiles_per_file, "n_workers": n_workers,
                "cache_bytes": cache_bytes},
               optional=("tile_size", "n_chunks"),
               at_least={"seed": 0, "max_categories": 0, "cache_bytes": 0, "n_workers": 1})
    check_flags({"obs": obs, "var": var, "use_raw": use_raw, "shuffle": shuffle,
                 "gene_major": gene_major, "overwrite": overwrite, "progress": progress,
                 "elements": elements})  # fmt: skip
    chosen_tile_size = tile_size is not None
    tile_size = DEFAULT_TILE_SIZE if tile_size is None else tile_size
    if tile_size < 1 or (n_chunks is not None and n_chunks < 1) or obs_tiles_per_file < 1:
        raise ValueError("tile_size, n_chunks and obs_tiles_per_file must be >= 1")
    if n_chunks is not None and n_chunks > tile_size:
        raise ValueError(f"n_chunks={n_chunks} is more than the {tile_size:,} cells of a tile "
                         "(tile_size), and a chunk holds at least one cell; chunks of 64 to 512 "
                         f"cells suit random reads (e.g. n_chunks={max(1, tile_size // 256)})")
    reserved = sorted(set(metadata or {}) & set(METADATA_KEYS))
    if reserved:
        raise ValueError(f"metadata keys {reserved} are the writer's own; name yours otherwise "
                         "(e.g. metadata={'my_" + reserved[0] + "': ...})")  # fmt: skip
    _check_options(zstd_level=zstd_level, layer=layer, use_raw=use_raw, spatial_key=spatial_key,
                   shapes=shapes, grid_tile_size=grid_tile_size, origin=origin, obs=obs,
                   obs_exclude=obs_exclude)  # fmt: skip
    sources = list(source) if isinstance(source, list | tuple) else [source]
    if not sources:
        raise ValueError("no source given")
    _check_target_path(path)
    target = open_store(path, storage_options)
    # Before reading any input: refusing a target should not wait for a pass over the counts.
    _check_target(target, overwrite)
    progress_bar = _progress_factory(progress)
    parts: list[_Part] = []
    cluster = contextlib.ExitStack()  # a LocalCluster started for this write
    try:
        for item in sources:
            parts.append(_open_part(item, layer, use_raw))
        var_names, col_maps, var_table = _align_genes(parts, join)
        n_genes = len(var_names)
        if n_genes == 0:
            raise ValueError("no genes to write (the inputs share none)" if len(parts) > 1
                             else f"{parts[0].label}: the input has no genes")  # fmt: skip
        if any("\n" in str(name) for name in var_names):
            raise ValueError("a gene name contains a newline, which var_names.txt cannot hold")
        on_disk = any(not p.in_memory for p in parts)
        # Blocks kept from pass 1 serve pass 2 only when both read the source in order.
        reordered = shuffle or cell_order is not None or spatial_key is not None \
            or shapes is not None  # fmt: skip
        dask_client = client if client is not None else (
            cluster.enter_context(_local_client(n_workers)) if n_workers > 1 else None)
        files_on_cluster = dask_client is not None and all(
            isinstance(item, str | os.PathLike) for item in sources)
        obs_plan = None
        if obs:
            obs_inputs = ObsInputs([p.read_obs for p in parts], [p.label for p in parts],
                                   obs_exclude, len(sources) > 1)  # fmt: skip
            # Files on a cluster: each worker summarises the obs of the files it reads.
            summaries = _obs_summaries_distributed(
                dask_client, sources, layer, use_raw, obs_inputs, max_categories,
                progress_bar) if files_on_cluster else None  # fmt: skip
            obs_plan = plan_obs(obs_inputs, max_categories, summaries)
        cache: dict = {}
        if files_on_cluster:
            totals, fitting = _check_and_total_distributed(
                dask_client, sources, parts, layer, use_raw, col_maps, n_genes, tile_size,
                progress_bar)  # fmt: skip
        else:
            # Blocks kept for pass 2 help only when this process writes the tiles.
            budget = cache_bytes if on_disk and not reordered and dask_client is None else 0
            totals, fitting = _check_and_total(parts, col_maps, n_genes, tile_size,
                                               progress_bar, cache, budget)  # fmt: skip
        tile_size = _settle_tile_size(tile_size, fitting, chosen_tile_size)
        if n_chunks is None:
            spatially = spatial_key is not None or shapes is not None
            n_chunks = max(DEFAULT_N_CHUNKS, tile_size // SPATIAL_CELLS_PER_CHUNK) \
                if spatially else DEFAULT_N_CHUNKS  # fmt: skip
        order = _resolve_gene_order(gene_order, totals)
        n_cells = sum(p.n_obs for p in parts)
        spatial = None
        if spatial_key is not None or shapes is not None:
            if shuffle or cell_order is not None or len(parts) > 1:
                raise ValueError("spatial order (spatial_key / shapes) takes a single input, "
                                 "without shuffle or cell_order")  # fmt: skip
            from deltacells.write.spatial_order import plan_spatial_order

            spatial = plan_spatial_order(sources[0], parts[0].read_obs().index,
                                         spatial_key=spatial_key,
                                         shapes=shapes, grid_tile_size=grid_tile_size,
                                         origin=origin)  # fmt: skip
            cell_order = spatial.cell_order
        elif shuffle:
            if cell_order is not None:
                raise ValueError("pass shuffle or cell_order, not both")
            cell_order = np.random.default_rng(seed).permutation(n_cells)
        elif cell_order is not None:
            cell_order = _check_permutation(cell_order, n_cells)
        stored_maps = col_maps
        if order is not None:
            inverse = np.empty(n_genes, dtype=np.int64)
            inverse[order] = np.arange(n_genes)
            stored: dict[int, np.ndarray] = {}  # shared maps stay shared
            stored_maps = [stored.setdefault(id(m), np.where(m >= 0, inverse[np.maximum(m, 0)],
                                                             -1)) for m in col_maps]  # fmt: skip
        plan = _Plan(
            n_cells=n_cells,
            n_genes=n_genes,
            col_maps=stored_maps,
            var_names=var_names if order is None else var_names[order],
            var=var_table if order is None else var_table.iloc[order],
            gene_order=order,
            cell_order=cell_order,
            offsets=np.concatenate([[0], np.cumsum([p.n_obs for p in parts])]).astype(np.int64),
            obs_names_unique=obs_plan is None or obs_plan.names_unique,
            obs_pandas=None if obs_plan is None else obs_plan.record,
            spatial=spatial,
        )

        # A dataset already there is replaced only at the end: the new one is written beside
        # it and swapped in whole, so a failed or killed write leaves the old one readable.
        # Checked again here: the target may have changed during the first pass.
        replacing = _check_target(target, overwrite)
        if replacing:
            store = target.staging_sibling()
        else:
            store = target
            existed = not store.is_local or os.path.lexists(store.describe())
            store.make_root()
        try:
            settings = _Settings(
                tile_size=tile_size, n_chunks=n_chunks, zstd_level=zstd_level,
                n_threads=n_threads, n_workers=n_workers, obs=obs, var=var, shuffle=shuffle,
                seed=seed, use_raw=use_raw, layer=layer, join=join, metadata=metadata,
                obs_tiles_per_file=obs_tiles_per_file,
                source=sources[0] if elements and len(sources) == 1 else None,
                storage_options=storage_options, inputs=tuple(sources),
                client=dask_client,
            )  # fmt: skip
            if elements and len(sources) > 1:
                _warn_if_dropped(sources)
            manifest = _write_dataset(store, parts, plan, obs_plan, settings, progress_bar, cache)
            if gene_major:
                from deltacells.read.dataset import open_dataset
                from deltacells.spatial.genemajor import add_gene_major

                written = open_dataset(store)
                add_gene_major(written, n_threads=n_threads, progress=lambda blocks: progress_bar(
                    blocks, desc="gene-major blocks"))  # fmt: skip
                manifest = written.manifest
            if replacing:
                _check_target(target, overwrite)  # still only a dataset of ours
                target.replace_with(store)
        except BaseException:
            # Nothing left behind that the user did not ask for: a failed overwrite leaves the
            # old dataset, a failed new write no folder at all (an empty folder that was
            # there before stays).
            store.remove_tree()  # the staging folder, or a target empty (or absent) before
            if not replacing and existed and store.is_local:
                store.make_root()
            raise
        return manifest
    finally:
        for part in parts:
            part.close()
        cluster.close()


def _write_dataset(
    store: Store, parts: list[_Part], plan: _Plan, obs_plan, settings: _Settings, progress_bar,
    cache: dict,
) -> Manifest:  # fmt: skip
    """Pass 2: tiles, gene and obs files, and the manifest last (the commit point)."""
    s = settings
    if s.client is not None:
        tile_cells, tile_nnz, tile_bytes, tile_crc32, headers, sum_rows = \
            _write_tiles_distributed(s.client, store, s, plan, progress_bar)  # fmt: skip
    else:
        tile_cells, tile_nnz, tile_bytes, tile_crc32, headers, sum_rows = _write_tiles(
            store, parts, plan, s.tile_size, s.n_chunks, s.zstd_level, s.n_threads,
            progress_bar, cache,
        )  # fmt: skip
    files: dict[str, dict] = {}

    def put(name: str, data: bytes) -> None:
        store.write_atomic(name, data)
        files[name] = file_record(data)

    chunk_sums, sums_data = chunk_sums_record(TILE_SUMS_NAME, sum_rows, headers)
    store.write_atomic(TILE_SUMS_NAME, sums_data)  # its rows are tied by chunk_sums
    if plan.gene_order is not None:
        put(GENE_ORDER_NAME, npy_bytes(plan.gene_order.astype(np.int32)))
    if s.var:
        names_text = "".join(f"{name}\n" for name in plan.var_names)
        put(VAR_NAMES_NAME, names_text.encode("utf-8"))
        put(VAR_TABLE_NAME, _var_parquet(plan.var))
    if plan.cell_order is not None:
        put(CELL_ORDER_NAME, npy_bytes(plan.cell_order.astype(np.int64)))
    if plan.spatial is not None:
        for name, data in plan.spatial.files().items():
            put(name, data)
    obs_fields: dict[str, Any] = {}
    if s.obs:
        obs_fields = write_obs(store, obs_plan, lambda t: _tile_rows(plan, t, s.tile_size),
                               plan.offsets, plan.cell_order, tile_cells,
                               s.obs_tiles_per_file)  # fmt: skip
        files[OBS_SCHEMA_NAME] = file_record(store.read_bytes(OBS_SCHEMA_NAME))
    extras = None
    if s.source is not None:
        from deltacells.write.extras import write_extras

        # Count layers and raw are stored in the same cell order as X.
        options = {"tile_size": s.tile_size, "n_chunks": s.n_chunks, "zstd_level": s.zstd_level,
                   "n_threads": s.n_threads, "cell_order": plan.cell_order,
                   "storage_options": s.storage_options}  # fmt: skip
        extras = write_extras(store, s.source, layer=s.layer, use_raw=s.use_raw,
                              gene_order=plan.gene_order, cell_order=plan.cell_order,
                              options=options, write_dataset=write_deltacells)  # fmt: skip
        # Nested datasets are tied by their manifests; anndata's element files one by one.
        stored = StoredParts(dict(extras["layers"]), extras["raw"], tuple(extras["elements"]))
        for location in stored.matrices:
            name = f"{location}/{MANIFEST_NAME}"
            files[name] = file_record(store.read_bytes(name))
        for name in store.list(ANNDATA_GROUP):
            files[name] = file_record(store.read_bytes(name))
    meta = {
        "writer": f"deltacells {_package_version()}",
        "anndata": extras,
        "obs_index_column": OBS_INDEX_COLUMN if s.obs else None,
        # What verify holds the index column to (AnnData allows repeated obs_names).
        "obs_names_unique": bool(plan.obs_names_unique) if s.obs else None,
        # Exact pandas dtypes and non-string names (deltacells.store.obs_dtypes).
        "obs_pandas": plan.obs_pandas if s.obs else None,
        "sources": [p.label for p in parts],
        "layer": "raw" if s.use_raw else s.layer,
        "join": s.join if len(parts) > 1 else None,
        "shuffle": {"seed": s.seed, "cell_order": CELL_ORDER_NAME} if s.shuffle else None,
        "cell_order": CELL_ORDER_NAME if plan.cell_order is not None else None,
        "spatial_index": plan.spatial.index.to_json() if plan.spatial is not None else None,
        # What readers decode into by default: the counts' dtype as written.
        "values_dtype": _written_dtype(parts),
    } | dict(s.metadata or {})
    manifest = Manifest(
        version=2,
        n_cells=plan.n_cells,
        n_genes=plan.n_genes,
        tile_size=s.tile_size,
        tile_cells=tile_cells,
        tile_nnz=tile_nnz,
        tile_bytes=tile_bytes,
        tile_crc32=tile_crc32,
        n_chunks=s.n_chunks,
        zstd_level=s.zstd_level,
        has_gene_order=plan.gene_order is not None,
        has_var_names=bool(s.var),
        has_var_table=bool(s.var),
        has_obs=bool(s.obs),
        metadata=meta,
        files=files,
        chunk_sums=chunk_sums,
        **obs_fields,
    )
    store.write_atomic(MANIFEST_NAME, manifest.to_json_text().encode("utf-8"))
    return manifest


def _written_dtype(parts: list[_Part]) -> str | None:
    """The dtype the inputs store their counts in (their common type), if numeric."""
    dtypes = [p.dtype for p in parts if p.dtype is not None]
    if not dtypes or len(dtypes) != len(parts):
        return None
    dtype = np.result_type(*dtypes)
    return dtype.name if dtype.kind in "iuf" else None


def _check_options(*, zstd_level, layer, use_raw, spatial_key, shapes, grid_tile_size, origin,
                   obs, obs_exclude) -> None:  # fmt: skip
    """Options that contradict each other or cannot work, refused before anything is read or
    written, naming the options (the command line says them as flags)."""
    lo, hi = _encode.zstd_level_range()
    if isinstance(zstd_level, bool) or not isinstance(zstd_level, int | np.integer) \
            or not lo <= int(zstd_level) <= hi:  # fmt: skip
        raise ValueError(f"zstd_level={zstd_level!r} is outside zstd's {lo}..{hi} (the default "
                         f"is {DEFAULT_LEVEL})")  # fmt: skip
    if layer is not None and use_raw:
        raise ValueError(f"layer={layer!r} and use_raw=True both say where the counts are; "
                         "pass one of them")  # fmt: skip
    if spatial_key is not None and shapes is not None:
        raise ValueError("spatial_key= and shapes= both give the cells' positions; pass one "
                         "(shapes= when the cells have polygons or circles)")  # fmt: skip
    if spatial_key is None and shapes is None and (grid_tile_size is not None
                                                   or origin is not None):  # fmt: skip
        raise ValueError("grid_tile_size= and origin= shape the spatial order, which needs "
                         "spatial_key= or shapes=")  # fmt: skip
    if not obs and len(obs_exclude):
        raise ValueError("obs=False stores no obs, so obs_exclude= has nothing to leave out; "
                         "pass one of them")  # fmt: skip


#: File names that say "AnnData file", not "dataset folder".
_ANNDATA_SUFFIXES = (".h5ad", ".h5", ".loom", ".zarr")


def _check_target_path(path: Any) -> None:
    """A target that cannot be a dataset folder, refused before anything is read."""
    text = os.fspath(path) if not isinstance(path, Store) else path.describe()
    name = text.rstrip("/").rsplit("/", 1)[-1]
    if name.lower().endswith(_ANNDATA_SUFFIXES):
        raise ValueError(f"{text}: a deltacells dataset is a folder, and this name is an "
                         "AnnData file's; pick another (e.g. "
                         f"{name.rsplit('.', 1)[0]}.dc) or check the order of source and "
                         "target")  # fmt: skip
    if isinstance(path, Store) or _is_url_path(text):
        return
    if os.path.isfile(text):
        raise FileExistsError(f"{text}: a file is there; a dataset is a folder: pick another "
                              "path")  # fmt: skip
    parent = os.path.dirname(os.path.abspath(text))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise FileExistsError(f"{text}: {parent} is a file, not a folder: pick another path")


def _expand_user(path: Any) -> Any:
    """A local path with ``~`` expanded; URLs, stores and AnnData objects as given."""
    if isinstance(path, str | os.PathLike) and not _is_url_path(os.fspath(path)):
        return os.path.expanduser(os.fspath(path))
    return path


def _is_url_path(text: str) -> bool:
    return "://" in text and not text.startswith("file://")


def _check_permutation(order: Any, n: int) -> np.ndarray:
    array = np.asarray(order)
    if array.ndim != 1 or array.dtype.kind not in "iu" or len(array) != n or not np.array_equal(
            np.sort(array), np.arange(n)):  # fmt: skip
        raise ValueError(f"cell_order must be a permutation of 0..{n - 1} (integers)")
    return array.astype(np.int64)


def _warn_if_dropped(sources: list) -> None:
    """Lists of inputs keep X, obs and var: say so, once, naming what any input (in memory or
    a file) has beyond them (a file's groups are only listed, not read)."""
    import warnings

    from deltacells.store.elements import ELEMENTS, ElementsWarning
    from deltacells.write.extras import has_raw

    names = (*ELEMENTS, "layers")
    found: set[str] = set()
    for item in sources:
        if isinstance(item, ad.AnnData):
            found.update(n for n in ELEMENTS if len(getattr(item, n)))
            found.update(["layers"] if layer_names(item) else [])
            found.update(["raw"] if item.raw is not None else [])
        else:
            group, closers = _open_group(Path(item))
            try:
                found.update(n for n in names if n in group and len(group[n]))
                found.update(["raw"] if has_raw(group) else [])
            finally:
                for close in closers:
                    close()
    extra = [n for n in (*names, "raw") if n in found]
    if extra:
        warnings.warn(
            f"writing a list of inputs keeps X, obs and var only; {', '.join(extra)} "
            "are left out (write each input on its own to keep them)",
            ElementsWarning,
            stacklevel=3,
        )


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deltacells")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


def _var_parquet(var: pd.DataFrame) -> bytes:
    try:
        table = pa.Table.from_pandas(var, preserve_index=True)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        raise ValueError(f"var cannot be stored as parquet: {err}") from None
    buffer = pa.BufferOutputStream()  # not a Python file object (see deltacells.read.dataset)
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue().to_pybytes()
