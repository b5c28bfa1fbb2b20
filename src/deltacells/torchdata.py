"""PyTorch adapter of :class:`deltacells.Loader` (needs the optional ``torch`` extra)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.utils.data

from deltacells.loader import Loader

__all__ = ["TorchIterableDataset"]


class TorchIterableDataset(torch.utils.data.IterableDataset):
    """A :class:`torch.utils.data.IterableDataset` over a :class:`~deltacells.Loader`'s batches.

    Use with ``torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=n)``: each
    worker opens the dataset itself and takes a contiguous run of the rank's batches, so the
    workers together yield each of the rank's batches once. Batches are dicts
    ``{"X", "cells", <obs columns>}``.

    Workers may be forked or spawned. GNU OpenMP hangs in a forked child whose parent has used
    it, so in a forked worker deltacells decodes on one thread unless ``n_threads`` is given:
    with ``multiprocessing_context="fork"`` use about as many workers as cores; with
    ``"spawn"`` (or ``"forkserver"``) each worker may use several threads (``n_threads``).

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
        self.url = str(url)
        self.loader_options = loader_options
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Iterate epoch ``epoch`` from the next ``iter()`` on."""
        self.epoch = int(epoch)

    def __iter__(self):
        loader = Loader(self.url, **self.loader_options)
        info = torch.utils.data.get_worker_info()
        if info is not None:
            loader.set_worker(info.id, info.num_workers)
        loader.set_epoch(self.epoch)
        for batch in loader:
            obs = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.obs.items()}
            yield {"X": batch.X, "cells": torch.from_numpy(batch.cells), **obs}
