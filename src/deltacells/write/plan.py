"""The first pass of a write: every count checked and gene totals added up (locally or on
a dask cluster), the genes of several inputs aligned, the gene order and the tile size.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from deltacells.codec import _rows
from deltacells.codec.format import STREAM_MAX
from deltacells.codec.tile import (
    CountError,
    canonical_csr,
    exception_limit,
)
from deltacells.write.defaults import JOINS
from deltacells.write.inputs import (
    _open_part,
    _Part,
)
from deltacells.write.obs import InputSummary, ObsInputs

# ---------------------------------------------------------------------------------------------
# Genes


def _align_genes(parts: list[_Part], join: str) -> tuple[pd.Index, list[np.ndarray], pd.DataFrame]:
    """Output gene names, each part's column map into them (-1: dropped) and the var table."""
    for part in parts:
        if not part.var.index.is_unique:
            dup = part.var.index[part.var.index.duplicated()][0]
            raise ValueError(f"{part.label}: var_names are not unique ({dup!r} repeats); make "
                             "them unique first (anndata's adata.var_names_make_unique()) and "
                             "write that AnnData")  # fmt: skip
    names = parts[0].var.index
    if join == "same":
        for part in parts[1:]:
            if len(part.var.index) != len(names) or not part.var.index.isin(names).all():
                raise ValueError(
                    f"{part.label}: its genes differ from {parts[0].label}'s; pass "
                    "join='inner' or join='outer' to intersect or unite them"
                )
    elif join == "inner":
        for part in parts[1:]:
            names = names[names.isin(part.var.index)]
    elif join == "outer":
        for part in parts[1:]:
            names = names.append(part.var.index[~part.var.index.isin(names)])
    else:
        raise ValueError(f"join must be one of {JOINS}, not {join!r}")
    maps: list[np.ndarray] = []
    for p, part in enumerate(parts):
        # Inputs with the same genes in the same order (the usual atlas) share one map.
        same = p > 0 and part.var.index.equals(parts[p - 1].var.index)
        maps.append(maps[-1] if same else names.get_indexer(part.var.index).astype(np.int64))
    # Each gene's row from the first input that has it (columns and dtypes as one
    # concatenation of all the tables gives), read one table at a time.
    var = parts[0].full_var()
    for part in parts[1:]:
        var = pd.concat([var, part.full_var()])
        var = var[~var.index.duplicated(keep="first")]
    for part in parts:
        if part.read_var is not None:
            part.var = None  # read again only to name a gene in an error
    return names, maps, var.reindex(names)


def _resolve_gene_order(gene_order: Any, totals: np.ndarray) -> np.ndarray | None:
    n = len(totals)
    if isinstance(gene_order, str):
        if gene_order == "total_counts":
            return np.argsort(-totals, kind="stable").astype(np.int32)
        if gene_order == "none":
            return None
        raise ValueError(
            f"gene_order must be 'total_counts', 'none' or a permutation, not {gene_order!r}"
        )
    if gene_order is None:
        return None
    order = np.asarray(gene_order)
    if (
        order.shape != (n,)
        or order.dtype.kind not in "iu"
        or not np.array_equal(np.sort(order), np.arange(n))
    ):
        raise ValueError(f"gene_order must be a permutation of 0..{n - 1}")
    return order.astype(np.int32)


# ---------------------------------------------------------------------------------------------
# The writer


@dataclass
class _Plan:
    """What pass 1 found and decided."""

    n_cells: int
    n_genes: int
    col_maps: list[np.ndarray]
    var_names: pd.Index
    var: pd.DataFrame
    gene_order: np.ndarray | None
    cell_order: np.ndarray | None
    offsets: np.ndarray
    obs_names_unique: bool = True
    obs_pandas: dict | None = None
    spatial: Any = None  # deltacells.write.spatial_order.SpatialPlan


def _remap_columns(block: sp.csr_matrix, col_map: np.ndarray, n_genes: int) -> sp.csr_matrix:
    """Columns of ``block`` moved to their output positions (-1: dropped), rows sorted.

    The block is checked and made canonical first (duplicates summed, zeros dropped), so the
    kernel only permutes.
    """
    indptr, indices, data, shape = canonical_csr(block)
    out = _rows.remap_columns(indptr, indices, data, col_map, n_genes)
    matrix = sp.csr_matrix((out[2], out[1], out[0]), shape=(shape[0], n_genes), copy=False)
    matrix.has_canonical_format = True
    return matrix


def _iter_blocks(
    parts: list[_Part], block_size: int
) -> Iterator[tuple[int, int, int, sp.csr_matrix]]:
    for p, part in enumerate(parts):
        for start in range(0, part.n_obs, block_size):
            stop = min(start + block_size, part.n_obs)
            yield p, start, stop, part.reader.block(start, stop)
        part.release()


