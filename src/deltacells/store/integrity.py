"""What ties every stored byte to the manifest, beyond each tile's own CRC-32.

* The manifest's own digest (``manifest_sha256``): SHA-256 of the manifest's bytes with the
  digest's own 64 digits replaced by zeros, so any changed byte is refused.
* The file table (``files``): size and SHA-256 of every file read whole (gene order, var tables,
  obs schema, cell order, spatial index files, the nested datasets' manifests and every file of
  the ``anndata.zarr`` element store). Tiles, obs shards and gene-major blocks have their own
  per-file records in the manifest.
* Chunk checksums (``chunk_sums``): for each tile, a row of CRC-32s, one per chunk, over the
  chunk's table entry, its indptr slice and its frames, plus one over the whole chunk table; the
  manifest keeps a CRC-32 of each tile's header and row. A partial read of a tile (ranged reads,
  the gene-major companion) checks exactly what it fetched without the whole tile's CRC.

Like ``deltacells.store.manifest``, this module does no I/O of its own: it checks bytes
handed to it.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from deltacells.codec import _checksum
from deltacells.codec.format import (
    GAPS_LEN,
    GAPS_OFF,
    HEADER_SIZE,
    FormatError,
    chunk_entry_size,
)

__all__ = [
    "CHUNK_SUMS_KEY",
    "DIGEST_KEY",
    "FILES_KEY",
    "ChunkSums",
    "FileTable",
    "check_checksum_row",
    "check_seal",
    "file_record",
    "sealed_json",
    "tile_checksum_row",
]

#: Manifest key of the manifest's own SHA-256 (over the canonical JSON of the other keys).
DIGEST_KEY = "manifest_sha256"
#: Manifest key of the file table: ``{name: {"bytes": n, "sha256": hex}}``.
FILES_KEY = "files"
#: Manifest key (and gene-major record key) of the chunk checksums.
CHUNK_SUMS_KEY = "chunk_sums"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _relative_name(name: Any) -> bool:
    """Whether ``name`` is a relative, ``/``-separated path with no empty, ``.`` or ``..``
    parts (a file-table name cannot reach outside the dataset)."""
    return isinstance(name, str) and all(
        part not in ("", ".", "..") and "\\" not in part and "\x00" not in part
        for part in name.split("/"))


def sha256_hex(data: Any) -> str:
    """SHA-256 (hex) of a bytes-like object."""
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def file_record(data: Any) -> dict:
    """The file-table record of ``data``: its size and SHA-256."""
    return {"bytes": len(memoryview(data).cast("B")), "sha256": sha256_hex(data)}


#: What stands for the digest while it is computed.
_UNSEALED = "0" * 64


def sealed_json(obj: Mapping[str, Any]) -> str:
    """``obj`` as indented JSON text with ``manifest_sha256`` last, holding the SHA-256 (hex)
    of that same text (UTF-8) in which the digest's 64 digits are zeros."""
    body = {k: v for k, v in obj.items() if k != DIGEST_KEY} | {DIGEST_KEY: _UNSEALED}
    text = json.dumps(body, indent=1, allow_nan=False)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    field = f'"{DIGEST_KEY}": "{_UNSEALED}"'
    head, _, tail = text.rpartition(field)
    return f'{head}"{DIGEST_KEY}": "{digest}"{tail}'


def check_seal(data: bytes, digest: Any, where: str) -> None:
    """Refuse manifest bytes ``data`` unless ``digest`` (its stored ``manifest_sha256``) is the
    SHA-256 of ``data`` with the digest's digits, found exactly once, replaced by zeros."""
    if not isinstance(digest, str) or not _HEX64.match(digest):
        raise FormatError(f"{where}: '{DIGEST_KEY}' must be 64 lowercase hex digits")
    needle = digest.encode("ascii")
    if data.count(needle) != 1:
        raise FormatError(f"{where}: its {DIGEST_KEY} appears {data.count(needle)} times")
    if hashlib.sha256(data.replace(needle, _UNSEALED.encode("ascii"))).hexdigest() != digest:
        raise FormatError(f"{where}: the manifest's bytes do not match its {DIGEST_KEY} (a "
                          "damaged or edited manifest; every byte is covered)")  # fmt: skip


