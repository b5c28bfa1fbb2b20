"""Tamper runs: damage every file of a dataset and read it through every user path.

A run copies a dataset, flips bits in (or truncates) one file at a time and reads the damaged
copy the ways users do: the lazy AnnData (slices, ``to_memory``, obs, var, layers, raw and the
elements), ranged reads, ``dask=True``, box queries, the gene-major companion and a loader
epoch, then ``verify``. Each path must give exactly what it gives on the intact dataset or raise
:class:`~deltacells.FormatError`; ``verify`` must report the damage. Used by
``tests/test_tamper.py`` (a bounded run in CI) and ``tools/fuzz.py --target tamper``.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import scipy.sparse as sp

from deltacells.codec.format import FormatError
from deltacells.codec.threads import usable_cpu_count

__all__ = ["TamperReport", "digest_of", "read_every_path", "tamper_dataset"]


def digest_of(value: Any) -> str:
    """A digest of a result that changes whenever its content, shape or dtype does (sparse and
    dense arrays, data frames, dicts and lists of them, scalars)."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h, value: Any) -> None:
    if sp.issparse(value):
        csr = sp.csr_matrix(value)
        csr.sort_indices()
        h.update(f"sparse{csr.shape}{csr.dtype}".encode())
        for part in (csr.indptr.astype(np.int64), csr.indices.astype(np.int64), csr.data):
            h.update(np.ascontiguousarray(part).tobytes())
    elif isinstance(value, pd.DataFrame):
        h.update(f"frame{value.shape}{list(value.columns)}{list(value.dtypes.astype(str))}".encode())
        _feed(h, value.index)
        for column in value.columns:
            _feed(h, value[column])
    elif isinstance(value, pd.Series | pd.Index):
        h.update(f"{type(value).__name__}{value.dtype}".encode())
        h.update(pd.util.hash_pandas_object(pd.Series(np.asarray(value, dtype=object)),
                                            index=False).to_numpy().tobytes())  # fmt: skip
    elif isinstance(value, np.ndarray):
        h.update(f"array{value.shape}{value.dtype}".encode())
        if value.dtype == object:
            h.update(repr(value.tolist()).encode())
        else:
            h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            h.update(f"key{key!r}".encode())
            _feed(h, value[key])
    elif isinstance(value, list | tuple):
        h.update(f"seq{len(value)}".encode())
        for item in value:
            _feed(h, item)
    elif hasattr(value, "compute"):  # dask
        _feed(h, value.compute())
    else:
        h.update(repr(value).encode())


def _to_memory(matrix: Any) -> Any:
    return matrix.to_memory() if hasattr(matrix, "to_memory") else matrix


