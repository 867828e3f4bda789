"""The replica's end of the channel: proves the secret to each gateway that opens a connection and
accepts those that prove it back (frames.py), runs each request as a task of the replica's event
loop and writes its reply back as frames.

Frames written by all streams of a connection during one turn of the event loop leave in one
write: the engine answers every running request in the same step, so a step of N streams costs
one system call here, not N.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
from functools import partial
from typing import Protocol

from channel import frames, seal
from channel.frames import (Adapters, Challenge, Failed, Head, Kind, Refused, Request, State,
                            Tokens, Usage)
from channel.flow import Pausable
from channel.local import LocalLink

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # a peer that has not said a valid HELLO by then is dropped


class Reply(Pausable):
    """Writes one request's reply, in the order frames.py gives; the replica's handler owns it
    (and waits in `resumed` while the gateway has it paused)."""

    __slots__ = ("_connection", "_stream", "done")

    def __init__(self, connection: _Connection, stream: int) -> None:
        super().__init__()
        self._connection, self._stream, self.done = connection, stream, False

    def head(self, status: int, streaming: bool, replica_id: str) -> None:
        self._connection.send(Kind.HEAD, self._stream,
                              frames.encode(Head(status, streaming, replica_id)))

    def data(self, chunk: bytes, token: bool = False) -> None:
        self._connection.send(Kind.TOKEN if token else Kind.DATA, self._stream, chunk)

    def tokens(self, chunk: bytes, ids: list[int]) -> None:
        """Token-carrying bytes with the ids they carry (a request that tracks its tokens)."""
        self._connection.send(Kind.TOKENS, self._stream, frames.encode(Tokens(chunk, ids)))

    def end(self, usage: Usage) -> None:
        self.done = True
        self._connection.send(Kind.END, self._stream, frames.encode(usage))

    def failed(self, message: str) -> None:
        self.done = True
        self._connection.send(Kind.FAILED, self._stream, frames.encode(Failed(message)))


class ReplySink(Protocol):
    """Where a handler writes one request's reply: `head` once, then `data` or `tokens` any number
    of times, then `end` with the usage or `failed` (Reply over a connection, LocalReply in the
    same process)."""

    def head(self, status: int, streaming: bool, replica_id: str) -> None: ...

    def data(self, chunk: bytes, token: bool = False) -> None: ...

    def tokens(self, chunk: bytes, ids: list[int]) -> None: ...

    def end(self, usage: Usage) -> None: ...

    def failed(self, message: str) -> None: ...

    @property
    def paused(self) -> bool: ...  # the gateway's client reads nothing: wait in `resumed`

    async def resumed(self) -> None: ...


class Handler(Protocol):
    """What serves requests arriving on the channel. All three run on the server's loop.

    `admit` is called as a request arrives: None reserves a slot for it (then `serve` runs and
    `release` is called exactly once when it is over, however it ended); a string refuses it,
    naming why (the gateway tries another replica). `serve` writes the reply; it is cancelled if
    the gateway cancels the request or goes away. An exception it raises becomes FAILED.
    """

    def admit(self) -> str | None: ...

    async def serve(self, request: Request, reply: ReplySink) -> None: ...

    def release(self) -> None: ...


class _Connection(asyncio.Protocol):
    """One gateway's connection."""

    def __init__(self, server: ChannelServer) -> None:
        self._server = server
        # an anonymous peer may not make the replica hold a large frame for the HELLO timeout
        self._reader = frames.FrameReader(frames.MAX_HELLO_PAYLOAD)
        self._transport: asyncio.Transport | None = None
        self._writer = frames.FrameWriter()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._replies: dict[int, Reply] = {}
        self.gateway: str | None = None  # set by a valid HELLO
        self.held = 0
        self._nonce = secrets.token_bytes(frames.NONCE_BYTES)  # this connection's challenge
        self._opened: bytes | None = None  # the gateway's nonce, from its OPEN
        self._keys = (b"", b"")  # the connection's (to replica, to gateway), after the OPEN

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._writer.transport = self._transport
        asyncio.get_running_loop().call_later(HELLO_TIMEOUT_S, self._close_if_anonymous)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _close_if_anonymous(self) -> None:
        if self.gateway is None:
            self.close()

    def data_received(self, data: bytes) -> None:
        try:
            for kind, stream, payload in self._reader.feed(data):
                self._frame(kind, stream, payload)
        except frames.ProtocolError as exc:
            logger.warning("closing channel from %s: %s", self.gateway or "unknown peer", exc)
            if self._transport is not None:
                self._transport.close()

    def _frame(self, kind: int, stream: int, payload: bytes) -> None:
        if self._opened is None:
            if kind != Kind.OPEN:
                raise frames.ProtocolError("no OPEN first")
            opened = frames.decode(Kind.OPEN, payload)
            frames.same_version(opened, "gateway")
            self._opened = frames.nonce(opened.nonce)
            server = self._server
            proof = frames.replica_proof(server.secret, self._opened, self._nonce, server.name)
            self.send(Kind.CHALLENGE, 0, frames.encode(Challenge(self._nonce, proof)))
            self._keys = seal.keys(server.secret, self._opened, self._nonce)
            self._writer.seal(seal.Sealer(self._keys[1]))
        elif self.gateway is None:
            hello = frames.decode(Kind.HELLO, payload) if kind == Kind.HELLO else None
            if hello is None or not hmac.compare_digest(
                    hello.proof, frames.hello_proof(self._server.secret, self._nonce,
                                                    self._opened, hello.gateway)):
                raise frames.ProtocolError("no valid HELLO")
            self.gateway = hello.gateway
            self._reader.max_payload = frames.MAX_PAYLOAD
            self._reader.opener = seal.Opener(self._keys[0])
            self._server.greet(self)
        elif kind == Kind.REQUEST:
            self._request(stream, frames.decode(Kind.REQUEST, payload))
        elif kind == Kind.CANCEL:
            task = self._tasks.get(stream)
            if task is not None:
                task.cancel()
        elif kind == Kind.HELD:
            self.held = frames.decode(Kind.HELD, payload).count
        elif kind == Kind.PAUSE or kind == Kind.RESUME:
            reply = self._replies.get(stream)
            if reply is not None:  # else it ended: the gateway's word crossed its END
                reply.pause(kind == Kind.PAUSE)
        else:
            raise frames.ProtocolError(f"unexpected frame kind {kind}")

    def _request(self, stream: int, request: Request) -> None:
        handler = self._server.handler
        refusal = handler.admit()
        if refusal is not None:
            self.send(Kind.REFUSED, stream, frames.encode(Refused(refusal)))
            return
        reply = self._replies[stream] = Reply(self, stream)
        task = asyncio.get_running_loop().create_task(handler.serve(request, reply))
        self._tasks[stream] = task
        task.add_done_callback(partial(self._finished, stream, reply))

    def _finished(self, stream: int, reply: Reply, task: asyncio.Task[None]) -> None:
        self._tasks.pop(stream, None)
        self._replies.pop(stream, None)
        self._server.handler.release()
        if task.cancelled() or reply.done:
            return
        error = task.exception()
        if error is not None:
            logger.warning("request on stream %d failed: %r", stream, error)
        reply.failed(f"replica failed: {error!r}" if error else "replica ended the reply early")

    def send(self, kind: Kind, stream: int, payload: bytes) -> None:
        self._writer.send(kind, stream, payload)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.forget(self)
        for task in list(self._tasks.values()):
            task.cancel()  # the gateway is gone: abort its engine requests