class FileTable:
    """The manifest's file table, checked when parsed; :meth:`check` holds bytes read to it.

    Parameters
    ----------
    records
        ``{name: {"bytes": int, "sha256": hex}}`` as stored, or None (a dataset written before
        file tables: nothing can be checked, ``present`` is False).
    where
        The manifest's location, for messages.
    """

    def __init__(self, records: Any, where: str) -> None:
        self.where = where
        self.present = records is not None
        self._records: dict[str, tuple[int, str]] = {}
        if records is None:
            return
        if not isinstance(records, dict):
            raise FormatError(f"{where}: '{FILES_KEY}' must be an object of file records")
        for name, record in records.items():
            if not _relative_name(name):
                raise FormatError(f"{where}: file table names {name!r}, not a relative path "
                                  "inside the dataset")  # fmt: skip
            if not (isinstance(record, dict) and set(record) == {"bytes", "sha256"}
                    and isinstance(record["bytes"], int) and not isinstance(record["bytes"], bool)
                    and 0 <= record["bytes"] <= 2**62 and isinstance(record["sha256"], str)
                    and _HEX64.match(record["sha256"])):  # fmt: skip
                raise FormatError(f"{where}: file table entry {name!r} must be "
                                  '{"bytes": size, "sha256": 64 hex digits}')  # fmt: skip
            self._records[name] = (record["bytes"], record["sha256"])

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def size(self, name: str) -> int | None:
        """The recorded size of ``name`` (None if not listed)."""
        record = self._records.get(name)
        return None if record is None else record[0]

    def names(self, prefix: str = "") -> list[str]:
        """Listed names below ``prefix`` (a folder, without its trailing slash), sorted."""
        start = prefix.rstrip("/") + "/" if prefix else ""
        return sorted(n for n in self._records if n.startswith(start))

    def require(self, name: str, describe: Callable[[str], str]) -> int:
        """The recorded size of ``name``; a dataset with a file table that does not list a
        file it needs is damaged."""
        size = self.size(name)
        if size is None:
            raise FormatError(f"{describe(name)}: not in the manifest's file table (damaged "
                              "manifest, or a file added after the dataset was written)")
        return size

    def check(self, name: str, data: Any, describe: Callable[[str], str]) -> None:
        """Raise :class:`~deltacells.FormatError` unless ``data`` has the size and SHA-256
        recorded for ``name``. Without a file table (older datasets) nothing is checked."""
        if not self.present:
            return
        size = self.require(name, describe)
        got = len(memoryview(data).cast("B"))
        if got != size:
            raise FormatError(f"{describe(name)}: {got} bytes, the manifest's file table "
                              f"says {size}")  # fmt: skip
        digest = sha256_hex(data)
        if digest != self._records[name][1]:
            raise FormatError(f"{describe(name)}: SHA-256 {digest[:16]}... is not the one the "
                              "manifest's file table records (the file is damaged or was "
                              "changed after writing)")  # fmt: skip

    def read(self, store: Any, name: str, max_size: int | None = None) -> bytes:
        """The whole file ``name`` from ``store`` (a :class:`~deltacells.store.storage.Store`),
        checked: its size before it is read, its SHA-256 after. Without a file table (older
        datasets) it is read unchecked, refused above ``max_size`` bytes if given."""
        if not self.present:
            return store.read_bytes(name, max_size=max_size)
        data = store.read_buffer(name, self.require(name, store.describe))
        self.check(name, data, store.describe)
        return data.tobytes()

    def to_json(self) -> dict:
        """The table as stored."""
        return {n: {"bytes": s, "sha256": h} for n, (s, h) in sorted(self._records.items())}


# -- chunk checksums ------------------------------------------------------------------------------


