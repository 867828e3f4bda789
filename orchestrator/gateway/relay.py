"""Answers the client from a replica's reply: bytes in, bytes out.

A whole reply is sent as it came. A streamed reply's bytes are written to the client socket by
the channel's callback as each frame arrives (no task wakes per token), and the frames that carry
tokens are timed: the first gives the time to first token, the rest the gaps between tokens.
The deadline is one of inactivity: a stream may last as long as it keeps producing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from channel.client import ReplyStream
from channel.frames import AdapterRef, Head, Usage
from orchestrator.gateway.errors import GatewayError, ReplicaFailed
from orchestrator.gateway.responder import Responder
from tokenfab.errors import LinkLost, ReplyFailed


@dataclass(slots=True)
class Call:
    """One admitted OpenAI request on its way through a flow (see gateway.flows)."""

    request_id: str
    endpoint: str  # "completions" or "chat"
    body: dict[str, Any]
    tokens: list[int] | None  # the prompt's token ids, when they were counted
    responder: Responder
    started: float  # time.monotonic() at arrival
    timeout_s: float  # deadline for the first reply, and for each gap in a stream
    first_token_s: float | None = None  # time to first token (streams)
    gaps: list[float] = field(default_factory=list)  # between streamed tokens
    replica: str = ""
    reached_engine: bool = False  # a replica took it: from then on its work may have been done
    stream_error: int | None = None  # status of an error sent in-stream, after a 200 head
    echo_id: str | None = None  # the client's `x-request-id`, echoed back (request_id holds it)
    adapter: AdapterRef | None = None  # the LoRA adapter the body's `model` names

    @property
    def deadline(self) -> float:
        return self.started + self.timeout_s

    def headers(self, replica: str) -> dict[str, str]:
        return {"x-request-id": self.echo_id or self.request_id, "x-tokenfab-replica": replica}


async def relay(call: Call, stream: ReplyStream, head: Head, clock: TokenClock) -> Usage:
    """Answer `call` with the reply whose head came, and return its usage. A reply that breaks
    off raises GatewayError (ReplicaFailed when its replica failed): what happens then is the
    flow's choice, by whether the client got anything yet (`call.responder.started`). A stream
    already started goes on with the reply of a continuation (see gateway.migration)."""
    call.replica = head.replica_id
    responder = call.responder
    if not head.streaming:
        usage = await _end(stream, call.timeout_s)
        if responder.started:  # a continuation, refused
            raise GatewayError(head.status, "the stream could not be continued on another "
                               f"replica: {stream.body()[:200].decode(errors='replace')}")
        responder.send(head.status, stream.body(), call.headers(head.replica_id))
        return usage
    headers = call.headers(head.replica_id)

    def sink(chunk: bytes, token: bool) -> None:
        if not responder.started:  # the headers leave with the first bytes, not before: until
            responder.start_stream(head.status, headers)  # then another replica may answer
        responder.write(chunk)
        clock.tick(token)

    clock.touch()
    stream.attach(sink)
    responder.watch(stream.pause)  # the replica holds the reply while the client reads nothing
    try:
        usage = await _end(stream, call.timeout_s, clock)
    finally:
        responder.watch(None)
    if not responder.started:
        responder.start_stream(head.status, headers)
    responder.end_stream()
    return usage


def end_in_stream(call: Call, error: GatewayError) -> None:
    """End a started stream with `error` as its last event (its headers said 200)."""
    call.responder.write(error.sse())
    call.stream_error = error.status
    call.responder.end_stream()


async def _end(stream: ReplyStream, timeout_s: float, clock: TokenClock | None = None
               ) -> Usage:
    """The reply's usage once it ended; waits while it keeps sending (a gap over `timeout_s`
    is a timeout)."""
    try:
        while True:
            last = clock.last_activity if clock is not None else time.monotonic()
            wait = last + timeout_s - time.monotonic()
            if wait <= 0:
                stream.cancel()
                raise GatewayError(504, f"no reply from the engine within {timeout_s:g} s")
            try:
                return await asyncio.wait_for(asyncio.shield(stream.end), wait)
            except TimeoutError:
                if clock is None:
                    stream.cancel()
                    raise GatewayError(504, f"no reply from the engine within {timeout_s:g} s") \
                        from None
    except ReplyFailed as exc:
        raise ReplicaFailed(stream.replica, f"engine replica failed: {exc}; retry") from exc
    except LinkLost as exc:
        raise ReplicaFailed(stream.replica, "engine replica unavailable; retry") from exc
    except BaseException:
        stream.cancel()  # the client left (cancelled): abort the engine's request
        raise


class TokenClock:
    """Times the token-carrying frames of a stream as they reach the client, whichever replicas
    they come from."""

    __slots__ = ("_call", "_on_first", "_last_token", "last_activity")

    def __init__(self, call: Call, on_first_token: Callable[[], None] | None) -> None:
        self._call, self._on_first = call, on_first_token
        self._last_token: float | None = None
        self.last_activity = time.monotonic()

    def touch(self) -> None:
        """A reply starts: its deadline runs from now."""
        self.last_activity = time.monotonic()

    def tick(self, token: bool) -> None:
        now = time.monotonic()
        self.last_activity = now
        if not token:
            return
        if self._last_token is None:
            self._call.first_token_s = now - self._call.started
            if self._on_first is not None:
                self._on_first()
        else:
            self._call.gaps.append(now - self._last_token)
        self._last_token = now
