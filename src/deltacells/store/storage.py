"""Byte access to a dataset root: a local directory or any fsspec URL.

Local paths use the file system directly (``pread``-style reads, temporary file + rename for
atomic writes). Everything else goes through fsspec (``s3://``, ``gs://``, ``memory://``, ...);
there an object appears whole when its single PUT completes, which is what atomic means on
object stores. For ``s3://``, ``gs://`` and ``az://`` the client can be
obstore's (Rust, ``pip install obstore``) instead of fsspec's own (s3fs, gcsfs, ...): pass
``storage_options={"client": "obstore", ...}`` or set ``$DELTACELLS_CLIENT=obstore``.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import numbers
import os
import shutil
import stat
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from deltacells.codec.format import FormatError

__all__ = ["CLIENTS", "DEFAULT_DEADLINE", "DEFAULT_TIMEOUT", "StorageError", "Store", "open_store"]

#: Seconds one request to a remote store may take before it is abandoned and retried
#: (``$DELTACELLS_TIMEOUT`` overrides it).
DEFAULT_TIMEOUT = 20.0
#: Seconds one operation on a remote store (a read, a size, a listing) may take in all, retries
#: and waits included, before :class:`StorageError` (``$DELTACELLS_DEADLINE`` overrides it).
DEFAULT_DEADLINE = 60.0


class StorageError(OSError):
    """Reading from a store kept failing after retries or ran past its deadline (the message
    names the URL, the attempts and the last cause)."""


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"${name} must be a number of seconds, not {value!r}") from None
    if not seconds > 0:
        raise ValueError(f"${name} must be > 0, not {value!r}")
    return seconds


def _describe_error(err: BaseException) -> str:
    """``Type: message`` (timeouts often carry no message at all)."""
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _remote_advice(err: BaseException) -> str:
    """What to try for a remote client's error that retrying cannot mend."""
    kind = type(err).__name__
    if "Credential" in kind:
        return ("; for a public bucket pass storage_options={'anon': True}, otherwise give "
                "credentials (the environment, ~/.aws, or storage_options key= and secret=)")
    if isinstance(err, PermissionError) or "AccessDenied" in str(err):
        return "; check the credentials and the bucket's permissions"
    if "Connect" in kind:
        return ("; check the URL, the endpoint (storage_options={'client_kwargs': "
                "{'endpoint_url': ...}}) and the network")
    return ""


class RequestTimeout(TimeoutError):
    """One request took longer than the store's ``timeout``."""


def _call_with_timeout(call, seconds: float):
    """``call()`` in a daemon thread, abandoned after ``seconds``.

    Remote clients do not all bound a request that a server accepts and never answers, and a
    thread blocked in one must not keep the interpreter from exiting, hence a daemon thread
    rather than a pool (whose threads are joined at exit).
    """
    done = threading.Event()
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as err:  # handed to the caller's thread
            outcome.append((False, err))
        finally:
            done.set()

    threading.Thread(target=run, name="deltacells-request", daemon=True).start()
    if not done.wait(seconds):
        raise RequestTimeout(f"no answer within {seconds:.2f} s")
    ok, value = outcome[0]
    if ok:
        return value
    raise value


def _current_umask() -> int:
    """The process umask, read without changing it where Linux allows."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, but brief)
    os.umask(old)
    return old


def _renameat2_exchange(a: str, b: str) -> bool:
    """Atomically swap two paths with Linux's ``renameat2(RENAME_EXCHANGE)``; False where the
    C library or the file system does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                          ctypes.c_uint]  # fmt: skip
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), a)


