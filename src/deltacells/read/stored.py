"""A dataset's files as its manifest records them: read whole and checked (size before
reading, SHA-256 after), integer arrays checked before they are allocated, and the parquet
helpers every part of a dataset reads tables with."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from deltacells.codec.format import FormatError
from deltacells.codec.npy import parse_npy_header
from deltacells.store.manifest import MANIFEST_NAME, Manifest
from deltacells.store.storage import Store

__all__ = ["PARQUET_ERRORS", "DatasetPart", "StoredFiles", "arrow_reader"]

#: What pyarrow raises for damaged parquet (ArrowInvalid is a ValueError, ArrowNotImplemented
#: a NotImplementedError; all are ArrowException).
PARQUET_ERRORS = (OSError, ValueError, KeyError, IndexError, NotImplementedError,
                  pa.ArrowException)  # fmt: skip


def arrow_reader(data: bytes) -> pa.BufferReader:
    """A pyarrow reader over a copy of ``data`` in memory pyarrow owns.

    Never hand pyarrow Python objects (file objects, or ``bytes`` it would wrap): its thread
    pools may drop the last reference in one of their threads after the call returned, which
    then needs the GIL, and during interpreter exit that aborted the process ("terminate
    called without an active exception", 3 of 120 ``deltacells verify`` runs).
    """
    buffer = pa.allocate_buffer(len(data))
    if len(data):
        np.frombuffer(buffer, dtype=np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
    return pa.BufferReader(buffer)


class StoredFiles:
    """Where a dataset lives and what its manifest vouches for.

    Attributes
    ----------
    store
        Where the dataset lives.
    manifest
        The validated manifest.
    files
        The manifest's file table (:class:`~deltacells.store.integrity.FileTable`).
    tile_sums
        The tiles' chunk checksums (:class:`~deltacells.store.integrity.ChunkSums`; None for
        datasets written before them).
    """

    def __init__(self, store: Store, manifest: Manifest) -> None:
        self.store = store
        self.manifest = manifest
        self.files = manifest.file_table(store.describe(MANIFEST_NAME))
        self.tile_sums = manifest.tile_sums(store.describe(MANIFEST_NAME))

    def read_file(self, name: str, max_size: int) -> bytes:
        """The whole file ``name``, checked against the manifest's file table (size before
        reading, SHA-256 after). Datasets written before file tables: read unchecked, refused
        above ``max_size`` bytes.

        Raises
        ------
        FormatError
            Naming the file, when it is not what the manifest records.
        """
        return self.files.read(self.store, name, max_size)

    def load_npy(self, name: str, length: int | tuple[int, ...],
                 dtype: str | None = None) -> np.ndarray:  # fmt: skip
        """An integer ``.npy`` file of ``length`` entries (or that shape), its header checked
        against the file's size before anything is allocated (and the whole file against the
        file table). ``dtype``: the one dtype accepted (default: any integer of up to 8 bytes).

        Raises
        ------
        FormatError
            Naming the file, for anything but such an array (empty, truncated, a header
            claiming more entries than the file holds, another dtype or shape).
        """
        where = self.store.describe(name)
        want = (length,) if isinstance(length, int) else tuple(length)
        count = int(np.prod(want, dtype=np.int64))
        # 8 bytes per entry at most, plus the header (numpy caps headers at 10,000 bytes).
        data = self.read_file(name, max_size=16 + 10_000 + 8 * count)
        shape, fortran, got, offset = parse_npy_header(data, where)
        wrong_dtype = got != np.dtype(dtype) if dtype is not None else (
            got.kind not in "iu" or got.itemsize > 8)  # fmt: skip
        if shape != want or wrong_dtype or fortran:
            what = f"{count} integers" if len(want) == 1 else f"integers of shape {want}"
            raise FormatError(f"{where}: expected {what}, got {got} {shape}")
        body = len(data) - offset
        if body != count * got.itemsize:
            raise FormatError(
                f"{where}: holds {body} bytes of data, {count} {got} entries need "
                f"{count * got.itemsize}"
            )
        return np.frombuffer(data, dtype=got, count=count, offset=offset).reshape(want)

    def verify_files(self) -> None:
        """Every file of the file table: present, its size and SHA-256."""
        for name in self.files.names():
            data = self.store.read_buffer(name, self.files.size(name))
            self.files.check(name, data, self.store.describe)
        if self.tile_sums is not None:
            size = self.store.size(self.tile_sums.file)
            if size != self.tile_sums.size:
                raise FormatError(f"{self.store.describe(self.tile_sums.file)}: {size} bytes, "
                                  f"{self.manifest.n_tiles} rows need {self.tile_sums.size}")


class DatasetPart:
    """One part of an opened dataset, reading through the dataset's :class:`StoredFiles`."""

    def __init__(self, stored: StoredFiles) -> None:
        self.stored = stored

    @property
    def store(self) -> Store:
        """Where the dataset lives."""
        return self.stored.store

    @property
    def manifest(self) -> Manifest:
        """The dataset's validated manifest."""
        return self.stored.manifest
