"""How a lazy X answers numpy and scanpy: through its dask array over tiles.

scanpy runs most of its preprocessing out of core on dask arrays. A lazy X does not
reimplement those functions: where scanpy (or fast_array_utils, which scanpy computes its
statistics with) has a dask implementation, the lazy X hands it its dask view, one scipy-CSR
chunk per tile, so that statistics are reduced tile by tile and transformed matrices
(``normalize_total``, ``log1p``, ``scale``) come back as lazy dask arrays. Nothing here
imports scanpy: its dispatchers are found among the modules already imported.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import anndata as ad
import pandas as pd

#: Module prefixes whose single-dispatch functions a lazy X joins when they know dask.
DISPATCHING_PACKAGES = ("scanpy", "fast_array_utils")

#: Dispatchers whose default implementation is the one that handles dask arrays (so their
#: registry does not name dask): (module, function).
DASK_THROUGH_DEFAULT = (("scanpy.preprocessing._simple", "log1p"),)

_registered: set[tuple[int, type]] = set()
#: (lazy type, module name) -> id of the module scanned for it (each type joins on its own).
_scanned_modules: dict[tuple[type, str], int] = {}


def dask_array_type() -> type | None:
    """``dask.array.Array``, or None without dask (an optional extra)."""
    try:
        import dask.array as da
    except ImportError:
        return None
    return da.Array


def _single_dispatch_functions(module: Any) -> list[Callable]:
    found = []
    for value in list(vars(module).values()):
        registry = getattr(value, "registry", None)
        if callable(value) and hasattr(value, "register") and hasattr(registry, "keys"):
            found.append(value)
    return found


def join_dispatchers(lazy_type: type, to_dask: Callable[[Any], Any]) -> int:
    """Register ``lazy_type`` with every single-dispatch function of scanpy and
    fast_array_utils (among the modules imported so far) that has a dask implementation and
    none for ``lazy_type``: the lazy matrix is handed over as ``to_dask(matrix)``.

    Returns how many functions were joined (0 without dask or scanpy). Cheap to call again:
    only modules imported since the last call are looked at.
    """
    new = [(name, module) for name, module in list(sys.modules.items())
           if module is not None and name.startswith(DISPATCHING_PACKAGES)
           and _scanned_modules.get((lazy_type, name)) != id(module)]  # fmt: skip
    if not new:
        return 0  # nothing imported since the last call (dask not even looked up)
    dask_type = dask_array_type()
    if dask_type is None:
        return 0
    joined = 0
    for name, module in new:
        _scanned_modules[(lazy_type, name)] = id(module)
        through_default = {f for m, f in DASK_THROUGH_DEFAULT if m == name}
        for function in _single_dispatch_functions(module):
            key = (id(function), lazy_type)
            if key in _registered or lazy_type in function.registry:
                continue
            knows_dask = any(_is_base_of(t, dask_type) for t in function.registry)
            if not knows_dask and getattr(function, "__name__", None) not in through_default:
                continue
            function.register(lazy_type)(_through_dask(function, to_dask))
            _registered.add(key)
            joined += 1
    return joined


def _is_base_of(registered: Any, dask_type: type) -> bool:
    if registered is object or not isinstance(registered, type):
        return False
    try:
        return issubclass(dask_type, registered)
    except TypeError:  # protocols with data members refuse issubclass
        return False


def _through_dask(function: Callable, to_dask: Callable[[Any], Any]) -> Callable:
    def on_lazy_matrix(x: Any, *args: Any, **kwargs: Any) -> Any:
        return function(to_dask(x), *args, **kwargs)

    on_lazy_matrix.__name__ = f"{getattr(function, '__name__', 'function')}_on_lazy_x"
    on_lazy_matrix.__doc__ = "The dask implementation, on the lazy X's dask array over tiles."
    return on_lazy_matrix


def _keeps_each_once(index: Any) -> bool:
    """Whether a subset by ``index`` takes no cell twice (a slice or a boolean mask)."""
    if isinstance(index, slice):
        return True
    dtype = getattr(index, "dtype", None)
    return dtype is not None and getattr(dtype, "kind", None) == "b"


def swap_lazy(value: Any, lazy_type: type, to_dask: Callable[[Any], Any]) -> Any:
    """``value`` with lazy matrices (also inside tuples, lists and dicts) as dask arrays."""
    if isinstance(value, lazy_type):
        return to_dask(value)
    if isinstance(value, tuple | list):
        return type(value)(swap_lazy(v, lazy_type, to_dask) for v in value)
    if isinstance(value, dict):
        return {k: swap_lazy(v, lazy_type, to_dask) for k, v in value.items()}
    return value


class PreparedObs:
    """obs as the reader built it, for anndata's constructor to take as it is.

    anndata checks and copies the obs index it is given (at 10M cells, a filtered copy of
    every name on anndata 0.13), and turns an integer index into strings. The reader's index
    needs neither: strings it made itself (no missing names), or the integer positions of
    ``obs_names="positions"``, which must stay a :class:`pandas.RangeIndex` to cost nothing.
    """

    __slots__ = ("frame",)

    def __init__(self, frame: pd.DataFrame) -> None:
        self.frame = frame

    def __len__(self) -> int:
        return len(self.frame)


def _take_prepared_obs(anno: PreparedObs, index_names: Any, *, source: str, attr: str,
                       length: int | None = None) -> pd.DataFrame:  # fmt: skip
    frame = anno.frame
    if length is not None and length != len(frame):
        raise ValueError(f"{attr} has {len(frame)} rows, the matrix {length}")
    if not len(frame.columns):  # as anndata does: column names of an empty frame are strings
        frame.columns = frame.columns.astype(str)
    return frame


def _accept_prepared_obs() -> bool:
    """Teach anndata's obs constructor (a single-dispatch function, private to anndata) to take
    :class:`PreparedObs` as it is. False where anndata has no such function: the reader then
    hands over the plain frame, which anndata checks (and stringifies) as usual."""
    try:
        from anndata._core.aligned_df import _gen_dataframe
    except ImportError:
        return False
    if not hasattr(_gen_dataframe, "register"):
        return False
    _gen_dataframe.register(PreparedObs)(_take_prepared_obs)
    return True


ACCEPTS_PREPARED_OBS = _accept_prepared_obs()


class OutOfCoreAnnData(ad.AnnData):
    """The AnnData :func:`~deltacells.read_deltacells` returns: an :class:`anndata.AnnData`
    whose in-place subsets stay out of core.

    scanpy's ``filter_cells`` and ``filter_genes`` subset an AnnData in place, which anndata
    does by copying a view, and a copied view of a lazy X holds the kept cells in memory.
    Here the lazy matrices (X and count layers) become their dask arrays over tiles first, so
    the subset is a lazy dask array too (without dask: as anndata does). Everything else is
    :class:`anndata.AnnData` unchanged; views and copies are plain AnnData objects.

    ``obs_names_unique=True`` (the reader's: names ``"0" .. "n-1"``, or stored names the
    writer recorded unique, which ``verify`` checks) skips anndata's duplicate check of the
    obs names, which hashes every name: most of the opening time of a 10M-cell dataset. The
    check comes back as soon as obs names are set anew or a subset may repeat cells.
    """

    #: The lazy matrix type whose instances become dask arrays (set by the reader).
    lazy_matrix_type: ClassVar[type | None] = None

    def __init__(self, *args: Any, obs_names_unique: bool = False, **kwargs: Any) -> None:
        # Set before anndata's constructor runs its checks (``_check_uniqueness``).
        self._obs_names_unique = obs_names_unique
        if isinstance(kwargs.get("obs"), PreparedObs) and not ACCEPTS_PREPARED_OBS:
            kwargs["obs"] = kwargs["obs"].frame
        super().__init__(*args, **kwargs)

    def _check_uniqueness(self) -> None:
        if not getattr(self, "_obs_names_unique", False):
            super()._check_uniqueness()
            return
        # anndata's check on the var names alone (anndata 0.13 can switch it off).
        names = self.var.index
        if (getattr(ad.settings, "restrict_index_types", True)
                and names[~names.isna()].has_duplicates):  # fmt: skip
            ad.utils.warn_names_duplicates("var")

    def _set_dim_index(self, value: Any, attr: str) -> None:
        if attr == "obs":
            self._obs_names_unique = False
        super()._set_dim_index(value, attr)

    def _inplace_subset_obs(self, index: Any) -> None:
        if not _keeps_each_once(index):
            self._obs_names_unique = False
        self._lazy_matrices_to_dask()
        # anndata subsets by building a copy, whose constructor would hash the kept names.
        unchecked = (ad.settings.override(check_uniqueness=False) if self._obs_names_unique
                     else contextlib.nullcontext())  # fmt: skip
        with warnings.catch_warnings(), unchecked:
            if pd.api.types.is_integer_dtype(self.obs_names.dtype):
                # obs_names="positions": the copy names the kept cells by their positions,
                # as strings (as documented), which anndata announces every time.
                warnings.filterwarnings("ignore", "Transforming to str index",
                                        ad.ImplicitModificationWarning)  # fmt: skip
            super()._inplace_subset_obs(index)

    def _inplace_subset_var(self, index: Any) -> None:
        self._lazy_matrices_to_dask()
        super()._inplace_subset_var(index)

    def _lazy_matrices_to_dask(self) -> None:
        lazy = self.lazy_matrix_type
        if lazy is None or dask_array_type() is None:
            return
        if isinstance(self.X, lazy):
            self.X = self.X.to_dask()
        for key in [k for k in self.layers.keys() if k is not None]:
            if isinstance(self.layers[key], lazy):
                self.layers[key] = self.layers[key].to_dask()