def _with_client_timeouts(url: str, options: dict, timeout: float, connections: int) -> dict:
    """``options`` plus connect/read timeouts (and, for s3fs, a connection pool as large as
    the store's I/O threads) for the clients that take them (s3fs, fsspec's HTTP), unless
    already set: a request abandoned by :func:`_call_with_timeout` then also
    ends in its own thread instead of waiting minutes for the server. They are twice the
    store's own, so the store's fires first and a client that turns its own timeout into a
    quiet answer (fsspec's HTTP ``exists`` says False) is not believed."""
    protocol = url.split("://", 1)[0]
    options = dict(options)
    timeout = 2 * timeout
    if protocol in ("s3", "s3a"):
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("connect_timeout", timeout)
        config.setdefault("read_timeout", timeout)
        # botocore keeps 10 connections by default, fewer than the requests a loader keeps in
        # flight on a long, fast link.
        config.setdefault("max_pool_connections", connections)
        options["config_kwargs"] = config
    elif protocol in ("http", "https"):
        client = dict(options.get("client_kwargs") or {})
        if "timeout" not in client:
            import aiohttp

            client["timeout"] = aiohttp.ClientTimeout(
                total=None, sock_connect=timeout, sock_read=timeout
            )
        options["client_kwargs"] = client
    return options


#: Background I/O threads of a store (``io_threads=None``): remote requests mostly wait, so
#: more of them cover a long latency at a high bandwidth; local reads need few.
REMOTE_IO_THREADS = 32
LOCAL_IO_THREADS = 8

#: Object-store clients a :class:`Store` can use for URLs (see the module docstring).
CLIENTS = ("fsspec", "obstore")
_OBSTORE_PROTOCOLS = {"s3": "s3", "s3a": "s3", "gs": "gs", "gcs": "gs", "az": "az",
                      "abfs": "az", "abfss": "az"}  # fmt: skip
#: s3fs options obstore has no use for (deltacells' own timeouts and retries apply).
_S3FS_ONLY = ("skip_instance_cache", "use_listings_cache", "config_kwargs", "default_block_size",
              "default_fill_cache", "asynchronous", "loop")  # fmt: skip


def _pop_client(url: str, options: dict) -> tuple[str, dict]:
    """The client named by ``options["client"]`` (or ``$DELTACELLS_CLIENT``, else fsspec)
    and the options without it."""
    options = dict(options)
    client = options.pop("client", None) or os.environ.get("DELTACELLS_CLIENT") or "fsspec"
    if client not in CLIENTS:
        raise ValueError(f"storage client must be one of {CLIENTS}, not {client!r}")
    protocol = url.split("://", 1)[0]
    if client == "obstore" and protocol not in _OBSTORE_PROTOCOLS:
        raise ValueError(f"the obstore client reads {sorted(set(_OBSTORE_PROTOCOLS))} URLs, "
                         f"not {protocol}://")  # fmt: skip
    return client, options


def _obstore_filesystem(url: str, options: dict, timeout: float):
    """obstore's fsspec file system for ``url``, from obstore's own options (``config``,
    ``client_options``, ``retry_config``) or s3fs-style ones (``key``, ``secret``, ``token``,
    ``anon``, ``endpoint_url`` / ``client_kwargs``). Its own retries are off: the
    :class:`Store` retries, within its deadline."""
    try:
        from obstore.fsspec import FsspecStore
    except ModuleNotFoundError:
        raise ImportError("the obstore client needs obstore: pip install obstore") from None
    options = dict(options)
    protocol = _OBSTORE_PROTOCOLS[url.split("://", 1)[0]]
    config = dict(options.pop("config", None) or {})
    client_options = dict(options.pop("client_options", None) or {})
    retry_config = options.pop("retry_config", None) or {"max_retries": 0}
    client_kwargs = dict(options.pop("client_kwargs", None) or {})
    endpoint = options.pop("endpoint_url", None) or client_kwargs.pop("endpoint_url", None)
    if protocol == "s3":
        renamed = {"key": "aws_access_key_id", "secret": "aws_secret_access_key",
                   "token": "aws_session_token"}  # fmt: skip
        for ours, theirs in renamed.items():
            if options.get(ours) is not None:
                config.setdefault(theirs, options.pop(ours))
        if options.pop("anon", False):
            config.setdefault("aws_skip_signature", "true")
        region = client_kwargs.pop("region_name", None)
        if region:
            config.setdefault("aws_region", region)
        if endpoint:
            config.setdefault("aws_endpoint", endpoint)
    for key in _S3FS_ONLY:
        options.pop(key, None)
    unknown = sorted(set(options) | set(client_kwargs))
    if unknown:
        raise ValueError(f"storage options the obstore client does not take: {unknown}; pass "
                         "obstore's own as config=, client_options=, retry_config=")  # fmt: skip
    if endpoint and endpoint.startswith("http://"):
        client_options.setdefault("allow_http", True)
    client_options.setdefault("timeout", f"{2 * timeout:g}s")
    client_options.setdefault("connect_timeout", f"{2 * timeout:g}s")
    return FsspecStore(protocol, config=config or None, client_options=client_options,
                       retry_config=retry_config)  # fmt: skip


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


