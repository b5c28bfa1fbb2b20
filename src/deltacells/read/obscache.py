"""The local obs cache of FORMAT.md: columns localized once, then memory-mapped.

The first time a column is asked for, the obs shards are read (each checked against the
manifest's size and SHA-256, so a rewritten shard is never served) and the column is written
to ``<cache>/<fingerprint>/obs/<url-quoted name>.arrow``: uncompressed Arrow IPC, one record
batch per tile, beside a ``.crc`` file holding its size and CRC-32. Columns are added
atomically (temporary file, then rename) under a lock file, so concurrent processes on a node
fetch each column once. A cached file is opened only if its size and CRC-32 match (checked
once per process and file) and its batch and row counts match the manifest; otherwise it is
deleted and fetched again, so a damaged cache file never crashes the reader or serves wrong
obs.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import urllib.parse
import warnings
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from deltacells.codec import _checksum
from deltacells.codec._rows import string_objects
from deltacells.codec.format import FormatError
from deltacells.codec.threads import effective_n_threads
from deltacells.read.obs_part import ObsPart, category_from_codes
from deltacells.read.stored import PARQUET_ERRORS, arrow_reader
from deltacells.store.manifest import OBS_SCHEMA_NAME, ObsSchema
from deltacells.store.obs_dtypes import index_string_dtype

__all__ = ["ObsCache", "cache_root"]


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: ``cache_dir``, ``$DELTACELLS_CACHE``, ``$XDG_CACHE_HOME/deltacells``
    or ``~/.cache/deltacells``, in that order (``~`` expanded).

    It holds each dataset's obs columns as local Arrow files (per obs fingerprint, CRC-checked
    when used). Where the default folder cannot be written (a read-only home), a folder in the
    temporary directory serves for the process, with a warning; a ``cache_dir`` or
    ``$DELTACELLS_CACHE`` that cannot be written is refused by name.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("DELTACELLS_CACHE"):
        return Path(os.environ["DELTACELLS_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "deltacells"
    return Path.home() / ".cache" / "deltacells"


_fallback_warned = False
#: The file whose lock serialises fetches into one cache folder.
LOCK_NAME = ".lock"


def _writable(cache_dir: str | os.PathLike | None, fingerprint: str) -> Path:
    """The obs cache folder of a dataset under :func:`cache_root`, made and checked writable.

    A folder the user chose (``cache_dir`` or ``$DELTACELLS_CACHE``) that cannot be written is
    their mistake, named with the way out. The default one (under the home folder) may be
    read-only where users cannot change it (containers, compute nodes): then a folder in
    the temporary directory serves, with a warning once per process, as matplotlib does for
    its own cache."""
    chosen = cache_dir is not None or bool(os.environ.get("DELTACELLS_CACHE"))
    root = cache_root(cache_dir)
    try:
        return _made(root / fingerprint / "obs")
    except OSError as err:
        if chosen:
            where = "cache_dir" if cache_dir is not None else "$DELTACELLS_CACHE"
            raise OSError(err.errno, f"{where} {root}: cannot hold the obs cache "
                                     f"({err.strerror}); pass a writable folder as cache_dir= "
                                     "or in $DELTACELLS_CACHE") from err  # fmt: skip
        fallback = Path(tempfile.gettempdir()) / f"deltacells-cache-{os.getuid()}"
        directory = _made(fallback / fingerprint / "obs")
        global _fallback_warned
        if not _fallback_warned:
            _fallback_warned = True
            warnings.warn(f"the obs cache's default folder {root} cannot be written "
                          f"({err.strerror}); using {fallback} for this process. Set "
                          "$DELTACELLS_CACHE or pass cache_dir= to choose a lasting one",
                          stacklevel=5)  # fmt: skip
        return directory


def _made(directory: Path) -> Path:
    """``directory`` created if needed and shown writable by making its lock file (which
    every fetch takes anyway; permission bits alone do not say it, e.g. for root or on a
    read-only mount)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / LOCK_NAME).touch()
    return directory


