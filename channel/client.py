"""The gateway's end of the channel: one link per replica, on which requests are opened as
streams. Reply bytes are handed to each stream's sink as frames arrive, in the link's own
callback: relaying a token wakes no task.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import secrets
import socket
import time
from collections.abc import Callable

from channel import frames, seal
from channel.frames import (Adapters, Head, Held, Hello, Kind, Open, Refused, Request, Usage,
                            hello_proof)
from tokenfab.errors import LinkLost, ReplyFailed

Sink = Callable[[bytes, bool], None]  # (reply bytes, carries tokens)


class ReplyStream:
    """One request's reply as it arrives. `head` resolves to a Head, or to Refused when the
    replica did not take the request; `end` to the reply's Usage. Both fail with LinkLost or
    ReplyFailed. Bytes go to the sink once one is attached, and are kept until then. `ids` are
    the generated tokens of the bytes received so far (requests that track their tokens)."""

    __slots__ = ("id", "_link", "head", "end", "_sink", "_kept", "ids", "_paused")

    def __init__(self, stream_id: int, link: ReplicaLink, loop: asyncio.AbstractEventLoop) -> None:
        self.id, self._link = stream_id, link
        self.head: asyncio.Future[Head | Refused] = loop.create_future()
        self.end: asyncio.Future[Usage] = loop.create_future()
        self._sink: Sink | None = None
        self._kept: list[tuple[bytes, bool]] = []
        self.ids: list[int] = []
        self._paused = False

    @property
    def replica(self) -> str:
        return self._link.replica

    def attach(self, sink: Sink) -> None:
        """Send the reply's bytes to `sink` from now on (what came before goes first)."""
        kept, self._kept = self._kept, []
        for chunk, token in kept:
            sink(chunk, token)
        self._sink = sink

    def body(self) -> bytes:
        """The bytes received so far, when no sink is attached (a whole reply, after `end`)."""
        return b"".join(chunk for chunk, _ in self._kept)

    def pause(self, paused: bool) -> None:
        """Ask the replica to hold the reply (True) while its client reads nothing, or to go on
        (False) once it reads again (channel.flow). No-op once it ended."""
        if paused != self._paused and not self.end.done():
            self._paused = paused
            self._link.pause(self, paused)

    def cancel(self) -> None:
        """Stop the request on the replica (no-op once it ended)."""
        if not self.end.done():
            self._link.cancel(self)
            self._fail(LinkLost("cancelled"))

    def _data(self, chunk: bytes, token: bool) -> None:
        if self._sink is not None:
            self._sink(chunk, token)
        else:
            self._kept.append((chunk, token))

    def _fail(self, error: Exception) -> None:
        for future in (self.head, self.end):
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: nobody may be waiting on the end any more


