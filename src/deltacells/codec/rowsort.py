"""Which sort puts each decoded row back in the source gene order.

The kernels renumber every row's columns (stored gene order to source gene order) and sort
them. Rows whose columns fit in 16 bits (datasets of up to 65,536 genes) can be sorted as
32-bit keys by numpy's quicksort, which runs x86-simd-sort's AVX-512 code on CPUs that have it:
about 2.3 ns an entry against 3.4 for the kernels' own radix sort (rows of ~760 entries). Where
numpy has no AVX-512 sort its quicksort is slower than the radix sort, so it is used only there.
The output is the same either way.

``DELTACELLS_ROW_SORT`` overrides the choice when the kernels are imported: ``auto`` (the
default), ``simd`` (numpy's quicksort whatever the CPU) or ``radix``.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["ENV_VAR", "numpy_sorts_with_avx512", "simd_row_sort_wanted"]

ENV_VAR = "DELTACELLS_ROW_SORT"
_CHOICES = ("auto", "simd", "radix")


def numpy_sorts_with_avx512() -> bool:
    """Whether numpy's quicksort of 32-bit integers runs AVX-512 code on this CPU."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_features__
    return bool(__cpu_features__.get("AVX512_SKX"))


def simd_row_sort_wanted() -> bool:
    """The choice for this process: ``DELTACELLS_ROW_SORT``, or ``auto``'s CPU check."""
    choice = os.environ.get(ENV_VAR, "auto").strip().lower()
    if choice not in _CHOICES:
        warnings.warn(
            f"{ENV_VAR}={choice!r} is not one of {', '.join(_CHOICES)}; using 'auto'. Set it "
            "to 'radix' to sort rows with deltacells' own radix sort, 'simd' for numpy's.",
            RuntimeWarning,
            stacklevel=2,
        )
        choice = "auto"
    if choice == "auto":
        return numpy_sorts_with_avx512()
    return choice == "simd"
