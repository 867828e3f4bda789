"""Backpressure on one reply (channel/flow.py): a paused reply's handler stops writing while the
other replies on the same link go on; resumed, it finishes whole. Over a socket and in-process;
and the HTTP side that says when a client stops and starts reading."""

from __future__ import annotations

import asyncio
import time

import pytest

from channel.client import ReplicaLink
from channel.frames import Request, Usage
from channel.server import ChannelServer, ReplySink
from orchestrator.gateway.connection_limits import Limits
from orchestrator.gateway.http import HttpServer
from orchestrator.gateway.responder import HttpRequest, Responder
from tests.unit.replicas import SECRET

CHUNKS = 400


class Honouring:
    """Streams CHUNKS chunks, one a millisecond, waiting while its reply is paused (as
    pools.deployment does); counts what each request wrote."""

    def __init__(self) -> None:
        self.written: dict[str, int] = {}

    def admit(self) -> str | None:
        return None

    def release(self) -> None:
        pass

    async def serve(self, request: Request, reply: ReplySink) -> None:
        name = request.body.decode()
        self.written[name] = 0
        reply.head(200, True, "r1")
        for _ in range(CHUNKS):
            await asyncio.sleep(0.001)
            reply.data(b"data: x\n\n", True)
            self.written[name] += 1
            if reply.paused:
                await reply.resumed()
        reply.end(Usage(1, CHUNKS, 0))


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("link", ["socket", "local"])
def test_a_paused_reply_waits_while_the_others_go_on(link: str) -> None:
    async def scenario() -> None:
        handler = Honouring()
        server = ChannelServer(SECRET, handler, "r1")
        if link == "socket":
            port = await server.start("127.0.0.1")
            replica = ReplicaLink("r1", "127.0.0.1", port, SECRET, "gw-1")
            await replica.connect()
        else:
            replica = server.local_link("r1")  # type: ignore[assignment]
        slow, fast = replica.open(Request("completions", b"slow")), \
            replica.open(Request("completions", b"fast"))
        got = {"slow": 0, "fast": 0}
        slow.attach(lambda chunk, token: got.__setitem__("slow", got["slow"] + 1))
        fast.attach(lambda chunk, token: got.__setitem__("fast", got["fast"] + 1))
        await until(lambda: handler.written.get("slow", 0) >= 10)
        slow.pause(True)
        held = handler.written["slow"]
        assert await fast.end == Usage(1, CHUNKS, 0)  # the other reply on the link goes on
        assert got["fast"] == CHUNKS
        # the paused one wrote what it had in hand when the word came (one turn on the socket),
        # and nothing after
        assert handler.written["slow"] <= held + 2 and not slow.end.done()
        slow.pause(False)
        assert await slow.end == Usage(1, CHUNKS, 0) and got["slow"] == CHUNKS
        replica.close()
        server.close()
    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_stream_is_told_when_its_client_stops_and_starts_reading() -> None:
    """Past the write buffer's mark the handler is told to pause; once the client reads, to go
    on; what the server holds meanwhile stays near the mark, not what the handler could make."""
    told: list[bool] = []

    async def firehose(request: HttpRequest, responder: Responder) -> None:
        paused = asyncio.Event()
        going = asyncio.Event()
        going.set()

        def flow(pause: bool) -> None:
            told.append(pause)
            (going.clear if pause else going.set)()
            (paused.set if pause else paused.clear)()

        responder.start_stream(200)
        responder.watch(flow)
        for _ in range(3000):  # 12 MB if nothing held it back
            await going.wait()
            responder.write(b"data: " + b"x" * 4000 + b"\n\n")
            await asyncio.sleep(0)
        responder.watch(None)
        responder.end_stream()

    async def scenario() -> None:
        server = HttpServer(firehose, 1024, Limits(stalled_client_timeout_s=30))
        port = await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
        await until(lambda: told == [True])
        connection = next(iter(server.connections))
        held = connection._transport.get_write_buffer_size()
        assert held < Limits().write_buffer_bytes + 8192, held  # one write past the mark
        received = 0
        while told[-1]:  # the client reads: the handler is told to go on
            received += len(await reader.read(1 << 16))
        assert received and told[:2] == [True, False]
        while not (await reader.read(1 << 20)).endswith(b"0\r\n\r\n"):
            pass  # read to the end: the stream finishes whole
        writer.close()
        server.close()
    asyncio.run(asyncio.wait_for(scenario(), 20))