class ReplicaLink(asyncio.Protocol):
    """The gateway's connection to one replica. Use from one event loop."""

    def __init__(self, replica: str, host: str, port: int, secret: bytes, gateway: str) -> None:
        self.replica, self.host, self.port = replica, host, port
        self._secret, self._gateway = secret, gateway
        self.state = "new"  # -> connecting -> ready | draining -> closed
        self._closed_at = 0.0
        self._transport: asyncio.Transport | None = None
        # a peer that has not challenged yet has proved nothing: small frames until it has
        self._reader = frames.FrameReader(frames.MAX_HELLO_PAYLOAD)
        self._streams: dict[int, ReplyStream] = {}
        self._ids = itertools.count(1)
        self._writer = frames.FrameWriter()
        self._challenge: asyncio.Future[bytes] | None = None  # the replica's nonce, at connect
        self._nonce = b""  # this connection's, in OPEN (drawn by connect)
        self.on_state: Callable[[ReplicaLink], None] | None = None
        self.adapters: Adapters | None = None  # as the replica last said (None: it has not)
        self.on_adapters: Callable[[ReplicaLink], None] | None = None

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def closed_for_s(self) -> float:
        """Seconds since the link closed (0 while it is not closed)."""
        return time.monotonic() - self._closed_at if self.state == "closed" else 0.0

    async def connect(self, timeout_s: float = 5.0) -> None:
        """Connect, check the replica's proof of the secret and give the gateway's (frames.py);
        LinkLost if the replica cannot be reached, does not prove the secret under its name, or
        does not answer within `timeout_s`. Nothing is sent to a peer that failed its proof."""
        if self.state != "new":
            raise LinkLost(f"replica {self.replica} link is {self.state}: a link connects once")
        self.state = "connecting"
        self._nonce = secrets.token_bytes(frames.NONCE_BYTES)
        loop = asyncio.get_running_loop()
        self._challenge = loop.create_future()
        try:
            nonce = await asyncio.wait_for(self._connected(loop), timeout_s)
        except (TimeoutError, OSError, LinkLost) as exc:
            if not self._challenge.done():
                self._challenge.cancel()  # nobody waits for it any more
            self.close()
            self.state, self._closed_at = "closed", time.monotonic()
            raise LinkLost(f"replica {self.replica} at {self.host}:{self.port}: {exc!r}") from exc
        proof = hello_proof(self._secret, nonce, self._nonce, self._gateway)
        self._send(Kind.HELLO, 0, frames.encode(Hello(proof, self._gateway)))
        self._writer.seal(seal.Sealer(seal.keys(self._secret, self._nonce, nonce)[0]))
        if self.state == "connecting":  # a STATE frame may not have come yet: ready until told
            self.state = "ready"

    def open(self, request: Request) -> ReplyStream:
        if self.state not in ("ready", "draining"):
            raise LinkLost(f"replica {self.replica} link is {self.state}")
        stream = ReplyStream(next(self._ids), self, asyncio.get_running_loop())
        self._streams[stream.id] = stream
        self._send(Kind.REQUEST, stream.id, frames.encode(request))
        return stream

    async def _connected(self, loop: asyncio.AbstractEventLoop) -> bytes:
        await loop.create_connection(lambda: self, self.host, self.port)
        challenge = self._challenge
        assert challenge is not None  # connect sets it before it dials
        return await challenge

    def cancel(self, stream: ReplyStream) -> None:
        if self._streams.pop(stream.id, None) is not None:
            self._send(Kind.CANCEL, stream.id)

    def pause(self, stream: ReplyStream, paused: bool) -> None:
        if stream.id in self._streams:
            self._send(Kind.PAUSE if paused else Kind.RESUME, stream.id)

    def send_held(self, count: int) -> None:
        if self.state in ("ready", "draining"):
            self._send(Kind.HELD, 0, frames.encode(Held(count)))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        else:
            self.state, self._closed_at = "closed", time.monotonic()

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._writer.transport = self._transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send(Kind.OPEN, 0, frames.encode(Open(self._nonce)))

    def data_received(self, data: bytes) -> None:
        try:
            for kind, stream_id, payload in self._reader.feed(data):
                self._frame(kind, stream_id, payload)
        except frames.ProtocolError:
            if self._transport is not None:
                self._transport.close()

    def _frame(self, kind: int, stream_id: int, payload: bytes) -> None:
        challenge = self._challenge
        if challenge is None or challenge.cancelled():  # connect gave up: nothing is expected
            raise frames.ProtocolError(f"frame kind {kind} on a link not connecting")
        if not challenge.done():
            if kind != Kind.CHALLENGE:
                raise frames.ProtocolError("no challenge first")
            said = frames.decode(Kind.CHALLENGE, payload)
            frames.same_version(said, "replica")
            nonce = frames.nonce(said.nonce)
            if not hmac.compare_digest(said.proof, frames.replica_proof(
                    self._secret, self._nonce, nonce, self.replica)):
                challenge.set_exception(LinkLost(f"replica {self.replica} at {self.host}:"
                                                 f"{self.port} did not prove the secret"))
                raise frames.ProtocolError("the replica's proof failed")
            challenge.set_result(nonce)
            self._reader.max_payload = frames.MAX_PAYLOAD
            self._reader.opener = seal.Opener(seal.keys(self._secret, self._nonce, nonce)[1])
            return
        if kind == Kind.CHALLENGE:
            raise frames.ProtocolError("a second challenge")
        if kind == Kind.STATE:
            self.state = frames.decode(Kind.STATE, payload).state
            if self.on_state is not None:
                self.on_state(self)
            return
        if kind == Kind.ADAPTERS:
            self.adapters = frames.decode(Kind.ADAPTERS, payload)
            if self.on_adapters is not None:
                self.on_adapters(self)
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            return  # cancelled by us; the replica's last frames cross the CANCEL
        if kind == Kind.TOKEN or kind == Kind.DATA:
            stream._data(payload, kind == Kind.TOKEN)
        elif kind == Kind.TOKENS:
            tokens = frames.decode(Kind.TOKENS, payload)
            stream.ids += tokens.ids
            stream._data(tokens.chunk, True)
        elif kind == Kind.HEAD:
            stream.head.set_result(frames.decode(Kind.HEAD, payload))
        elif kind == Kind.END:
            del self._streams[stream_id]
            stream.end.set_result(frames.decode(Kind.END, payload))
        elif kind == Kind.REFUSED:
            del self._streams[stream_id]
            stream.head.set_result(frames.decode(Kind.REFUSED, payload))
        elif kind == Kind.FAILED:
            del self._streams[stream_id]
            stream._fail(ReplyFailed(frames.decode(Kind.FAILED, payload).message))
        else:
            raise frames.ProtocolError(f"unexpected frame kind {kind}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.state, self._closed_at = "closed", time.monotonic()
        if self._challenge is not None and not self._challenge.done():
            self._challenge.set_exception(LinkLost("closed before its challenge"))
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._fail(LinkLost(f"replica {self.replica} connection lost"))
        if self.on_state is not None:
            self.on_state(self)

    def _send(self, kind: Kind, stream_id: int, payload: bytes = b"") -> None:
        self._writer.send(kind, stream_id, payload)
