"""The dataset manifest and obs schema of FORMAT.md: parsing, validation, fingerprint.

Like :mod:`deltacells.codec.format`, this module does no I/O: it turns JSON text into checked
objects and back.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltacells.codec.format import (
    HEADER_SIZE,
    MAX_GENES,
    FormatError,
    check_decoded_size,
    chunk_entry_size,
    decoded_bytes,
    get_limits,
)
from deltacells.store.integrity import (
    CHUNK_SUMS_KEY,
    DIGEST_KEY,
    FILES_KEY,
    ChunkSums,
    FileTable,
    check_seal,
    ints_within,
    sealed_json,
)

__all__ = [
    "DATASET_FORMAT",
    "OBS_FORMAT",
    "Manifest",
    "ObsColumn",
    "ObsSchema",
    "obs_fingerprint",
    "obs_shard_name",
    "tile_name",
]

DATASET_FORMAT = "deltacells-dataset"
DATASET_VERSION = 2
READABLE_DATASET_VERSIONS = (1, 2)
OBS_FORMAT = "deltacells-obs"
OBS_VERSION = 1
MANIFEST_NAME = "manifest.json"
#: Largest manifest read (a 100M-cell dataset's is a few MB); bigger ones are refused unread.
MAX_MANIFEST_BYTES = 64 * 2**20
GENE_ORDER_NAME = "gene_order.npy"
VAR_NAMES_NAME = "var_names.txt"
VAR_TABLE_NAME = "var.parquet"
OBS_SCHEMA_NAME = "obs/schema.json"
#: The tiles' chunk checksums (see :mod:`deltacells.store.integrity`).
TILE_SUMS_NAME = "tiles/chunk_crc32.bin"
#: The obs column that holds obs_names (recorded in the manifest's metadata too).
OBS_INDEX_COLUMN = "_index"
CATEGORY_CODE_TYPES = ("int8", "int16", "int32")
NUMERIC_ARROW_TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                       "halffloat", "float", "double")  # fmt: skip
_HEX24 = re.compile(r"^[0-9a-f]{24}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


#: Largest integer a manifest may hold (JSON integers are unbounded; numpy's are not).
MAX_JSON_INT = 2**62


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    """``object_pairs_hook`` refusing repeated keys (``json`` silently keeps the last one)."""
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} appears twice")
        obj[key] = value
    return obj


def parse_json(text: str | bytes, where: str) -> Any:
    """Parse JSON strictly: valid UTF-8, no repeated keys, no NaN or Infinity.

    Raises
    ------
    FormatError
        Naming ``where`` and what is wrong.
    """

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=no_constants)
    except (ValueError, TypeError, RecursionError) as err:
        raise FormatError(f"{where}: not valid JSON ({err})") from None


def tile_name(index: int) -> str:
    """Path of tile ``index`` inside a dataset (``tiles/tile_000123.dct``)."""
    return f"tiles/tile_{index:06d}.dct"


def obs_shard_name(index: int) -> str:
    """Path of obs shard ``index`` inside a dataset (``obs/obs_0001.parquet``)."""
    return f"obs/obs_{index:04d}.parquet"


def category_code_type(n_categories: int) -> str:
    """Smallest signed integer type holding codes ``-1 .. n_categories - 1``."""
    if n_categories <= 2**7 - 1:
        return "int8"
    if n_categories <= 2**15 - 1:
        return "int16"
    return "int32"


@dataclass(frozen=True)
class ObsColumn:
    """One obs column: its name, kind (category, numeric, bool, string) and Arrow type."""

    name: str
    kind: str
    arrow_type: str
    categories: list | None = None

    def to_json(self) -> dict:
        """The column as it appears in ``obs/schema.json``."""
        return {
            "name": self.name,
            "kind": self.kind,
            "arrow_type": self.arrow_type,
            "categories": self.categories,
        }


@dataclass(frozen=True)
class ObsSchema:
    """The obs schema (``obs/schema.json``)."""

    columns: tuple[ObsColumn, ...]

    def to_json_text(self) -> str:
        """The canonical text written to ``obs/schema.json``."""
        obj = {
            "format": OBS_FORMAT,
            "version": OBS_VERSION,
            "columns": [c.to_json() for c in self.columns],
        }
        return json.dumps(obj, indent=1, ensure_ascii=False)

    @property
    def names(self) -> list[str]:
        """Column names in order."""
        return [c.name for c in self.columns]

    def __getitem__(self, name: str) -> ObsColumn:
        for column in self.columns:
            if column.name == name:
                return column
        raise KeyError(name)

    @classmethod
    def from_json_text(cls, text: str, where: str = OBS_SCHEMA_NAME) -> ObsSchema:
        """Parse and validate ``obs/schema.json``.

        Raises
        ------
        FormatError
            If the schema is not valid JSON or breaks FORMAT.md's obs rules.
        """
        obj = parse_json(text, where)
        if not isinstance(obj, dict) or obj.get("format") != OBS_FORMAT:
            raise FormatError(f"{where}: format is not {OBS_FORMAT!r}")
        if obj.get("version") != OBS_VERSION:
            raise FormatError(f"{where}: unsupported obs schema version {obj.get('version')!r}")
        columns = obj.get("columns")
        if not isinstance(columns, list):
            raise FormatError(f"{where}: 'columns' must be a list")
        parsed, seen = [], set()
        for i, col in enumerate(columns):
            if not isinstance(col, dict) or not isinstance(col.get("name"), str):
                raise FormatError(f"{where}: column {i} has no name")
            name, kind, arrow_type = col["name"], col.get("kind"), col.get("arrow_type")
            categories = col.get("categories")
            if name in seen:
                raise FormatError(f"{where}: column {name!r} appears twice")
            seen.add(name)
            if kind == "category":
                if not isinstance(categories, list):
                    raise FormatError(f"{where}: category column {name!r} has no categories list")
                if arrow_type not in CATEGORY_CODE_TYPES:
                    raise FormatError(f"{where}: category column {name!r} has codes {arrow_type!r}")
                limit = {"int8": 2**7 - 1, "int16": 2**15 - 1, "int32": 2**31 - 1}[arrow_type]
                if len(categories) > limit:
                    raise FormatError(
                        f"{where}: column {name!r}: {len(categories)} categories do not fit "
                        f"{arrow_type} codes"
                    )
            elif kind == "numeric":
                if arrow_type not in NUMERIC_ARROW_TYPES:
                    raise FormatError(f"{where}: numeric column {name!r} has type {arrow_type!r}")
            elif kind == "bool":
                if arrow_type != "bool":
                    raise FormatError(f"{where}: bool column {name!r} has type {arrow_type!r}")
            elif kind == "string":
                if arrow_type != "string":
                    raise FormatError(f"{where}: string column {name!r} has type {arrow_type!r}")
            else:
                raise FormatError(f"{where}: column {name!r} has unknown kind {kind!r}")
            parsed.append(ObsColumn(name, kind, arrow_type, categories))
        return cls(tuple(parsed))


def obs_fingerprint(schema_text: str, tile_cells: list[int], shard_sha256: list[str]) -> str:
    """The 24-hex-character obs fingerprint of FORMAT.md, canonical JSON as in NOTES.md."""
    obj = {"schema": schema_text, "tile_cells": [int(c) for c in tile_cells],
           "shards": list(shard_sha256)}  # fmt: skip
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(canonical).hexdigest()[:24]


def _int_list(obj: dict, key: str, where: str, length: int | None = None) -> list[int]:
    value = obj.get(key)
    if not isinstance(value, list) or not ints_within(value, 0, MAX_JSON_INT):
        raise FormatError(f"{where}: '{key}' must be a list of integers in 0..2^62")
    if length is not None and len(value) != length:
        raise FormatError(f"{where}: '{key}' has {len(value)} entries, expected {length}")
    return value


def _check_tiles(tile_cells: list[int], tile_nnz: list[int], tile_bytes: list[int],
                 tile_size: int, n_genes: int, version: int, where: str) -> None:
    """Each tile's cells, nonzeros and bytes are possible for its place and within the
    decoded-size limit; raises for the first tile that is not, as the per-tile checks
    (:func:`_check_tile_cells`, :func:`_check_tile_sizes`) do.

    numpy finds the tiles to look at (all of them pass in a valid manifest of 100M cells);
    the per-tile checks then run on those alone. Values past 2^40 always go to the per-tile
    checks (cells past 2^30: times up to 2^31 genes), so that numpy's int64 and float64
    arithmetic is exact wherever it decides."""
    cells = np.asarray(tile_cells, dtype=np.int64)
    if (cells[:-1] != tile_size).any() or (cells < 1).any() or (cells > tile_size).any():
        for i in range(len(tile_cells)):
            _check_tile_cells(i, tile_cells, tile_size, where)
    nnz = np.asarray(tile_nnz, dtype=np.int64)
    stored = np.asarray(tile_bytes, dtype=np.int64)
    large = (nnz > 2**40) | (stored > 2**40) | (cells > 2**30)
    # The same formulas as the per-tile checks, on arrays (Limits.decoded_budget's max is
    # Python's, hence np.maximum here).
    limits = get_limits()
    budget = np.maximum(float(limits.decoded_floor), limits.decoded_ratio * stored)
    suspect = large | (nnz > cells * n_genes) | (stored < _smallest_tile(cells, version))
    suspect |= decoded_bytes(cells, nnz) > budget
    for i in np.flatnonzero(suspect).tolist():
        _check_tile_sizes(i, tile_cells, tile_nnz, tile_bytes, n_genes, version, where)


def _smallest_tile(cells, version: int):
    """Fewest bytes a tile of ``cells`` cells can have (a count, or an array of them): its
    header, one chunk entry and its uncompressed indptr."""
    return HEADER_SIZE + chunk_entry_size(version) + 8 * (cells + 1)


def _check_tile_cells(i: int, tile_cells: list[int], tile_size: int, where: str) -> None:
    """Every tile but the last holds ``tile_size`` cells, the last 1..tile_size."""
    cells, expected_full = tile_cells[i], i < len(tile_cells) - 1
    if (expected_full and cells != tile_size) or not 1 <= cells <= tile_size:
        raise FormatError(
            f"{where}: tile {i} holds {cells} cells; every tile but the last holds "
            f"tile_size={tile_size}, the last 1..{tile_size}"
        )


def _check_tile_sizes(i: int, tile_cells: list[int], tile_nnz: list[int],
                      tile_bytes: list[int], n_genes: int, version: int, where: str) -> None:
    """Tile ``i``'s nonzeros fit its cells, its bytes hold at least its header, one chunk
    entry and its indptr, and it decodes within the limits."""
    if tile_nnz[i] < 0 or tile_nnz[i] > tile_cells[i] * n_genes:
        raise FormatError(f"{where}: tile {i} claims {tile_nnz[i]} nonzeros")
    smallest = _smallest_tile(tile_cells[i], version)
    if tile_bytes[i] < smallest:
        raise FormatError(
            f"{where}: tile {i} claims {tile_bytes[i]} bytes, too few for "
            f"{tile_cells[i]} cells (at least {smallest})"
        )
    check_decoded_size(tile_cells[i], tile_nnz[i], tile_bytes[i], f"{where}: tile {i}")


def _int(obj: dict, key: str, where: str, minimum: int = 0, maximum: int = MAX_JSON_INT) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise FormatError(
            f"{where}: '{key}' must be an integer in {minimum}..{maximum}, got {value!r}"
        )
    return value


def _bool(obj: dict, key: str, where: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise FormatError(f"{where}: '{key}' must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class Manifest:
    """A validated ``manifest.json``.

    Attributes mirror the manifest keys of FORMAT.md; ``metadata`` is the free-form object.
    """

    version: int
    n_cells: int
    n_genes: int
    tile_size: int
    tile_cells: list[int]
    tile_nnz: list[int]
    tile_bytes: list[int]
    n_chunks: int
    zstd_level: int
    has_gene_order: bool
    has_var_names: bool
    has_var_table: bool
    has_obs: bool
    obs_tiles_per_file: int | None = None
    obs_shard_bytes: list[int] | None = None
    obs_shard_sha256: list[str] | None = None
    obs_fingerprint: str | None = None
    metadata: dict = field(default_factory=dict)
    #: Each tile's CRC-32 (its header's), in tile order. This ties every tile file to its
    #: place, so tiles swapped together with their counts are found. Optional (older datasets).
    tile_crc32: list[int] | None = None
    #: Size and SHA-256 of every other file read whole (``{name: {"bytes", "sha256"}}``;
    #: see :mod:`deltacells.store.integrity`). None for datasets written before file tables.
    files: dict | None = None
    #: The tiles' chunk checksums (``{"file", "slots", "row_crc32"}``), which let a partial
    #: read of a tile be checked. None for datasets written before them.
    chunk_sums: dict | None = None
    #: Whether the stored manifest carried its own digest (``manifest_sha256``), checked when
    #: parsed. Manifests written before digests are read without one.
    sealed: bool = True
    #: The stored ``manifest_sha256`` (None when not sealed or not read from a store). Keep a
    #: copy elsewhere to detect a manifest rewritten on purpose.
    digest: str | None = field(default=None, compare=False)

    def file_table(self, where: str = MANIFEST_NAME) -> FileTable:
        """The file table (an empty, absent one for older datasets)."""
        return FileTable(self.files, where)

    def tile_sums(self, where: str = MANIFEST_NAME) -> ChunkSums | None:
        """The tiles' chunk checksums (None for older datasets)."""
        if self.chunk_sums is None:
            return None
        return ChunkSums(self.chunk_sums, self.n_tiles, where, (TILE_SUMS_NAME,))

    @property
    def n_tiles(self) -> int:
        """Number of tiles."""
        return len(self.tile_cells)

    @property
    def nnz(self) -> int:
        """Stored nonzeros over all tiles."""
        return sum(self.tile_nnz)

    @property
    def limits(self) -> np.ndarray:
        """Cumulative cell counts (tile ``i`` holds cells ``limits[i-1]`` to ``limits[i]``)."""
        return np.cumsum(np.asarray(self.tile_cells, dtype=np.int64))

    @property
    def n_obs_shards(self) -> int:
        """Number of obs parquet shards."""
        if not self.has_obs or not self.obs_tiles_per_file:
            return 0
        return math.ceil(self.n_tiles / self.obs_tiles_per_file)

    def to_json_text(self) -> str:
        """The manifest as JSON text."""
        obj: dict[str, Any] = {
            "format": DATASET_FORMAT,
            "version": self.version,
            "n_cells": self.n_cells,
            "n_genes": self.n_genes,
            "tile_size": self.tile_size,
            "tile_cells": self.tile_cells,
            "tile_nnz": self.tile_nnz,
            "tile_bytes": self.tile_bytes,
            **({"tile_crc32": self.tile_crc32} if self.tile_crc32 is not None else {}),
            "n_chunks": self.n_chunks,
            "zstd_level": self.zstd_level,
            "has_gene_order": self.has_gene_order,
            "has_var_names": self.has_var_names,
            "has_var_table": self.has_var_table,
            "has_obs": self.has_obs,
        }
        if self.has_obs:
            obj |= {
                "obs_tiles_per_file": self.obs_tiles_per_file,
                "obs_shard_bytes": self.obs_shard_bytes,
                "obs_shard_sha256": self.obs_shard_sha256,
                "obs_fingerprint": self.obs_fingerprint,
            }
        obj["metadata"] = self.metadata
        if self.files is not None:
            obj[FILES_KEY] = self.files
        if self.chunk_sums is not None:
            obj[CHUNK_SUMS_KEY] = self.chunk_sums
        return sealed_json(obj)

    @classmethod
    def from_json_text(cls, text: str | bytes, where: str = MANIFEST_NAME) -> Manifest:
        """Parse a manifest and check it is complete and self-consistent.

        Raises
        ------
        FormatError
            For unknown formats or versions, missing keys and inconsistent counts.
        """
        obj = parse_json(text, where)
        if not isinstance(obj, dict):
            raise FormatError(f"{where}: the manifest must be a JSON object")
        _check_keys(obj, where)
        sealed = DIGEST_KEY in obj
        if sealed:
            check_seal(text.encode("utf-8") if isinstance(text, str) else bytes(text),
                       obj[DIGEST_KEY], where)  # fmt: skip
        if obj.get("format") != DATASET_FORMAT:
            raise FormatError(f"{where}: format is {obj.get('format')!r}, not {DATASET_FORMAT!r}")
        version = obj.get("version")
        if version not in READABLE_DATASET_VERSIONS:
            raise FormatError(f"{where}: unsupported dataset version {version!r} (reads 1 and 2)")
        n_cells = _int(obj, "n_cells", where)
        n_genes = _int(obj, "n_genes", where, 1, MAX_GENES)
        tile_size = _int(obj, "tile_size", where, 1)
        tile_cells = _int_list(obj, "tile_cells", where)
        n_tiles = len(tile_cells)
        tile_nnz = _int_list(obj, "tile_nnz", where, n_tiles)
        tile_bytes = _int_list(obj, "tile_bytes", where, n_tiles)
        if sum(tile_cells) != n_cells:
            raise FormatError(
                f"{where}: tile_cells add up to {sum(tile_cells)}, n_cells is {n_cells}"
            )
        _check_tiles(tile_cells, tile_nnz, tile_bytes, tile_size, n_genes, version, where)
        tile_crc32 = None
        if "tile_crc32" in obj:
            tile_crc32 = _int_list(obj, "tile_crc32", where, n_tiles)
            if tile_crc32 and max(tile_crc32) >= 2**32:
                raise FormatError(f"{where}: 'tile_crc32' holds a value above 32 bits")
        has_obs = _bool(obj, "has_obs", where)
        fields: dict[str, Any] = {}
        if has_obs:
            per_file = _int(obj, "obs_tiles_per_file", where, 1)
            n_shards = math.ceil(n_tiles / per_file)
            shard_bytes = _int_list(obj, "obs_shard_bytes", where, n_shards)
            sha = obj.get("obs_shard_sha256")
            if not isinstance(sha, list) or len(sha) != n_shards:
                raise FormatError(f"{where}: 'obs_shard_sha256' must list {n_shards} hashes")
            if not all(isinstance(h, str) and _HEX64.match(h) for h in sha):
                raise FormatError(f"{where}: 'obs_shard_sha256' holds a malformed SHA-256")
            fingerprint = obj.get("obs_fingerprint")
            if not isinstance(fingerprint, str) or not _HEX24.match(fingerprint):
                raise FormatError(f"{where}: 'obs_fingerprint' must be 24 lowercase hex digits")
            fields = {"obs_tiles_per_file": per_file, "obs_shard_bytes": shard_bytes,
                      "obs_shard_sha256": sha, "obs_fingerprint": fingerprint}  # fmt: skip
        metadata = obj.get("metadata", {})
        if not isinstance(metadata, dict):
            raise FormatError(f"{where}: 'metadata' must be a JSON object")
        _check_metadata(metadata, where)
        files = obj.get(FILES_KEY)
        FileTable(files, where)  # checked here, used by the readers
        chunk_sums = obj.get(CHUNK_SUMS_KEY)
        if chunk_sums is not None:
            ChunkSums(chunk_sums, n_tiles, where, (TILE_SUMS_NAME,))
        return cls(
            version=version,
            n_cells=n_cells,
            n_genes=n_genes,
            tile_size=tile_size,
            tile_cells=tile_cells,
            tile_nnz=tile_nnz,
            tile_bytes=tile_bytes,
            n_chunks=_int(obj, "n_chunks", where),
            zstd_level=obj.get("zstd_level") if isinstance(obj.get("zstd_level"), int) else 0,
            has_gene_order=_bool(obj, "has_gene_order", where),
            has_var_names=_bool(obj, "has_var_names", where),
            has_var_table=_bool(obj, "has_var_table", where),
            has_obs=has_obs,
            metadata=metadata,
            tile_crc32=tile_crc32,
            files=files,
            chunk_sums=chunk_sums,
            sealed=sealed,
            digest=obj.get(DIGEST_KEY) if sealed else None,
            **fields,
        )


