"""The ``anndata.zarr`` element group read through the dataset's own :class:`~.Store`, every
file checked against the manifest's file table.

zarr reads the group through this read-only store, so the elements obey the rules of the rest of
the dataset: regular files only and no links out of the root (local), the store's timeouts,
deadline and retries (remote), each file's size and SHA-256 checked before zarr parses it, and no
directory listing needed (the file table lists the files, so plain HTTP servers work). Datasets
written before file tables are listed through the store and read unchecked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import Any

from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    SuffixByteRequest,
)
from zarr.abc.store import (
    Store as ZarrStore,
)
from zarr.core.buffer import Buffer, BufferPrototype

from deltacells.codec.format import LimitError, get_limits
from deltacells.store.integrity import FileTable
from deltacells.store.storage import Store

__all__ = ["CheckedZarrStore", "check_declared_sizes"]

#: Names zarr gives metadata (not chunks) in format 2 and 3.
_METADATA_FILES = (".zarray", ".zattrs", ".zgroup", ".zmetadata", "zarr.json")


class CheckedZarrStore(ZarrStore):
    """A read-only zarr store over the folder ``prefix`` of a dataset.

    Parameters
    ----------
    store
        The dataset's store.
    files
        The manifest's file table (checked reads), or an absent one (older datasets: the
        folder is listed and read unchecked).
    prefix
        The folder inside the dataset (``anndata.zarr``).
    """

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(self, store: Store, files: FileTable, prefix: str) -> None:
        super().__init__(read_only=True)
        self.store, self.files, self.prefix = store, files, prefix.rstrip("/")
        start = len(self.prefix) + 1
        if files.present:
            names = files.names(self.prefix)
        elif store.is_local:
            # Links and FIFOs too: reading them is refused, where leaving them out would let
            # zarr fill a missing chunk with its fill value.
            names = [n for n, kind in store.entries()
                     if kind != "dir" and n.startswith(self.prefix + "/")]  # fmt: skip
        else:
            names = store.list(self.prefix)
        self._keys = sorted(name[start:] for name in names)
        self._key_set = frozenset(self._keys)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CheckedZarrStore) and other.prefix == self.prefix
                and other.store.describe() == self.store.describe())  # fmt: skip

    def __hash__(self) -> int:
        return hash((self.store.describe(), self.prefix))

    def __getstate__(self) -> dict:
        return {"store": self.store, "files": self.files, "prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["store"], state["files"], state["prefix"])

    def name_of(self, key: str) -> str:
        """The dataset file holding ``key``."""
        return f"{self.prefix}/{key}"

    def read(self, key: str) -> bytes:
        """The whole file of ``key``, checked (size first, then SHA-256)."""
        return self.files.read(self.store, self.name_of(key))

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:  # fmt: skip
        if key not in self._key_set:
            return None
        # The whole file is read and checked even for a byte range: a part of a file cannot
        # be checked against its SHA-256 (anndata's elements are not sharded).
        data = await asyncio.to_thread(self.read, key)
        if isinstance(byte_range, RangeByteRequest):
            data = data[byte_range.start : byte_range.end]
        elif isinstance(byte_range, OffsetByteRequest):
            data = data[byte_range.offset :]
        elif isinstance(byte_range, SuffixByteRequest):
            data = data[-byte_range.suffix :] if byte_range.suffix else b""
        return prototype.buffer.from_bytes(data)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]
                                 ) -> list[Buffer | None]:  # fmt: skip
        return list(await asyncio.gather(*(self.get(key, prototype, byte_range)
                                           for key, byte_range in key_ranges)))  # fmt: skip

    async def exists(self, key: str) -> bool:
        return key in self._key_set

    async def set(self, key: str, value: Buffer) -> None:
        raise PermissionError(f"{self.store.describe(self.prefix)} is read only")

    async def delete(self, key: str) -> None:
        raise PermissionError(f"{self.store.describe(self.prefix)} is read only")

    async def list(self) -> AsyncIterator[str]:
        for key in self._keys:
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in self._keys:
            if key.startswith(prefix):
                yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        start = f"{prefix}/" if prefix else ""
        seen = set()
        for key in self._keys:
            if key.startswith(start):
                child = key[len(start) :].split("/", 1)[0]
                if child not in seen:
                    seen.add(child)
                    yield child

    def stored_bytes(self, folder: str) -> int:
        """Bytes of the chunk files below ``folder`` (an array's path), metadata excluded."""
        start = f"{folder.strip('/')}/" if folder.strip("/") else ""
        names = [self.name_of(k) for k in self._keys
                 if k.startswith(start) and "/" not in k[len(start) :]
                 and k[len(start) :] not in _METADATA_FILES]  # fmt: skip
        if not names:
            return 0
        if self.files.present:
            return sum(self.files.size(n) or 0 for n in names)
        return sum(self.store.sizes(names))


def check_declared_sizes(group: Any, zstore: CheckedZarrStore) -> None:
    """Refuse arrays whose declared shape would decode to more than the reader limits allow
    for the bytes stored (a small edit to an array's metadata must not make a reader allocate
    gigabytes): at most ``max(decoded_floor, decoded_ratio * stored bytes)``, as for tiles.

    Raises
    ------
    deltacells.LimitError
        Naming the array, its declared size and the bytes behind it.
    """
    import numpy as np

    limits = get_limits()
    for path, member in group.members(max_depth=None):
        shape = getattr(member, "shape", None)
        if shape is None:
            continue  # a group
        try:
            dtype = np.dtype(member.dtype)
            # Object (string) arrays hold a pointer per element at least.
            itemsize = 8 if dtype.kind in "OUST" else dtype.itemsize
        except TypeError:  # zarr 3's own string dtypes and the like
            itemsize = 8
        declared = int(np.prod([int(n) for n in shape], dtype=object)) * max(itemsize, 1)
        stored = zstore.stored_bytes(f"{group.path}/{path}" if group.path else path)
        budget = limits.decoded_budget(stored)
        if declared > budget:
            raise LimitError(
                f"{zstore.store.describe(zstore.name_of(path))}: declared as {tuple(shape)} "
                f"({declared} bytes) from {stored} stored bytes, more than the limit of "
                f"{int(budget)} (damaged array metadata?; deltacells.set_limits(decoded_ratio="
                "...) raises it)"
            )
