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


class FaultProxy:
    """Forwards every request to ``upstream`` (``host:port``) unless a fault applies.

    ``injected`` records each fault applied (path, kind), ``forwarded`` each path passed on.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
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
            return None

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
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (a timeout under test)
                finally:
                    upstream.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        return Handler