class Store:
    """A dataset root that can read, write and list objects by relative name.

    Parameters
    ----------
    root
        A local directory, a ``file://`` URL or an fsspec URL.
    storage_options
        Passed to fsspec for URLs (credentials, endpoint, ...). ``"client": "obstore"`` reads
        ``s3://``, ``gs://`` and ``az://`` URLs with obstore instead (the
        s3fs-style ``key``, ``secret``, ``token``, ``anon`` and ``endpoint_url`` are
        translated; obstore's own ``config``, ``client_options`` and ``retry_config`` are
        passed on); ``$DELTACELLS_CLIENT`` sets the default.
    retries, backoff
        Transient read failures are retried this many times, waiting ``backoff`` seconds and
        doubling each time.
    io_threads
        Threads for background prefetching (default :data:`.REMOTE_IO_THREADS` for URLs,
        :data:`.LOCAL_IO_THREADS` for local directories).
    timeout
        Remote stores: seconds one request may take before it is abandoned and retried
        (default :data:`DEFAULT_TIMEOUT`, or ``$DELTACELLS_TIMEOUT``). Also passed to s3fs and
        fsspec's HTTP client as their connect and read timeouts unless ``storage_options``
        sets them.
    deadline
        Remote stores: seconds one operation may take in all, retries included (default
        :data:`DEFAULT_DEADLINE`, or ``$DELTACELLS_DEADLINE``).
    follow_external_links
        Local directories: read files that are symbolic links leading out of the dataset's
        root (refused by default, as are FIFOs, devices and other non-regular files).
    """

    def __getstate__(self) -> dict:
        # Pickles as its location and options; the other side reconnects lazily.
        return {"root": self.url, "storage_options": self.storage_options} | self._options()

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
        io_threads: int | None = None,
        timeout: float | None = None,
        deadline: float | None = None,
        follow_external_links: bool = False,
    ) -> None:
        if not isinstance(root, str | os.PathLike):
            raise TypeError(f"a dataset's location is a path or URL (str or os.PathLike), not "
                            f"{type(root).__name__}")  # fmt: skip
        root = os.fspath(root)
        if not root.strip():
            raise ValueError(f"path {root!r} is empty: give the dataset folder's path or URL")
        self.url = root
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise TypeError(f"storage_options must be a dict of fsspec options (e.g. "
                            f"{{'anon': True}}) or None, not {type(storage_options).__name__}")
        for name, seconds in (("timeout", timeout), ("deadline", deadline)):
            if seconds is not None and (isinstance(seconds, bool)
                                        or not isinstance(seconds, numbers.Real)):  # fmt: skip
                raise TypeError(f"{name} must be a number of seconds or None, not "
                                f"{type(seconds).__name__}")  # fmt: skip
        self.storage_options = dict(storage_options or {})
        self.retries, self.backoff = retries, backoff
        remote = _is_url(root)
        # Requests in flight are bounded by the callers (the loader's prefetch_tiles, ...);
        # remote ones wait on latency, so enough threads to cover latency x bandwidth.
        self.io_threads = io_threads if io_threads is not None else (
            REMOTE_IO_THREADS if remote else LOCAL_IO_THREADS)  # fmt: skip
        self.timeout = _env_seconds("DELTACELLS_TIMEOUT", DEFAULT_TIMEOUT) if timeout is None \
            else float(timeout)  # fmt: skip
        self.deadline = _env_seconds("DELTACELLS_DEADLINE", DEFAULT_DEADLINE) \
            if deadline is None else float(deadline)  # fmt: skip
        if not (self.timeout > 0 and self.deadline > 0):
            raise ValueError("timeout and deadline must be > 0 seconds")
        self.follow_external_links = follow_external_links
        self.client = "local"
        # What a failed attempt raises when it may succeed if tried again.
        self._transient: tuple[type[BaseException], ...] = (OSError, TimeoutError,
                                                             ConnectionError)  # fmt: skip
        self._executor: ThreadPoolExecutor | None = None
        self._executor_pid = os.getpid()
        if root.startswith("file://"):
            root = root[len("file://") :]
        self.is_local = not _is_url(root)
        self._is_http = root.split("://", 1)[0] in ("http", "https")
        if self.is_local:
            self._root = Path(root).expanduser()  # "~/data.dc", as pandas and fsspec take it
            self._real_root: str | None = None
            self._fs: Any = None
        else:
            self.client, options = _pop_client(root, self.storage_options)
            if self.client != "fsspec":
                # Chosen by the environment: pickles (dask workers) keep the same client.
                self.storage_options["client"] = self.client
            if self.client == "obstore":
                self._fs = _obstore_filesystem(root, options, self.timeout)
                self._root_path = root.split("://", 1)[1].rstrip("/")
                from obstore.exceptions import BaseError

                self._transient = (*self._transient, BaseError)
            else:
                import fsspec

                options = _with_client_timeouts(root, options, self.timeout, self.io_threads)
                self._fs, self._root_path = fsspec.core.url_to_fs(root, **options)

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

        A missing object is not transient: it raises FormatError at once. On remote stores
        each attempt is abandoned after ``timeout`` seconds and no attempt starts past
        ``deadline`` seconds from the first. Anything that keeps failing raises
        :class:`StorageError` naming the URL, the attempts made, the time taken and the last
        cause.
        """
        delay = self.backoff
        start = time.monotonic()
        for attempt in range(1, self.retries + 2):
            try:
                if self.is_local:
                    return call()
                remaining = self.deadline - (time.monotonic() - start)
                return _call_with_timeout(call, max(0.0, min(self.timeout, remaining)))
            except FileNotFoundError:
                raise FormatError(f"{self.describe(name)}: missing") from None
            except Exception as err:
                if not self._is_transient(err):
                    if self.is_local or isinstance(err, FormatError | StorageError):
                        raise
                    # The remote client's own errors (botocore's, aiohttp's, ...) named with
                    # the URL and what to do, not bare.
                    raise StorageError(f"{self.describe(name)}: {what} failed: "
                                       f"{_describe_error(err)}{_remote_advice(err)}") from err
                elapsed = time.monotonic() - start
                out_of_time = elapsed + delay >= self.deadline and not self.is_local
                if attempt > self.retries or out_of_time:
                    why = f" (deadline {self.deadline:g} s)" if out_of_time else ""
                    raise StorageError(
                        f"{self.describe(name)}: {what} failed {attempt} times in "
                        f"{elapsed:.1f} s{why}; last error: {_describe_error(err)}"
                    ) from err
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def _is_transient(self, err: BaseException) -> bool:
        """Whether a failed attempt may succeed if tried again: connection and timeout errors,
        and HTTP answers that say so (408, 425, 429 and 5xx), whatever the client."""
        if isinstance(err, self._transient):
            return True
        status = getattr(err, "status", None) or getattr(err, "status_code", None)
        return isinstance(status, int) and (status >= 500 or status in (408, 425, 429))

    # -- local files: regular files inside the root only -----------------------------------------

    def _inside_root(self, path: str) -> bool:
        if self._real_root is None:
            self._real_root = os.path.realpath(self._root)
        real = os.path.realpath(path)
        return real == self._real_root or real.startswith(self._real_root.rstrip(os.sep) + os.sep)

    def _open_local(self, name: str) -> int:
        """A read-only descriptor of local file ``name``, refusing links out of the root and
        anything but a regular file (a FIFO would block the reader forever)."""
        path = self._path(name)
        if not self.follow_external_links and not self._inside_root(path):
            raise FormatError(
                f"{self.describe(name)}: a symbolic link leading out of the dataset's root; "
                "refused (pass follow_external_links=True to read it)"
            )
        # O_NONBLOCK: opening a FIFO must not wait for a writer; regular files ignore it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
                raise FormatError(f"{self.describe(name)}: {kind}; refused")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _local_file(self, name: str):
        return os.fdopen(self._open_local(name), "rb", buffering=0)

    def _read_local(self, name: str) -> bytes:
        with self._local_file(name) as f:
            return f.readall()

    def exists(self, name: str) -> bool:
        """Whether object ``name`` exists."""
        if self.is_local:
            return os.path.lexists(self._path(name))
        path = self._path(name)
        if self._is_http:
            # fsspec's HTTP exists() answers False for any error (a 503 included): ask
            # strictly, so that errors are retried and only a 404 means absent.
            def strict() -> bool:
                try:
                    return bool(self._fs.exists(path, strict=True))
                except FileNotFoundError:
                    return False

            return self._retrying("exists", name, strict)
        return self._retrying("exists", name, lambda: self._fs.exists(path))

    def size(self, name: str) -> int:
        """Size of object ``name`` in bytes."""
        if self.is_local:

            def local_size() -> int:
                with self._local_file(name) as f:
                    return os.fstat(f.fileno()).st_size

            return self._retrying("stat", name, local_size)
        return self._retrying("size", name, lambda: int(self._fs.size(self._path(name))))

    def sizes(self, names: list[str]) -> list[int]:
        """Sizes of several objects (asked concurrently on remote stores)."""
        if self.is_local or len(names) < 2:
            return [self.size(name) for name in names]
        futures = [self._pool().submit(self.size, name) for name in names]
        return [future.result() for future in futures]

    def read_bytes(self, name: str, max_size: int | None = None) -> bytes:
        """The whole object ``name``.

        With ``max_size``, an object larger than that raises :class:`.FormatError` before it
        is read (for files whose size no manifest records, e.g. the manifest itself).
        """
        if max_size is not None:
            data = self.read_buffer(name, max_size=max_size)
            return data.tobytes()
        if self.is_local:
            return self._retrying("read", name, lambda: self._read_local(name))
        return self._retrying("read", name, lambda: self._fs.cat_file(self._path(name)))

    def read_buffer(
        self, name: str, size: int | None = None, *, max_size: int | None = None
    ) -> np.ndarray:
        """The whole object ``name`` as a ``uint8`` array.

        With ``size`` (what a manifest says the object holds) an object of another size raises
        :class:`.FormatError` before anything that size is allocated: local files are checked
        with ``fstat``, remote ones are read only up to one byte past ``size``. ``max_size``
        likewise refuses objects larger than that. Local files are read into memory from
        pyarrow's pool: large reads into fresh ``bytes`` cost a page fault per 4 KiB, about
        three quarters of the time of a tile read.
        """
        if not self.is_local:
            if size is None and max_size is None:
                return np.frombuffer(self.read_bytes(name), dtype=np.uint8)
            limit = size if size is not None else max_size
            data = self.read_range(name, 0, limit + 1)
            if size is not None and len(data) != size:
                got = f"more than {size}" if len(data) > size else str(len(data))
                raise self._size_error(name, got, size)
            if len(data) > limit:
                raise self._too_large(name, limit)
            return np.frombuffer(data, dtype=np.uint8)

        def read() -> np.ndarray:
            with self._local_file(name) as f:
                actual = os.fstat(f.fileno()).st_size
                if size is not None and actual != size:
                    raise self._size_error(name, str(actual), size)
                if max_size is not None and actual > max_size:
                    raise self._too_large(name, max_size)
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

    def _too_large(self, name: str, limit: int) -> FormatError:
        return FormatError(f"{self.describe(name)}: larger than {limit} bytes; refused")

    def read_range(self, name: str, start: int, stop: int) -> bytes:
        """Bytes ``start:stop`` of object ``name``."""
        if self.is_local:

            def read() -> bytes:
                with self._local_file(name) as f:
                    return os.pread(f.fileno(), stop - start, start)

            return self._retrying("ranged read", name, read)

        def fetch() -> bytes:
            try:
                return self._fs.cat_file(self._path(name), start=start, end=stop)
            except Exception as err:
                # A range starting at or past the object's end (an empty object) is 416 to
                # obstore and no bytes to s3fs: no bytes, so size checks name the object.
                if self.client == "obstore" and "416 Range Not Satisfiable" in str(err):
                    return b""
                raise

        return self._retrying("ranged read", name, fetch)

    def range_reader(self, name: str) -> Callable[[int, int], bytes]:
        """A function ``read(start, stop)`` of bytes ``start:stop`` of object ``name``, for
        several ranged reads of one object: a local file is opened (and its path checked)
        once, here, and closed when the function is dropped."""
        if not self.is_local:
            return functools.partial(self.read_range, name)
        return _OpenFile(self._retrying("ranged read", name, lambda: self._open_local(name)))

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
            return self._retrying("open", name, lambda: self._local_file(name))
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
        if not self._retrying("list", prefix, lambda: self._fs.exists(base)):
            return []
        root = self._root_path.rstrip("/") + "/"
        found = self._retrying("list", prefix, lambda: self._fs.find(base))
        return sorted(p[len(root) :] if p.startswith(root) else p for p in found)

    def entries(self) -> list[tuple[str, str]]:
        """Everything below the root as ``(relative name, kind)``, kind being ``"file"``,
        ``"dir"``, ``"link"`` (a symbolic link, not followed) or ``"other"`` (FIFO, socket,
        device). Object stores only have files."""
        if not self.is_local:
            return [(name, "file") for name in self.list()]
        if not self._root.is_dir():
            return []
        out = []
        for dirpath, dirnames, filenames in os.walk(self._root, followlinks=False):
            for entry in [*dirnames, *filenames]:
                full = os.path.join(dirpath, entry)
                mode = os.lstat(full).st_mode
                kind = ("link" if stat.S_ISLNK(mode) else "dir" if stat.S_ISDIR(mode)
                        else "file" if stat.S_ISREG(mode) else "other")  # fmt: skip
                out.append((os.path.relpath(full, self._root), kind))
        return sorted(out)

    # -- writing -------------------------------------------------------------------------------

    def write_atomic(self, name: str, data: bytes) -> None:
        """Write object ``name`` so that it appears whole or not at all.

        Local files get the permissions any other writer would give them (``0666`` less the
        umask), not ``mkstemp``'s private ``0600``.
        """
        if self.is_local:
            target = Path(self._path(name))
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
            try:
                os.fchmod(fd, 0o666 & ~_current_umask())
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

    def remove_tree(self) -> None:
        """Delete the root and everything below it (the caller has checked it is ours)."""
        if self.is_local:
            if os.path.lexists(self._root):
                shutil.rmtree(self._root)
            return
        for name in self.list():
            self.remove(name)

    def make_root(self) -> None:
        """Create the root directory (a no-op on object stores); honours the umask."""
        if self.is_local:
            self._root.mkdir(parents=True, exist_ok=True)

    def _options(self) -> dict:
        """This store's keyword arguments, for stores made from it."""
        return {"retries": self.retries, "backoff": self.backoff, "io_threads": self.io_threads,
                "timeout": self.timeout, "deadline": self.deadline,
                "follow_external_links": self.follow_external_links}  # fmt: skip

    def child(self, name: str) -> Store:
        """A store for the folder or prefix ``name`` inside this one (same options)."""
        options = self._options()
        if self.is_local:
            child = Store(self._root / name, **options)
            # Links inside the dataset are judged against the dataset's root, not the child's.
            child._real_root = self._real_root or os.path.realpath(self._root)
            return child
        return Store(self.describe(name), self.storage_options, **options)

    # -- replacing a dataset -----------------------------------------------------------------------

    def staging_sibling(self) -> Store:
        """A new, empty store beside this one (same parent directory or bucket prefix) in
        which a replacement is written before :meth:`replace_with` moves it here."""
        tag = f".deltacells-staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        options = self._options()
        if self.is_local:
            root = self._root.resolve() if self._root.is_symlink() else self._root.absolute()
            staged = root.parent / f".{root.name}{tag}"
            staged.mkdir(mode=0o777)  # the umask applies, as for any new directory
            return Store(staged, **options)
        return Store(self.url.rstrip("/") + tag, self.storage_options, **options)

    def replace_with(self, staged: Store) -> None:
        """Make the complete dataset in ``staged`` this store's content, then delete the old.

        Local directories are swapped in one atomic ``renameat2(RENAME_EXCHANGE)`` where Linux
        offers it (otherwise two renames, the old one kept aside until the new is in place),
        so a reader or a crash sees either the old dataset or the new one. Object stores have
        no rename: the old manifest is removed first (the old dataset is then incomplete),
        the staged objects are copied over, the manifest last, and the staged copy, complete
        and readable at its own prefix until then, is deleted.
        """
        if self.is_local:
            root = self._root.resolve() if self._root.is_symlink() else self._root.absolute()
            if not os.path.lexists(root):
                os.rename(staged._root, root)
                return
            # The replacement keeps the old folder's permissions (e.g. group-shared).
            os.chmod(staged._root, stat.S_IMODE(os.stat(root).st_mode))
            if not _renameat2_exchange(str(staged._root), str(root)):
                aside = root.parent / f".{root.name}.deltacells-old-{uuid.uuid4().hex[:8]}"
                os.rename(root, aside)
                os.rename(staged._root, root)
                os.rename(aside, staged._root)
            shutil.rmtree(staged._root)  # now the old dataset
            return
        from deltacells.store.manifest import MANIFEST_NAME

        new_names = staged.list()
        self.remove(MANIFEST_NAME)
        for name in self.list():
            if name not in new_names:
                self.remove(name)
        for name in sorted(new_names, key=lambda n: n == MANIFEST_NAME):
            copy = staged._path(name), self._path(name)
            self._retrying("copy", name, lambda c=copy: self._fs.copy(*c))
        staged.remove_tree()


def open_store(
    root: str | os.PathLike | Store, storage_options: dict | None = None, **options: Any
) -> Store:
    """A :class:`Store` for ``root`` (returned as is if it already is one); ``options`` are
    :class:`Store`'s keyword arguments (``timeout``, ``deadline``, ...)."""
    if isinstance(root, Store):
        return root
    return Store(root, storage_options, **options)


class _OpenFile:
    """Ranged reads of one open local file (see :meth:`Store.range_reader`)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._close = weakref.finalize(self, os.close, fd)

    def __call__(self, start: int, stop: int) -> bytes:
        return os.pread(self.fd, stop - start, start)
