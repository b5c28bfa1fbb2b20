"""Shuffled minibatches of cells for training: :class:`Loader` and its PyTorch adapter.

An epoch is planned from ``(seed, epoch)`` alone, so every rank and worker derives the same
plan without talking to the others (:class:`~deltacells.train.plan.EpochPlan` draws it a
buffer at a time, so its memory grows with tiles, not cells):

1. the order of cells: ``"tiles"`` shuffles the tile order, groups it into buffers of
   ``buffer_tiles`` tiles and shuffles cells within each buffer; ``"cells"`` is one random
   permutation of all cells; ``"none"`` keeps the stored order;
2. ranks: the order is cut into ``world_size`` contiguous, equally long parts (padded by
   wrapping around to the start of the order, or shortened with ``drop_last``), so every rank
   yields the same number of batches and, in ``"tiles"`` mode, decodes only its own tiles;
3. batches: each part is cut into batches of ``batch_size`` cells, and the batches of a rank
   are split into contiguous runs, one per DataLoader worker.

A background thread builds the next batches while the consumer works. In ``"tiles"`` and
``"none"`` mode, batches in the source gene order with sorted rows (the default) are decoded
straight from the compressed tiles: each buffer's chunks once, every cell decoded, renumbered
and sorted while in cache and streamed into the batch that takes it. Other column choices
decode each tile a batch needs once into a small cache of decoded tiles and copy rows from
it. ``"cells"`` gathers only the chunks of the compressed tiles a batch's cells live in
(every batch touches every tile). The plans themselves are in :mod:`deltacells.train.plan`.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
from numpy.typing import DTypeLike

from deltacells.codec import _rows
from deltacells.codec._decode import ColumnMap
from deltacells.codec.arguments import check_ints
from deltacells.codec.scatter import gather_tiles_into_many
from deltacells.codec.threads import check_n_threads, effective_n_threads
from deltacells.codec.tile import Tile, _value_dtype, empty_output, gathered_indptr
from deltacells.read.dataset import Dataset, gather_cells, group_by_tile, open_dataset
from deltacells.read.obscache import ObsCache
from deltacells.store.manifest import tile_name
from deltacells.train.plan import (
    SHUFFLE_MODES,
    BatchRuns,
    EpochPlan,
    plan_epoch,
    split_batches,
)

__all__ = ["Batch", "BatchRuns", "EpochPlan", "Loader", "plan_epoch", "split_batches"]

OUTPUTS = ("scipy", "numpy", "torch", "torch_dense")


@dataclass
class Batch:
    """One minibatch.

    Attributes
    ----------
    X
        ``batch_size`` x genes: scipy CSR, numpy dense, or a torch sparse CSR / dense tensor.
    cells
        Global positions of the cells (rows of the dataset as stored).
    obs
        Requested obs columns: category codes (int32, -1 for missing), numbers (NaN for
        missing) or booleans (float32 with NaN when some are missing).
    """

    X: Any
    cells: np.ndarray
    obs: dict[str, np.ndarray]


class _DecodedTile:
    """A whole tile decoded once, with per-row totals and kept-column counts for batches."""

    def __init__(self, tile: Tile, dtype: np.dtype, col_map: np.ndarray | None, totals: bool,
                 n_threads: int, out: tuple[np.ndarray, np.ndarray]) -> None:  # fmt: skip
        self.buffers = out
        self.matrix = tile.decode(dtype, n_threads=n_threads, out=out)
        self.indptr = self.matrix.indptr.astype(np.int64, copy=False)
        # Library sizes over all genes, before any are dropped (only when normalising).
        self.totals = (
            _rows.row_sums(self.indptr, self.matrix.data, n_threads) if totals else None
        )
        if col_map is None:
            self.lengths = np.diff(self.indptr)
        else:
            self.lengths = _rows.kept_per_row(self.indptr, self.matrix.indices, col_map,
                                                 n_threads)  # fmt: skip
        self.nbytes = self.matrix.data.nbytes + self.matrix.indices.nbytes


class Loader:
    """Iterate minibatches of cells of a deltacells dataset, shuffled, sharded and prefetched.

    Parameters
    ----------
    source
        A dataset URL or path, or an opened :class:`~deltacells.Dataset`.
    batch_size
        Cells per batch.
    shuffle
        ``"tiles"`` (default: tile order shuffled, cells shuffled within buffers of
        ``buffer_tiles`` tiles), ``"cells"`` (fully random; every batch touches every tile, so
        it decodes far more per cell), ``"none"`` (stored order). ``True`` / ``False`` mean
        ``"tiles"`` / ``"none"``.
    seed
        Seed of the epoch plans; epoch ``n`` uses ``(seed, n)`` (the exact generators are in
        :class:`~deltacells.train.plan.EpochPlan`), so every rank and worker derives the
        same plan. A non-negative int.
    buffer_tiles
        Tiles whose cells are mixed together in ``"tiles"`` mode (default 2: 8,192 cells with
        the default tile size, as many as annbatch's default preload). About one buffer of
        decoded cells is held in memory (twice as many while a batch straddles two buffers):
        the batches a buffer feeds, or its decoded tiles, dropped as soon as no later batch
        needs them; from the second epoch on, compressed tiles are kept besides (see
        ``tile_cache_bytes``).
    drop_last
        Drop the cells that do not fill the ranks evenly and the last incomplete batch;
        otherwise ranks are padded by wrapping around to the start of the epoch's order (a few
        cells then appear twice in an epoch) and the last batch may be short.
    rank, world_size
        This process's shard (default: ``RANK`` / ``WORLD_SIZE`` from the environment, else
        0 / 1). Every rank yields the same number of batches.
    obs
        obs columns to put in each batch (category codes or numbers, from the local cache):
        names, one name, or None (none, as the default).
    genes
        Gene subset: names, or a boolean mask / integer positions in ``var`` order. Columns
        come out in the order given (masks: ``var`` order).
    normalize
        Target sum of per-cell library-size normalisation (counts over all genes, as
        ``scanpy.pp.normalize_total(target_sum=...)``): a positive number, or None.
    log1p
        Apply ``log1p`` after normalising (``scanpy.pp.log1p``).
    output
        ``"scipy"`` (CSR), ``"numpy"`` (dense), ``"torch"`` (sparse CSR tensor) or
        ``"torch_dense"``; torch is an optional extra.
    values_dtype
        ``float32`` (default) or ``float64``; ``int32`` without normalisation.
    column_order
        ``"source"`` (genes in the order they were written, as ``read_deltacells``) or
        ``"stored"`` (on-disk order, the fastest: rows are copied as decoded). Ignored when
        ``genes`` is given.
    sorted_indices
        ``True`` (default): canonical CSR, each row's columns in increasing order. ``False``
        (``output="scipy"`` only): rows keep their entries in the stored gene order, each
        renumbered to its output column but not sorted, and the matrix says so
        (``has_sorted_indices`` is False, so scipy sorts where an operation needs it).
        Putting rows back in order is most of the time of a source-order epoch; consumers that
        do not need it (a dense layer's ``X @ W``, ``toarray()``) get the stored order's
        speed with the source order's columns. Dense outputs never sort (they need not);
        ``shuffle="cells"`` batches come sorted either way.
    prefetch
        Batches built ahead of the consumer by the background thread.
    prefetch_tiles
        Tiles fetched ahead, in the order the epoch first needs them, while earlier ones
        decode. ``None``: :data:`.REMOTE_TILES_IN_FLIGHT` for remote stores (enough requests in
        flight to cover latency x bandwidth: 16 tiles of ~2.7 MB are 43 MB, more than a
        200 ms, 150 MB/s link holds in flight; ``benchmarks/bench_remote.py`` sweeps it),
        :data:`.LOCAL_TILES_IN_FLIGHT` for local files (the next tiles are read, into
        fresh pages when the loader keeps them, while the CPUs decode).
    tile_cache_bytes
        Most bytes of compressed tiles kept in memory. In the tile modes (``"tiles"``,
        ``"none"``), from a loader's second iteration (epoch) on, the tiles it reads, up to
        this many bytes, are kept and neither read nor checked again: from the third epoch
        on, a dataset that fits is decoded from memory (on a remote store, not fetched
        again), skipping about a tenth of a local epoch (``docs/benchmarks.md``). A loader
        iterated once keeps none (its first epoch runs in about one buffer of tiles, as
        before). In ``"cells"`` mode (every batch reads every tile) the most recently used
        tiles are kept while an epoch runs. Split evenly between :meth:`set_worker`'s
        workers; 0 keeps none.
    n_threads
        Decoding threads; ``None`` resolves like scikit-learn.
    storage_options, cache_dir
        fsspec options, and where obs columns are cached.
    """

    def __init__(
        self,
        source: str | os.PathLike | Dataset,
        *,
        batch_size: int = 4096,
        shuffle: str | bool = "tiles",
        seed: int = 0,
        buffer_tiles: int = 2,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        obs: Sequence[str] | str | None = (),
        genes: Sequence[str] | np.ndarray | None = None,
        normalize: float | None = None,
        log1p: bool = False,
        output: str = "scipy",
        values_dtype: DTypeLike = np.float32,
        column_order: str = "source",
        sorted_indices: bool = True,
        prefetch: int = 2,
        prefetch_tiles: int | None = None,
        tile_cache_bytes: int = 256 * 2**20,
        n_threads: int | None = None,
        storage_options: dict | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        shuffle, dtype = _checked_arguments(
            shuffle=shuffle, output=output, batch_size=batch_size, buffer_tiles=buffer_tiles,
            prefetch=prefetch, tile_cache_bytes=tile_cache_bytes, seed=seed, rank=rank,
            world_size=world_size, prefetch_tiles=prefetch_tiles, normalize=normalize,
            log1p=log1p, values_dtype=values_dtype, n_threads=n_threads,
            column_order=column_order, sorted_indices=sorted_indices)  # fmt: skip
        self.dataset = (
            source
            if isinstance(source, Dataset)
            else open_dataset(source, storage_options=storage_options)
        )
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.buffer_tiles, self.drop_last, self.prefetch = buffer_tiles, drop_last, prefetch
        self.prefetch_tiles = (prefetch_tiles if prefetch_tiles is not None
                               else LOCAL_TILES_IN_FLIGHT if self.dataset.store.is_local
                               else REMOTE_TILES_IN_FLIGHT)  # fmt: skip
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world_size {self.world_size}")
        self.normalize, self.log1p, self.output = normalize, log1p, output
        self.dtype = dtype
        self.n_threads = n_threads
        self.tile_cache_bytes = int(tile_cache_bytes)
        # Parsed (checked) compressed tiles kept across epochs in the tile modes; see
        # tile_cache_bytes. Not pickled: each worker process keeps its own share.
        self._kept_tiles: dict[int, Tile] = {}
        self._kept_bytes = 0
        self._kept_lock = threading.Lock()  # two iterations of one loader may run at once
        self._iterations = 0  # tiles are kept from the second on (a loader that repeats)
        self.column_order = column_order
        self.sorted_indices = bool(sorted_indices)
        self._worker = (0, 1)  # (worker id, number of workers) within this rank
        self.epoch = 0
        self._batches_done = 0
        self._col_map, self.var_names = self._columns(genes, column_order)
        drops = self._col_map is not None and bool(np.any(self._col_map < 0))
        self._drop_map = self._col_map if drops else None  # only a subset changes row lengths
        # One column may be named alone; None asks for none.
        # (``obs or ()`` would refuse a pandas Index or numpy array of names: no truth value.)
        self.obs_columns = [] if obs is None else [obs] if isinstance(obs, str) else list(obs)
        self._obs = self._load_obs(self.obs_columns, cache_dir)
        m = self.dataset.manifest
        self._limits = m.limits  # one past each tile's last cell

    # -- set-up --------------------------------------------------------------------------------

    def _columns(self, genes, column_order: str) -> tuple[np.ndarray | None, np.ndarray]:
        """``col_map`` from stored columns to output columns (-1: dropped), and the output's
        gene names."""
        n_genes = self.dataset.shape[1]
        stored_names = self.dataset.var_names()
        if stored_names is None:
            var = self.dataset.var()
            stored_names = (
                [str(i) for i in range(n_genes)] if var is None else list(var.index.astype(str))
            )
        stored_names = np.asarray(stored_names, dtype=object)
        order = self.dataset.gene_order()
        to_source = np.arange(n_genes) if order is None else order  # stored j -> source column
        source_names = np.empty(n_genes, dtype=object)
        source_names[to_source] = stored_names
        if genes is None:
            if column_order == "stored" or order is None:
                return None, stored_names
            return to_source.astype(np.int64), source_names
        wanted = np.asarray(genes)
        if wanted.dtype == bool:
            if wanted.shape != (n_genes,):
                raise ValueError(f"gene mask of shape {wanted.shape} for {n_genes} genes")
            wanted = np.flatnonzero(wanted)
        if wanted.dtype.kind in "iu":
            source_positions = wanted.astype(np.int64)
            if source_positions.size and (
                source_positions.min() < 0 or source_positions.max() >= n_genes
            ):
                bad = source_positions[(source_positions < 0) | (source_positions >= n_genes)]
                raise IndexError(f"gene position {int(bad[0])} out of range: the dataset has "
                                 f"{n_genes} genes")  # fmt: skip
        else:
            lookup = {name: i for i, name in enumerate(source_names)}
            missing = [g for g in wanted if g not in lookup]
            if missing:
                shown = [str(g) for g in missing[:5]]
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                raise KeyError(f"{len(missing)} of the genes are not in the dataset: {shown}{more} "
                               "(deltacells.open_dataset(path).var_names() lists its genes)")
            source_positions = np.array([lookup[g] for g in wanted], dtype=np.int64)
        unique, counts = np.unique(source_positions, return_counts=True)
        if len(unique) != len(source_positions):
            twice = str(source_names[unique[np.argmax(counts > 1)]])
            raise ValueError(f"genes lists {twice!r} more than once")
        output_of_source = np.full(n_genes, -1, dtype=np.int64)
        output_of_source[source_positions] = np.arange(len(source_positions))
        return output_of_source[to_source], source_names[source_positions]

    def _load_obs(self, columns: list[str], cache_dir) -> dict[str, np.ndarray]:
        if not columns:
            return {}
        cache = ObsCache(self.dataset.obs_part, cache_dir)
        cache.localize(columns)
        out = {}
        for column in columns:
            spec = cache.schema[column]
            if spec.kind not in ("category", "numeric", "bool"):
                lookup = ("obs_names" if column == self.dataset.obs_index_column(cache.schema)
                          else f"obs[{column!r}].iloc")  # fmt: skip
                raise ValueError(
                    f"obs column {column!r} is {spec.kind}: batches carry category codes and "
                    f"numbers only; look its values up by each batch's cells "
                    f"(read_deltacells(...).{lookup}[batch.cells]), or store it as a "
                    f"categorical (write_deltacells(max_categories=) above its distinct values)"
                )
            values = cache.column(column)
            if spec.kind == "category":
                out[column] = values.fill_null(-1).to_numpy().astype(np.int32)
            elif values.null_count and spec.kind == "bool":  # missing flags become NaN
                out[column] = values.cast("float32").fill_null(np.nan).to_numpy()
            else:  # numbers with missing values come out as floats with NaN
                out[column] = values.to_numpy(zero_copy_only=False)
        return out

    # -- epochs, sharding, state ---------------------------------------------------------------

    def set_worker(self, worker_id: int, num_workers: int) -> None:
        """Yield only worker ``worker_id``'s contiguous run of this rank's batches (of
        ``num_workers``; the first runs are one batch longer when they do not divide)."""
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker {worker_id} outside {num_workers} workers")
        self._worker = (worker_id, num_workers)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_kept_tiles"], state["_kept_bytes"], state["_iterations"] = {}, 0, 0
        del state["_kept_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._kept_lock = threading.Lock()

    def _kept_tile(self, t: int) -> Tile | None:
        """Tile ``t`` if an earlier epoch kept it (parsed and checked when it was read)."""
        return self._kept_tiles.get(t)

    def _keep_tile(self, t: int, tile: Tile) -> None:
        """Keep tile ``t`` for later epochs while this worker's share of
        ``tile_cache_bytes`` has room (the first tiles read stay; none are evicted, so an
        epoch's reads of the rest are not traded for re-reads of these)."""
        share = self.tile_cache_bytes // self._worker[1]
        with self._kept_lock:
            if t not in self._kept_tiles and self._kept_bytes + tile.nbytes <= share:
                self._kept_tiles[t] = tile
                self._kept_bytes += tile.nbytes

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s plan from the next iteration on (and start it from its
        beginning)."""
        self.epoch = int(epoch)
        self._batches_done = 0

    def state_dict(self) -> dict:
        """Where iteration stands: the epoch and the batches of it already yielded."""
        return {"seed": self.seed, "epoch": self.epoch, "batches_done": self._batches_done}

    def load_state_dict(self, state: dict) -> None:
        """Resume: the next iteration yields exactly the batches an uninterrupted run would
        have yielded after ``state``."""
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"state is for seed {state['seed']}, this loader uses {self.seed}")
        self.epoch = int(state["epoch"])
        self._batches_done = int(state["batches_done"])

    def _batches(self) -> BatchRuns:
        """This rank's (and worker's) batches of the current epoch, as global cell positions."""
        plan = EpochPlan(self.dataset.manifest.tile_cells, shuffle=self.shuffle,
                         buffer_tiles=self.buffer_tiles, seed=self.seed,
                         epoch=self.epoch)  # fmt: skip
        return BatchRuns(plan, self.batch_size, rank=self.rank, world_size=self.world_size,
                         worker=self._worker, drop_last=self.drop_last)  # fmt: skip

    def __len__(self) -> int:
        """Batches per epoch for this rank (and worker)."""
        return len(self._batches())

    # -- iteration -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        self._iterations += 1
        batches = self._batches()
        skip = self._batches_done
        results: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        done = object()

        def produce() -> None:
            try:
                builder = _BatchBuilder(self, batches, skip)
                for index in range(skip, len(batches)):
                    if stop.is_set():
                        return
                    item = builder.build(batches[index], index)
                    builder.release(index)
                    while not stop.is_set():
                        try:
                            results.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                results.put(done)
            except BaseException as err:  # handed to the consumer, raised there
                results.put(err)

        thread = threading.Thread(target=produce, name="deltacells-loader", daemon=True)
        thread.start()
        try:
            while True:
                item = results.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                self._batches_done += 1
                yield item
            self.epoch += 1
            self._batches_done = 0
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    results.get_nowait()
                except queue.Empty:
                    thread.join(0.05)


def _checked_arguments(*, shuffle, output, batch_size, buffer_tiles, prefetch, tile_cache_bytes,
                       seed, rank, world_size, prefetch_tiles, normalize, log1p, values_dtype,
                       n_threads, column_order, sorted_indices, **others: Any
                       ) -> tuple[str, np.dtype]:  # fmt: skip
    """The :class:`Loader` arguments that need no dataset, checked (each mistake named, before
    anything is opened): the shuffle mode (a bool made a mode) and the values dtype. The
    ``others`` (source, genes, obs, ...) need the dataset and are checked with it."""
    if isinstance(shuffle, bool):
        shuffle = "tiles" if shuffle else "none"
    if shuffle not in SHUFFLE_MODES:
        raise ValueError(f"shuffle must be one of {SHUFFLE_MODES}, not {shuffle!r}")
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {OUTPUTS}, not {output!r}")
    if output.startswith("torch") and importlib.util.find_spec("torch") is None:
        raise ImportError(f"output={output!r} needs torch: pip install 'deltacells[torch]'")
    check_ints({"batch_size": batch_size, "buffer_tiles": buffer_tiles, "prefetch": prefetch,
                "tile_cache_bytes": tile_cache_bytes, "seed": seed, "rank": rank,
                "world_size": world_size, "prefetch_tiles": prefetch_tiles},
               optional=("rank", "world_size", "prefetch_tiles"),  # None: the environment
               at_least={"batch_size": 1, "buffer_tiles": 1, "prefetch": 1,
                         "tile_cache_bytes": 0, "seed": 0, "prefetch_tiles": 0})  # fmt: skip
    if normalize is not None and (
        isinstance(normalize, bool) or not isinstance(normalize, numbers.Real)
    ):
        raise TypeError(f"normalize must be a number (the target sum, e.g. 1e4) or None, not "
                        f"{type(normalize).__name__}")  # fmt: skip
    if normalize is not None and not (math.isfinite(normalize) and normalize > 0):
        raise ValueError(f"normalize must be a positive target sum (e.g. 1e4) or None, not "
                         f"{normalize}")  # fmt: skip
    check_n_threads(n_threads)  # named here, not in the first batch (and not a request)
    if column_order not in ("source", "stored"):
        raise ValueError(f"column_order must be 'source' or 'stored', not {column_order!r}")
    if not sorted_indices and output != "scipy":
        raise ValueError(
            f"sorted_indices=False is for output='scipy' (whose has_sorted_indices records "
            f"it), not output={output!r}: dense outputs never sort, and torch's sparse "
            "tensors are built canonical"
        )
    dtype = _value_dtype(values_dtype)
    if (normalize is not None or log1p) and dtype.kind != "f":
        raise ValueError("normalize / log1p need a float values_dtype")
    return shuffle, dtype


def check_loader_options(**options: Any) -> None:
    """Check :class:`Loader` keyword options without opening a dataset (for adapters that make
    their loaders later, in worker processes): an unknown name is a ``TypeError``, a bad
    value the error :class:`Loader` gives."""
    try:
        bound = inspect.signature(Loader).bind("", **options)
    except TypeError as err:  # inspect's words ("got an unexpected keyword argument 'x'")
        raise TypeError(f"Loader {err}") from None
    bound.apply_defaults()
    _checked_arguments(**bound.arguments)


#: Tiles a loader keeps in flight on remote stores by default (see ``prefetch_tiles``).
#: Measured at 150 MB/s: 8 reach the plateau at 50 ms, 200 ms needs 16 (and as many
#: connections: :data:`deltacells.store.storage.REMOTE_IO_THREADS`).
REMOTE_TILES_IN_FLIGHT = 16
#: Tiles a loader reads ahead on local files by default. First epochs ran 3-6% faster and
#: second ones (which read the kept tiles into fresh pages) up to a quarter faster than
#: reading each when needed (fresh processes taking turns; ``docs/benchmarks.md``). Later
#: epochs read nothing.
LOCAL_TILES_IN_FLIGHT = 2


class _BatchBuilder:
    """Builds batches for one iteration (runs in the loader's background thread)."""

    def __init__(self, loader: Loader, batches: BatchRuns, skip: int = 0) -> None:
        self.loader = loader
        self.n_threads = effective_n_threads(loader.n_threads)
        self.decoded: dict[int, _DecodedTile] = {}
        self.compressed: OrderedDict[int, Tile] = OrderedDict()
        self.compressed_bytes = 0
        self.n_out_cols = len(loader.var_names)
        # Kept across epochs from a loader's second iteration on: a loader iterated once
        # (a single pass, or a torch worker that is not persistent) holds no more memory than
        # before, and the first epoch reads into recycled buffers, not fresh pages.
        self.keep_tiles = loader.shuffle != "cells" and loader._iterations >= 2
        # The last batch that may need each tile (from the buffers a batch overlaps, without
        # drawing its cells): a decoded tile is dropped right after it, so memory holds only
        # the tiles still to be used (about one buffer), and its buffers are reused for the
        # next tile instead of fresh pages. And the tiles in the order the epoch first needs
        # them: up to ``prefetch_tiles`` of them are being fetched at any time.
        self.last_use = np.full(len(loader._limits), -1, dtype=np.int64)
        seen = np.zeros(len(loader._limits), dtype=bool)
        self.upcoming = []
        for i in range(skip, len(batches)):
            tiles = batches.plan.tiles_at(*batches.bounds(i))
            self.last_use[tiles] = i
            for t in tiles:
                if not seen[t]:
                    seen[t] = True
                    self.upcoming.append(t)
            if batches.plan.shuffle == "cells":
                break  # every batch may need every tile: all of them, in tile order
        # Source-order batches of the tile-order modes (every gene kept, rows sorted) are
        # decoded straight into their places from the compressed tiles: a buffer's chunks are
        # decoded once and every cell lands, renumbered and sorted while in cache, in the
        # batch that takes it, so no row is copied twice.
        self.batches = batches
        sort = loader.output in ("scipy", "torch") and loader.sorted_indices
        self.direct = (batches.plan.shuffle != "cells" and loader._col_map is not None
                       and loader._drop_map is None and sort)  # fmt: skip
        if self.direct:
            self._plan_direct(skip)
        self.capacity = max(loader.dataset.manifest.tile_nnz, default=0)
        self.spare: list[tuple[np.ndarray, np.ndarray]] = []
        self.next_up = 0
        self.inflight: dict[int, Any] = {}
        self._fetch_ahead()

    def _plan_direct(self, skip: int) -> None:
        """Which batches each buffer's cells go to: "visits" (a buffer's pieces taken by
        consecutive batches, decoded together; a buffer is visited again only when the
        ranks' padding wraps around to it), and the visits each batch waits for."""
        plan = self.batches.plan
        self.column_map = ColumnMap(self.loader._col_map, self.loader.dataset.shape[1])
        self.visits: list[tuple[int, list[tuple[int, int, int, int]]]] = []
        self.batch_visits: dict[int, list[int]] = {}
        open_visit: dict[int, int] = {}  # buffer -> its visit still being extended
        for i in range(skip, len(self.batches)):
            row0, mine = 0, []
            for k, lo, hi in plan.buffer_pieces(*self.batches.bounds(i)):
                v = open_visit.get(k)
                if v is None or self.visits[v][1][-1][0] < i - 1:
                    v = open_visit[k] = len(self.visits)
                    self.visits.append((k, []))
                self.visits[v][1].append((i, lo, hi, row0))
                row0 += hi - lo
                mine.append(v)
            self.batch_visits[i] = mine
        self.visited: set[int] = set()
        self.outputs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.parsed: OrderedDict[int, Tile] = OrderedDict()

    def _parsed_kept(self, t: int) -> Tile:
        """Tile ``t`` parsed, kept while its buffer's batches are laid out and decoded."""
        tile = self.parsed.get(t)
        if tile is None:
            tile = self.parsed[t] = self._parsed(t)
            while len(self.parsed) > 3 * self.loader.buffer_tiles + 2:
                self.parsed.popitem(last=False)
        return tile

    def _output(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Batch ``i``'s indptr and empty indices and values, sized from the tiles' indptr."""
        out = self.outputs.get(i)
        if out is None:
            touched, groups, local = group_by_tile(self.batches[i], self.loader._limits)
            tiles = [self._parsed_kept(int(t)) for t in touched]
            indptr = gathered_indptr(tiles, groups, local)
            n = int(indptr[-1])
            out = self.outputs[i] = (indptr, empty_output(n, np.int32),
                                     empty_output(n, self.loader.dtype))  # fmt: skip
        return out

    def _decode_visit(self, v: int) -> None:
        k, pieces = self.visits[v]
        cells = self.batches.plan.buffer(k)
        batch_ids = sorted({p[0] for p in pieces})
        slot = {j: n for n, j in enumerate(batch_ids)}
        outputs = [self._output(j) for j in batch_ids]
        taken = np.concatenate([cells[lo:hi] for _, lo, hi, _ in pieces])
        which = np.repeat([slot[j] for j, *_ in pieces], [hi - lo for _, lo, hi, _ in pieces])
        offsets = np.concatenate([outputs[slot[j]][0][row0 : row0 + hi - lo]
                                  for j, lo, hi, row0 in pieces])  # fmt: skip
        touched, groups, local = group_by_tile(taken, self.loader._limits)
        tiles = [self._parsed_kept(int(t)) for t in touched]
        gather_tiles_into_many(tiles, groups, local, [o[1:] for o in outputs], which, offsets,
                               self.column_map, n_threads=self.n_threads)  # fmt: skip
        for t in touched:
            self.parsed.pop(int(t), None)

    def _build_direct(self, index: int) -> sp.csr_matrix:
        for v in self.batch_visits[index]:
            if v not in self.visited:
                self._decode_visit(v)
                self.visited.add(v)
        indptr, indices, values = self.outputs.pop(index)
        matrix = sp.csr_matrix((values, indices, indptr), shape=(len(indptr) - 1,
                               self.n_out_cols), copy=False)  # fmt: skip
        matrix.has_canonical_format = True
        return matrix

    def _fetch_ahead(self) -> None:
        loader = self.loader
        m = loader.dataset.manifest
        while len(self.inflight) < loader.prefetch_tiles and self.next_up < len(self.upcoming):
            t = self.upcoming[self.next_up]
            self.next_up += 1
            if (t not in self.decoded and t not in self.compressed
                    and loader._kept_tile(t) is None):  # fmt: skip
                name = tile_name(t)
                self.inflight[t] = loader.dataset.store.prefetch([name], [m.tile_bytes[t]])[name]

    def _parsed(self, t: int) -> Tile:
        """Tile ``t`` parsed: kept from an earlier epoch, or read (from its prefetched bytes
        when they were asked for) and checked, and kept for later epochs in the tile modes
        while there is room."""
        loader = self.loader
        tile = loader._kept_tile(t)
        if tile is not None:
            return tile
        future = self.inflight.pop(t, None)
        blob = future.result() if future is not None else None
        tile = loader.dataset.tile(t, n_threads=self.n_threads, blob=blob)
        if self.keep_tiles:
            loader._keep_tile(t, tile)
        self._fetch_ahead()
        return tile

    def _decoded(self, t: int) -> _DecodedTile:
        tile = self.decoded.get(t)
        if tile is None:
            loader = self.loader
            parsed = self._parsed(t)
            out = self.spare.pop() if self.spare else (
                empty_output(self.capacity, np.int32), empty_output(self.capacity, loader.dtype)
            )  # fmt: skip
            totals = loader.normalize is not None
            tile = _DecodedTile(parsed, loader.dtype, loader._drop_map, totals, self.n_threads,
                                out)  # fmt: skip
            self.decoded[t] = tile
        return tile

    def release(self, batch_index: int) -> None:
        """Drop the decoded tiles no batch after ``batch_index`` needs (buffers kept spare)."""
        for t in [t for t in self.decoded if self.last_use[t] <= batch_index]:
            tile = self.decoded.pop(t)
            if len(self.spare) < 2:
                self.spare.append(tile.buffers)

    def _compressed(self, t: int) -> Tile:
        """A parsed compressed tile, from a cache bounded by ``tile_cache_bytes``."""
        tile = self.compressed.get(t)
        if tile is None:
            tile = self._parsed(t)
            self.compressed[t] = tile
            self.compressed_bytes += tile.nbytes
            while self.compressed_bytes > self.loader.tile_cache_bytes and len(self.compressed) > 1:
                _, old = self.compressed.popitem(last=False)
                self.compressed_bytes -= old.nbytes
        else:
            self.compressed.move_to_end(t)
        return tile

    def build(self, cells: np.ndarray, index: int) -> Batch:
        loader = self.loader
        if self.direct:
            matrix = self._build_direct(index)
            # Every gene is kept on this path: library sizes are the rows' own sums.
            totals = (_rows.row_sums(matrix.indptr.astype(np.int64), matrix.data, self.n_threads)
                      if loader.normalize is not None else None)  # fmt: skip
        else:
            touched, groups, local = group_by_tile(cells, loader._limits)
            if loader.shuffle == "cells":
                matrix, totals = self._gather_compressed(touched, groups, local)
            else:
                matrix, totals = self._take_decoded(touched, groups, local)
        if loader.normalize is not None or loader.log1p:
            target = 0.0 if loader.normalize is None else float(loader.normalize)
            _rows.normalize_rows(matrix.indptr.astype(np.int64, copy=False), matrix.data,
                                    totals, target, loader.log1p, self.n_threads)  # fmt: skip
        obs = {name: values[cells] for name, values in loader._obs.items()}
        return Batch(X=_convert(matrix, loader.output), cells=cells, obs=obs)

    def _take_decoded(self, touched, groups, local) -> tuple[sp.csr_matrix, np.ndarray]:
        loader = self.loader
        # Dense outputs do not care in which order a row's entries come: skip the sort; so
        # does a scipy output asked for unsorted indices (and told so below).
        sort = loader.output in ("scipy", "torch") and loader.sorted_indices
        decoded = [self._decoded(int(t)) for t in touched]
        lengths = np.empty(len(local), dtype=np.int64)
        totals = np.zeros(len(local), dtype=np.float64)
        for tile, mine in zip(decoded, groups, strict=True):
            lengths[mine] = tile.lengths[local[mine]]
            if tile.totals is not None:
                totals[mine] = tile.totals[local[mine]]
        indptr = np.zeros(len(local) + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        indices = empty_output(int(indptr[-1]), np.int32)
        values = empty_output(int(indptr[-1]), loader.dtype)
        for tile, mine in zip(decoded, groups, strict=True):
            m = tile.matrix
            _rows.take_rows_into(tile.indptr, m.indices, m.data, local, mine, indptr, indices,
                                    values, loader._col_map, self.n_threads, sort)  # fmt: skip
        shape = (len(local), self.n_out_cols)
        matrix = sp.csr_matrix((values, indices, indptr), shape=shape, copy=False)
        if sort or loader._col_map is None:  # stored order: rows come sorted as decoded
            matrix.has_canonical_format = True
        else:
            matrix.has_sorted_indices = False
        return matrix, totals

    def _gather_compressed(self, touched, groups, local) -> tuple[sp.csr_matrix, np.ndarray]:
        loader = self.loader
        tiles = [self._compressed(int(t)) for t in touched]
        matrix = gather_cells(tiles, groups, local, loader.dataset.shape[1], loader.dtype,
                              self.n_threads)  # fmt: skip
        indptr = matrix.indptr.astype(np.int64, copy=False)
        # Library sizes over all genes, before any are dropped (only when normalising).
        totals = (
            _rows.row_sums(indptr, matrix.data, self.n_threads)
            if loader.normalize is not None
            else np.zeros(len(local))
        )
        if loader._col_map is not None:
            out = _rows.remap_columns(indptr, matrix.indices, matrix.data, loader._col_map,
                                         self.n_out_cols, self.n_threads)  # fmt: skip
            matrix = sp.csr_matrix((out[2], out[1], out[0]), shape=(len(local), self.n_out_cols),
                                   copy=False)  # fmt: skip
        matrix.has_canonical_format = True
        return matrix, totals


def _convert(matrix: sp.csr_matrix, output: str) -> Any:
    if output == "scipy":
        return matrix
    if output == "numpy":
        return matrix.toarray()
    try:
        import torch
    except ModuleNotFoundError as err:  # pragma: no cover - exercised without torch
        raise ImportError(
            f"output={output!r} needs torch: pip install 'deltacells[torch]'"
        ) from err

    if output == "torch_dense":
        return torch.from_numpy(matrix.toarray())
    # The kernels have checked every index already (in range, no repeats, sorted unless
    # sorted_indices=False); saying so also spares users torch's warning that it checks nothing.
    return torch.sparse_csr_tensor(
        torch.from_numpy(matrix.indptr.astype(np.int64)),
        torch.from_numpy(matrix.indices.astype(np.int64)),
        torch.from_numpy(matrix.data),
        size=matrix.shape,
        check_invariants=False,
    )
