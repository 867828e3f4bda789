"""The channel to the replica in the gateway's own process: the same requests and replies as a
`ReplicaLink`, passed as calls on the one event loop instead of frames on a socket.

A pool replica that also serves the gateway (`gateway.colocate`) answers the requests it places
on itself this way: no frame is encoded, no socket written, no other process woken. What it
places on other replicas still goes over their `ReplicaLink`s.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from channel.client import ReplyStream
from channel.flow import Pausable
from channel.frames import Adapters, Head, Refused, Request, Usage
from tokenfab.errors import LinkLost, ReplyFailed

if TYPE_CHECKING:
    from channel.server import Handler

logger = logging.getLogger(__name__)


class LocalReply(Pausable):
    """The handler's side of one local request: what `channel.server.Reply` writes as frames,
    delivered to the gateway's `ReplyStream` at once (paused by a call, as PAUSE would)."""

    __slots__ = ("_link", "_stream", "done")

    def __init__(self, link: LocalLink, stream: ReplyStream) -> None:
        super().__init__()
        self._link, self._stream, self.done = link, stream, False

    def head(self, status: int, streaming: bool, replica_id: str) -> None:
        if self._open():
            self._stream.head.set_result(Head(status, streaming, replica_id))

    def data(self, chunk: bytes, token: bool = False) -> None:
        if self._open():
            self._stream._data(chunk, token)

    def tokens(self, chunk: bytes, ids: list[int]) -> None:
        if self._open():
            self._stream.ids += ids
            self._stream._data(chunk, True)

    def _open(self) -> bool:
        """Whether the gateway still listens (as a socket's frames for a cancelled stream are
        dropped by `ReplicaLink`)."""
        return self._stream.id in self._link._streams

    def end(self, usage: Usage) -> None:
        self.done = True
        if self._link._streams.pop(self._stream.id, None) is not None:
            self._stream.end.set_result(usage)

    def failed(self, message: str) -> None:
        self.done = True
        if self._link._streams.pop(self._stream.id, None) is not None:
            self._stream._fail(ReplyFailed(message))


class LocalLink:
    """The gateway's link to the replica whose handler runs in this process (the interface of
    `channel.client.ReplicaLink` that `PoolDispatcher` uses). Made and kept by the replica's
    `ChannelServer`, which tells it the replica's state and counts the requests it holds."""

    def __init__(self, replica: str, handler: Handler) -> None:
        self.replica, self._handler = replica, handler
        self.state = "ready"  # -> draining -> closed, as the replica's server says
        self.held = 0  # requests the gateway of this process holds for the pool
        self._streams: dict[int, ReplyStream] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._replies: dict[int, LocalReply] = {}
        self._ids = itertools.count(1)
        self.on_state: Callable[[LocalLink], None] | None = None
        self.adapters: Adapters | None = None  # as the replica last said (None: it has not)
        self.on_adapters: Callable[[LocalLink], None] | None = None

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    def closed_for_s(self) -> float:
        return 0.0  # never reopened: it lives as long as the replica

    def open(self, request: Request) -> ReplyStream:
        if self.state not in ("ready", "draining"):
            raise LinkLost(f"replica {self.replica} link is {self.state}")
        loop = asyncio.get_running_loop()
        stream = ReplyStream(next(self._ids), self, loop)  # type: ignore[arg-type]
        refusal = self._handler.admit()
        if refusal is not None:
            stream.head.set_result(Refused(refusal))
            return stream
        self._streams[stream.id] = stream
        reply = self._replies[stream.id] = LocalReply(self, stream)
        task = loop.create_task(self._handler.serve(request, reply))
        self._tasks[stream.id] = task
        task.add_done_callback(partial(self._finished, stream, reply))
        return stream

    def cancel(self, stream: ReplyStream) -> None:
        if self._streams.pop(stream.id, None) is not None:
            task = self._tasks.get(stream.id)
            if task is not None:
                task.cancel()

    def pause(self, stream: ReplyStream, paused: bool) -> None:
        reply = self._replies.get(stream.id)
        if reply is not None:
            reply.pause(paused)

    def send_held(self, count: int) -> None:
        self.held = count

    def set_state(self, state: str) -> None:
        self.state = state
        if self.on_state is not None:
            self.on_state(self)

    def set_adapters(self, adapters: Adapters) -> None:
        self.adapters = adapters
        if self.on_adapters is not None:
            self.on_adapters(self)

    def close(self) -> None:
        """The gateway lets go of the link (it is the server's to stop): nothing to do."""

    def stop(self) -> None:
        """The replica stops: its requests here are cancelled (the gateway retries or continues
        them elsewhere, as for a lost connection)."""
        self.set_state("closed")
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._fail(LinkLost(f"replica {self.replica} stopped"))
        for task in list(self._tasks.values()):
            task.cancel()

    def _finished(self, stream: ReplyStream, reply: LocalReply, task: asyncio.Task[None]) -> None:
        """As `channel.server._Connection._finished`: the slot is freed exactly once, and a
        handler that ended without an end becomes a failed reply."""
        self._tasks.pop(stream.id, None)
        self._replies.pop(stream.id, None)
        self._handler.release()
        if task.cancelled():  # by `cancel` or `stop` (the stream is gone), or from elsewhere
            if self._streams.pop(stream.id, None) is not None:
                stream._fail(LinkLost(f"replica {self.replica} cancelled the request"))
            return
        if reply.done:
            return
        error = task.exception()
        if error is not None:
            logger.warning("local request %d failed: %r", stream.id, error)
        reply.failed(f"replica failed: {error!r}" if error else "replica ended the reply early")