def read_every_path(root: str | Path, cache_dir: str | Path) -> dict[str, Callable[[], Any]]:
    """The user paths of a dataset, each a function returning what it reads (comparable with
    :func:`digest_of`). Paths the dataset has no data for (no spatial order, no companion)
    are left out."""
    from deltacells.read.assemble import read_deltacells
    from deltacells.read.dataset import open_dataset
    from deltacells.read.outofcore import dask_array_type
    from deltacells.train.loader import Loader

    root = str(root)
    paths: dict[str, Callable[[], Any]] = {}

    def lazy() -> Any:
        adata = read_deltacells(root, cache_dir=cache_dir)
        n = adata.n_obs
        rows = np.unique(np.linspace(0, n - 1, 7).astype(np.int64))
        out = {"slice": _to_memory(adata[rows].X), "obs": adata.obs, "var": adata.var,
               "obsm": dict(adata.obsm), "varm": dict(adata.varm), "obsp": dict(adata.obsp),
               "varp": dict(adata.varp), "uns": dict(adata.uns),
               "layers": {k: _to_memory(v) for k, v in adata.layers.items()}}  # fmt: skip
        if adata.raw is not None:
            out["raw"] = {"X": _to_memory(adata.raw.X), "var": adata.raw.var}
        return out

    paths["read_deltacells"] = lazy
    paths["to_memory"] = lambda: read_deltacells(root, cache_dir=cache_dir, obs=False,
                                                 elements=False).X.to_memory()  # fmt: skip

    def ranged() -> Any:
        adata = read_deltacells(root, cache_dir=cache_dir, obs=False, elements=False,
                                ranged_reads=True)  # fmt: skip
        n = adata.n_obs
        return _to_memory(adata[np.unique([0, n // 3, n // 2, n - 1])].X)

    paths["ranged_reads"] = ranged
    if dask_array_type() is not None:  # dask is an optional extra
        paths["dask"] = lambda: read_deltacells(root, cache_dir=cache_dir, obs=False,
                                                elements=False, dask=True).X.compute()  # fmt: skip

    def epoch() -> Any:
        loader = Loader(root, batch_size=64, seed=0, cache_dir=cache_dir)
        batches = [sp.csr_matrix(batch.X) for batch in loader]
        return sp.vstack(batches, format="csr") if batches else None

    paths["loader"] = epoch
    manifest = open_dataset(root).manifest
    if manifest.metadata.get("spatial_index"):
        index = manifest.metadata["spatial_index"]
        (ox, oy), (tx, ty) = index["origin"], index["tile_size"]
        box = (ox, oy, ox + 1.3 * tx, oy + 1.3 * ty)
        paths["query_bbox"] = lambda: open_dataset(root).query_bbox(box).rows
        paths["read_deltacells(bbox=)"] = lambda: _to_memory(
            read_deltacells(root, cache_dir=cache_dir, bbox=box, elements=False).X)
    if manifest.metadata.get("gene_major"):
        genes = [0, manifest.n_genes // 2, manifest.n_genes - 1]
        paths["genes"] = lambda: open_dataset(root).genes(genes, column_order="stored")
    return paths


@dataclass
class TamperReport:
    """What a tamper run saw. ``silent`` (a path that returned a changed result without an
    error), ``missed`` (damage ``verify`` did not report) and ``crashed`` (an error other than
    :class:`~deltacells.FormatError`) must stay empty."""

    damages: int = 0
    refused: int = 0
    silent: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    slowest: float = 0.0


@dataclass(frozen=True)
class _Damage:
    """One damage to one file: a flipped bit, or a truncation to ``cut`` bytes."""

    name: str
    bit: int | None = None
    cut: int | None = None

    @property
    def what(self) -> str:
        if self.bit is not None:
            return f"{self.name}: bit {self.bit} flipped"
        return f"{self.name}: truncated to {self.cut} bytes"

    def apply(self, data: bytes) -> bytes:
        if self.bit is None:
            return data[: self.cut]
        changed = bytearray(data)
        changed[self.bit // 8] ^= 1 << (self.bit % 8)
        return bytes(changed)


def _damages(root: Path, rng: np.random.Generator, flips_per_file: int,
             truncate: float) -> Iterator[_Damage]:  # fmt: skip
    """The damages to apply, file by file in name order (drawn from ``rng`` alone, so a seed
    names the same damages however many processes apply them)."""
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        size = path.stat().st_size
        name = str(path.relative_to(root))
        if not size:
            continue
        for _ in range(flips_per_file):
            yield _Damage(name, bit=int(rng.integers(8 * size)))
        if rng.random() < truncate:
            yield _Damage(name, cut=int(rng.integers(size)))


def tamper_dataset(root: str | Path, *, flips_per_file: int = 1, truncate: float = 1.0,
                   seed: int = 0, only: Callable[[str], bool] | None = None,
                   seconds: float | None = None, processes: int = 1) -> TamperReport:  # fmt: skip
    """Damage each file of ``root`` in turn (``flips_per_file`` single-bit flips, and a
    truncation) in a copy, and read the copy through :func:`read_every_path` and ``verify``.

    Parameters
    ----------
    root
        A local dataset (never changed).
    truncate
        The share of files also truncated (at a random length), 0 to 1.
    only
        Damage only the files whose relative names it accepts.
    seconds
        Stop starting new damages after this long (each process on its own clock).
    processes
        Processes applying the damages, each to its own copy (started with ``spawn``, each
        decoding with its share of the usable CPUs). The same seed gives the same damages.
    """
    rng = np.random.default_rng(seed)
    damages = [d for d in _damages(Path(root), rng, flips_per_file, truncate)
               if only is None or only(d.name)]  # fmt: skip
    if processes <= 1:
        return _apply_damages(str(root), damages, seconds)
    threads = max(1, usable_cpu_count() // processes)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=context, initializer=_limit_threads,
                             initargs=(threads,)) as pool:  # fmt: skip
        shares = [damages[k::processes] for k in range(processes)]
        reports = list(pool.map(_apply_damages, [str(root)] * processes, shares,
                                [seconds] * processes))  # fmt: skip
    merged = TamperReport()
    for report in reports:
        merged.damages += report.damages
        merged.refused += report.refused
        merged.silent += report.silent
        merged.missed += report.missed
        merged.crashed += report.crashed
        merged.slowest = max(merged.slowest, report.slowest)
    return merged


def _limit_threads(n: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(n)


def _apply_damages(root: str, damages: list[_Damage], seconds: float | None) -> TamperReport:
    """Apply ``damages`` one at a time to a copy of ``root`` and read it every way."""
    from deltacells.read.dataset import open_dataset

    report = TamperReport()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="deltacells-tamper-") as tmp:
        work = Path(tmp) / "d"
        shutil.copytree(root, work)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = {name: digest_of(read())
                        for name, read in read_every_path(work, Path(tmp) / "c0").items()}
        for i, damage in enumerate(damages):
            if seconds is not None and time.monotonic() - start > seconds:
                break
            what = damage.what
            target = work / damage.name
            pristine = target.read_bytes()
            target.write_bytes(damage.apply(pristine))
            report.damages += 1
            began = time.monotonic()
            cache = Path(tmp) / f"c{i + 1}"  # a fresh obs cache: the damage must be seen
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        paths = read_every_path(work, cache)
                    except FormatError:
                        paths = {}
                        report.refused += 1
                    for path, read in paths.items():
                        try:
                            got = digest_of(read())
                        except FormatError:
                            report.refused += 1
                            continue
                        except Exception as err:
                            report.crashed.append(f"{what}: {path} raised {err!r}")
                            continue
                        if got != expected.get(path):
                            report.silent.append(f"{what}: {path} returned a changed result")
                    try:
                        if not open_dataset(work).problems():
                            report.missed.append(f"{what}: verify found nothing")
                    except FormatError:
                        pass
                    except Exception as err:
                        report.crashed.append(f"{what}: verify raised {err!r}")
            finally:
                target.write_bytes(pristine)
                shutil.rmtree(cache, ignore_errors=True)
            report.slowest = max(report.slowest, time.monotonic() - began)
    return report
