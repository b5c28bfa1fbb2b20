"""Progress of long passes: tqdm bars on a terminal, plain lines in logs.

tqdm redraws its bar with carriage returns, which fill a log file or CI output with every
redraw. When stderr is not a terminal, a pass prints a line at most every
:data:`LOG_INTERVAL_S` seconds and one when it ends.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

#: Seconds between two progress lines in a log (the last line is always printed).
LOG_INTERVAL_S = 30.0


def progress(iterable: Iterable, *, desc: str, unit: str = "tile", total: int | None = None,
             stream: Any = None) -> Iterable:  # fmt: skip
    """``iterable`` wrapped in a tqdm bar (terminal) or in progress lines (anything else)."""
    stream = sys.stderr if stream is None else stream
    if total is None:
        total = len(iterable) if hasattr(iterable, "__len__") else None  # type: ignore[arg-type]
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, unit=unit, total=total, file=stream)
    return _lines(iterable, desc, unit, total, stream)


def _lines(iterable: Iterable, desc: str, unit: str, total: int | None,
           stream: Any) -> Iterator:  # fmt: skip
    start = last = time.perf_counter()
    done = 0

    def line(now: float) -> str:
        share = f"{100 * done // total}% " if total else ""
        of = f"{done:,}/{total:,}" if total is not None else f"{done:,}"
        return f"{desc}: {share}{of} {unit}s in {now - start:.1f} s"

    for item in iterable:
        yield item
        done += 1
        now = time.perf_counter()
        if now - last >= LOG_INTERVAL_S and (total is None or done < total):
            print(line(now), file=stream, flush=True)
            last = now
    print(line(time.perf_counter()), file=stream, flush=True)
