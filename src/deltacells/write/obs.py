"""The writer's obs, planned and written one input at a time.

The obs of many inputs is the concatenation pandas makes of their tables (outer join on
columns), but it is never built whole: a first pass reads each input's obs in turn and keeps
a few representative rows per column (whose concatenation has the dtypes of the whole), the
distinct values of text columns (up to ``max_categories``) and a 64-bit hash per obs name.
The schema follows from those. Writing reads each input's obs again when its rows come up; a
write in another cell order (``shuffle``, ``cell_order``), where any tile may hold rows of any
input, first encodes each input's obs into one temporary Arrow file and takes the tiles' rows
from it memory-mapped. What the caller keeps per cell is the hash, 8 bytes.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from deltacells.store.manifest import (
    OBS_INDEX_COLUMN,
    OBS_SCHEMA_NAME,
    ObsColumn,
    ObsSchema,
    category_code_type,
    obs_fingerprint,
    obs_shard_name,
)
from deltacells.store.obs_dtypes import pandas_record

#: The column naming each cell's input file when a list of inputs is written.
SOURCE_FILE_COLUMN = "source_file"

Encoder = Callable[[pd.Series], pa.Array]


class ObsInputs:
    """Each input's obs as it enters the output: excluded columns dropped and, for a list of
    inputs, ``source_file`` (a categorical of the file names, in input order) added."""

    def __init__(self, readers: Sequence[Callable[[], pd.DataFrame]], labels: Sequence[str],
                 exclude: Sequence[str], list_input: bool) -> None:  # fmt: skip
        self.readers = list(readers)
        self.labels = list(labels)
        self.exclude = list(exclude)
        self.file_names = [Path(label).name for label in labels] if list_input else None
        self._categories = list(dict.fromkeys(self.file_names or []))

    def __len__(self) -> int:
        return len(self.readers)

    def frame(self, p: int) -> pd.DataFrame:
        return self._entering(self.readers[p](), p)

    def summary(self, p: int, max_categories: int) -> InputSummary:
        """Input ``p``'s obs read once and summarised for planning (see :func:`summarize`),
        with the ``exclude`` names it had."""
        obs = self.readers[p]()
        found = tuple(c for c in self.exclude if c in obs.columns)
        return summarize(self._entering(obs, p), max_categories, found)

    def _entering(self, obs: pd.DataFrame, p: int) -> pd.DataFrame:
        frame = obs.drop(columns=[c for c in self.exclude if c in obs.columns])
        if self.file_names is not None:
            code = self._categories.index(self.file_names[p])
            frame = frame.assign(**{SOURCE_FILE_COLUMN: pd.Categorical.from_codes(
                np.full(len(frame), code, dtype=np.int32), categories=self._categories)})
        return frame


@dataclass
class ObsPlan:
    """The output obs: its schema, the pandas record, the combined dtypes and how each
    column's values become Arrow arrays."""

    inputs: ObsInputs
    schema: ObsSchema
    record: dict
    dtypes: pd.Series  # per output column, in order
    encoders: list[Encoder]  # the index's first, then each column's
    names_unique: bool

    def conform(self, frame: pd.DataFrame) -> pd.DataFrame:
        """Some inputs' rows with the output's columns and dtypes (as the concatenation of
        all the inputs gives them)."""
        frame = frame.reindex(columns=self.dtypes.index)
        for i, dtype in enumerate(self.dtypes):
            if frame.dtypes.iloc[i] != dtype:
                frame.isetitem(i, frame.iloc[:, i].astype(dtype))
        return frame

    def arrays(self, frame: pd.DataFrame) -> list[pa.Array]:
        """The Arrow arrays of a conformed frame: obs names first, then the columns."""
        index = pd.Series(frame.index.astype(str), dtype=object)
        return [self.encoders[0](index)] + [
            encode(frame.iloc[:, i]) for i, encode in enumerate(self.encoders[1:])
        ]


