"""The gateway's HTTP/1.1 server on real loopback sockets: keep-alive and pipelining in order,
chunked request bodies, streamed (chunked) replies, size limits, malformed requests, HTTP/1.0,
and a client that leaves cancelling its request's handler."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import uvloop

from orchestrator.gateway.http import FIRST_REQUEST_GRACE_S, HttpServer
from orchestrator.gateway.responder import HttpRequest, Responder


class App:
    """Echoes requests; /stream streams three chunks; /slow answers after 0.2 s; /hang waits
    until cancelled."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.requests = 0

    async def __call__(self, request: HttpRequest, responder: Responder) -> None:
        self.requests += 1
        if request.path == "/stream":
            responder.start_stream(200, {"x-kind": "sse"})
            for i in range(3):
                await asyncio.sleep(0.01)
                responder.write(b"data: %d\n\n" % i)
            responder.end_stream()
        elif request.path == "/hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        elif request.path == "/slow":
            await asyncio.sleep(0.2)
            responder.send(200, b"{}")
        elif request.path == "/boom":
            raise RuntimeError("a bug")
        else:
            body = {"method": request.method, "path": request.path, "query": request.query,
                    "body": request.body.decode(), "too_large": request.too_large,
                    "agent": request.headers.get("user-agent")}
            responder.send(200, json.dumps(body).encode())


async def serving(max_body: int = 1024) -> tuple[HttpServer, App, int]:
    app = App()
    server = HttpServer(app, max_body)
    return server, app, await server.start("127.0.0.1", 0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def raw(port: int, data: bytes, read_until_close: bool = True) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = await reader.read() if read_until_close else await reader.read(65536)
    writer.close()
    return out


def test_keep_alive_json_and_streams_with_a_real_client() -> None:
    async def scenario() -> None:
        server, _, port = await serving()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as c:
            for i in range(3):  # one connection, kept alive
                reply = await c.post(f"/echo?i={i}", content=b"x" * i)
                assert reply.json()["query"] == f"i={i}" and reply.json()["body"] == "x" * i
            async with c.stream("GET", "/stream") as reply:
                assert reply.headers["transfer-encoding"] == "chunked"
                assert reply.headers["x-kind"] == "sse"
                assert [line async for line in reply.aiter_lines() if line] == [
                    "data: 0", "data: 1", "data: 2"]

            async def chunks():
                yield b"ab"
                yield b"cd"

            assert (await c.post("/echo", content=chunks())).json()["body"] == "abcd"
        server.close()
    run(scenario())


def test_pipelined_requests_are_answered_in_order() -> None:
    async def scenario() -> None:
        server, _, port = await serving()
        requests = b"".join(b"GET /r%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(3))
        out = await raw(port, requests + b"GET /last HTTP/1.1\r\nconnection: close\r\n\r\n")
        paths = [json.loads(part.split(b"\r\n\r\n", 1)[1].split(b"HTTP/1.1")[0])["path"]
                 for part in out.split(b"HTTP/1.1 200 OK")[1:]]
        assert paths == ["/r0", "/r1", "/r2", "/last"]
        server.close()
    run(scenario())


def test_oversized_body_is_flagged_and_the_connection_closed() -> None:
    async def scenario() -> None:
        server, _, port = await serving(max_body=10)
        body = b"y" * 100
        out = await raw(port, b"POST /echo HTTP/1.1\r\ncontent-length: %d\r\n\r\n%s" % (
            len(body), body))  # read until close: the server closes after answering
        assert json.loads(out.split(b"\r\n\r\n", 1)[1]) | {} == {
            "method": "POST", "path": "/echo", "query": "", "body": "", "too_large": True,
            "agent": None}
        assert b"connection: close" in out
        server.close()
    run(scenario())


@pytest.mark.parametrize("request_bytes,status", [
    (b"NOT HTTP AT ALL\r\n\r\n", b"400"),
    (b"GET / HTTP/1.1\r\nx-big: " + b"z" * (70 << 10) + b"\r\n\r\n", b"431"),
    (b"GET / HTTP/1.1\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n", b"400"),
    # a coding this server does not decode, the body's framing then read as chunked: 501, and
    # the request behind it is not answered
    (b"POST /echo HTTP/1.1\r\ntransfer-encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
     b"GET / HTTP/1.1\r\n\r\n", b"501"),
    (b"POST /echo HTTP/1.1\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n"
     b"0\r\n\r\nGET / HTTP/1.1\r\n\r\n", b"400"),
], ids=["garbage", "headers-too-large", "upgrade", "coding-not-chunked", "length-and-chunked"])
def test_malformed_requests_get_an_error_and_a_closed_connection(request_bytes: bytes,
                                                                 status: bytes) -> None:
    async def scenario() -> None:
        server, _, port = await serving()
        out = await raw(port, request_bytes)
        assert out.startswith(b"HTTP/1.1 " + status) and out.count(b"HTTP/1.1 ") == 1, out
        assert json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]["code"] == int(status)
        server.close()
    run(scenario())


def test_a_handler_bug_is_a_500_and_the_server_keeps_serving() -> None:
    async def scenario() -> None:
        server, _, port = await serving()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", trust_env=False) as c:
            assert (await c.get("/boom")).status_code == 500
            assert (await c.get("/fine")).json()["path"] == "/fine"
        server.close()
    run(scenario())


def test_http10_stream_ends_with_the_connection() -> None:
    async def scenario() -> None:
        server, _, port = await serving()
        out = await raw(port, b"GET /stream HTTP/1.0\r\n\r\n")
        head, body = out.split(b"\r\n\r\n", 1)
        assert b"transfer-encoding" not in head and b"connection: close" in head
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        server.close()
    run(scenario())


def test_client_leaving_cancels_its_handler() -> None:
    async def scenario() -> None:
        server, app, port = await serving()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hang HTTP/1.1\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 5)
        server.close()
    run(scenario())