#: Keys every manifest has (FORMAT.md's list).
REQUIRED_KEYS = ("format", "version", "n_cells", "n_genes", "tile_size", "tile_cells", "tile_nnz",
                 "tile_bytes", "n_chunks", "zstd_level", "has_gene_order", "has_var_names",
                 "has_var_table", "has_obs", "metadata")  # fmt: skip
#: Keys a manifest with obs has, and only then.
OBS_KEYS = ("obs_tiles_per_file", "obs_shard_bytes", "obs_shard_sha256", "obs_fingerprint")
#: Keys this package adds (docs/format.md), each optional for datasets written before it.
EXTENSION_KEYS = ("tile_crc32", FILES_KEY, CHUNK_SUMS_KEY, DIGEST_KEY)


def _optional(kind: type | tuple[type, ...]):
    def check(value: Any) -> bool:
        return value is None or (isinstance(value, kind) and not (
            isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))))
    return check


def _shuffle_record(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and set(value) <= {"seed", "cell_order"}
                             and _optional(str)(value.get("cell_order"))
                             and _optional(int)(value.get("seed")))  # fmt: skip


#: The metadata keys this package writes and reads, and what each may hold. Others are the
#: user's (``write_deltacells(metadata=...)``) and never read. The records inside (anndata,
#: spatial_index, gene_major, obs_pandas) are checked where they are read.
METADATA_KEYS = {
    "writer": _optional(str),
    "anndata": _optional(dict),
    "obs_index_column": _optional(str),
    "obs_names_unique": _optional(bool),
    "obs_pandas": _optional(dict),
    "sources": lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "layer": _optional(str),
    "join": _optional(str),
    "shuffle": _shuffle_record,
    "cell_order": _optional(str),
    "spatial_index": _optional(dict),
    "gene_major": _optional(dict),
    "simulated": _optional(dict),
    "values_dtype": _optional(str),
}


