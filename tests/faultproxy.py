"""An HTTP proxy for tests that stands between a client and a real server (moto's S3) and,
on request, answers with server errors or holds responses back, so that retries and timeouts
are exercised by the real client stack (s3fs, aiobotocore, aiohttp) rather than by patching
Python functions."""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# What S3 answers when it fails internally (a transient error clients are expected to retry).
S3_INTERNAL_ERROR = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>"
)


@dataclass
class Fault:
    """The next ``count`` requests whose path contains ``match`` fail (``status``) or are
    answered after ``delay`` seconds."""

    match: str
    count: int
    status: int | None = None
    delay: float = 0.0


class Bandwidth:
    """A token bucket shared by the connections it is given to: at most ``bytes_per_s`` in
    total (``None``: unlimited)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.rate = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def take(self, n: int) -> None:
        """Wait until ``n`` more bytes may be sent."""
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + n / self.rate
            wait = self._next - now
        if wait > 0:
            time.sleep(wait)


class FaultProxy:
    """Forwards every request to ``upstream`` (``host:port``) unless a fault applies.

    ``injected`` records each fault applied (path, kind), ``forwarded`` each path passed on.
    As a network emulator: ``latency`` seconds pass before each response's first byte, and
    bodies are sent at most at ``per_connection`` bytes/s per request and ``total`` bytes/s
    over all of them; ``requests`` and ``bytes_sent`` count what went through.
    """

    #: Bytes sent between bandwidth checks.
    SLICE = 64 * 1024

    def __init__(self, upstream: str, *, latency: float = 0.0, per_connection: float | None = None,
                 total: float | None = None) -> None:  # fmt: skip
        self.upstream = upstream
        self.latency = latency
        self.per_connection = per_connection
        self.total = Bandwidth(total)
        self.requests = 0
        self.bytes_sent = 0
        self.faults: list[Fault] = []
        self.injected: list[tuple[str, str]] = []
        self.forwarded: list[str] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, fault: Fault) -> None:
        with self._lock:
            self.faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.injected.clear()
            self.forwarded.clear()

    def _take(self, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.match in path and fault.count != 0:
                    fault.count -= 1
                    self.injected.append((path, "error" if fault.status else "delay"))
                    return fault
            self.forwarded.append(path)
            self.requests += 1
            return None

    def _send(self, out, payload: bytes) -> None:
        """Write ``payload`` at the emulated bandwidth."""
        if not (self.per_connection or self.total.rate):
            out.write(payload)
        else:
            own = Bandwidth(self.per_connection)
            view = memoryview(payload)
            for start in range(0, len(view), self.SLICE):
                piece = view[start : start + self.SLICE]
                own.take(len(piece))
                self.total.take(len(piece))
                out.write(piece)
        with self._lock:
            self.bytes_sent += len(payload)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy._take(self.path)
                if fault is not None and fault.status is not None:
                    self.send_response(fault.status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(S3_INTERNAL_ERROR)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(S3_INTERNAL_ERROR)
                    return
                if fault is not None:
                    time.sleep(fault.delay)
                upstream = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    payload = response.read()
                    self.send_response(response.status)
                    # A HEAD answer carries the object's length, not its (empty) body's.
                    length = response.getheader("Content-Length") or "0"
                    for key, value in response.getheaders():
                        if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(key, value)
                    self.send_header(
                        "Content-Length", length if self.command == "HEAD" else str(len(payload))
                    )
                    if proxy.latency:
                        time.sleep(proxy.latency)
                    self.end_headers()
                    if self.command != "HEAD":
                        proxy._send(self.wfile, payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (a timeout under test)
                finally:
                    upstream.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        return Handler
