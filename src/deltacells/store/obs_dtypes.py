"""Exact pandas dtypes and names of obs columns, beyond what the format's obs schema says.

The schema knows four kinds (category, numeric, bool, string), so on its own a round trip
turns an ordered categorical into an unordered one, nullable ``Int64`` with missing values into
float64, nullable ``boolean`` into object, ``string`` and object columns into categoricals, and
the column name ``0`` into ``"0"``. The writer records each column's pandas dtype (and original
name where it is not a string) in the manifest's ``metadata["obs_pandas"]``; readers restore
them. Datasets without the record read as before.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import pandas as pd

from deltacells.codec.format import FormatError

__all__ = ["index_string_dtype", "pandas_record", "restore_dtypes"]

#: dtypes a record may name (anything else in a manifest is refused, never passed to pandas).
_ALLOWED = re.compile(
    r"category|object|str|string|bool|boolean|u?int(8|16|32|64)|U?Int(8|16|32|64)"
    r"|float(16|32|64)|Float(32|64)"
)


def index_string_dtype() -> Any:
    """The dtype pandas gives an index of strings: numpy's object on pandas 2 (Python
    strings), its Arrow-backed ``str`` on pandas 3, which readers build from Arrow buffers."""
    return pd.Index(["name"]).dtype


def _string_name(dtype: pd.StringDtype) -> str:
    """``"str"`` for pandas 3's default string dtype (missing values are NaN), ``"string"``
    for the nullable one (missing values are ``pd.NA``)."""
    return "string" if getattr(dtype, "na_value", pd.NA) is pd.NA else "str"


def _string_dtype(name: str) -> Any:
    """The string dtype a record names; ``"str"`` where pandas has no such dtype (before
    2.3) reads as object strings, which is what pandas 2 writes for the same data."""
    if name == "string":
        return pd.StringDtype()
    try:
        return pd.StringDtype(na_value=np.nan)
    except TypeError:  # pragma: no cover - pandas < 2.3
        return object


def _dtype_name(dtype: Any) -> str | None:
    if isinstance(dtype, pd.CategoricalDtype):
        return "category"
    if isinstance(dtype, pd.StringDtype):
        return _string_name(dtype)
    name = str(dtype)
    return name if _ALLOWED.fullmatch(name) else None


def pandas_record(obs: pd.DataFrame) -> dict[str, dict]:
    """Per stored column name: the pandas dtype, ``ordered`` for categoricals, and the
    original name if it is a number or bool (JSON keeps those exactly)."""
    record: dict[str, dict] = {}
    for column in obs.columns:
        entry: dict[str, Any] = {}
        name = _dtype_name(obs[column].dtype)
        if name is not None:
            entry["dtype"] = name
        if isinstance(obs[column].dtype, pd.CategoricalDtype):
            if obs[column].cat.ordered:
                entry["ordered"] = True
            categories = obs[column].cat.categories.dtype
            if isinstance(categories, pd.StringDtype):
                entry["categories"] = _string_name(categories)
        if isinstance(column, bool | int | float | np.integer | np.floating):
            entry["name"] = column.item() if isinstance(column, np.generic) else column
        elif not isinstance(column, str):
            warnings.warn(
                f"obs column name {column!r} is stored as the string {str(column)!r}",
                UserWarning,
                stacklevel=4,
            )
        if entry:
            record[str(column)] = entry
    return record


def restore_dtypes(frame: pd.DataFrame, record: Any, where: str) -> pd.DataFrame:
    """``frame`` (obs as the schema reads it) with the recorded dtypes and names.

    Raises
    ------
    FormatError
        For a malformed record or a column whose values do not fit its recorded dtype.
    """
    if record is None:
        return frame
    if not isinstance(record, dict):
        raise FormatError(f"{where}: metadata 'obs_pandas' must be an object")
    renames: dict[str, Any] = {}
    for column, entry in record.items():
        if column not in frame.columns:
            continue  # not read (obs=[...] chose others) or excluded
        if not isinstance(entry, dict):
            raise FormatError(f"{where}: obs_pandas entry of {column!r} must be an object")
        dtype = entry.get("dtype")
        if dtype is not None and (not isinstance(dtype, str) or not _ALLOWED.fullmatch(dtype)):
            raise FormatError(f"{where}: obs column {column!r} has recorded dtype {dtype!r}")
        try:
            frame[column] = _convert(frame[column], dtype, entry.get("ordered") is True)
            kind = entry.get("categories")
            if kind in ("string", "str") and dtype == "category":
                series = frame[column]
                frame[column] = series.cat.rename_categories(
                    series.cat.categories.astype(_string_dtype(kind))
                )
        except (TypeError, ValueError) as err:
            raise FormatError(
                f"{where}: obs column {column!r} does not fit its recorded dtype {dtype} ({err})"
            ) from None
        if "name" in entry:
            original = entry["name"]
            if not isinstance(original, bool | int | float) or str(original) != column:
                raise FormatError(f"{where}: obs column {column!r} has recorded name {original!r}")
            renames[column] = original
    return frame.rename(columns=renames) if renames else frame


def _convert(series: pd.Series, dtype: str | None, ordered: bool) -> pd.Series:
    if dtype is None or str(series.dtype) == dtype:
        return series.cat.as_ordered() if ordered and dtype == "category" else series
    if dtype == "category":
        series = series.astype("category")
        return series.cat.as_ordered() if ordered else series
    if dtype == "object":
        values = series.astype(object)
        return values.where(series.notna(), None) if series.isna().any() else values
    if dtype in ("str", "string"):
        return series.astype(_string_dtype(dtype))
    return series.astype(dtype)
