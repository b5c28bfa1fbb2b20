"""Training: the :class:`~deltacells.train.loader.Loader` of shuffled batches and its torch
adapter."""