class ChannelServer:
    """Listens on one address for gateways; serves their requests with `handler`. `name` is what
    the gateways know the replica by (its proof names it: another replica cannot answer for it)."""

    def __init__(self, secret: bytes, handler: Handler, name: str) -> None:
        self.secret, self.handler, self.name = secret, handler, name
        self._connections: set[_Connection] = set()
        self._local: list[LocalLink] = []
        self._server: asyncio.Server | None = None
        self._state = "ready"
        self._adapters: bytes | None = None  # the latest ADAPTERS payload (None: none sent)

    async def start(self, host: str, port: int = 0) -> int:
        """Bind and listen; returns the port (a free one when `port` is 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)
        bound: int = self._server.sockets[0].getsockname()[1]
        return bound

    def local_link(self, replica_id: str) -> LocalLink:
        """A link for a gateway in this process: its requests reach `handler` as calls."""
        link = LocalLink(replica_id, self.handler)
        link.state = self._state
        if self._adapters is not None:
            link.adapters = frames.decode(Kind.ADAPTERS, self._adapters)
        self._local.append(link)
        return link

    def greet(self, connection: _Connection) -> None:
        self._connections.add(connection)
        if self._state != "ready":
            connection.send(Kind.STATE, 0, frames.encode(State(self._state)))
        if self._adapters is not None:
            connection.send(Kind.ADAPTERS, 0, self._adapters)

    def forget(self, connection: _Connection) -> None:
        self._connections.discard(connection)

    def set_state(self, state: str) -> None:
        """Tell every gateway (now and later) the replica's state, e.g. "draining"."""
        self._state = state
        for connection in self._connections:
            connection.send(Kind.STATE, 0, frames.encode(State(state)))
        for link in self._local:
            link.set_state(state)

    def set_adapters(self, adapters: Adapters) -> None:
        """Tell every gateway (now and later) the adapters the replica holds and runs."""
        self._adapters = frames.encode(adapters)
        for connection in self._connections:
            connection.send(Kind.ADAPTERS, 0, self._adapters)
        for link in self._local:
            link.set_adapters(adapters)

    def held(self) -> int:
        """Requests the connected gateways (and one in this process) hold for this replica's
        pool."""
        return sum(connection.held for connection in self._connections) \
            + sum(link.held for link in self._local)

    def gateways(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        """Stop listening and drop every connection (their requests are cancelled)."""
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close()
        for link in self._local:
            link.stop()
