"""An epoch's order of cells, cut into ranks, workers and batches: :class:`EpochPlan`,
:class:`BatchRuns` and the functions that materialise them.

An epoch is planned from ``(seed, epoch)`` alone, so every rank and worker derives the same
plan without talking to the others; :class:`EpochPlan` draws it a buffer at a time, so its
memory grows with tiles, not cells. The shuffle modes are described with the
:class:`~deltacells.Loader` (module ``deltacells.train.loader``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = ["SHUFFLE_MODES", "BatchRuns", "EpochPlan", "plan_epoch", "split_batches"]

SHUFFLE_MODES = ("tiles", "cells", "none")


class EpochPlan:
    """An epoch's order of cells, made one buffer at a time.

    Its memory grows with the number of tiles, not of cells: a buffer's shuffled cells are
    drawn when a batch first asks for them (from ``(seed, epoch, buffer)``), so an epoch over
    100M cells is planned in a few MB, as one over 100k. ``shuffle="cells"`` is the exception:
    it holds one permutation of all cells (8 bytes per cell).

    Seeds: the tile order of epoch ``e`` comes from ``numpy.random.default_rng([seed, e, 0])``
    and the order of cells within buffer ``k`` from ``default_rng([seed, e, 1, k])``, so every
    rank and worker derives the same plan without talking to the others.
    """

    #: Buffers whose shuffled cells are kept (a batch straddles at most a few).
    KEPT_BUFFERS = 4

    def __init__(self, tile_cells: Sequence[int], *, shuffle: str, buffer_tiles: int, seed: int,
                 epoch: int) -> None:  # fmt: skip
        if shuffle not in SHUFFLE_MODES:
            raise ValueError(f"shuffle must be one of {SHUFFLE_MODES}, not {shuffle!r}")
        if buffer_tiles < 1:
            raise ValueError("buffer_tiles must be at least 1")
        counts = np.asarray(tile_cells, dtype=np.int64)
        self.shuffle, self.seed, self.epoch = shuffle, int(seed), int(epoch)
        self.n_tiles = len(counts)
        self._tile_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.n_cells = int(self._tile_starts[-1])
        self._permutation: np.ndarray | None = None
        if shuffle == "tiles":
            self.tile_order = np.random.default_rng([self.seed, self.epoch, 0]).permutation(
                self.n_tiles
            )
            self.buffer_tiles = buffer_tiles
        else:
            self.tile_order = np.arange(self.n_tiles)
            self.buffer_tiles = 1
            if shuffle == "cells":
                rng = np.random.default_rng([self.seed, self.epoch, 0])
                self._permutation = rng.permutation(self.n_cells).astype(np.int64)
        sizes = counts[self.tile_order]
        per_buffer = (np.add.reduceat(sizes, np.arange(0, self.n_tiles, self.buffer_tiles))
                      if self.n_tiles else np.zeros(0, dtype=np.int64))  # fmt: skip
        #: Position in the order where each buffer starts (and one past the last).
        self.buffer_starts = np.concatenate([[0], np.cumsum(per_buffer)]).astype(np.int64)
        self._kept: OrderedDict[int, np.ndarray] = OrderedDict()

    def buffer(self, k: int) -> np.ndarray:
        """The cells of buffer ``k`` in the order the epoch visits them."""
        cells = self._kept.get(k)
        if cells is not None:
            self._kept.move_to_end(k)
            return cells
        tiles = self.buffer_tiles_of(k)
        starts = self._tile_starts
        ranges = [np.arange(starts[t], starts[t + 1], dtype=np.int64) for t in tiles]
        cells = np.concatenate(ranges) if ranges else np.zeros(0, dtype=np.int64)
        if self.shuffle == "tiles":
            cells = np.random.default_rng([self.seed, self.epoch, 1, k]).permutation(cells)
        self._kept[k] = cells
        while len(self._kept) > self.KEPT_BUFFERS:
            self._kept.popitem(last=False)
        return cells

    def buffer_tiles_of(self, k: int) -> np.ndarray:
        """The tiles buffer ``k`` mixes."""
        return self.tile_order[k * self.buffer_tiles : (k + 1) * self.buffer_tiles]

    def _segments(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """Positions ``start:stop`` as pieces of the order, positions past its end wrapping
        around to its start (the padding of :func:`split_batches`)."""
        n = self.n_cells
        while start < stop and n:
            real = start % n
            take = min(stop - start, n - real)
            yield real, real + take
            start += take

    def buffer_pieces(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """Positions ``start:stop`` (wrapping past the end) as ``(buffer, lo, hi)``: positions
        ``lo:hi`` within each buffer, in order (not for ``shuffle="cells"``)."""
        for a, b in self._segments(start, stop):
            first = int(np.searchsorted(self.buffer_starts, a, side="right")) - 1
            last = int(np.searchsorted(self.buffer_starts, b - 1, side="right")) - 1
            for k in range(first, last + 1):
                base = int(self.buffer_starts[k])
                yield k, max(a, base) - base, min(b, int(self.buffer_starts[k + 1])) - base

    def cells(self, start: int, stop: int) -> np.ndarray:
        """The cells at positions ``start:stop`` of the order (wrapping past its end)."""
        if self._permutation is not None:
            pieces = [self._permutation[a:b] for a, b in self._segments(start, stop)]
        else:
            pieces = [self.buffer(k)[lo:hi] for k, lo, hi in self.buffer_pieces(start, stop)]
        if not pieces:
            return np.zeros(0, dtype=np.int64)
        return pieces[0].copy() if len(pieces) == 1 else np.concatenate(pieces)

    def tiles_at(self, start: int, stop: int) -> list[int]:
        """Tiles whose cells may be at positions ``start:stop`` (all tiles with
        ``shuffle="cells"``), in the order of the buffers."""
        if self._permutation is not None:
            return list(range(self.n_tiles))
        out: list[int] = []
        for k, _, _ in self.buffer_pieces(start, stop):
            out.extend(sorted(int(t) for t in self.buffer_tiles_of(k)))
        return out


def plan_epoch(
    tile_cells: Sequence[int],
    *,
    shuffle: str,
    buffer_tiles: int,
    seed: int,
    epoch: int,
) -> np.ndarray:
    """The order in which an epoch visits all cells (global positions, each once).

    Deterministic in ``(seed, epoch)``; see the module docstring for the modes and
    :class:`EpochPlan` for the seeds. This materialises the whole order (8 bytes per cell);
    the :class:`~deltacells.Loader` draws it a buffer at a time instead.
    """
    plan = EpochPlan(tile_cells, shuffle=shuffle, buffer_tiles=buffer_tiles, seed=seed,
                     epoch=epoch)  # fmt: skip
    return plan.cells(0, plan.n_cells)


def split_batches(
    order: np.ndarray,
    batch_size: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    worker: tuple[int, int] = (0, 1),
    drop_last: bool = False,
) -> list[np.ndarray]:
    """The batches of one rank and worker in an epoch's ``order`` of cells.

    The order is cut into ``world_size`` contiguous, equally long parts (the shorter ones padded
    by wrapping around to the start of the order, or all cut to the shortest with
    ``drop_last``), each part into batches of ``batch_size`` (the last one short unless
    ``drop_last``), and a rank's batches into contiguous runs for ``worker = (id, count)``,
    the first runs one batch longer when they do not divide.
    """
    runs = BatchRuns(_GivenOrder(np.asarray(order)), batch_size, rank=rank,
                     world_size=world_size, worker=worker, drop_last=drop_last)  # fmt: skip
    return [runs[i] for i in range(len(runs))]


class _GivenOrder:
    """An order of cells already in memory, read as :class:`BatchRuns` reads a plan."""

    def __init__(self, order: np.ndarray) -> None:
        self.order, self.n_cells = order, len(order)

    def cells(self, start: int, stop: int) -> np.ndarray:
        """Positions ``start:stop``, wrapping past the end (the padding of the ranks)."""
        return self.order[np.arange(start, stop) % self.n_cells]


class BatchRuns(Sequence):
    """One rank's (and worker's) batches of an :class:`EpochPlan`, cut as
    :func:`split_batches` documents, each drawn from the plan when asked for."""

    def __init__(self, plan: EpochPlan, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 worker: tuple[int, int] = (0, 1), drop_last: bool = False) -> None:  # fmt: skip
        n = plan.n_cells
        length = n // world_size if drop_last else -(-n // world_size)
        n_batches = length // batch_size if drop_last else -(-length // batch_size)
        worker_id, n_workers = worker
        base, extra = divmod(n_batches, n_workers)
        first = worker_id * base + min(worker_id, extra)
        self.plan, self.batch_size = plan, batch_size
        self._part_start, self._part_stop = rank * length, (rank + 1) * length
        self._first, self._count = first, base + (worker_id < extra)

    def __len__(self) -> int:
        return self._count

    def bounds(self, i: int) -> tuple[int, int]:
        """Positions in the (padded) order of batch ``i``."""
        if not 0 <= i < self._count:
            raise IndexError(i)
        start = self._part_start + (self._first + i) * self.batch_size
        return start, min(start + self.batch_size, self._part_stop)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._count))]
        return self.plan.cells(*self.bounds(i))
