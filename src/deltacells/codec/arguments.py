"""Checks of the arguments users pass to the front doors, shared by the reader, the writer,
the loader and the storage layer so that one mistake gets one message everywhere.

A flag given as a string would otherwise be truthy (``ranged_reads="no"`` meaning True) and a
bool given as a count would be 1 (``tile_size=True``): both are refused by name.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = ["check_flags", "check_ints"]


def check_ints(values: dict[str, Any], *, optional: tuple[str, ...] = (),
               at_least: dict[str, int] | None = None) -> None:  # fmt: skip
    """Refuse any of ``values`` (name -> value) that is not an int (a bool is not), naming it;
    names in ``optional`` may be None. ``at_least`` gives the smallest value allowed by name
    (a ``ValueError``)."""
    for name, value in values.items():
        if value is None and name in optional:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    for name, least in (at_least or {}).items():
        value = values[name]
        if value is not None and value < least:
            raise ValueError(f"{name} must be >= {least}, not {value}")


def check_flags(values: dict[str, Any]) -> None:
    """Refuse any of ``values`` (name -> value) that is not True or False, naming it."""
    for name, value in values.items():
        if not isinstance(value, bool | np.bool_):
            raise TypeError(f"{name} must be True or False, not {value!r}")
