"""The obs part of a dataset: the obs schema, the shards checked against the manifest, the
obs names column and reading columns whole."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from deltacells.codec.format import FormatError
from deltacells.read.stored import PARQUET_ERRORS, DatasetPart, arrow_reader
from deltacells.store.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    OBS_INDEX_COLUMN,
    OBS_SCHEMA_NAME,
    ObsColumn,
    ObsSchema,
    obs_fingerprint,
    obs_shard_name,
)

__all__ = ["ObsPart", "category_from_codes"]


class ObsPart(DatasetPart):
    """Obs: the schema, the shards and the obs names column."""

    def obs_schema(self) -> ObsSchema | None:
        """The obs schema (None if the dataset has no obs)."""
        if not self.manifest.has_obs:
            return None
        return ObsSchema.from_json_text(self._schema_text(), self.store.describe(OBS_SCHEMA_NAME))

    def _schema_text(self) -> str:
        data = self.stored.read_file(OBS_SCHEMA_NAME, max_size=MAX_MANIFEST_BYTES)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as err:
            where = self.store.describe(OBS_SCHEMA_NAME)
            raise FormatError(f"{where}: not UTF-8 ({err})") from None

    def obs_shard(self, index: int) -> bytes:
        """Obs shard ``index``, checked against the manifest's size and SHA-256."""
        name = obs_shard_name(index)
        m = self.manifest
        data = self.store.read_buffer(name, m.obs_shard_bytes[index]).tobytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest != m.obs_shard_sha256[index]:
            raise FormatError(f"{self.store.describe(name)}: SHA-256 {digest} != manifest's")
        return data

    def read_obs(self, columns: list[str] | None = None) -> pd.DataFrame:
        """All obs columns (or ``columns``) read whole from the shards, in cell order.

        Category columns come back as pandas categoricals with their global vocabulary.
        """
        import pyarrow.parquet as pq

        schema = self.obs_schema()
        if schema is None:
            return pd.DataFrame(index=pd.RangeIndex(self.manifest.n_cells))
        names = schema.names if columns is None else list(columns)
        parts = []
        for s in range(self.manifest.n_obs_shards):
            where = self.store.describe(obs_shard_name(s))
            try:
                table = pq.read_table(arrow_reader(self.obs_shard(s)), columns=names)
            except PARQUET_ERRORS as err:
                raise FormatError(f"{where}: unreadable parquet ({err})") from None
            if table.column_names != names:
                raise FormatError(f"{where}: columns {table.column_names}, expected {names}")
            k = self.manifest.obs_tiles_per_file
            cells = sum(self.manifest.tile_cells[s * k : (s + 1) * k])
            if table.num_rows != cells:
                raise FormatError(f"{where}: {table.num_rows} rows, its tiles hold {cells} cells")
            part = table.to_pandas()
            for name in names:
                if schema[name].kind == "category":
                    part[name] = category_from_codes(part[name].to_numpy(), schema[name], where)
            parts.append(part)
        frame = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=names)
        return frame

    def obs_index_column(self, schema: ObsSchema | None = None) -> str | None:
        """The obs column holding obs_names (None: there is none), checked to be a string
        column of the schema.

        Raises
        ------
        FormatError
            If the manifest names a column that is missing or not a string column.
        """
        schema = self.obs_schema() if schema is None else schema
        if schema is None:
            return None
        name = self.manifest.metadata.get("obs_index_column", OBS_INDEX_COLUMN)
        where = self.store.describe(MANIFEST_NAME)
        if name is None:
            return None
        if not isinstance(name, str) or name not in schema.names:
            if name == OBS_INDEX_COLUMN and "obs_index_column" not in self.manifest.metadata:
                return None  # a dataset from another writer, without obs_names
            raise FormatError(f"{where}: obs_index_column {name!r} is not an obs column")
        if schema[name].kind != "string":
            raise FormatError(
                f"{where}: obs_index_column {name!r} is a {schema[name].kind} column; obs "
                "names are stored as strings"
            )
        return name

    def verify(self) -> None:
        m = self.manifest
        schema_text = self._schema_text()
        schema = ObsSchema.from_json_text(schema_text, self.store.describe(OBS_SCHEMA_NAME))
        for s in range(m.n_obs_shards):
            self._check_obs_shard(s, schema)
        expected = obs_fingerprint(schema_text, m.tile_cells, m.obs_shard_sha256)
        if expected != m.obs_fingerprint:
            raise FormatError(
                f"{self.store.describe(MANIFEST_NAME)}: obs_fingerprint {m.obs_fingerprint} "
                f"!= {expected} computed from the schema and shards"
            )
        self._check_obs_values(schema)

    def _check_obs_values(self, schema: ObsSchema) -> None:
        """Category codes in range in every column; obs names present, and unique where the
        writer recorded that they were."""
        index = self.obs_index_column(schema)
        categories = [c.name for c in schema.columns if c.kind == "category"]
        # One pass over the shards; reading a category column checks its codes.
        frame = self.read_obs(categories + ([index] if index is not None else []))
        if index is None:
            return
        names = frame[index]
        where = self.store.describe(obs_shard_name(0))
        if names.isna().any():
            raise FormatError(f"{where}: obs names column {index!r} has missing values")
        duplicated = names.duplicated()
        if self.manifest.metadata.get("obs_names_unique") and duplicated.any():
            repeated = names[duplicated].iloc[0]
            raise FormatError(
                f"{self.store.describe(MANIFEST_NAME)}: obs names in {index!r} repeat "
                f"({repeated!r}) but the writer recorded them unique (obs_index_column "
                "points at the wrong column?)"
            )

    def _check_obs_shard(self, index: int, schema: ObsSchema) -> None:
        import pyarrow.parquet as pq

        name = self.store.describe(obs_shard_name(index))
        try:
            meta = pq.ParquetFile(arrow_reader(self.obs_shard(index))).metadata
            arrow_schema = meta.schema.to_arrow_schema()
        except PARQUET_ERRORS as err:
            raise FormatError(f"{name}: unreadable parquet ({err})") from None
        m = self.manifest
        k = m.obs_tiles_per_file
        tiles = range(index * k, min((index + 1) * k, m.n_tiles))
        if meta.num_row_groups != len(tiles):
            raise FormatError(f"{name}: {meta.num_row_groups} row groups, expected {len(tiles)}")
        for g, t in enumerate(tiles):
            if meta.row_group(g).num_rows != m.tile_cells[t]:
                raise FormatError(
                    f"{name}: row group {g} has {meta.row_group(g).num_rows} rows, "
                    f"tile {t} has {m.tile_cells[t]} cells"
                )
        if arrow_schema.names != schema.names:
            raise FormatError(f"{name}: columns {arrow_schema.names} != schema {schema.names}")
        for column in schema.columns:
            actual = str(arrow_schema.field(column.name).type)
            if actual != column.arrow_type:
                raise FormatError(
                    f"{name}: column {column.name!r} is {actual}, schema says {column.arrow_type}"
                )


def category_from_codes(codes: np.ndarray, column: ObsColumn, where: str) -> pd.Categorical:
    """Stored category codes as a categorical; codes outside ``-1 .. n - 1`` are a
    :class:`FormatError` naming ``where`` and the column."""
    codes = np.asarray(codes)
    n = len(column.categories or [])
    if codes.dtype.kind not in "iu":
        raise FormatError(f"{where}: column {column.name!r} codes are {codes.dtype}")
    if codes.size and (int(codes.min()) < -1 or int(codes.max()) >= n):
        raise FormatError(
            f"{where}: column {column.name!r} has category codes outside -1..{n - 1}"
        )
    try:
        return pd.Categorical.from_codes(codes.astype(np.int64), categories=column.categories)
    except (ValueError, TypeError) as err:  # e.g. repeated categories
        raise FormatError(f"{where}: column {column.name!r}: {err}") from None
