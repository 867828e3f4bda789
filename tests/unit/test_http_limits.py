"""What one client can make the gateway's HTTP server hold, and for how long, on real loopback
sockets: a head or a body that does not arrive within its deadline gets a 408 and a closed
connection (a trickled head too: slowloris), an idle kept-alive connection is closed, and the
connections over a cap (per process, per client address) are closed at once; each trip is
reported with its reason. A request within its deadlines is answered as before."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from orchestrator.gateway.http import HttpServer
from orchestrator.gateway.responder import HttpRequest, Responder
from orchestrator.gateway.connection_limits import LIMIT_REASONS, Limits

GET = b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"


async def answer(request: HttpRequest, responder: Responder) -> None:
    responder.send(200, b"{}")


async def serving(limits: Limits) -> tuple[HttpServer, list[str], int]:
    tripped: list[str] = []
    server = HttpServer(answer, 1024, limits, tripped.append)
    return server, tripped, await server.start("127.0.0.1", 0)


@pytest.fixture(params=[asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def loop_factory(request):
    """Both event loops the gateway may run on (Serve's replicas run uvloop)."""
    return request.param


def run(coro, loop_factory):
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(asyncio.wait_for(coro, 10))


async def connect(port: int, source: str = "127.0.0.1"
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sent until it closed; fails if it had not closed by `seconds`."""
    return await asyncio.wait_for(reader.read(), seconds)


async def answered(port: int, source: str = "127.0.0.1") -> bool:
    reader, writer = await connect(port, source)
    writer.write(GET)
    reply = await asyncio.wait_for(reader.read(4096), 2)
    writer.close()
    return reply.startswith(b"HTTP/1.1 200")


def test_a_trickled_head_gets_408_at_its_deadline_while_others_are_answered(loop_factory) -> None:
    async def scenario() -> None:
        server, tripped, port = await serving(Limits(header_timeout_s=0.4))
        reader, writer = await connect(port)
        began = time.monotonic()
        writer.write(b"GET /x HTTP/1.1\r\n")

        async def trickle() -> None:
            for _ in range(40):  # one header byte every 50 ms: never a whole head
                await asyncio.sleep(0.05)
                if writer.is_closing():
                    return
                writer.write(b"x")

        dripping = asyncio.create_task(trickle())
        assert await answered(port)  # a fresh request meanwhile
        reply = await closed_within(reader, 2)
        dripping.cancel()
        assert reply.startswith(b"HTTP/1.1 408") and b"head" in reply
        assert 0.35 < time.monotonic() - began < 1.5
        assert tripped == ["header_timeout"]
        writer.close()
        server.close()

    run(scenario(), loop_factory)


def test_a_body_that_stops_arriving_gets_408_at_its_deadline(loop_factory) -> None:
    async def scenario() -> None:
        server, tripped, port = await serving(Limits(body_timeout_s=0.3))
        reader, writer = await connect(port)
        writer.write(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 10\r\n\r\nabc")
        reply = await closed_within(reader, 2)
        assert reply.startswith(b"HTTP/1.1 408") and b"body" in reply
        assert tripped == ["body_timeout"]
        writer.close()
        server.close()

    run(scenario(), loop_factory)


def test_a_slow_request_within_its_deadlines_is_answered(loop_factory) -> None:
    async def scenario() -> None:
        server, tripped, port = await serving(Limits(header_timeout_s=1.0, body_timeout_s=1.0))
        reader, writer = await connect(port)
        for piece in (b"POST /x HTTP/1.1\r\n", b"host: t\r\n", b"content-length: 4\r\n\r\n",
                      b"ab", b"cd"):
            writer.write(piece)
            await asyncio.sleep(0.1)
        reply = await asyncio.wait_for(reader.read(4096), 2)
        assert reply.startswith(b"HTTP/1.1 200") and tripped == []
        writer.close()
        server.close()

    run(scenario(), loop_factory)


def test_idle_connections_are_closed_after_the_idle_timeout(loop_factory) -> None:
    async def scenario() -> None:
        server, tripped, port = await serving(Limits(idle_timeout_s=0.3))
        silent_reader, silent = await connect(port)  # never sends a byte
        reader, writer = await connect(port)
        writer.write(GET)
        first = await asyncio.wait_for(reader.read(4096), 2)
        assert first.startswith(b"HTTP/1.1 200")
        began = time.monotonic()
        assert await closed_within(reader, 2) == b""  # kept alive, then idle: closed
        assert await closed_within(silent_reader, 2) == b""
        assert time.monotonic() - began < 1.0
        assert tripped == []  # an idle timeout is the normal end of a kept-alive connection
        writer.close()
        silent.close()
        server.close()

    run(scenario(), loop_factory)


def test_connections_over_a_cap_are_closed_at_once_and_counted(loop_factory) -> None:
    async def scenario() -> None:
        server, tripped, port = await serving(Limits(max_connections=3,
                                                     max_connections_per_client=2))
        held = [await connect(port) for _ in range(2)]  # 127.0.0.1's two
        for _, writer in held:
            writer.write(GET)
        for reader, _ in held:
            assert (await asyncio.wait_for(reader.read(4096), 2)).startswith(b"HTTP/1.1 200")
        third_reader, third = await connect(port)  # a third from 127.0.0.1
        assert await closed_within(third_reader, 2) == b""
        assert tripped == ["max_connections_per_client"]
        other = await connect(port, "127.0.0.2")  # another address: the process's third
        other[1].write(GET)
        assert (await asyncio.wait_for(other[0].read(4096), 2)).startswith(b"HTTP/1.1 200")
        fourth_reader, fourth = await connect(port, "127.0.0.3")
        assert await closed_within(fourth_reader, 2) == b""
        assert tripped == ["max_connections_per_client", "max_connections"]
        held[0][1].close()  # one of 127.0.0.1's ends: it may open another
        await asyncio.sleep(0.1)
        assert len(server.connections) == 2
        assert await answered(port)
        assert set(tripped) <= set(LIMIT_REASONS)
        for writer in (held[1][1], other[1], third, fourth):
            writer.close()
        server.close()

    run(scenario(), loop_factory)


def test_a_reply_the_client_does_not_read_is_dropped_after_the_stall_timeout(loop_factory) -> None:
    """A client that reads nothing: once 64 KiB of its reply wait in the server and it still
    reads nothing for the stall timeout, the connection is dropped and the handler cancelled;
    a client that reads slowly but steadily is not."""
    written, cancelled = [0], asyncio.Event()

    async def firehose(request: HttpRequest, responder: Responder) -> None:
        responder.start_stream(200)
        try:
            while not responder.closed:
                responder.write(b"data: " + b"x" * 4000 + b"\n\n")
                written[0] += 1
                await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def scenario() -> None:
        tripped: list[str] = []
        server = HttpServer(firehose, 1024, Limits(stalled_client_timeout_s=0.5), tripped.append)
        port = await server.start("127.0.0.1", 0)
        reader, writer = await connect(port)
        writer.write(GET)
        began = time.monotonic()
        await asyncio.wait_for(cancelled.wait(), 8)  # the kernel's buffers fill first
        assert tripped == ["stalled_client"] and time.monotonic() - began >= 0.5
        held = written[0] * 4008  # what it wrote, all of it held somewhere: kernel and server
        assert held < 64 << 20, held
        writer.close()
        server.close()

    run(scenario(), loop_factory)


def test_a_pipelined_request_has_its_deadline_and_waits_for_the_answer_before_it(
        loop_factory) -> None:
    """One write holds a whole request and the start of the next: the first is answered in
    full, then the second, whose head never completes, gets its 408 at its own deadline."""
    async def slow(request: HttpRequest, responder: Responder) -> None:
        await asyncio.sleep(0.5)  # longer than the next request's header deadline
        responder.send(200, b"{}")

    async def scenario() -> None:
        tripped: list[str] = []
        server = HttpServer(slow, 1024, Limits(header_timeout_s=0.2), tripped.append)
        port = await server.start("127.0.0.1", 0)
        reader, writer = await connect(port)
        writer.write(GET + b"GET /next HTTP/1.1\r\nhost:")
        reply = await closed_within(reader, 3)
        first, _, rest = reply.partition(b"\r\n\r\n{}")
        assert first.startswith(b"HTTP/1.1 200") and rest.startswith(b"HTTP/1.1 408")
        assert tripped == ["header_timeout"]
        writer.close()
        server.close()

    run(scenario(), loop_factory)


def test_a_body_read_with_its_head_does_not_count_as_head(loop_factory) -> None:
    """A head and a 100 KiB body in one write are a request, not a 431."""
    async def scenario() -> None:
        server = HttpServer(answer, 1 << 20, Limits())
        port = await server.start("127.0.0.1", 0)
        reader, writer = await connect(port)
        body = b"x" * (100 << 10)
        writer.write(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n%b"
                     % (len(body), body))
        reply = await asyncio.wait_for(reader.read(4096), 3)
        assert reply.startswith(b"HTTP/1.1 200")
        writer.close()
        server.close()

    run(scenario(), loop_factory)