class ObsCache:
    """Per-column local copies of a dataset's obs, keyed by its obs fingerprint.

    Parameters
    ----------
    dataset
        An opened dataset with obs (:class:`~deltacells.Dataset`), or its obs part
        (:class:`~deltacells.read.obs_part.ObsPart`, all the cache reads).
    cache_dir
        See :func:`cache_root`.
    """

    def __init__(self, dataset: Any, cache_dir: str | os.PathLike | None = None) -> None:
        dataset = getattr(dataset, "obs_part", dataset)
        if not isinstance(dataset, ObsPart):
            raise TypeError(f"ObsCache reads an opened dataset, not {type(dataset).__name__}")
        manifest = dataset.manifest
        if not manifest.has_obs:
            raise ValueError(f"{dataset.store.describe()} has no obs")
        self.obs_part = dataset
        self.schema: ObsSchema = dataset.obs_schema()
        self.directory = _writable(cache_dir, manifest.obs_fingerprint)
        # Files whose CRC was checked in this process: column -> (inode, mtime, size).
        self._checked: dict[str, tuple[int, int, int]] = {}

    def path(self, column: str) -> Path:
        """Where column ``column`` is cached."""
        return self.directory / f"{urllib.parse.quote(column, safe='')}.arrow"

    @contextmanager
    def _locked(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / LOCK_NAME, "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _crc_path(self, column: str) -> Path:
        return self.path(column).with_suffix(".crc")

    def _valid(self, column: str) -> bool:
        """Whether the cached file of ``column`` is intact and matches the manifest (a bad
        one is deleted, so the next fetch replaces it)."""
        path = self.path(column)
        if not path.exists():
            return False
        ok = self._intact(column) and self._matches_manifest(column)
        if not ok:
            path.unlink(missing_ok=True)  # stale or corrupt: fetch it again
            self._crc_path(column).unlink(missing_ok=True)
        return ok

    def _intact(self, column: str) -> bool:
        """Size and CRC-32 as recorded when the file was made (once per process and file)."""
        path = self.path(column)
        try:
            st = path.stat()
            identity = (st.st_ino, st.st_mtime_ns, st.st_size)
            if self._checked.get(column) == identity:
                return True
            recorded = self._crc_path(column).read_text().split()
            size, crc = int(recorded[0]), int(recorded[1], 16)
            if size != st.st_size:
                return False
            with pa.memory_map(str(path)) as source:
                data = np.frombuffer(source.read_buffer(), dtype=np.uint8)
                ok = _file_crc(data) == crc
        except (OSError, ValueError, IndexError):
            return False
        if ok:
            self._checked[column] = identity
        return ok

    def _matches_manifest(self, column: str) -> bool:
        m = self.obs_part.manifest
        try:
            with pa.memory_map(str(self.path(column))) as source:
                reader = pa.ipc.open_file(source)
                return (
                    reader.schema.names == [column]
                    and reader.num_record_batches == m.n_tiles
                    and all(reader.get_batch(i).num_rows == m.tile_cells[i]
                            for i in range(m.n_tiles))
                )  # fmt: skip
        except PARQUET_ERRORS:
            return False

    def localize(self, columns: Sequence[str]) -> list[str]:
        """Make sure ``columns`` are cached; return the ones this call fetched."""
        for column in columns:
            if column not in self.schema.names:
                raise KeyError(f"obs column {column!r} not in the dataset")
        missing = [c for c in dict.fromkeys(columns) if not self._valid(c)]
        if not missing:
            return []
        with self._locked():
            missing = [c for c in missing if not self._valid(c)]  # another process's work
            if missing:
                self._fetch(missing)
        return missing

    def _fetch(self, columns: list[str]) -> None:
        """Write the cache files of ``columns`` from one pass over the verified shards."""
        m = self.obs_part.manifest
        store = self.obs_part.store
        schemas = {
            c: pa.schema([pa.field(c, pa.type_for_alias(self.schema[c].arrow_type))])
            for c in columns
        }
        temporary: dict[str, str] = {}
        try:
            with ExitStack() as stack:
                writers = {}
                for column in columns:
                    fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".fetch-",
                                               suffix=".arrow")  # fmt: skip
                    os.close(fd)
                    temporary[column] = tmp
                    sink = stack.enter_context(pa.OSFile(tmp, "wb"))
                    writers[column] = stack.enter_context(
                        pa.ipc.new_file(sink, schemas[column])
                    )
                for s in range(m.n_obs_shards):
                    # Size and SHA-256 against the manifest before anything is parsed.
                    parquet = pq.ParquetFile(arrow_reader(self.obs_part.obs_shard(s)))
                    for g in range(parquet.metadata.num_row_groups):
                        # One batch per row group, i.e. per tile (tiles are never empty).
                        table = parquet.read_row_group(g, columns=columns)
                        for column in columns:
                            part = table.select([column]).cast(schemas[column])
                            writers[column].write_batch(part.combine_chunks().to_batches()[0])
            for column in columns:
                self._commit(column, temporary.pop(column))
        except PARQUET_ERRORS as err:
            where = store.describe()
            raise FormatError(f"{where}: cannot localize obs columns {columns}: {err}") from err
        finally:
            for tmp in temporary.values():
                Path(tmp).unlink(missing_ok=True)
        for column in columns:
            if not self._valid(column):
                raise FormatError(
                    f"{store.describe()}: obs column {column!r} does not match the manifest's "
                    "tiles"
                )

    def _commit(self, column: str, tmp: str) -> None:
        """Record the size and CRC-32 of a finished file, then move it into place."""
        with pa.memory_map(tmp) as source:
            data = np.frombuffer(source.read_buffer(), dtype=np.uint8)
            record = f"{len(data)} {_file_crc(data):08x}\n"
        fd, crc_tmp = tempfile.mkstemp(dir=self.directory, prefix=".fetch-", suffix=".crc")
        with os.fdopen(fd, "w") as f:
            f.write(record)
        # The record first: a reader seeing a new file with the old record refetches it.
        os.replace(crc_tmp, self._crc_path(column))
        os.replace(tmp, self.path(column))
        self._checked.pop(column, None)

    def column(self, column: str) -> pa.ChunkedArray:
        """The cached column, memory-mapped, one chunk per tile (localized if needed)."""
        self.localize([column])
        source = pa.memory_map(str(self.path(column)))
        reader = pa.ipc.open_file(source)
        return reader.read_all().column(0)

    def series(self, column: str) -> pd.Series:
        """The column as pandas; category codes become a categorical with the global vocabulary.

        Raises
        ------
        FormatError
            For category codes outside the vocabulary (naming the column and the dataset).
        """
        values = self.column(column)
        spec = self.schema[column]
        if spec.kind == "category":
            where = self.obs_part.store.describe(OBS_SCHEMA_NAME)
            categorical = category_from_codes(values.to_numpy(), spec, where)
            return pd.Series(categorical, name=column)
        return values.to_pandas().rename(column)

    def names(self, column: str, rows: np.ndarray | None = None,
              n_threads: int | None = None) -> pd.Index:  # fmt: skip
        """The string column ``column`` (stored obs names) as a pandas index of strings, of
        every cell or of stored rows ``rows``.

        On pandas 2 the Python strings are made from the Arrow buffers by
        ``codec._rows.string_objects`` (pyarrow's ``to_pandas`` hashes each string to share
        repeats, most of the time for unique names); on pandas 3 its Arrow-backed ``str``
        comes from the Arrow column (no Python string each); a column with nulls goes
        through pandas as before.

        Raises
        ------
        FormatError
            For string buffers out of bounds or bytes that are not UTF-8, naming the file.
        """
        # A bad thread count is the caller's mistake, not the file's: refused before the
        # kernel's errors are named as the file's below.
        n_threads = effective_n_threads(n_threads)
        where = f"{self.path(column)}: obs names column {column!r}"
        values = self.column(column)
        if rows is not None:
            values = values.take(pa.array(rows))
        string_types = (pa.types.is_string(values.type) or pa.types.is_large_string(values.type))
        if not string_types or values.null_count:
            return pd.Index(values.to_pandas().astype(str).to_numpy())
        default = index_string_dtype()
        if not isinstance(default, np.dtype):
            try:  # offsets in order and in bounds, UTF-8: 40 ms at 10M names
                values.validate(full=True)
            except pa.ArrowInvalid as err:
                raise FormatError(f"{where}: {err}") from err
            return pd.Index(pd.array(values, dtype=default), copy=False)
        offset_type = np.int64 if pa.types.is_large_string(values.type) else np.int32
        chunks = []
        for chunk in values.chunks:
            if not len(chunk):
                continue
            buffers = chunk.buffers()
            offsets = np.frombuffer(buffers[1], dtype=offset_type)
            offsets = offsets[chunk.offset:chunk.offset + len(chunk) + 1].astype(np.int64)
            data = (np.frombuffer(buffers[2], dtype=np.uint8) if buffers[2] is not None
                    else np.zeros(0, dtype=np.uint8))  # fmt: skip
            if len(offsets) != len(chunk) + 1:
                raise FormatError(f"{where} has {len(offsets)} string offsets for "
                                  f"{len(chunk)} strings")
            if not 0 <= offsets[0] <= len(data):
                raise FormatError(f"{where} has string offsets that do not fit its "
                                  f"{len(data)} bytes")
            # The kernel checks the rest: each offset within the chunk's data, in order.
            chunks.append((offsets - offsets[0], data[offsets[0]:]))
        try:
            return pd.Index(string_objects(chunks, n_threads), dtype=object, copy=False)
        except (ValueError, UnicodeDecodeError) as err:
            raise FormatError(f"{where}: {err}") from err


def _file_crc(data: np.ndarray) -> int:
    return _checksum.crc32_range(data, 0, 1) if len(data) else 0
