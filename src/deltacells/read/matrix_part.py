"""The matrix part of a dataset: its tiles checked against the manifest, the cell order, and
the gathering of cells from several tiles into one CSR matrix."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import scipy.sparse as sp

from deltacells.codec.arguments import check_ints
from deltacells.codec.format import HEADER_SIZE, MAGIC, FormatError
from deltacells.codec.tile import (
    Tile,
    empty_output,
    gather_tiles_into,
    gathered_indptr,
    stable_order,
)
from deltacells.read.stored import DatasetPart
from deltacells.store.integrity import check_checksum_row
from deltacells.store.manifest import MANIFEST_NAME, tile_name

__all__ = ["CELL_ORDER_FILE", "MatrixPart", "gather_cells", "group_by_tile"]

#: Where the writer records the cell order (stored row -> source row).
CELL_ORDER_FILE = "cell_order.npy"


class MatrixPart(DatasetPart):
    """The tiles of a dataset and the order of its cells."""

    def tile_blob(self, index: int) -> np.ndarray:
        """The bytes of tile ``index`` (``uint8``), checked against the manifest's size."""
        size = self.manifest.tile_bytes[index]
        return self._checked_blob(index, self.store.read_buffer(tile_name(index), size))

    def _checked_blob(self, index: int, blob: Any) -> Any:
        if len(blob) != self.manifest.tile_bytes[index]:
            raise FormatError(
                f"{self.store.describe(tile_name(index))}: {len(blob)} bytes, the manifest says "
                f"{self.manifest.tile_bytes[index]}"
            )
        return blob

    def tile(
        self,
        index: int,
        *,
        verify_crc: bool = True,
        n_threads: int | None = None,
        blob: bytes | None = None,
    ) -> Tile:
        """Tile ``index`` parsed and validated, checked against the manifest's counts.

        ``blob`` may hold the tile's bytes if they were fetched already (e.g. prefetched).
        """
        check_ints({"index": index})
        if not 0 <= index < self.manifest.n_tiles:
            raise IndexError(f"tile {index} out of range ({self.manifest.n_tiles} tiles)")
        name = self.store.describe(tile_name(index))
        blob = self.tile_blob(index) if blob is None else self._checked_blob(index, blob)
        m = self.manifest
        self._check_tile_version(blob, name)
        tile = Tile(blob, name=name, verify_crc=verify_crc, n_threads=n_threads)
        if tile.shape != (m.tile_cells[index], m.n_genes) or tile.nnz != m.tile_nnz[index]:
            raise FormatError(
                f"{name}: holds {tile.shape[0]} cells x {tile.shape[1]} genes, {tile.nnz} "
                f"nonzeros; the manifest says {m.tile_cells[index]} x {m.n_genes}, "
                f"{m.tile_nnz[index]}"
            )
        if m.tile_crc32 is not None and tile.layout.crc32 != m.tile_crc32[index]:
            raise FormatError(
                f"{name}: CRC-32 {tile.layout.crc32:08x} is not the {m.tile_crc32[index]:08x} "
                f"the manifest records for tile {index} (tiles swapped or replaced)"
            )
        return tile

    def _check_tile_version(self, blob: Any, name: str) -> None:
        # A dataset's tiles have its manifest's version. The header is outside the CRC, so a
        # damaged version field would otherwise read as "unsupported tile version 3".
        head = memoryview(blob).cast("B")[:HEADER_SIZE]
        if len(head) < 12 or bytes(head[:8]) != MAGIC:
            return  # the tile parser names what is wrong
        version = int.from_bytes(head[8:12], "little")
        if version != self.manifest.version:
            raise FormatError(
                f"{name}: the header says tile version {version}, but the dataset is version "
                f"{self.manifest.version} (its manifest): the tile's header is damaged (the "
                "CRC does not cover it) or the tile comes from another dataset"
            )

    def check_tile_sizes(self, indices: Sequence[int] | None = None) -> None:
        """Check that tiles ``indices`` (default: all) have the sizes the manifest says.

        Done before allocating for what the manifest claims of tiles not yet read (e.g. all
        of them for ``to_memory()``), so the allocation is bounded by bytes that exist.
        """
        m = self.manifest
        chosen = range(m.n_tiles) if indices is None else indices
        names = [tile_name(int(t)) for t in chosen]
        for name, t, size in zip(names, chosen, self.store.sizes(names), strict=True):
            if size != m.tile_bytes[int(t)]:
                raise FormatError(
                    f"{self.store.describe(name)}: {size} bytes, the manifest says "
                    f"{m.tile_bytes[int(t)]}"
                )

    def cell_order(self) -> np.ndarray | None:
        """``cell_order[i]`` is the source row of stored row ``i`` (None when cells are stored
        in source order); checked to be a permutation."""
        name = self.manifest.metadata.get("cell_order") or (
            (self.manifest.metadata.get("shuffle") or {}).get("cell_order"))  # fmt: skip
        if name is None:
            return None
        if name != CELL_ORDER_FILE:
            raise FormatError(f"{self.store.describe(MANIFEST_NAME)}: cell_order must name "
                              f"{CELL_ORDER_FILE!r}")  # fmt: skip
        n = self.manifest.n_cells
        order = self.stored.load_npy(CELL_ORDER_FILE, n).astype(np.int64)
        if not np.array_equal(np.sort(order), np.arange(n)):
            raise FormatError(f"{self.store.describe(CELL_ORDER_FILE)}: not a permutation of "
                              f"0..{n - 1}")  # fmt: skip
        return order

    def iter_tiles(self, *, verify_crc: bool = True) -> Iterator[tuple[int, Tile]]:
        """Every tile in order."""
        for i in range(self.manifest.n_tiles):
            yield i, self.tile(i, verify_crc=verify_crc)

    def verify_tile(self, index: int) -> None:
        """Tile ``index`` whole (CRC, structure, full decode) and its chunk checksum row."""
        blob = self.tile_blob(index)
        self.tile(index, blob=blob).decode(np.int32)
        if self.stored.tile_sums is not None:
            check_checksum_row(self.stored.tile_sums, index, blob, self.store.read_range,
                               self.store.describe)  # fmt: skip


