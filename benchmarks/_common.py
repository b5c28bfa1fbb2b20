"""Shared pieces of the benchmark scripts: the machine description stored with every result."""

from __future__ import annotations

import datetime
import os
import platform
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("deltacells", "numpy", "scipy", "anndata", "zarr", "h5py", "zstandard", "pyarrow",
            "pandas")


def machine() -> dict:
    """CPU model, usable CPUs, Python, platform, libzstd/OpenMP/CRC of the build, versions."""
    cpu, fields = "", {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first CPU's fields are enough
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        cpu = fields.get("model name", "")
    except OSError:
        pass
    # The model name alone does not tell CPU generations apart ("AMD EPYC" is both a Zen 3 and
    # a Zen 5 here), and the row sort's speed depends on the vector extensions.
    flags = set(fields.get("flags", "").split())
    cpu_id = f"family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    simd = [f for f in ("avx2", "avx512f", "avx512_vbmi2") if f in flags]
    from deltacells.codec import _checksum, _decode, _encode, _sortchoice

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu,
        "cpu_id": cpu_id,
        "simd": simd,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "libzstd": _encode.zstd_version(),
        "openmp": _decode.openmp_enabled(),
        "crc": _checksum.crc_backend(),
        "row_sort": _sortchoice._use_row_sort(),
        "packages": versions,
    }


def _status_mb(field: str) -> float:
    """A memory field of /proc/self/status (``VmHWM``, ``VmRSS``) in MB."""
    for line in open("/proc/self/status"):
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def fresh_processes(argv: list[str], repeats: int) -> dict:
    """Run ``python *argv`` in ``repeats`` fresh processes, each printing a JSON record with
    its time ``"s"`` on its last line: the record of median time, with every run's time under
    ``s_all`` (one process differs from the next by up to a third on the benchmark machine)."""
    import json
    import subprocess
    import sys

    runs = []
    for _ in range(repeats):
        done = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                              check=True)  # fmt: skip
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    runs.sort(key=lambda run: run["s"])
    return runs[len(runs) // 2] | {"s_all": [run["s"] for run in runs]}


def peak_rss_mb() -> float:
    """This process's own peak RSS in MB: VmHWM, since getrusage's ru_maxrss carries the
    parent's peak across fork and exec on Linux."""
    return _status_mb("VmHWM")


def rss_mb() -> float:
    """This process's resident memory now, in MB (VmRSS)."""
    return _status_mb("VmRSS")


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


#: Figures are drawn at the docs' text width (about 750 px), panels stacked, so that nothing is
#: shrunk on the page: 7.5 in at 130 dpi, 10 pt text.
PAGE_WIDTH_IN = 7.5
FIGURE_DPI = 130


def page_figure(n_panels: int = 1, panel_height: float = 3.0):
    """A figure as wide as the docs' text with ``n_panels`` axes stacked top to bottom."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "legend.fontsize": 9})
    fig, axes = plt.subplots(n_panels, 1, figsize=(PAGE_WIDTH_IN, panel_height * n_panels + 0.4),
                             squeeze=False)  # fmt: skip
    return fig, list(axes[:, 0])


def machine_label(results: dict) -> str:
    """The same machine line on every plot: CPU, usable CPUs, Python, date of the run."""
    m = results["machine"]
    cpu = f"{m['cpu']} ({m['cpu_id']})" if m.get("cpu_id") else m["cpu"]
    line = f"{cpu}, {m['usable_cpus']} CPUs, Python {m['python']}"
    return line + (f", run on {m['date']}" if m.get("date") else "")


def save_figure(fig, path: Path, title: str | None = None, results: dict | None = None) -> None:
    """Lay out and write a matplotlib figure, creating its folder; ``title`` and the machine
    line of ``results`` go on top."""
    if title is not None or results is not None:
        lines = [t for t in (title, machine_label(results) if results else None) if t]
        fig.suptitle("\n".join(lines), fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=FIGURE_DPI)


def stacked_adata(source: Path, n_cells: int, seed: int = 0):
    """``source`` (an .h5ad) stacked with shuffled rows up to ``n_cells`` cells, as an AnnData
    with unique obs names: the larger inputs every benchmark uses."""
    import anndata as ad
    import numpy as np
    import scipy.sparse as sp

    base = ad.read_h5ad(source)
    rows = np.random.default_rng(seed).integers(0, base.n_obs, n_cells)
    obs = base.obs.iloc[rows].copy()
    obs.index = [f"{name}-{i}" for i, name in enumerate(obs.index)]
    return ad.AnnData(X=sp.csr_matrix(base.X)[rows], obs=obs, var=base.var)


class MotoS3:
    """moto's S3 server on a free port of 127.0.0.1 with one bucket (a context manager).

    ``upload(key, path)`` puts a file or a folder's files under ``key`` and returns its
    ``s3://`` URL; ``options`` are the s3fs storage options that reach the server.
    """

    def __init__(self, bucket: str = "bench") -> None:
        self.bucket = bucket

    def __enter__(self) -> MotoS3:
        import logging
        import socket

        import boto3
        from moto.server import ThreadedMotoServer

        # werkzeug logs every request to stderr: server CPU a real object store does not take
        # from the reader's machine.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                                   aws_access_key_id="x", aws_secret_access_key="x")  # fmt: skip
        self.client.create_bucket(Bucket=self.bucket)
        self.options = {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": self.endpoint}}
        return self

    def upload(self, key: str, path: Path) -> str:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for p in files:
            name = key if p == path else f"{key}/{p.relative_to(path)}"
            self.client.upload_file(str(p), self.bucket, name)
        return f"s3://{self.bucket}/{key}"

    def __exit__(self, *exc) -> None:
        self.server.stop()
