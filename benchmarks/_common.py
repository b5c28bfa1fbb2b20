"""Shared pieces of the benchmark scripts: the machine description stored with every result."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("deltacells", "numpy", "scipy", "anndata", "zarr", "h5py", "zstandard", "pyarrow")


def machine() -> dict:
    """CPU model, usable CPUs, Python, platform, libzstd/OpenMP of the build, package versions."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from deltacells import _kernels

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return {
        "cpu": cpu,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libzstd": _kernels.zstd_version(),
        "openmp": _kernels.openmp_enabled(),
        "packages": versions,
    }


def median_time(fn, repeats: int, *, warmup: bool = False) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` (after one untimed call if asked)."""
    import statistics
    import time

    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def save_figure(fig, path: Path) -> None:
    """Lay out and write a matplotlib figure, creating its folder."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
