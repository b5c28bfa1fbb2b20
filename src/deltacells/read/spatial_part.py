"""The spatial part of a dataset: its grid index, box queries and the gene-major companion."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from deltacells.read.matrix_part import MatrixPart
from deltacells.read.stored import DatasetPart, StoredFiles
from deltacells.read.var_part import VarPart
from deltacells.store.manifest import MANIFEST_NAME

__all__ = ["SpatialPart"]


class SpatialPart(DatasetPart):
    """Where cells lie (the grid index and its reader) and genes read gene by gene."""

    def __init__(self, stored: StoredFiles, var: VarPart, matrix: MatrixPart) -> None:
        super().__init__(stored)
        self.var = var
        self.matrix = matrix  # the companion is checked against the tiles
        self._spatial: Any = None
        self._gene_major: Any = None

    def forget(self) -> None:
        """Drop what was read of the spatial files and the companion (the manifest changed)."""
        self._spatial = None
        self._gene_major = None

    def gene_major(self):
        """The gene-major companion (:class:`~deltacells.spatial.genemajor.GeneMajor`), or None if
        the dataset has none (add it with :func:`~deltacells.spatial.genemajor.add_gene_major` or
        ``deltacells add-gene-major``)."""
        if self.manifest.metadata.get("gene_major") is None:
            return None
        if self._gene_major is None:
            from deltacells.spatial.genemajor import GeneMajor

            self._gene_major = GeneMajor(self.matrix)
        return self._gene_major

    def gene(self, gene: str | int, values_dtype: Any = np.float32) -> sp.csc_matrix:
        """One gene for every cell (``ds.gene("CD3E")``): :meth:`genes` of one name or
        source position, a cells x 1 CSC matrix."""
        return self.genes([gene], values_dtype=values_dtype)

    def genes(self, genes: Sequence[str | int] | str | int, values_dtype: Any = np.float32,
              column_order: str = "source") -> sp.csc_matrix:  # fmt: skip
        """Genes for every cell, read from the gene-major companion (a few small ranged reads
        per block of cells, not a scan of the tiles).

        Parameters
        ----------
        genes
            Gene names (var_names), or integer positions in ``column_order``; one or many.
        values_dtype
            dtype of the values.
        column_order
            What integer positions refer to: ``"source"`` (the written order) or
            ``"stored"``.

        Returns
        -------
        scipy.sparse.csc_matrix
            Cells (stored order) by the genes asked, in the order asked.

        Raises
        ------
        ValueError
            When the dataset has no gene-major companion.
        KeyError
            For an unknown gene name.
        """
        companion = self.gene_major()
        if companion is None:
            raise ValueError(f"{self.store.describe()}: no gene-major companion (add it with "
                             "deltacells add-gene-major)")  # fmt: skip
        if column_order not in ("source", "stored"):
            raise ValueError(f"column_order must be 'source' or 'stored', not {column_order!r}")
        asked = [genes] if isinstance(genes, str | int | float | np.number) else list(genes)
        source_to_stored = self.var.source_to_stored()
        names: np.ndarray | None = None
        stored = []
        for g in asked:
            if isinstance(g, str):
                if names is None:
                    names = np.asarray(self.var.var_names() or [], dtype=object)  # stored order
                hits = np.flatnonzero(names == g)
                if not len(hits):
                    raise KeyError(f"{self.store.describe()}: no gene named {g!r}")
                stored.append(int(hits[0]))
                continue
            if isinstance(g, bool) or not isinstance(g, int | np.integer):
                raise TypeError(f"genes are names or integer positions, not {g!r}")
            p = int(g)
            if not 0 <= p < self.manifest.n_genes:
                raise IndexError(f"gene position {p} outside 0..{self.manifest.n_genes - 1}")
            use_order = column_order == "source" and source_to_stored is not None
            stored.append(int(source_to_stored[p]) if use_order else p)
        return companion.read(stored, values_dtype)

    def spatial_index(self):
        """The dataset's :class:`~deltacells.spatial.grid.SpatialIndex` (None unless it was written
        in spatial order)."""
        from deltacells.spatial.grid import SpatialIndex

        record = self.manifest.metadata.get("spatial_index")
        if record is None:
            return None
        return SpatialIndex.from_json(record, self.store.describe(MANIFEST_NAME),
                                      self.manifest.n_cells)  # fmt: skip

    def spatial(self):
        """The spatial part (:class:`~deltacells.spatial.query.SpatialReader`), read once.

        Raises
        ------
        ValueError
            When the dataset was not written in spatial order.
        """
        if self._spatial is None:
            from deltacells.spatial.query import SpatialReader

            index = self.spatial_index()
            if index is None:
                raise ValueError(f"{self.store.describe()}: not written in spatial order (write "
                                 "it with spatial_key= or shapes=)")  # fmt: skip
            self._spatial = SpatialReader(self.stored, index, self.manifest.n_cells)
        return self._spatial

    def query_bbox(self, bbox: tuple[float, float, float, float], mode: str = "intersects"):
        """The cells in ``bbox`` = (xmin, ymin, xmax, ymax), as a
        :class:`~deltacells.spatial.query.BoxQuery` (stored rows, bytes read).

        ``mode="intersects"`` (default) selects the cells whose shape intersects the box,
        borders included (points: inside or on the edge; circles: within their radius of it;
        polygons: exactly, with shapely). ``mode="centroid"`` selects by centroid. Only the
        grid tiles overlapping the box grown by the margin are read.
        """
        return self.spatial().query(bbox, mode=mode)