def _concat(frames: list[pd.DataFrame]) -> pd.DataFrame:
    return pd.concat(frames, join="outer") if len(frames) > 1 else frames[0]


def _representative_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows whose concatenation with the other inputs' has the dtypes the whole tables'
    would: per column, its first missing and first present value. pandas settles a
    concatenation's dtypes from each piece's dtype and whether it is empty or all
    missing, which these rows keep."""
    if frame.shape[1] == 0:
        return frame.iloc[: min(len(frame), 1)]
    missing = frame.isna().to_numpy()
    rows = set()
    for column in missing.T:
        if column.any():
            rows.add(int(column.argmax()))  # the first missing value
        if not column.all():
            rows.add(int((~column).argmax()))  # the first present one
    return frame.iloc[sorted(rows)]


def _value_kind(series: pd.Series) -> tuple[str, np.ndarray]:
    """What pandas infers of the column's present values, and those values (distinct for
    categoricals)."""
    if isinstance(series.dtype, pd.CategoricalDtype):
        codes = series.cat.codes.to_numpy()
        used = np.asarray(series.cat.categories.take(np.unique(codes[codes >= 0])), dtype=object)
        return (pd.api.types.infer_dtype(used, skipna=True) if len(used) else "empty"), used
    present = series.dropna()
    if present.empty:
        return "empty", np.empty(0, dtype=object)
    return pd.api.types.infer_dtype(present, skipna=True), present.to_numpy()


class _ColumnStats:
    """One column's value kinds and distinct values over the inputs merged so far."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.values: set | None = set()  # None: more distinct values than tracked

    def merge(self, kind: str, distinct: set | None, limit: int) -> None:
        """Add one input's :func:`_column_summary`."""
        self.kinds.append(kind)
        if self.values is None or kind == "empty":
            return
        if distinct is None:  # not strings (refused or kept as they are), or too many
            self.values = None
            return
        self.values |= distinct
        if len(self.values) > limit:
            self.values = None

    def kind(self) -> str:
        """The kind pandas infers of all the values together."""
        present = [k for k in self.kinds if k != "empty"]
        if not present:
            return "empty"
        distinct = set(present)
        if distinct == {"string"}:
            return "string"
        if len(distinct) == 1:
            return present[0]
        return "mixed-integer" if "integer" in distinct else "mixed"


def _column_summary(series: pd.Series, limit: int) -> tuple[str, set | None]:
    """One input's column: the kind of its present values and, for strings, their distinct
    values (None beyond ``limit``: only strings become categories)."""
    kind, values = _value_kind(series)
    if kind != "string":
        return kind, None
    distinct = set(pd.unique(values))
    return kind, distinct if len(distinct) <= limit else None


@dataclass
class InputSummary:
    """What planning keeps of one input's obs (see :func:`summarize`)."""

    representative: pd.DataFrame
    columns: list[tuple[Any, str, set | None]]  # label, kind, distinct strings
    hashes: np.ndarray  # uint64, one per obs name
    excluded_found: tuple = ()  # the obs_exclude columns this input had


def summarize(frame: pd.DataFrame, max_categories: int,
              excluded_found: tuple = ()) -> InputSummary:  # fmt: skip
    """One input's obs (as :meth:`ObsInputs.frame` gives it) summarised for planning: run
    in this process or, for files, as a task on the worker that reads the file."""
    _check_names(frame.columns)
    columns = [(column, *_column_summary(frame.iloc[:, i], max_categories))
               for i, column in enumerate(frame.columns)]  # fmt: skip
    names = np.asarray(frame.index.astype(str), dtype=object)
    return InputSummary(_representative_rows(frame), columns, pd.util.hash_array(names),
                        excluded_found)  # fmt: skip


