"""The second pass of a write: tiles built from the inputs' rows and encoded, locally or on
a dask cluster, each written atomically with its checksum records.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import OrderedDict

import anndata as ad
import numpy as np
import scipy.sparse as sp

from deltacells.codec.format import HEADER_SIZE
from deltacells.codec.tile import (
    encode_tile,
)
from deltacells.store.integrity import tile_checksum_row
from deltacells.store.manifest import (
    tile_name,
)
from deltacells.store.storage import Store
from deltacells.write.inputs import (
    _open_part,
    _Part,
)
from deltacells.write.plan import (
    _Plan,
    _remap_columns,
    _Settings,
    _tile_rows,
)


def _max_open_inputs() -> int:
    """How many file inputs a reordered write keeps open: a quarter of the soft limit on
    open files (at least 4), leaving the rest to the process."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1024 if soft == resource.RLIM_INFINITY else max(4, soft // 4)


def _tile_matrix(
    parts: list[_Part], plan: _Plan, rows: np.ndarray, contiguous: bool, cache: dict,
    opened: OrderedDict | None = None,
) -> sp.csr_matrix:
    """The counts of global rows ``rows`` in stored gene order.

    In order, an input is released once its last row is read. Reordered, any tile may need
    any input: the inputs used last stay open (in ``opened``), up to :func:`_max_open_inputs`.
    """
    pieces, positions = [], []
    keep_open = _max_open_inputs() if opened is not None else 0
    part_of = np.searchsorted(plan.offsets, rows, side="right") - 1
    for p in np.unique(part_of):
        mine = np.flatnonzero(part_of == p)
        local = rows[mine] - plan.offsets[p]
        if contiguous:
            key = (int(p), int(local[0]), int(local[-1]) + 1)
            block = cache.pop(key) if key in cache else parts[p].reader.block(*key[1:])
            if key[2] == parts[p].n_obs:  # in order, so this input is done with
                parts[p].release()
        else:
            order = np.argsort(local, kind="stable")
            block = parts[p].reader.rows(local[order])[np.argsort(order)]
            if opened is not None:
                opened[p] = None
                opened.move_to_end(p)
                while len(opened) > keep_open:
                    parts[opened.popitem(last=False)[0]].release()
        pieces.append(_remap_columns(sp.csr_matrix(block), plan.col_maps[p], plan.n_genes))
        positions.append(mine)
    matrix = sp.vstack(pieces, format="csr") if len(pieces) > 1 else pieces[0]
    if not contiguous and len(pieces) > 1:
        matrix = matrix[np.argsort(np.concatenate(positions))]
    return matrix