def group_by_tile(
    cells: np.ndarray, tile_limits: np.ndarray
) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """Split cell positions by the tile they live in.

    ``tile_limits[t]`` is one past tile ``t``'s last cell. Returns the touched tiles
    (increasing), for each the positions in ``cells`` that fall in it, and every cell's
    position within its tile.
    """
    which = np.searchsorted(tile_limits, cells, side="right")
    starts = np.concatenate([[0], tile_limits[:-1]]).astype(np.int64)
    by_tile = stable_order(which)
    touched, first = np.unique(which[by_tile], return_index=True)
    return touched, np.split(by_tile, first[1:]), cells - starts[which]


def gather_cells(
    tiles: list[Tile],
    groups: list[np.ndarray],
    local: np.ndarray,
    n_genes: int,
    values_dtype: np.dtype,
    n_threads: int | None,
    col_map: np.ndarray | None = None,
) -> sp.csr_matrix:
    """One CSR of the cells ``local`` (positions within their tiles), row ``j`` decoded by the
    tile whose group holds ``j``, straight into its place; only touched chunks are read. With
    ``col_map`` (a column permutation) each row is renumbered and sorted as it is decoded."""
    indptr = gathered_indptr(tiles, groups, local)
    indices = empty_output(int(indptr[-1]), np.int32)
    values = empty_output(int(indptr[-1]), values_dtype)
    gather_tiles_into(tiles, groups, local, indptr, indices, values, n_threads=n_threads,
                      col_map=col_map)  # fmt: skip
    matrix = sp.csr_matrix((values, indices, indptr), shape=(len(local), n_genes), copy=False)
    matrix.has_canonical_format = True
    return matrix