def _check_names(columns: pd.Index) -> None:
    if OBS_INDEX_COLUMN in columns:
        raise ValueError(f"obs has a column named {OBS_INDEX_COLUMN!r}, which holds obs_names "
                         f"in a stored dataset (and anndata's files); rename or drop that "
                         f"column first")  # fmt: skip
    stored = [str(c) for c in columns]
    clashes = sorted({n for n in stored if stored.count(n) > 1})
    if clashes:
        raise ValueError(
            f"obs columns {[c for c in columns if str(c) in clashes]!r} would all be stored "
            f"as {clashes[0]!r} (column names are stored as strings); rename one of them"
        )


def plan_obs(inputs: ObsInputs, max_categories: int,
             summaries: Iterable[InputSummary] | None = None) -> ObsPlan:  # fmt: skip
    """Plan the output obs from each input's :class:`InputSummary`, in input order (made
    here, reading each input's obs once, unless given; see the module docstring)."""
    if summaries is None:
        summaries = (inputs.summary(p, max_categories) for p in range(len(inputs)))
    representatives, hashes = [], []
    stats: dict[Any, _ColumnStats] = {}
    found: set = set()
    for summary in summaries:
        found.update(summary.excluded_found)
        representatives.append(summary.representative)
        for column, kind, distinct in summary.columns:
            stats.setdefault(column, _ColumnStats()).merge(kind, distinct, max_categories)
        hashes.append(summary.hashes)
    # A name no input has is a typo, and the column it meant would be kept unasked.
    unknown = [c for c in inputs.exclude if c not in found]
    if unknown:
        raise ValueError(f"obs_exclude names {unknown} but no input's obs has "
                         f"{'that column' if len(unknown) == 1 else 'these columns'}; check "
                         "the spelling (obs columns are case-sensitive)")  # fmt: skip
    combined = _concat(representatives)
    _check_names(combined.columns)
    record = pandas_record(combined)
    columns = [ObsColumn(OBS_INDEX_COLUMN, "string", "string")]
    encoders: list[Encoder] = [_strings]
    for column, dtype in combined.dtypes.items():
        described, encoder = _column(str(column), dtype, stats[column], max_categories)
        columns.append(described)
        encoders.append(encoder)
    every = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    hashes.clear()
    unique = _names_unique(inputs, every)
    return ObsPlan(inputs, ObsSchema(tuple(columns)), record, combined.dtypes, encoders, unique)


def _names_unique(inputs: ObsInputs, hashes: np.ndarray) -> bool:
    """Whether no obs name repeats: by their hashes, and where two hashes agree, by the
    names (read again; rare unless names do repeat)."""
    hashes.sort()
    repeated = np.unique(hashes[1:][hashes[1:] == hashes[:-1]])
    if not len(repeated):
        return True
    seen: set[str] = set()
    for p in range(len(inputs)):
        names = np.asarray(inputs.frame(p).index.astype(str), dtype=object)
        for name in names[np.isin(pd.util.hash_array(names), repeated)]:
            if name in seen:
                return False
            seen.add(name)
    return True


def _column(name: str, dtype: Any, stats: _ColumnStats, max_categories: int
            ) -> tuple[ObsColumn, Encoder]:  # fmt: skip
    """How a column is stored, from its dtype over all inputs and its values' stats."""
    if isinstance(dtype, pd.CategoricalDtype):
        if len(dtype.categories) <= max_categories:
            return _category(name, list(dtype.categories), lambda s: s.cat.codes.to_numpy())
        return ObsColumn(name, "string", "string"), _strings
    if pd.api.types.is_bool_dtype(dtype):
        return ObsColumn(name, "bool", "bool"), _booleans
    if pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_complex_dtype(dtype):
        numpy_dtype = dtype.numpy_dtype if hasattr(dtype, "numpy_dtype") else np.dtype(dtype)
        arrow_type = pa.from_numpy_dtype(numpy_dtype)
        return ObsColumn(name, "numeric", str(arrow_type)), lambda s: pa.array(
            s.array, type=arrow_type, from_pandas=True)  # fmt: skip
    if pd.api.types.is_object_dtype(dtype) or pd.api.types.is_string_dtype(dtype):
        inferred = stats.kind()
        if inferred not in ("string", "empty"):
            raise ValueError(
                f"obs column {name!r} holds {inferred} values, not strings; convert it or "
                f"exclude it with obs_exclude=[{name!r}]"
            )
        if stats.values is not None and len(stats.values) <= max_categories:
            # The categories pandas' astype("category") gives: the values, sorted.
            categories = sorted(stats.values)
            return _category(name, categories, lambda s: pd.Categorical(
                s.astype(object), categories=categories).codes)  # fmt: skip
        return ObsColumn(name, "string", "string"), _strings
    raise ValueError(
        f"obs column {name!r} has unsupported dtype {dtype}; deltacells stores categorical, "
        f"numeric, boolean and string columns: convert it or pass obs_exclude=[{name!r}]"
    )


