"""PyTorch adapter of :class:`deltacells.Loader` (needs the optional ``torch`` extra)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.utils.data

from deltacells.train.loader import Loader, check_loader_options

__all__ = ["TorchIterableDataset"]


class TorchIterableDataset(torch.utils.data.IterableDataset):
    """A :class:`torch.utils.data.IterableDataset` over a :class:`~deltacells.Loader`'s batches.

    Use with ``torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=n)``: each
    worker opens the dataset itself and takes a contiguous run of the rank's batches, so the
    workers together yield each of the rank's batches once. Batches are dicts
    ``{"X", "cells", <obs columns>}``.

    Workers may be forked or spawned. GNU OpenMP hangs in a forked child whose parent has used
    it, so a forked worker decodes on one thread (with a warning if ``n_threads`` asked for
    more after the parent decoded in parallel): with ``multiprocessing_context="fork"`` use
    about as many workers as cores; with ``"spawn"`` (or ``"forkserver"``) each worker may
    use several threads (``n_threads``).

    Each process keeps one :class:`~deltacells.Loader` across iterations, and with it the
    tiles the loader keeps from its second epoch on (``tile_cache_bytes``): without workers,
    or with ``persistent_workers=True``, later epochs decode a dataset that fits from memory.
    Workers that are not persistent start each epoch with a new loader, which reads every
    tile and keeps none.

    Parameters
    ----------
    url
        Dataset URL or path.
    **loader_options
        Passed to :class:`~deltacells.Loader` (``batch_size``, ``shuffle``, ``seed``,
        ``output``, ``obs``, ``genes``, ...).
    """

    def __init__(self, url: str | os.PathLike, **loader_options: Any) -> None:
        super().__init__()
        # The loaders are made in the workers; a mistaken option is named here, not there.
        check_loader_options(**loader_options)
        self.url = str(url)
        self.loader_options = loader_options
        self.epoch = 0
        self.batches_done = 0
        self._loader: tuple[int, Loader] | None = None  # (process id, loader) made there

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_loader"] = None  # each worker process makes its own
        return state

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` from its start from the next ``iter()`` on."""
        self.epoch = int(epoch)
        self.batches_done = 0

    def state_dict(self, batches_done: int) -> dict:
        """The state after the consumer took ``batches_done`` batches of the current epoch
        from the DataLoader (which the caller counts; the workers cannot tell it)."""
        return {"epoch": self.epoch, "batches_done": int(batches_done)}

    def load_state_dict(self, state: dict) -> None:
        """Resume: a DataLoader over this dataset (same ``num_workers``) then yields exactly the
        batches an uninterrupted one would have yielded after ``state``.

        The DataLoader takes one batch from each worker in turn and every worker's run of
        batches is as long as the others' or one longer (the first ones), so after ``k``
        batches worker ``w`` has delivered those ``j < k`` with ``j % num_workers == w``; on
        resuming, worker ``i`` takes over worker ``(i + k) % num_workers``'s run.
        """
        self.epoch = int(state["epoch"])
        self.batches_done = int(state["batches_done"])

    def __iter__(self):
        if self._loader is None or self._loader[0] != os.getpid():
            self._loader = (os.getpid(), Loader(self.url, **self.loader_options))
        loader = self._loader[1]
        info = torch.utils.data.get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        # A new DataLoader asks worker 0 first: it plays the part of the worker whose turn
        # it was, so the round robin continues where it stopped.
        role = (worker + self.batches_done) % n_workers
        loader.set_worker(role, n_workers)
        skip = max(0, (self.batches_done - role + n_workers - 1) // n_workers)
        loader.load_state_dict({"epoch": self.epoch, "batches_done": skip})
        for batch in loader:
            obs = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.obs.items()}
            yield {"X": batch.X, "cells": torch.from_numpy(batch.cells), **obs}
