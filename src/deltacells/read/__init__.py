"""Reading a dataset: the opened :class:`~deltacells.read.dataset.Dataset`, lazy matrices,
the obs cache and the AnnData that :func:`~deltacells.read_deltacells` assembles."""