def _category(name: str, categories: list, codes_of: Callable[[pd.Series], np.ndarray]
              ) -> tuple[ObsColumn, Encoder]:  # fmt: skip
    code_type = category_code_type(len(categories))
    arrow_type = pa.from_numpy_dtype(np.dtype(code_type))
    described = ObsColumn(name, "category", code_type, [_json_scalar(c) for c in categories])
    return described, lambda s: pa.array(codes_of(s).astype(code_type), type=arrow_type)


def _booleans(series: pd.Series) -> pa.Array:
    values = series.to_numpy(dtype=object) if series.hasnans else series.to_numpy()
    return pa.array(values, type=pa.bool_(), from_pandas=True)


def _strings(series: pd.Series) -> pa.Array:
    values = series.astype(object).to_numpy()
    return pa.array([None if _is_missing(v) else str(v) for v in values], type=pa.string())


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value)) or value is pd.NA


def _json_scalar(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


#: Rows per batch of the temporary obs file of a reordered write.
SPILL_ROWS = 1 << 20


class TileObs:
    """The output obs of one tile at a time, as Arrow arrays.

    In input order, an input's obs is read when its first row is asked for and dropped after
    its last. Rows in another order may come from any input: each input's obs is encoded in
    turn into one temporary Arrow file, memory-mapped, from which the tiles' rows are taken
    (the pages are the file's, not the heap's). Call :meth:`close` to remove the file.
    """

    def __init__(self, plan: ObsPlan, arrow_schema: pa.Schema, offsets: np.ndarray,
                 reordered: bool) -> None:  # fmt: skip
        self.plan = plan
        self.arrow_schema = arrow_schema
        self.offsets = offsets
        self.reordered = reordered
        self._frames: dict[int, pd.DataFrame] = {}
        self._spill: Any = None  # the temporary directory of a reordered write
        self._batches: list[pa.RecordBatch] = []  # one per input, memory-mapped
        self._starts = np.zeros(1, dtype=np.int64)

    def _input(self, p: int) -> pd.DataFrame:
        if p not in self._frames:
            self._frames = {p: self.plan.inputs.frame(p)}  # the inputs before are done
        return self._frames[p]

    def arrays(self, rows: np.ndarray) -> list[pa.Array]:
        """The obs of global rows ``rows`` (consecutive unless reordered)."""
        if self.reordered:
            return self._taken(rows)
        first, last = int(rows[0]), int(rows[-1]) + 1
        pieces = []
        for p in range(int(np.searchsorted(self.offsets, first, side="right")) - 1,
                       int(np.searchsorted(self.offsets, last - 1, side="right"))):  # fmt: skip
            start, stop = self.offsets[p], self.offsets[p + 1]
            if stop > start:
                lo, hi = max(first, start) - start, min(last, stop) - start
                pieces.append(self._input(p).iloc[lo:hi])
        with warnings.catch_warnings():  # pandas' warnings were given when planning
            warnings.simplefilter("ignore", FutureWarning)
            return self.plan.arrays(self.plan.conform(_concat(pieces)))

    def _taken(self, rows: np.ndarray) -> list[pa.Array]:
        """Rows of the spilled obs, taken from each input's batch on its own: a take on the
        whole (chunked) table would first copy every chunk into one array in memory."""
        if self._spill is None:
            self._spill_inputs()
        which = np.searchsorted(self._starts, rows, side="right") - 1
        order = np.argsort(which, kind="stable")
        grouped = which[order]
        cuts = np.flatnonzero(np.diff(grouped)) + 1
        pieces = [self._batches[int(grouped[run[0]])].take(
                      pa.array(rows[order[run]] - self._starts[grouped[run[0]]]))
                  for run in np.split(np.arange(len(rows)), cuts) if len(run)]  # fmt: skip
        inverse = np.empty(len(rows), dtype=np.int64)
        inverse[order] = np.arange(len(rows))
        table = pa.Table.from_batches(pieces, schema=self.arrow_schema).take(pa.array(inverse))
        return [column.combine_chunks() for column in table.columns]

    def _spill_inputs(self) -> None:
        import tempfile

        self._spill = tempfile.TemporaryDirectory(prefix="deltacells-obs-")
        path = str(Path(self._spill.name) / "obs.arrow")
        inputs = self.plan.inputs
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, self.arrow_schema) as out:
            for p in range(len(inputs)):
                frame = inputs.frame(p)
                # In slices: the Python strings made for one stay few, and no string array
                # nears Arrow's 2 GiB per array.
                for start in range(0, max(len(frame), 1), SPILL_ROWS):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", FutureWarning)
                        piece = self.plan.conform(frame.iloc[start : start + SPILL_ROWS])
                    out.write_batch(pa.RecordBatch.from_arrays(self.plan.arrays(piece),
                                                               schema=self.arrow_schema))
        reader = pa.ipc.open_file(pa.memory_map(path, "r"))
        self._batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        self._starts = np.cumsum([0] + [b.num_rows for b in self._batches]).astype(np.int64)

    def close(self) -> None:
        self._batches = []
        if self._spill is not None:
            self._spill.cleanup()
            self._spill = None


