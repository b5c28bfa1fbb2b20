"""Which sort puts each decoded row back in the source gene order.

The kernels renumber every row's columns (stored gene order to source gene order) and sort
them, in one of four ways, all with the same output:

- ``"simd16"``: rows of datasets of up to 65,536 genes park each value at its column in a
  dense per-thread array and sort just the columns, as uint16, with numpy's quicksort (which
  runs x86-simd-sort's AVX-512 code on CPUs with AVX512-VBMI2: 0.56 ns an entry for rows of
  800, against 1.33 for 32-bit keys). The values are then read back in column order, sixteen
  at a time with AVX-512F gathers (one at a time where Linux reports the gathers slowed by
  the Gather Data Sampling mitigation: :func:`gathers_slowed`), and streamed into
  minibatches. On an AVX-512 Zen 5, loader epochs about 10% faster than ``"simd"`` and
  ``to_memory()`` 5-8% (alternating rounds in one process; ``docs/benchmarks.md``).
- ``"simd"``: rows whose columns fit in 16 bits are sorted as 32-bit keys (column above the
  entry's position in the row) by numpy's quicksort, AVX-512 where the CPU has it: about
  2.3 ns an entry against 3.4 for the radix sort (rows of ~760 entries, Intel AVX-512).
- ``"bitmap"``: rows with an entry for at least every eighth 64-column word set bits in a
  bitmap of the output columns; each entry then goes straight to its place (the bits before
  it, counted with popcnt): about 4 ns an entry against 9 for the radix sort on an AVX2 Zen 3
  (rows of ~790 entries of 33,539 genes), whose renumbering gathers eight entries at a time
  with AVX2 where the CPU has it (one at a time where :func:`gathers_slowed`). x86-64 CPUs
  without popcnt (before 2008) run the radix sort instead.
- ``"radix"``: the kernels' own LSD radix sort; also what the others fall back to for the
  rows they do not take.

``auto`` (the default) picks ``"simd16"`` where numpy sorts 16-bit integers with AVX-512
(AVX512_ICL: VBMI2), ``"simd"`` where it sorts only 32-bit ones with AVX-512 (AVX512_SKX),
and ``"bitmap"`` elsewhere (numpy's quicksort without AVX-512 is slower than the radix sort).
``DELTACELLS_ROW_SORT`` overrides the choice when the kernels are imported.
"""

from __future__ import annotations

import os
import warnings

__all__ = [
    "ENV_VAR",
    "ROW_SORTS",
    "gathers_slowed",
    "numpy_sorts16_with_avx512",
    "numpy_sorts_with_avx512",
    "row_sort_wanted",
]

# Where Linux says whether the CPU's vector gathers run under the microcode mitigation for
# Gather Data Sampling ("Downfall", Intel Skylake to Ice Lake / Tiger Lake), which makes
# them several times slower.
GATHER_SAMPLING = "/sys/devices/system/cpu/vulnerabilities/gather_data_sampling"

ENV_VAR = "DELTACELLS_ROW_SORT"
ROW_SORTS = ("simd16", "simd", "bitmap", "radix")


def _cpu_features() -> dict:
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_features__
    return __cpu_features__


def numpy_sorts_with_avx512() -> bool:
    """Whether numpy's quicksort of 32-bit integers runs AVX-512 code on this CPU."""
    return bool(_cpu_features().get("AVX512_SKX"))


def numpy_sorts16_with_avx512() -> bool:
    """Whether numpy's quicksort of 16-bit integers runs AVX-512 code on this CPU (its
    x86-simd-sort dispatch needs AVX512_ICL, which includes VBMI2)."""
    return bool(_cpu_features().get("AVX512_ICL"))


def gathers_slowed(path: str = GATHER_SAMPLING) -> bool:
    """Whether this CPU's vector gathers run under a microcode mitigation (Linux's report
    starts with "Mitigation"): then the ``"simd16"`` sort reads values back one at a time
    instead of sixteen at a time with AVX-512 gathers, and the bitmap sort renumbers one entry
    at a time instead of eight with AVX2 gathers (the same output)."""
    try:
        with open(path) as report:
            return report.read().strip().startswith("Mitigation")
    except OSError:
        return False


def row_sort_wanted() -> str:
    """The sort for this process (one of ``ROW_SORTS``): ``DELTACELLS_ROW_SORT``, or
    ``auto``'s CPU check."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower()
    if choice != "auto" and choice not in ROW_SORTS:
        warnings.warn(
            f"{ENV_VAR}={choice!r} is not one of auto, {', '.join(ROW_SORTS)}; using 'auto'. "
            "Set it to 'radix' to sort rows with deltacells' own radix sort, 'bitmap' for its "
            "bitmap sort, 'simd' or 'simd16' for numpy's.",
            RuntimeWarning,
            stacklevel=2,
        )
        choice = "auto"
    if choice == "auto":
        if numpy_sorts16_with_avx512():
            return "simd16"
        return "simd" if numpy_sorts_with_avx512() else "bitmap"
    return choice