def tile_checksum_row(blob: Any) -> np.ndarray:
    """The checksum row of a version-2 tile: ``[n_chunks, crc32(chunk table), crc of chunk 0,
    ...]`` (uint32), as the writer stores it in the chunk checksum file."""
    data = memoryview(blob).cast("B")
    n_chunks = int.from_bytes(data[36:40], "little")
    indptr_off = int.from_bytes(data[40:48], "little")
    entry = chunk_entry_size(2)
    table_end = HEADER_SIZE + entry * n_chunks
    table = np.frombuffer(data[HEADER_SIZE:table_end], dtype="<u8").reshape(n_chunks, entry // 8)
    row = np.empty(2 + n_chunks, dtype=np.uint32)
    row[0] = n_chunks
    row[1] = zlib.crc32(data[HEADER_SIZE:table_end])
    # Each chunk: its table entry, its indptr slice, then its frames (see chunk_crcs).
    cells = table[:, :2].astype(np.int64)
    row[2:] = _checksum.chunk_crcs(
        np.frombuffer(data[HEADER_SIZE:table_end], dtype=np.uint8).reshape(n_chunks, entry),
        np.frombuffer(data, dtype=np.uint8), indptr_off + 8 * cells[:, 0],
        indptr_off + 8 * (cells[:, 1] + 1), np.frombuffer(data, dtype=np.uint8),
        np.ascontiguousarray(table[:, GAPS_OFF::2][:, :4], dtype=np.int64),
        np.ascontiguousarray(table[:, GAPS_LEN::2][:, :4], dtype=np.int64))  # fmt: skip
    return row


def row_crc(header: Any, row: np.ndarray) -> int:
    """CRC-32 of a tile's 64-byte header followed by its checksum row, zero-padded to the
    file's slots (what the manifest records per tile: it ties the header and the row to the
    manifest)."""
    return zlib.crc32(np.ascontiguousarray(row, dtype="<u4").tobytes(),
                      zlib.crc32(bytes(memoryview(header).cast("B")[:HEADER_SIZE])))  # fmt: skip


def chunk_sums_record(file: str, rows: list[np.ndarray], headers: list[bytes]) -> tuple[dict,
                                                                                         bytes]:
    """The manifest record and the file bytes of the checksum rows of a set of tiles."""
    slots = max((len(r) - 2 for r in rows), default=0)
    table = np.zeros((len(rows), slots + 2), dtype="<u4")
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    crcs = [row_crc(h, r) for h, r in zip(headers, table, strict=True)]
    return {"file": file, "slots": slots, "row_crc32": crcs}, table.tobytes()


def ints_within(values: list, low: int, high: int) -> bool:
    """Whether every entry of ``values`` is a JSON integer (a Python ``int``, not a bool) in
    ``low .. high``. The type test and the bounds run in C (``map(type)``, ``min``, ``max``):
    a 100M-cell manifest lists 24,425 tiles in each of its lists."""
    return set(map(type, values)) <= {int} and (not values or (low <= min(values)
                                                               and max(values) <= high))


class ChunkSums:
    """The chunk checksums of a set of tiles (``chunk_sums`` record), read a row at a time.

    Parameters
    ----------
    record
        The stored record ``{"file", "slots", "row_crc32"}``.
    n_rows
        How many tiles (or blocks) it must cover.
    where
        The manifest's location, for messages.
    allowed_files
        File names the record may point at.
    """

    def __init__(self, record: Any, n_rows: int, where: str, allowed_files: tuple[str, ...]):
        if not (isinstance(record, dict) and set(record) == {"file", "slots", "row_crc32"}):
            raise FormatError(f"{where}: '{CHUNK_SUMS_KEY}' must hold file, slots and "
                              "row_crc32")  # fmt: skip
        file, slots, crcs = record["file"], record["slots"], record["row_crc32"]
        if file not in allowed_files:
            raise FormatError(f"{where}: '{CHUNK_SUMS_KEY}' names {file!r}, not one of "
                              f"{list(allowed_files)}")  # fmt: skip
        if not isinstance(slots, int) or isinstance(slots, bool) or not 0 <= slots <= 2**31:
            raise FormatError(f"{where}: '{CHUNK_SUMS_KEY}' slots must be 0..2^31")
        if not (isinstance(crcs, list) and len(crcs) == n_rows and ints_within(crcs, 0, 2**32 - 1)):
            raise FormatError(f"{where}: '{CHUNK_SUMS_KEY}' row_crc32 must list {n_rows} "
                              "32-bit values")  # fmt: skip
        self.file, self.slots, self.row_crc32 = file, slots, crcs
        self.row_bytes = 4 * (slots + 2)

    @property
    def size(self) -> int:
        """Bytes of the checksum file."""
        return self.row_bytes * len(self.row_crc32)

    def row(self, index: int, header: Any, read_range: Callable[[str, int, int], bytes],
            describe: Callable[[str], str]) -> tuple[int, np.ndarray]:  # fmt: skip
        """The checked row of tile ``index`` whose header is ``header``: ``(crc32 of the chunk
        table, per-chunk CRC-32s)``.

        Raises
        ------
        FormatError
            If the row or the header is not what the manifest records, or the header's chunk
            count is not the row's.
        """
        start = self.row_bytes * index
        data = read_range(self.file, start, start + self.row_bytes)
        if len(data) != self.row_bytes:
            raise FormatError(f"{describe(self.file)}: shorter than the manifest's "
                              f"{self.size} bytes")  # fmt: skip
        words = np.frombuffer(data, dtype="<u4")
        n_chunks = int(words[0])
        header_chunks = int.from_bytes(bytes(memoryview(header).cast("B")[36:40]), "little")
        if n_chunks > self.slots or n_chunks != header_chunks:
            raise FormatError(f"{describe(self.file)}: row {index} is for {n_chunks} chunks, the "
                              f"tile header says {header_chunks}")  # fmt: skip
        row = words[: 2 + n_chunks]
        # The CRC covers the whole row, unused slots included (they must stay zero).
        if row_crc(header, words) != self.row_crc32[index]:
            raise FormatError(f"{describe(self.file)}: row {index} or the header of its tile "
                              "does not match the CRC-32 the manifest records (damaged)")
        return int(row[1]), row[2:].astype(np.uint32)


def check_checksum_row(sums: ChunkSums, index: int, blob: Any,
                       read_range: Callable[[str, int, int], bytes],
                       describe: Callable[[str], str]) -> None:  # fmt: skip
    """Tile (or block) ``index``'s stored chunk checksum row against the one computed from its
    whole ``blob`` (what ``verify`` does for every tile)."""
    table_crc, stored = sums.row(index, bytes(memoryview(blob).cast("B")[:HEADER_SIZE]),
                                 read_range, describe)  # fmt: skip
    computed = tile_checksum_row(blob)
    if int(computed[1]) != table_crc or not np.array_equal(stored, computed[2:]):
        raise FormatError(f"{describe(sums.file)}: row {index} does not match the chunks of "
                          "its tile")  # fmt: skip