def _check_metadata(metadata: dict, where: str) -> None:
    """Each metadata key this package reads holds what it must (type level)."""
    for key, ok in METADATA_KEYS.items():
        if key in metadata and not ok(metadata[key]):
            raise FormatError(f"{where}: metadata {key!r} holds {metadata[key]!r}, not what "
                              "the writer records there")  # fmt: skip


def _check_keys(obj: dict, where: str) -> None:
    """The strict schema: every key known, every required one present. Extra information
    belongs in ``metadata`` (free-form), so an unknown key is a damaged or misspelt one."""
    known = {*REQUIRED_KEYS, *OBS_KEYS, *EXTENSION_KEYS}
    unknown = sorted(k for k in obj if k not in known)
    if unknown:
        raise FormatError(f"{where}: unknown manifest keys {unknown} (a damaged manifest, or "
                          f"one this version does not read; known: {sorted(known)})")  # fmt: skip
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if obj.get("has_obs") is True:
        missing += [k for k in OBS_KEYS if k not in obj]
    if missing:
        raise FormatError(f"{where}: manifest keys {missing} are missing")
    stray = [k for k in OBS_KEYS if k in obj and obj.get("has_obs") is False]
    if stray:
        raise FormatError(f"{where}: manifest keys {stray} belong to a dataset with obs, and "
                          "has_obs is not true")  # fmt: skip