def write_obs(store: Any, plan: ObsPlan, tile_rows: Callable[[int], np.ndarray],
              offsets: np.ndarray, cell_order: np.ndarray | None, tile_cells: list[int],
              tiles_per_file: int) -> dict:  # fmt: skip
    """The obs parquet shards (a row group per tile) and schema; the manifest's obs fields."""
    arrow_schema = pa.schema(
        [pa.field(c.name, pa.type_for_alias(c.arrow_type)) for c in plan.schema.columns]
    )
    source = TileObs(plan, arrow_schema, offsets, cell_order is not None)
    n_tiles = len(tile_cells)
    shard_bytes, shard_sha = [], []
    try:
        for s in range(-(-n_tiles // tiles_per_file)):
            buffer = pa.BufferOutputStream()
            with pq.ParquetWriter(
                buffer, arrow_schema, compression="zstd", write_statistics=False
            ) as writer:
                for t in range(s * tiles_per_file, min((s + 1) * tiles_per_file, n_tiles)):
                    rows = tile_rows(t)
                    table = pa.Table.from_arrays(source.arrays(rows), schema=arrow_schema)
                    writer.write_table(table, row_group_size=max(len(rows), 1))
            data = buffer.getvalue().to_pybytes()
            store.write_atomic(obs_shard_name(s), data)
            shard_bytes.append(len(data))
            shard_sha.append(hashlib.sha256(data).hexdigest())
    finally:
        source.close()
    schema_text = plan.schema.to_json_text()
    store.write_atomic(OBS_SCHEMA_NAME, schema_text.encode("utf-8"))
    return {
        "obs_tiles_per_file": tiles_per_file,
        "obs_shard_bytes": shard_bytes,
        "obs_shard_sha256": shard_sha,
        "obs_fingerprint": obs_fingerprint(schema_text, tile_cells, shard_sha),
    }
