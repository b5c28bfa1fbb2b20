"""Byte access to a dataset root: a local directory or any fsspec URL.

Local paths use the file system directly (``pread``-style reads, temporary file + rename for
atomic writes). Everything else goes through fsspec (``s3://``, ``gs://``, ``memory://``, ...);
there an object appears whole when its single PUT completes, which is what atomic means on
object stores.
"""

from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from deltacells.format import FormatError

__all__ = ["StorageError", "Store", "open_store"]


class StorageError(OSError):
    """Reading from a store kept failing after retries (the message names the URL)."""


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class Store:
    """A dataset root that can read, write and list objects by relative name.

    Parameters
    ----------
    root
        A local directory, a ``file://`` URL or an fsspec URL.
    storage_options
        Passed to fsspec for URLs (credentials, endpoint, ...).
    retries, backoff
        Transient read failures are retried this many times, waiting ``backoff`` seconds and
        doubling each time.
    io_threads
        Threads for background prefetching.
    """

    def __getstate__(self) -> dict:
        # Pickles as its location and options; the other side reconnects lazily.
        return {
            "root": self.url,
            "storage_options": self.storage_options,
            "retries": self.retries,
            "backoff": self.backoff,
            "io_threads": self.io_threads,
        }

    def __setstate__(self, state: dict) -> None:
        root = state.pop("root")
        self.__init__(root, state.pop("storage_options"), **state)

    def __init__(
        self,
        root: str | os.PathLike,
        storage_options: dict | None = None,
        *,
        retries: int = 4,
        backoff: float = 0.05,
        io_threads: int = 8,
    ) -> None:
        root = os.fspath(root)
        self.url = root
        self.storage_options = dict(storage_options or {})
        self.retries, self.backoff, self.io_threads = retries, backoff, io_threads
        self._executor: ThreadPoolExecutor | None = None
        self._executor_pid = os.getpid()
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.is_local = not _is_url(root)
        if self.is_local:
            self._root = Path(root)
            self._fs: Any = None
        else:
            import fsspec

            self._fs, self._root_path = fsspec.core.url_to_fs(root, **self.storage_options)

    # -- naming --------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        if self.is_local:
            return str(self._root / name)
        return f"{self._root_path.rstrip('/')}/{name}" if name else self._root_path

    def describe(self, name: str = "") -> str:
        """Human-readable location of ``name`` (used in error messages)."""
        if self.is_local:
            return self._path(name)
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    # -- reading -------------------------------------------------------------------------------

    def _retrying(self, what: str, name: str, call):
        """Run ``call()``, retrying transient failures with exponential backoff.

        A missing object is not transient: it raises FormatError at once. Anything else that
        keeps failing raises :class:`StorageError` naming the URL and the attempts made.
        """
        delay = self.backoff
        for attempt in range(1, self.retries + 2):
            try:
                return call()
            except FileNotFoundError:
                raise FormatError(f"{self.describe(name)}: missing") from None
            except (OSError, TimeoutError, ConnectionError) as err:
                if attempt > self.retries:
                    raise StorageError(
                        f"{self.describe(name)}: {what} failed {attempt} times; last error: {err}"
                    ) from err
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists."""
        if self.is_local:
            return Path(self._path(name)).exists()
        return self._retrying("exists", name, lambda: self._fs.exists(self._path(name)))

    def size(self, name: str) -> int:
        """Size of object ``name`` in bytes."""
        if self.is_local:
            return self._retrying("stat", name, lambda: os.stat(self._path(name)).st_size)
        return self._retrying("size", name, lambda: int(self._fs.size(self._path(name))))

    def read_bytes(self, name: str) -> bytes:
        """The whole object ``name``."""
        if self.is_local:
            return self._retrying("read", name, lambda: Path(self._path(name)).read_bytes())
        return self._retrying("read", name, lambda: self._fs.cat_file(self._path(name)))

    def read_buffer(self, name: str, size: int | None = None) -> np.ndarray:
        """The whole object ``name`` as a ``uint8`` array.

        With ``size`` (what a manifest says the object holds) an object of another size raises
        :class:`FormatError` before anything that size is allocated: local files are checked
        with ``fstat``, remote ones are read only up to one byte past ``size``. Local files are
        read into memory from pyarrow's pool: large reads into fresh ``bytes`` cost a page fault
        per 4 KiB, about three quarters of the time of a tile read.
        """
        if not self.is_local:
            if size is None:
                return np.frombuffer(self.read_bytes(name), dtype=np.uint8)
            data = self.read_range(name, 0, size + 1)
            if len(data) != size:
                got = f"more than {size}" if len(data) > size else str(len(data))
                raise self._size_error(name, got, size)
            return np.frombuffer(data, dtype=np.uint8)

        def read() -> np.ndarray:
            with open(self._path(name), "rb", buffering=0) as f:
                actual = os.fstat(f.fileno()).st_size
                if size is not None and actual != size:
                    raise self._size_error(name, str(actual), size)
                if actual == 0:
                    return np.zeros(0, dtype=np.uint8)
                out = np.frombuffer(pa.allocate_buffer(actual), dtype=np.uint8)
                got = 0
                while got < actual:  # readinto may return less than asked for
                    n = f.readinto(memoryview(out)[got:])
                    if not n:
                        break
                    got += n
                if size is not None and got != size:  # the file shrank while being read
                    raise self._size_error(name, str(got), size)
                return out[:got]

        return self._retrying("read", name, read)

    def _size_error(self, name: str, got: str, expected: int) -> FormatError:
        return FormatError(f"{self.describe(name)}: {got} bytes, the manifest says {expected}")

    def read_range(self, name: str, start: int, stop: int) -> bytes:
        """Bytes ``start:stop`` of object ``name``."""
        if self.is_local:

            def read() -> bytes:
                with open(self._path(name), "rb") as f:
                    return os.pread(f.fileno(), stop - start, start)

            return self._retrying("ranged read", name, read)
        return self._retrying(
            "ranged read", name, lambda: self._fs.cat_file(self._path(name), start=start, end=stop)
        )

    def prefetch(self, names: list[str], sizes: list[int] | None = None) -> dict[str, Future]:
        """Start reading ``names`` (as :meth:`read_buffer`, with their expected ``sizes`` if
        given) in background threads; returns a future per name."""
        expected = [None] * len(names) if sizes is None else sizes
        return {
            name: self._pool().submit(self.read_buffer, name, size)
            for name, size in zip(names, expected, strict=True)
        }

    def _pool(self) -> ThreadPoolExecutor:
        # A forked child inherits the executor object but not its threads: make a new one.
        if self._executor is None or self._executor_pid != os.getpid():
            self._executor = ThreadPoolExecutor(self.io_threads, thread_name_prefix="deltacells-io")
            self._executor_pid = os.getpid()
        return self._executor

    def open(self, name: str):
        """A seekable binary file object for ``name`` (ranged reads on remote stores)."""
        if self.is_local:
            return self._retrying("open", name, lambda: open(self._path(name), "rb"))
        return self._retrying("open", name, lambda: self._fs.open(self._path(name), "rb"))

    def list(self, prefix: str = "") -> list[str]:
        """Names of all objects below ``prefix`` (recursively), relative to the root."""
        if self.is_local:
            base = Path(self._path(prefix))
            if not base.exists():
                return []
            if base.is_file():
                return [prefix]
            return sorted(str(p.relative_to(self._root)) for p in base.rglob("*") if p.is_file())
        base = self._path(prefix)
        if not self._fs.exists(base):
            return []
        root = self._root_path.rstrip("/") + "/"
        return sorted(p[len(root) :] if p.startswith(root) else p for p in self._fs.find(base))

    # -- writing -------------------------------------------------------------------------------

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write object ``name`` so that it appears whole or not at all."""
        if self.is_local:
            target = Path(self._path(name))
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        else:
            self._fs.pipe_file(self._path(name), data)

    def remove(self, name: str) -> None:
        """Delete object ``name`` if it exists."""
        if self.is_local:
            Path(self._path(name)).unlink(missing_ok=True)
        elif self._fs.exists(self._path(name)):
            self._fs.rm_file(self._path(name))

    def remove_all(self) -> None:
        """Delete everything below the root (the root itself stays)."""
        for name in self.list():
            self.remove(name)
        if self.is_local:
            for d in sorted(self._root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if d.is_dir():
                    d.rmdir()

    def make_root(self) -> None:
        """Create the root directory (a no-op on object stores)."""
        if self.is_local:
            self._root.mkdir(parents=True, exist_ok=True)


def open_store(root: str | os.PathLike | Store, storage_options: dict | None = None) -> Store:
    """A :class:`Store` for ``root`` (returned as is if it already is one)."""
    if isinstance(root, Store):
        return root
    return Store(root, storage_options)
