"""What a handler of the gateway's HTTP server gets: the request, parsed, and a `Responder` that
writes its answer (one JSON body, or a stream of server-sent events, chunked) to the connection."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Protocol


class Sink(Protocol):
    """The connection a responder writes to (the HTTP server's)."""

    @property
    def closed(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    def watch(self, flow: Callable[[bool], None] | None) -> None: ...


class HttpRequest:
    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive", "too_large",
                 "http10")

    def __init__(self, method: str, path: str, query: str, headers: dict[str, str], body: bytes,
                 keep_alive: bool, too_large: bool, http10: bool = False) -> None:
        self.method, self.path, self.query, self.headers = method, path, query, headers
        self.body, self.keep_alive, self.too_large = body, keep_alive, too_large
        self.http10 = http10  # no chunked encoding: a stream ends with the connection


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


def head(status: int, headers: dict[str, str], extra: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\nserver: tokenfab\r\n" % (status, _reason(status))]
    for name, value in headers.items():
        lines.append(f"{name}: {value}\r\n".encode("latin-1"))
    lines.append(extra)
    lines.append(b"\r\n")
    return b"".join(lines)


class Responder:
    """Answers one request: either `send` once, or `start_stream`, `write`* and `end_stream`.
    Writing after the client left does nothing (`closed` says so)."""

    __slots__ = ("_connection", "_keep_alive", "_chunked", "started", "finished", "status")

    def __init__(self, connection: Sink, keep_alive: bool, chunked: bool) -> None:
        self._connection, self._keep_alive, self._chunked = connection, keep_alive, chunked
        self.started = self.finished = False
        self.status = 0

    @property
    def closed(self) -> bool:
        return self._connection.closed

    def send(self, status: int, body: bytes, headers: dict[str, str] | None = None,
             content_type: str = "application/json") -> None:
        self.started = self.finished = True
        self.status = status
        extra = b"content-type: %s\r\ncontent-length: %d\r\n" % (content_type.encode(), len(body))
        if not self._keep_alive:
            extra += b"connection: close\r\n"
        self._connection.write(head(status, headers or {}, extra) + body)

    def start_stream(self, status: int, headers: dict[str, str] | None = None,
                     content_type: str = "text/event-stream") -> None:
        self.started, self.status = True, status
        extra = b"content-type: %s\r\ncache-control: no-cache\r\n" % content_type.encode()
        if self._chunked:
            extra += b"transfer-encoding: chunked\r\n"
        else:  # an HTTP/1.0 client: the end of the stream is the end of the connection
            self._keep_alive = False
        if not self._keep_alive:
            extra += b"connection: close\r\n"
        self._connection.write(head(status, headers or {}, extra))

    def write(self, chunk: bytes) -> None:
        if chunk:
            self._connection.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self._chunked
                                   else chunk)

    def end_stream(self) -> None:
        self.finished = True
        if self._chunked:
            self._connection.write(b"0\r\n\r\n")

    def watch(self, flow: Callable[[bool], None] | None) -> None:
        """While streaming: `flow(True)` when the client stops reading (its connection holds
        more than the write buffer's mark), `flow(False)` when it reads again; None stops it."""
        self._connection.watch(flow)

    @property
    def keep_alive(self) -> bool:
        return self._keep_alive


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]