def _write_tiles(store, parts, plan, tile_size, n_chunks, level, n_threads, progress, cache):
    n_tiles = -(-plan.n_cells // tile_size)
    records = []
    bar = progress(range(n_tiles), total=n_tiles, desc="encoding tiles")
    ticks = iter(bar)
    # tqdm counts an item when the next one is asked for: start the bar now, so that the
    # tick after each written tile counts it and the last one closes the bar at n/n.
    next(ticks, None)
    opened: OrderedDict = OrderedDict()
    for t in range(n_tiles):
        records.append(_encode_tile_to(store, parts, plan, t, tile_size, n_chunks, level,
                                       n_threads, cache, opened))  # fmt: skip
        next(ticks, None)
    return _columns(records)


def _encode_tile_to(store: Store, parts, plan: _Plan, t: int, tile_size: int, n_chunks: int,
                    level: int, n_threads, cache: dict, opened: OrderedDict,
                    rows: np.ndarray | None = None) -> tuple[int, int, int, int]:  # fmt: skip
    """Encode tile ``t`` and write it; return what the manifest records of it (cells,
    nonzeros, bytes, the header's CRC). ``rows``: the tile's source rows of a reordered
    write, when ``plan`` does not carry the cell order."""
    in_order = rows is None and plan.cell_order is None
    rows = _tile_rows(plan, t, tile_size) if rows is None else rows
    matrix = _tile_matrix(parts, plan, rows, in_order, cache, opened)
    blob = encode_tile(matrix, n_chunks=n_chunks, level=level, n_threads=n_threads)
    store.write_atomic(tile_name(t), blob)
    nnz = int(np.frombuffer(blob, "<u8", 1, 24)[0])
    return (matrix.shape[0], nnz, len(blob), int.from_bytes(blob[56:60], "little"),
            bytes(blob[:HEADER_SIZE]), tile_checksum_row(blob))  # fmt: skip


def _columns(records: list) -> tuple[list, ...]:
    """The tiles' records as columns: cells, nonzeros, bytes, CRC-32, headers, checksum rows."""
    if not records:
        return [], [], [], [], [], []
    return tuple(list(c) for c in zip(*records, strict=True))


@contextlib.contextmanager
def _local_client(n_workers: int):
    """A dask.distributed ``LocalCluster`` of ``n_workers`` processes and its client, for one
    write. One thread each: distributed starts workers with ``OMP_NUM_THREADS=1``, so their
    kernels run on one thread too, and the workers are the parallelism."""
    try:
        from distributed import Client, LocalCluster
    except ImportError as err:  # pragma: no cover - exercised without the extra
        raise ImportError("n_workers > 1 needs dask.distributed: pip install "
                          "'deltacells[dask]'") from err  # fmt: skip
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:  # fmt: skip
        yield client


#: Tiles one dask task encodes: enough work to amortise opening the inputs, small enough to
#: balance the workers.
TILES_PER_TASK = 4


def _encode_task(inputs: tuple, layer, use_raw, plan: _Plan, tile_size: int, n_chunks: int,
                 level: int, n_threads, store: Store, tiles: list[int],
                 tile_rows: list[np.ndarray] | None = None) -> list:  # fmt: skip
    """One dask task: open the inputs its tiles' rows are in, here (files are read by the
    worker, not shipped; their counts only, not obs and var), then encode and write
    ``tiles`` (whose source rows are ``tile_rows`` in a reordered write). The other inputs
    stay unopened: a task's cost does not grow with the atlas."""
    reordered = tile_rows is not None
    if tile_rows is None:
        tile_rows = [_tile_rows(plan, t, tile_size) for t in tiles]
    rows = np.concatenate(tile_rows)
    needed = set(np.unique(np.searchsorted(plan.offsets, rows, side="right") - 1).tolist())
    parts = [_open_part(item, layer, use_raw, tables=False) if p in needed else None
             for p, item in enumerate(inputs)]  # fmt: skip
    try:
        opened: OrderedDict = OrderedDict()
        return [(t, _encode_tile_to(store, parts, plan, t, tile_size, n_chunks, level,
                                    n_threads, {}, opened, own if reordered else None))
                for t, own in zip(tiles, tile_rows, strict=True)]  # fmt: skip
    finally:
        for part in parts:
            if part is not None:
                part.close()


def _write_tiles_distributed(client, store: Store, s: _Settings, plan: _Plan, progress):
    """Pass 2 on dask.distributed: a task per few tiles opens the inputs on its worker and
    writes its tiles to the target; the tiles are those of the single-process writer."""
    from distributed import as_completed

    n_tiles = -(-plan.n_cells // s.tile_size)
    # Files travel as paths; in-memory AnnData once per worker that needs it.
    inputs = tuple(client.scatter(item, broadcast=False) if isinstance(item, ad.AnnData)
                   else item for item in s.inputs)  # fmt: skip
    # What every worker needs, without the per-cell arrays (a shuffled 100M-cell atlas's cell
    # order is 800 MB): each task gets its own tiles' rows instead.
    shared = dataclasses.replace(plan, cell_order=None, var=plan.var.iloc[:0], spatial=None)
    plan_future = client.scatter(shared, broadcast=False)
    groups = [list(range(t, min(t + TILES_PER_TASK, n_tiles)))
              for t in range(0, n_tiles, TILES_PER_TASK)]  # fmt: skip
    futures = [client.submit(_encode_task, inputs, s.layer, s.use_raw, plan_future, s.tile_size,
                             s.n_chunks, s.zstd_level, s.n_threads, store, group,
                             None if plan.cell_order is None
                             else [_tile_rows(plan, t, s.tile_size) for t in group],
                             pure=False) for group in groups]  # fmt: skip
    records: dict[int, tuple] = {}
    bar = progress(range(n_tiles), total=n_tiles, desc="encoding tiles (dask)")
    ticks = iter(bar)
    next(ticks, None)
    for future in as_completed(futures):
        for t, record in future.result():
            records[t] = record
            next(ticks, None)
    return _columns([records[t] for t in range(n_tiles)])