def _check_and_total(
    parts: list[_Part], col_maps, n_genes: int, block_size: int, progress, cache: dict, budget: int
) -> np.ndarray:
    """Pass 1: every value checked, gene totals (in output gene space) added up.

    Checked blocks are kept in ``cache`` while they fit in ``budget`` bytes, so that small
    inputs are read (and, for .h5ad, decompressed) once; past the budget the cache is dropped
    and pass 2 reads again, keeping memory flat whatever the input size.
    """
    totals = np.zeros(n_genes, dtype=np.float64)
    fitting = block_size  # the largest tile size whose blocks hold few enough large counts
    cached_bytes = 0
    blocks = _iter_blocks(parts, block_size)
    n_blocks = sum(-(-part.n_obs // block_size) for part in parts)
    for p, start, stop, block in progress(blocks, total=n_blocks, desc="checking counts"):
        try:
            (indptr, indices, data, shape), part_totals, allowed = _checked_block(block,
                                                                                  block_size)
        except CountError as err:
            raise _count_error(parts[p], err.problem, start + err.cell, err.gene) from None
        fitting = min(fitting, allowed)
        mapped = col_maps[p]
        keep = mapped >= 0
        totals[mapped[keep]] += part_totals[keep]  # mapped columns are distinct
        if budget > 0:
            cached_bytes += indptr.nbytes + indices.nbytes + data.nbytes
            if cached_bytes <= budget:
                cache[(p, start, stop)] = sp.csr_matrix((data, indices, indptr), shape=shape)
            else:
                cache.clear()
                budget = 0
    return totals, fitting


def _checked_block(block: Any, block_size: int) -> tuple[tuple, np.ndarray, int]:
    """One block of an input, checked and made canonical (a CountError names the block's own
    row): its CSR parts, its gene totals (the input's own genes) and the most cells per tile
    its counts above 65535 allow. Both first passes (here and on dask) check with it."""
    indptr, indices, data, shape = canonical_csr(block)
    totals = np.bincount(indices, weights=data, minlength=shape[1])
    return (indptr, indices, data, shape), totals, _cells_per_tile_for_exceptions(
        indptr, data, block_size)  # fmt: skip


def _count_error(part: _Part, problem: str, cell: int, gene: int) -> CountError:
    """A CountError naming the input, the cell and the gene."""
    hint = part.count_hint() if part.count_hint is not None and problem in (
        "non-integral count", "negative count") else ""  # fmt: skip
    return CountError(problem, cell, gene, message=(
        f"{part.label}: {problem} at cell {cell} ({part.read_obs().index[cell]!r}), gene {gene} "
        f"({part.full_var().index[gene]!r}){hint}"))  # fmt: skip


#: Blocks (of the tile size) one pass-1 dask task checks.
CHECK_BLOCKS_PER_TASK = 16


def _check_task(item: Any, layer, use_raw, start: int, stop: int, block_size: int) -> tuple:
    """One pass-1 dask task: cells ``start:stop`` of one input checked in the blocks the
    single-process pass reads, their gene totals (the input's own genes) and the tile size
    their large counts allow; or the first bad value as ``("error", problem, cell, gene)``."""
    part = _open_part(item, layer, use_raw, tables=False)
    try:
        totals, fitting = None, block_size
        for first in range(start, stop, block_size):
            block = part.reader.block(first, min(first + block_size, stop))
            try:
                _, block_totals, allowed = _checked_block(block, block_size)
            except CountError as err:
                return ("error", err.problem, first + err.cell, err.gene)
            fitting = min(fitting, allowed)
            totals = block_totals if totals is None else totals + block_totals
        return ("ok", totals, fitting)
    finally:
        part.close()


def _check_and_total_distributed(client, sources: list, parts: list[_Part], layer, use_raw,
                                 col_maps, n_genes: int, block_size: int,
                                 progress) -> tuple[np.ndarray, int]:  # fmt: skip
    """Pass 1 on dask.distributed: a task per run of blocks of each input file, summed here.
    Counts are integers, so the float64 totals are exact in any order: the result, and so the
    gene order, equals the single-process pass's."""
    from distributed import as_completed

    step = block_size * CHECK_BLOCKS_PER_TASK
    jobs = [(p, start, min(start + step, part.n_obs))
            for p, part in enumerate(parts) for start in range(0, part.n_obs, step)]  # fmt: skip
    futures = {client.submit(_check_task, sources[p], layer, use_raw, start, stop, block_size,
                             pure=False): (p, start) for p, start, stop in jobs}  # fmt: skip
    results: dict[tuple[int, int], tuple] = {}
    bar = iter(progress(range(len(jobs)), total=len(jobs), desc="checking counts (dask)",
                         unit="task"))
    next(bar, None)
    for future in as_completed(futures):
        results[futures[future]] = future.result()
        next(bar, None)
    totals = np.zeros(n_genes, dtype=np.float64)
    fitting = block_size
    for p, start, _ in jobs:  # in input order: the first bad value is the one reported
        outcome = results[(p, start)]
        if outcome[0] == "error":
            raise _count_error(parts[p], *outcome[1:])
        _, part_totals, part_fitting = outcome
        fitting = min(fitting, part_fitting)
        keep = col_maps[p] >= 0
        totals[col_maps[p][keep]] += part_totals[keep]
    return totals, fitting


def _obs_summary_task(item: Any, layer, use_raw, labels: list[str], exclude: Sequence[str],
                      list_input: bool, p: int, max_categories: int) -> InputSummary:  # fmt: skip
    """One dask task: input ``p``'s obs read on the worker and summarised for planning."""
    readers: list = [None] * len(labels)
    readers[p] = _open_part(item, layer, use_raw, tables=False).read_obs
    return ObsInputs(readers, labels, exclude, list_input).summary(p, max_categories)


def _obs_summaries_distributed(client, sources: list, layer, use_raw, inputs: ObsInputs,
                               max_categories: int, progress
                               ) -> Iterator[InputSummary]:  # fmt: skip
    """Each input's obs summary made by a task, yielded in input order (each released once
    used, so this process holds one at a time)."""
    futures = [client.submit(_obs_summary_task, item, layer, use_raw, inputs.labels,
                             inputs.exclude, inputs.file_names is not None, p, max_categories,
                             pure=False) for p, item in enumerate(sources)]  # fmt: skip
    for future in progress(futures, total=len(futures), desc="planning obs (dask)",
                           unit="input"):
        summary = future.result()
        future.release()
        yield summary


def _cells_per_tile_for_exceptions(indptr: np.ndarray, data: np.ndarray, cells: int) -> int:
    """The most cells per tile this block allows: every run of that many cells holds at most
    ``exception_limit`` counts above 65535 (runs over the block's cells, in order)."""
    large = data > STREAM_MAX
    if not large.any():
        return cells
    row_of = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
    per_cell = np.bincount(row_of[large], minlength=len(indptr) - 1)
    nnz_per_cell = np.diff(indptr)
    size = cells
    while size >= 1:
        window = np.ones(min(size, len(per_cell)), dtype=np.int64)
        exceptions = np.convolve(per_cell, window, mode="valid")
        nonzeros = np.convolve(nnz_per_cell, window, mode="valid")
        if (exceptions <= exception_limit(nonzeros)).all():
            return size
        size = size // 2 if size > 1 else 0
    return 0


def _settle_tile_size(tile_size: int, fitting: int, chosen: bool) -> int:
    """``tile_size``, or a smaller one that holds the data's large counts (with a warning),
    or an error naming the size that would (for an explicit ``tile_size``)."""
    if fitting >= tile_size:
        return tile_size
    if fitting < 1:
        raise ValueError(
            "a single cell holds more than 1024 counts above 65535: values this large are not "
            "raw counts (the format stores them as rare exceptions)"
        )
    if chosen:
        raise ValueError(
            f"tiles of {tile_size} cells would hold more counts above 65535 than a tile may "
            f"(max(1024, nnz/200)); pass tile_size={fitting} or smaller, or leave tile_size "
            "unset to let the writer choose"
        )
    import warnings

    warnings.warn(
        f"many counts above 65535: writing tiles of {fitting} cells instead of {tile_size} "
        "(a tile may hold at most max(1024, nnz/200) of them)",
        UserWarning,
        stacklevel=3,
    )
    return fitting


def _tile_rows(plan: _Plan, tile: int, tile_size: int) -> np.ndarray:
    start, stop = tile * tile_size, min((tile + 1) * tile_size, plan.n_cells)
    if plan.cell_order is None:
        return np.arange(start, stop, dtype=np.int64)
    return plan.cell_order[start:stop]


@dataclass(frozen=True)
class _Settings:
    """The write options pass 2 needs (see :func:`write_deltacells`)."""

    tile_size: int
    n_chunks: int
    zstd_level: int
    n_threads: int | None
    n_workers: int
    obs: bool
    var: bool
    shuffle: bool
    seed: int
    use_raw: bool
    layer: str | None
    join: str
    metadata: dict | None
    obs_tiles_per_file: int
    source: Any = None  # the single input whose other elements are stored too
    storage_options: dict | None = None
    inputs: tuple = ()  # every input, for dask workers that open them themselves
    client: Any = None  # a dask.distributed Client encoding tiles (None: this process)