def test_two_servers_share_a_port() -> None:
    """Ingress replicas on one node bind the same address (SO_REUSEPORT)."""
    async def scenario() -> None:
        first, _, port = await serving()
        second = HttpServer(App(), 1024)
        assert await second.start("127.0.0.1", port) == port
        first.close()
        async with httpx.AsyncClient(trust_env=False) as c:
            assert (await c.get(f"http://127.0.0.1:{port}/still")).json()["path"] == "/still"
        second.close()
    run(scenario())


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop],
                         ids=["asyncio", "uvloop"])
def test_a_closing_listener_answers_the_connections_queued_on_it(loop_factory) -> None:
    """Listeners sharing a port (SO_REUSEPORT) each have an accept queue of their own: the
    kernel hands a connection to one of them before its process accepts it. A listener that
    closes (a replica drains) answers those queued on it; closing the socket with them queued
    would reset them."""
    async def scenario() -> None:
        first, first_app, port = await serving()
        second_app = App()
        second = HttpServer(second_app, 1024)
        await second.start("127.0.0.1", port)
        clients = []
        for _ in range(32):  # connected and sent before either server has accepted any
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
            sock.setblocking(False)
            clients.append(sock)
        second.close()
        answers = await asyncio.gather(*(_answer(sock) for sock in clients))
        assert [a[:12] for a in answers] == [b"HTTP/1.1 200"] * len(clients)
        assert second_app.requests > 0 and first_app.requests > 0  # both had some queued
        await asyncio.sleep(0.1)
        taken = second_app.requests
        later = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
        for sock in later:  # once it has closed, the port's other listener takes them all
            sock.sendall(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
            sock.setblocking(False)
        assert [a[:12] for a in await asyncio.gather(*(_answer(s) for s in later))] == [
            b"HTTP/1.1 200"] * len(later)
        assert second_app.requests == taken
        for sock in clients + later:
            sock.close()
        first.close()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(asyncio.wait_for(scenario(), 10))


async def _answer(sock: socket.socket) -> bytes:
    """An answer read to the end of its JSON body (or what came before the connection ended)."""
    data, loop = b"", asyncio.get_running_loop()
    try:
        while not data.endswith(b"}"):
            chunk = await loop.sock_recv(sock, 4096)
            if not chunk:
                break
            data += chunk
    except ConnectionResetError:
        return data + b"<reset>"
    return data


def test_closing_drains_idle_connections_now_and_busy_ones_after_their_answer() -> None:
    async def scenario() -> None:
        server, _, port = await serving()
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        idle_writer.write(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
        assert (await idle_reader.readuntil(b"}")).startswith(b"HTTP/1.1 200")  # kept alive
        busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", port)
        busy_writer.write(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\n")
        while not any(c._task for c in server.connections):
            await asyncio.sleep(0.01)
        server.close()
        assert await asyncio.wait_for(idle_reader.read(), 1) == b""  # closed at once
        answer = await asyncio.wait_for(busy_reader.read(), 2)  # the answer, then the close
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"{}")
        with pytest.raises(OSError):  # and no new connection
            await asyncio.open_connection("127.0.0.1", port)
        for writer in (idle_writer, busy_writer):
            writer.close()
    run(scenario())


def test_draining_answers_the_first_request_of_a_fresh_connection() -> None:
    # a client that connected just before the drain sends its request just after: answered
    # (connection: close), not dropped; one that sends nothing is closed after the grace
    async def scenario() -> None:
        server, _, port = await serving()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        silent_reader, silent_writer = await asyncio.open_connection("127.0.0.1", port)
        while len(server.connections) < 2:
            await asyncio.sleep(0.01)
        server.close()
        await asyncio.sleep(0.1)
        assert server.waiting() == 2  # a drain waits for their requests (Ingress.in_flight)
        writer.write(b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 2)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer
        started = time.monotonic()
        assert await asyncio.wait_for(silent_reader.read(), FIRST_REQUEST_GRACE_S + 2) == b""
        assert time.monotonic() - started >= FIRST_REQUEST_GRACE_S - 0.5
        assert server.waiting() == 0
        for w in (writer, silent_writer):
            w.close()
    run(scenario())


def test_draining_leaves_a_request_partly_received_to_finish() -> None:
    async def scenario() -> None:
        server, _, port = await serving()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\n\r\nab")
        while not any(not c._in_head for c in server.connections):
            await asyncio.sleep(0.01)
        server.close()
        assert server.connections  # still open: its request is half in
        writer.write(b"cd")
        answer = await asyncio.wait_for(reader.read(), 2)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer
        assert b'"body": "abcd"' in answer
        writer.close()
    run(scenario())


def test_a_request_answered_while_draining_says_connection_close() -> None:
    async def scenario() -> None:
        server, _, port = await serving()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: t\r\n\r\nGET /x HTTP/1.1\r\nhost: t\r\n\r\n")
        while not any(c._pending for c in server.connections):  # the second waits its turn
            await asyncio.sleep(0.01)
        assert server.waiting() == 1  # counted by a drain (Ingress.in_flight)
        server.close()
        answers = (await asyncio.wait_for(reader.read(), 2)).split(b"HTTP/1.1 ")[1:]
        assert len(answers) == 2 and b"connection: close" not in answers[0]
        assert b"connection: close" in answers[1]  # started after the close: the last one
        writer.close()
    run(scenario())


def test_a_connection_taken_from_a_closing_listeners_queue_gets_the_first_request_grace() -> None:
    # queued, sending nothing: closed after FIRST_REQUEST_GRACE_S, as a fresh connection that
    # the drain found, and counted as waiting until then (not for the idle timeout)
    async def scenario() -> None:
        server, _, port = await serving()
        silent = socket.create_connection(("127.0.0.1", port))  # queued, not yet accepted
        silent.setblocking(False)
        server.close()
        deadline = time.monotonic() + 2.0
        while not server.connections:  # taken from the queue by the closing listener
            assert time.monotonic() < deadline, "the queued connection was not taken"
            await asyncio.sleep(0.01)
        assert len(server.connections) == 1 and server.waiting() == 1
        started = time.monotonic()
        assert await asyncio.wait_for(_answer(silent), FIRST_REQUEST_GRACE_S + 2) == b""
        assert time.monotonic() - started <= FIRST_REQUEST_GRACE_S + 0.5
        assert server.waiting() == 0
        silent.close()
    run(scenario())
