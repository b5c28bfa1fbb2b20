"""The local obs cache of FORMAT.md: columns localized once, then memory-mapped.

The first time a column is asked for, only its column chunks are read from the parquet shards
(pyarrow reads the footer and the chunks it needs, with ranged reads on remote stores) and
written to ``<cache>/<fingerprint>/obs/<url-quoted name>.arrow``: uncompressed Arrow IPC, one
record batch per tile. Columns are added one at a time, atomically (temporary file, then
rename), under a lock file, so concurrent processes on a node fetch each column once. A cached
file whose batch or row counts disagree with the manifest is deleted and fetched again.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import urllib.parse
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from deltacells.dataset import Dataset
from deltacells.format import FormatError
from deltacells.manifest import ObsSchema, obs_shard_name

__all__ = ["ObsCache", "cache_root"]


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory: ``cache_dir``, ``$DELTACELLS_CACHE``, ``$XDG_CACHE_HOME/deltacells``
    or ``~/.cache/deltacells``, in that order."""
    if cache_dir is not None:
        return Path(cache_dir)
    if os.environ.get("DELTACELLS_CACHE"):
        return Path(os.environ["DELTACELLS_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "deltacells"
    return Path.home() / ".cache" / "deltacells"


class ObsCache:
    """Per-column local copies of a dataset's obs, keyed by its obs fingerprint.

    Parameters
    ----------
    dataset
        An opened dataset with obs.
    cache_dir
        See :func:`cache_root`.
    """

    def __init__(self, dataset: Dataset, cache_dir: str | os.PathLike | None = None) -> None:
        manifest = dataset.manifest
        if not manifest.has_obs:
            raise ValueError(f"{dataset.store.describe()} has no obs")
        self.dataset = dataset
        self.schema: ObsSchema = dataset.obs_schema()
        self.directory = cache_root(cache_dir) / manifest.obs_fingerprint / "obs"

    def path(self, column: str) -> Path:
        """Where column ``column`` is cached."""
        return self.directory / f"{urllib.parse.quote(column, safe='')}.arrow"

    @contextmanager
    def _locked(self):
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _valid(self, column: str) -> bool:
        path = self.path(column)
        if not path.exists():
            return False
        m = self.dataset.manifest
        try:
            with pa.memory_map(str(path)) as source:
                reader = pa.ipc.open_file(source)
                ok = reader.num_record_batches == m.n_tiles and all(
                    reader.get_batch(i).num_rows == m.tile_cells[i] for i in range(m.n_tiles)
                )
                ok = ok and reader.schema.names == [column]
        except (pa.ArrowInvalid, OSError):
            ok = False
        if not ok:
            path.unlink(missing_ok=True)  # stale or corrupt: fetch it again
        return ok

    def localize(self, columns: Sequence[str]) -> list[str]:
        """Make sure ``columns`` are cached; return the ones this call fetched."""
        for column in columns:
            if column not in self.schema.names:
                raise KeyError(f"obs column {column!r} not in the dataset")
        missing = [c for c in columns if not self._valid(c)]
        fetched = []
        if missing:
            with self._locked():
                for column in missing:
                    if not self._valid(column):  # another process may have fetched it
                        self._fetch(column)
                        fetched.append(column)
        return fetched

    def _fetch(self, column: str) -> None:
        m = self.dataset.manifest
        store = self.dataset.store
        arrow_type = pa.type_for_alias(self.schema[column].arrow_type)
        schema = pa.schema([pa.field(column, arrow_type)])
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".fetch-", suffix=".arrow")
        os.close(fd)
        try:
            with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
                for s in range(m.n_obs_shards):
                    name = obs_shard_name(s)
                    with store.open(name) as handle:
                        parquet = pq.ParquetFile(handle)
                        for g in range(parquet.metadata.num_row_groups):
                            # One batch per row group, i.e. per tile (tiles are never empty).
                            table = parquet.read_row_group(g, columns=[column]).cast(schema)
                            writer.write_batch(table.combine_chunks().to_batches()[0])
            os.replace(tmp, self.path(column))
        except (OSError, pa.ArrowInvalid, IndexError) as err:
            where = store.describe()
            raise FormatError(f"{where}: cannot localize obs column {column!r}: {err}") from err
        finally:
            Path(tmp).unlink(missing_ok=True)
        if not self._valid(column):
            raise FormatError(
                f"{store.describe()}: obs column {column!r} does not match the manifest's tiles"
            )

    def column(self, column: str) -> pa.ChunkedArray:
        """The cached column, memory-mapped, one chunk per tile (localized if needed)."""
        self.localize([column])
        source = pa.memory_map(str(self.path(column)))
        reader = pa.ipc.open_file(source)
        return reader.read_all().column(0)

    def series(self, column: str) -> pd.Series:
        """The column as pandas; category codes become a categorical with the global vocabulary."""
        values = self.column(column)
        spec = self.schema[column]
        if spec.kind == "category":
            codes = values.to_numpy().astype(np.int64)
            categorical = pd.Categorical.from_codes(codes, categories=spec.categories)
            return pd.Series(categorical, name=column)
        return values.to_pandas().rename(column)
