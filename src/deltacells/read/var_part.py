"""The var part of a dataset: the gene order, the gene names and the var table."""

from __future__ import annotations

import numpy as np
import pandas as pd

from deltacells.codec.format import FormatError
from deltacells.read.stored import PARQUET_ERRORS, DatasetPart, StoredFiles, arrow_reader
from deltacells.store.manifest import GENE_ORDER_NAME, VAR_NAMES_NAME, VAR_TABLE_NAME

__all__ = ["MAX_VAR_TABLE_BYTES_PER_GENE", "VarPart"]

#: Most bytes per gene a var table may have when no file table bounds it (older datasets).
MAX_VAR_TABLE_BYTES_PER_GENE = 64 * 1024


class VarPart(DatasetPart):
    """Genes: their stored order, names and table (each read and checked when asked for)."""

    def __init__(self, stored: StoredFiles) -> None:
        super().__init__(stored)
        self._gene_order: np.ndarray | None = None
        self._source_to_stored: np.ndarray | None = None

    def gene_order(self) -> np.ndarray | None:
        """``gene_order[j]`` is the source column of stored column ``j`` (None if absent).

        Read and checked once per opened dataset; each call returns a fresh copy."""
        if not self.manifest.has_gene_order:
            return None
        if self._gene_order is None:
            where = self.store.describe(GENE_ORDER_NAME)
            n = self.manifest.n_genes
            order = self.stored.load_npy(GENE_ORDER_NAME, n)
            if not np.array_equal(np.sort(order), np.arange(n)):
                raise FormatError(f"{where}: not a permutation of 0..{n - 1}")
            self._gene_order = order.astype(np.int64)
        return self._gene_order.copy()

    def source_to_stored(self) -> np.ndarray | None:
        """``source_to_stored[p]`` is the stored column of source column ``p`` (the inverse
        of :meth:`gene_order`; None if absent). Made once per opened dataset; read-only."""
        if self._source_to_stored is None:
            order = self.gene_order()
            if order is None:
                return None
            inverse = np.empty_like(order)
            inverse[order] = np.arange(len(order))
            inverse.flags.writeable = False
            self._source_to_stored = inverse
        return self._source_to_stored

    def var_names(self) -> list[str] | None:
        """Gene names in stored order (None if absent)."""
        if not self.manifest.has_var_names:
            return None
        where = self.store.describe(VAR_NAMES_NAME)
        # A name is rarely above 100 bytes: 1 KiB each on average is far more than enough.
        data = self.stored.read_file(VAR_NAMES_NAME, max_size=1024 * self.manifest.n_genes + 1024)
        try:
            names = data.decode("utf-8").split("\n")
        except UnicodeDecodeError as err:
            raise FormatError(f"{where}: not UTF-8 text ({err})") from None
        if names and names[-1] == "":
            names.pop()
        if len(names) != self.manifest.n_genes:
            raise FormatError(
                f"{self.store.describe(VAR_NAMES_NAME)}: {len(names)} names for "
                f"{self.manifest.n_genes} genes"
            )
        return names

    def var(self) -> pd.DataFrame | None:
        """The gene table in stored order, pandas index restored (None if absent)."""
        if not self.manifest.has_var_table:
            return None
        import pyarrow.parquet as pq

        where = self.store.describe(VAR_TABLE_NAME)
        try:
            data = self.stored.read_file(VAR_TABLE_NAME, max_size=MAX_VAR_TABLE_BYTES_PER_GENE
                                  * self.manifest.n_genes + 2**20)  # fmt: skip
            # pandas metadata is JSON inside the file: decoding it can fail too.
            var = pq.ParquetFile(arrow_reader(data)).read().to_pandas()
        except PARQUET_ERRORS as err:
            raise FormatError(f"{where}: unreadable parquet ({err})") from None
        if len(var) != self.manifest.n_genes:
            raise FormatError(f"{where}: {len(var)} rows for {self.manifest.n_genes} genes")
        return var
