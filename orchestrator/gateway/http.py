"""A small HTTP/1.1 server for the gateway: httptools parses, the handler answers, bytes go out.

It is what the request path needs and no more: keep-alive, pipelined requests answered in order,
bodies capped at a size, JSON and server-sent-event replies (chunked), every phase of a request
timed out (head, body, idle time between requests, a reply left unread) and connections capped
per process and per client address (`Limits`), a client that leaves cancels the handler of its
request, and a close that drains: no new connection, an idle kept-alive one closed at once, a
busy one after its answers (`connection: close`), one that has not sent its first request yet
after that request or FIRST_REQUEST_GRACE_S, and the connections the kernel had queued on the
closing listener answered, not reset. A streamed reply's chunks are written to the socket by
whoever has them (the channel's callback), with no task switch per chunk.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections import Counter, deque
from collections.abc import Callable
from typing import cast

import httptools

from orchestrator.gateway.connection_limits import Limits
from orchestrator.gateway.responder import Handler, HttpRequest, Responder, head

logger = logging.getLogger("ray.serve").getChild("tokenfab.http")

# A drain gives a connection that has not sent its first request yet this long to send it: the
# client connected to send one (a fresh connection is not a kept-alive one the client may find
# closed and retry), so it is answered, with `connection: close`, not dropped.
FIRST_REQUEST_GRACE_S = 2.0
MAX_HEADER_BYTES = 64 << 10
MAX_PIPELINED = 16  # requests read ahead of the one being answered; more pause reading
MAX_QUEUED = 4096  # connections a closing listener takes from its queue at most (backlog 1024)
# listeners taking their queues (a task needs a holder)
_closing: set[asyncio.Task[None]] = set()
# accept(2) on Linux: errors of one pending connection, to be treated as a retry (its man page)
_ACCEPT_RETRY = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.ENETDOWN, errno.ENOPROTOOPT,
                           errno.EHOSTDOWN, errno.ENONET, errno.EHOSTUNREACH, errno.EOPNOTSUPP,
                           errno.ENETUNREACH})


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them one at a time, in order."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._pending: deque[HttpRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None  # armed while the client reads nothing
        self._flow: Callable[[bool], None] | None = None  # told when it stops and starts reading
        self._overdue: str | None = None  # a request timed out behind an answer being written
        self._paused = False
        self.closed = False
        self._answered = 0  # requests taken up for an answer
        self._reset()

    def _reset(self) -> None:
        self._started = False  # a byte of the next request has arrived
        self._head_bytes = 0  # bytes received while the request's head is not complete
        self._in_head = True
        self._url = b""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._too_large = False
        self._unsupported: str | None = None  # a Transfer-Encoding other than chunked

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a stream server's, read and write (uvloop's is not an asyncio.Transport subclass)
        self._transport = tcp = cast(asyncio.Transport, transport)
        if not self._server.admit(self, tcp.get_extra_info("peername")):
            tcp.close()  # over a cap: closed before a byte is read
            self.closed = True
            return
        tcp.set_write_buffer_limits(self._server.limits.write_buffer_bytes)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                            self._server.limits.send_buffer_bytes)
        if self._server.draining:  # taken from a closing listener's queue: as any fresh one
            self.close_if_idle()
        else:
            self._arm_idle()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
            return
        except httptools.HttpParserError as exc:
            if self._header_bytes > MAX_HEADER_BYTES:  # raised from on_header, wrapped
                self._reject(431, "request headers are too large")
            elif self._unsupported is not None:  # raised from on_headers_complete, wrapped
                self._reject(501, f"transfer coding {self._unsupported[:64]!r} is not "
                             "supported: send the body as it is, or chunked")
            else:
                self._reject(400, f"malformed HTTP request: {exc}")
            return
        if self._started and self._in_head:  # a head still incomplete: the parser buffers it
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEADER_BYTES + 8192:
                self._reject(431, "request headers are too large")

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._server.release(self)
        self._disarm_idle()
        self.resume_writing()
        if self._task is not None:
            self._task.cancel()  # the client left: its request's handler stops (and cleans up)

    def pause_writing(self) -> None:
        """The reply is buffered past `write_buffer_bytes`: the client is not reading it. Unless
        it reads within `stalled_client_timeout_s`, the connection is dropped (which cancels the
        request's handler: its engine stops generating; what was sent is charged)."""
        self._stall = asyncio.get_running_loop().call_later(
            self._server.limits.stalled_client_timeout_s, self._stalled)
        if self._flow is not None:
            self._flow(True)

    def resume_writing(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
            if self._flow is not None:
                self._flow(False)

    def watch(self, flow: Callable[[bool], None] | None) -> None:
        """Tell `flow` (True: paused) whenever the client stops or starts reading, from now (at
        once if it reads nothing now) until it is replaced or None."""
        self._flow = flow
        if flow is not None and self._stall is not None:
            flow(True)

    def _stalled(self) -> None:
        self._stall = None
        self._server.tripped("stalled_client")
        if self._transport is not None:
            logger.warning("dropping a connection whose client read nothing for %g s (%d bytes "
                           "of reply waiting)", self._server.limits.stalled_client_timeout_s,
                           self._transport.get_write_buffer_size())
            self._transport.abort()

    # -- httptools callbacks ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._started = True  # its head has a deadline from its first byte
        self._arm(self._server.limits.header_timeout_s, "header")

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > MAX_HEADER_BYTES:
            raise ValueError("request headers are too large")
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        self._headers[key] = f"{self._headers[key]}, {text}" if key in self._headers else text

    def on_headers_complete(self) -> None:
        self._in_head = False
        coding = self._headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            # llhttp takes "gzip, chunked" as chunked; a body in a coding this server does not
            # decode would reach the handler as it came (RFC 9112 6.1: answer 501)
            self._unsupported = coding
            raise ValueError("unsupported transfer coding")
        self._arm(self._server.limits.body_timeout_s, "body")  # done with the message if none
        declared = self._headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._server.max_body_bytes:
            self._too_large = True

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._server.max_body_bytes:
            self._too_large = True
        if not self._too_large:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self._disarm_idle()
        url = httptools.parse_url(self._url)
        request = HttpRequest(
            self._parser.get_method().decode("latin-1"), url.path.decode("latin-1"),
            (url.query or b"").decode("latin-1"), self._headers,
            b"".join(self._body) if not self._too_large else b"",
            self._parser.should_keep_alive(), self._too_large,
            self._parser.get_http_version() == "1.0")
        self._reset()
        self._pending.append(request)
        if len(self._pending) > MAX_PIPELINED and not self._paused:
            assert self._transport is not None  # connection_made set it: data came on it
            self._paused = True
            self._transport.pause_reading()
        if self._task is None:
            self._next()

    # -- answering ----------------------------------------------------------------------------

    def _next(self) -> None:
        if self._paused and len(self._pending) <= MAX_PIPELINED and self._overdue is None:
            assert self._transport is not None  # paused: reading had started on it
            self._paused = False
            self._transport.resume_reading()
        if not self._pending or self.closed:
            self._task = None
            if self._overdue is not None and not self.closed:
                self._reject(408, self._overdue)  # now that the answer before it is out
            elif self._server.draining:
                self.close()
            elif not self.closed and not self._started:  # no request on its way: idle
                self._arm_idle()
            return
        request = self._pending.popleft()
        self._answered += 1
        keep_alive = request.keep_alive and not request.too_large and not self._server.draining
        responder = Responder(self, keep_alive, not request.http10)
        self._task = asyncio.get_running_loop().create_task(self._answer(request, responder))

    async def _answer(self, request: HttpRequest, responder: Responder) -> None:
        try:
            await self._server.handler(request, responder)
        except asyncio.CancelledError:
            return  # the client left
        except Exception:  # noqa: BLE001 - a bug must not take the connection's others down
            logger.exception("unhandled error answering %s %s", request.method, request.path)
            if not responder.started:
                responder.send(500, b'{"error": {"message": "internal error", "type": '
                               b'"InternalServerError", "param": null, "code": 500}}')
        if not responder.finished:
            self.close()  # a stream that broke off: the client must not wait for more
        elif not responder.keep_alive:
            self.close()
        self._next()

    def write(self, data: bytes) -> None:
        transport = self._transport
        assert transport is not None  # connection_made set it before any request came
        if not self.closed and not transport.is_closing():
            transport.write(data)

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()
        self.closed = True
        self._disarm_idle()  # no deadline of a closed connection trips

    def _reject(self, status: int, message: str) -> None:
        kind = b"NotImplementedError" if status == 501 else b"BadRequestError"
        body = (b'{"error": {"message": "%s", "type": "%s", "param": null, "code": %d}}'
                % (message.replace('"', "'").encode(), kind, status))
        self.write(head(status, {}, b"content-type: application/json\r\ncontent-length: %d\r\n"
                         b"connection: close\r\n" % len(body)) + body)
        self.close()

    @property
    def waiting(self) -> int:
        """Requests received and not yet being answered; while the server drains, a connection
        still in its first request's grace counts as one (its request is on its way)."""
        expected = self._server.draining and not self._answered and not self.closed \
            and self._task is None
        return len(self._pending) + (1 if expected and not self._pending else 0)

    def close_if_idle(self) -> None:
        """Close now if no request is being answered, waiting, or partly received (the server
        drains; one partly received is answered with `connection: close` if it completes). A
        connection that has not sent its first request gets FIRST_REQUEST_GRACE_S to send it."""
        if self._nothing_in_progress():
            if self._answered:
                self.close()
            elif not self.closed:
                self._disarm_idle()
                self._idle = asyncio.get_running_loop().call_later(FIRST_REQUEST_GRACE_S,
                                                                   self.close_if_idle_now)

    def close_if_idle_now(self) -> None:
        """The first request's grace is over: close unless a request came (see close_if_idle)."""
        self._idle = None
        if self._nothing_in_progress():
            self.close()

    def _nothing_in_progress(self) -> bool:
        """No request being answered, waiting, or partly received."""
        return self._task is None and not self._pending and not self._started

    def _arm_idle(self) -> None:
        self._disarm_idle()
        self._idle = asyncio.get_running_loop().call_later(self._server.limits.idle_timeout_s,
                                                           self.close)

    def _arm(self, seconds: float, phase: str) -> None:
        """The request's `phase` (head or body) must be in within `seconds`."""
        self._disarm_idle()
        self._idle = asyncio.get_running_loop().call_later(seconds, self._timed_out, phase,
                                                           seconds)

    def _timed_out(self, phase: str, seconds: float) -> None:
        self._idle = None
        self._server.tripped(f"{phase}_timeout")
        message = f"the request's {phase} did not arrive within {seconds:g} s"
        if self._task is None and not self._pending:
            self._reject(408, message)
        else:  # the answers before it go out first; nothing more is read meanwhile
            self._overdue = message
            if not self._paused and self._transport is not None:
                self._paused = True
                self._transport.pause_reading()

    def _disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None


class HttpServer:
    """Serves `handler` on one address; several processes may share it (SO_REUSEPORT)."""

    def __init__(self, handler: Handler, max_body_bytes: int, limits: Limits = Limits(),
                 on_limit: Callable[[str], None] | None = None) -> None:
        self.handler, self.max_body_bytes, self.limits = handler, max_body_bytes, limits
        self._on_limit = on_limit  # called with one of LIMIT_REASONS when a limit trips
        self._server: asyncio.Server | None = None
        self._listeners: list[socket.socket] = []
        self.connections: set[_Connection] = set()
        self._per_client: Counter[str] = Counter()
        self._client: dict[_Connection, str] = {}
        self.draining = False

    def admit(self, connection: _Connection, peer: object) -> bool:
        """Count a new connection in, unless it is over a cap (then it is counted as tripped)."""
        client = peer[0] if isinstance(peer, tuple) and peer else ""
        cap = self.limits.max_connections_per_client
        if len(self.connections) >= self.limits.max_connections:
            self.tripped("max_connections")
            return False
        if cap is not None and client and self._per_client[client] >= cap:
            self.tripped("max_connections_per_client")
            return False
        self.connections.add(connection)
        if client:
            self._client[connection] = client
            self._per_client[client] += 1
        return True

    def release(self, connection: _Connection) -> None:
        self.connections.discard(connection)
        client = self._client.pop(connection, None)
        if client is not None:
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]

    def tripped(self, reason: str) -> None:
        if self._on_limit is not None:
            self._on_limit(reason)

    async def start(self, host: str, port: int) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port,
                                                reuse_port=True, backlog=1024)
        # a descriptor of each listening socket of our own: closing the server's leaves the
        # socket listening until the connections queued on it are taken (`_take_queued`)
        self._listeners = [socket.fromfd(s.fileno(), s.family, s.type)
                           for s in self._server.sockets]
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    def waiting(self) -> int:
        """Requests received on open connections and not yet handed to the handler."""
        return sum(connection.waiting for connection in self.connections)

    def close(self) -> None:
        """Drain: take no new connection; close idle ones now and busy ones once their answers
        are out (each says `connection: close`). Clients reconnect to the port's other
        listeners."""
        self.draining = True
        if self._server is not None:
            self._server.close()
            self._server = None
            listeners, self._listeners = self._listeners, []
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop to serve them on: closed, as the server's own were
                _close_all(listeners)
            else:
                task = loop.create_task(self._take_queued(listeners))
                _closing.add(task)

                def done(task: asyncio.Task[None]) -> None:  # also if cancelled before it started
                    _closing.discard(task)
                    _close_all(listeners)

                task.add_done_callback(done)
        for connection in list(self.connections):
            connection.close_if_idle()

    async def _take_queued(self, listeners: list[socket.socket]) -> None:
        """Answer the connections the kernel queued on this listener, then close it.

        Listeners sharing a port each have an accept queue of their own, and a listening socket
        that closes resets the connections in its queue: under load, one a drain would lose
        each time. So the event loop's descriptor is closed first (the server stops accepting),
        then the queue is taken here until it is empty and the socket closes with it empty:
        only what arrives in the microseconds between, and handshakes not yet complete on it,
        can still be reset. Connections taken here are served as any other while draining
        (`connection: close`). The sockets are closed when this ends, however it ends
        (`close`)."""
        loop = asyncio.get_running_loop()
        for sock in listeners:
            sock.setblocking(False)
            for _ in range(MAX_QUEUED):
                try:
                    conn, _ = sock.accept()
                except (BlockingIOError, InterruptedError):  # the queue is empty
                    break
                except OSError as exc:
                    if exc.errno in _ACCEPT_RETRY:  # that client's error; the queue goes on
                        continue
                    logger.warning("taking the connections queued on a closing listener: %r",
                                   exc)
                    break
                try:
                    await loop.connect_accepted_socket(lambda: _Connection(self), conn)
                except OSError:
                    conn.close()
            sock.close()  # at once: what comes in after the last accept is reset


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()