#: Where a count layer (``layers/<quoted name>``) or raw (``raw``) may live in a dataset.
_STORED_MATRIX = re.compile(r"layers/[^/.][^/]*|raw")
_ELEMENT_NAMES = ("obsm", "varm", "obsp", "varp", "uns", "layers", "X", "raw")


@dataclass(frozen=True)
class StoredParts:
    """What ``metadata["anndata"]`` records of an AnnData's other parts: count layers and raw
    stored as datasets of their own (location ``"."`` means X itself), and the elements in the
    ``anndata.zarr`` group."""

    layers: dict[str, str] = field(default_factory=dict)
    raw: str | None = None
    elements: tuple[str, ...] = ()

    @classmethod
    def from_manifest(cls, manifest: Manifest, where: str = MANIFEST_NAME) -> StoredParts:
        """Parse and check the record (an empty one for datasets without it).

        Raises
        ------
        FormatError
            For a malformed record or a location outside the dataset.
        """
        record = manifest.metadata.get("anndata")
        if record is None:
            return cls()
        if not isinstance(record, dict):
            raise FormatError(f"{where}: metadata 'anndata' must be an object")
        layers = record.get("layers") or {}
        raw = record.get("raw")
        elements = record.get("elements") or []
        if not isinstance(layers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and (v == "." or _STORED_MATRIX.fullmatch(v))
            and v != "raw" for k, v in layers.items()
        ):  # fmt: skip
            raise FormatError(f"{where}: metadata 'anndata' has a malformed layer location")
        if raw is not None and raw not in (".", "raw"):
            raise FormatError(f"{where}: metadata 'anndata' has raw location {raw!r}")
        if not isinstance(elements, list) or not all(e in _ELEMENT_NAMES for e in elements):
            raise FormatError(f"{where}: metadata 'anndata' lists unknown elements")
        return cls(dict(layers), raw, tuple(elements))

    @property
    def matrices(self) -> list[str]:
        """Locations of the stored count matrices (datasets of their own)."""
        out = [v for v in self.layers.values() if v != "."]
        return out + ([self.raw] if self.raw not in (None, ".") else [])
