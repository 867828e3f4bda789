"""The data channel over real loopback sockets: framing, authentication, multiplexed streams,
refusals, cancellation both ways, failures, and what the replica learns from gateways."""

from __future__ import annotations

import asyncio
import json

import pytest

from channel import frames, seal
from channel.client import ReplicaLink
from channel.frames import FrameReader, Head, Hello, Kind, Refused, Request, Usage
from tests.unit.replicas import SECRET, ScriptedReplica, Step, streamed, whole
from tokenfab.errors import LinkLost, ReplyFailed


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def linked(replica: ScriptedReplica, secret: bytes = SECRET) -> ReplicaLink:
    await replica.start()
    link = ReplicaLink(replica.name, "127.0.0.1", replica.port, secret, "gw-1")
    await link.connect()
    return link


def request(prompt: str = "hi") -> Request:
    return Request("completions", json.dumps({"model": "m", "prompt": prompt}).encode())


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_frames_cut_from_any_split_of_the_bytes() -> None:
    sent = [(Kind.HEAD, 3, frames.encode(Head(200, True, "r"))), (Kind.TOKEN, 3, b"data: x\n\n"),
            (Kind.END, 3, frames.encode(Usage(5, 2, 1))), (Kind.CANCEL, 9, b"")]
    wire = b"".join(frames.frame(kind, stream, payload) for kind, stream, payload in sent)
    for cut in range(len(wire)):
        reader = FrameReader()
        got = list(reader.feed(wire[:cut])) + list(reader.feed(wire[cut:]))
        assert got == [(int(k), s, p) for k, s, p in sent]
    assert frames.decode(Kind.END, sent[2][2]) == Usage(5, 2, 1)


def test_oversized_or_garbled_frames_are_protocol_errors() -> None:
    with pytest.raises(frames.ProtocolError):
        list(FrameReader().feed(frames.HEADER.pack(frames.MAX_PAYLOAD + 1, 1, Kind.DATA)))
    with pytest.raises(frames.ProtocolError):
        frames.decode(Kind.HEAD, b"\x01\x02")


def test_a_whole_reply_and_a_stream_share_one_link() -> None:
    async def scenario() -> None:
        replica = ScriptedReplica("r1", whole(200, {"text": "a"}, Usage(3, 1, 0)),
                                  streamed(b"data: 1\n\n", b"data: 2\n\n", usage=Usage(3, 2, 0)))
        link = await linked(replica)
        first, second = link.open(request("a")), link.open(request("b"))
        assert await first.head == Head(200, False, "r1")
        assert await first.end == Usage(3, 1, 0) and json.loads(first.body()) == {"text": "a"}
        assert await second.head == Head(200, True, "r1")
        got: list[tuple[bytes, bool]] = []
        second.attach(lambda chunk, token: got.append((chunk, token)))
        assert await second.end == Usage(3, 2, 0)
        assert got == [(b"data: 1\n\n", True), (b"data: 2\n\n", True),
                       (b"data: [DONE]\n\n", False)]
        assert [r[1]["prompt"] for r in replica.requests] == ["a", "b"]
        assert link.open_streams == 0 and replica.in_flight == 0
    run(scenario())


def test_a_gateway_with_another_secret_is_refused_at_connect() -> None:
    async def scenario() -> None:
        replica = await ScriptedReplica("r1", whole(200, {})).start()
        link = ReplicaLink("r1", "127.0.0.1", replica.port, b"x" * 32, "gw-1")
        with pytest.raises(LinkLost, match="did not prove the secret"):
            await link.connect()  # the replica's proof fails under the link's secret
        assert link.state == "closed"
        with pytest.raises(LinkLost, match="connects once"):
            await link.connect()  # a link's nonce is one connection's
    run(scenario())


@pytest.mark.parametrize("peer", ["a HELLO before its OPEN", "a large frame before its OPEN",
                                  "an OPEN with a short nonce", "an older version",
                                  "a request before its HELLO", "another secret",
                                  "the HELLO of another OPEN", "a second OPEN"])
def test_a_peer_that_does_not_prove_the_secret_is_never_served(peer) -> None:
    # what reaches the replica from someone who is not a gateway of its application: it says at
    # most its challenge, closes, and serves nothing
    async def scenario() -> None:
        replica = await ScriptedReplica("r1", whole(200, {})).start()
        reader, writer = await asyncio.open_connection("127.0.0.1", replica.port)
        ours, other = b"g" * frames.NONCE_BYTES, b"o" * frames.NONCE_BYTES
        ask = frames.frame(Kind.REQUEST, 1, frames.encode(request()))
        unanswered = {  # what it says first, closed without a word: no challenge
            "a HELLO before its OPEN":
                frames.frame(Kind.HELLO, 0, frames.encode(Hello(b"p" * 32, "gw"))) + ask,
            # a 1 MiB frame announced: closed at once, not held for the HELLO timeout while
            # the peer trickles the payload in
            "a large frame before its OPEN":
                frames.HEADER.pack(1 << 20, 1, Kind.REQUEST) + b"x" * 1024,
            "an OPEN with a short nonce":
                frames.frame(Kind.OPEN, 0, frames.encode(frames.Open(b"g" * 8))),
            "an older version": frames.frame(Kind.OPEN, 0, frames.encode(
                frames.Open(ours, frames.VERSION - 1)))}
        writer.write(unanswered.get(peer) or frames.frame(Kind.OPEN, 0, frames.encode(
            frames.Open(ours))))
        if peer not in unanswered:
            header = await asyncio.wait_for(reader.readexactly(frames.HEADER.size), 2.0)
            length, _, kind = frames.HEADER.unpack(header)
            assert kind == Kind.CHALLENGE
            nonce = frames.decode(Kind.CHALLENGE, await reader.readexactly(length)).nonce
            secret = b"x" * 32 if peer == "another secret" else SECRET
            proved = other if peer == "the HELLO of another OPEN" else ours
            hello = frames.frame(Kind.HELLO, 0, frames.encode(
                Hello(frames.hello_proof(secret, nonce, proved, "gw"), "gw")))
            writer.write({"a request before its HELLO": ask,
                          "a second OPEN": frames.frame(Kind.OPEN, 0, frames.encode(
                              frames.Open(other)))}.get(peer, hello + ask))
        assert await asyncio.wait_for(reader.read(), 2.0) == b""  # closed: nothing more said
        assert replica.requests == [] and replica.server.gateways() == 0
        writer.close()
    run(scenario())


async def _challenged(port: int, replica: str = "r1",
                      gateway_nonce: bytes = b"g" * frames.NONCE_BYTES,
                      ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A raw peer's connection, opened as a gateway opens one, and the replica's nonce (its
    proof checked)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frames.frame(Kind.OPEN, 0, frames.encode(frames.Open(gateway_nonce))))
    header = await asyncio.wait_for(reader.readexactly(frames.HEADER.size), 2.0)
    length, stream, kind = frames.HEADER.unpack(header)
    assert (stream, kind) == (0, Kind.CHALLENGE)
    challenge = frames.decode(Kind.CHALLENGE, await reader.readexactly(length))
    assert len(challenge.nonce) == frames.NONCE_BYTES
    assert challenge.proof == frames.replica_proof(SECRET, gateway_nonce, challenge.nonce, replica)
    return reader, writer, challenge.nonce


def test_a_gateway_proves_the_secret_without_sending_it_and_a_recorded_hello_opens_nothing(
        ) -> None:
    async def scenario() -> None:
        replica = await ScriptedReplica("r1", whole(200, {"n": 1}), whole(200, {"n": 2})).start()
        hellos, ours = [], b"g" * frames.NONCE_BYTES
        for _ in range(2):  # two connections: a new nonce each, proved with the secret
            reader, writer, nonce = await _challenged(replica.port, gateway_nonce=ours)
            hello = frames.encode(Hello(frames.hello_proof(SECRET, nonce, ours, "gw"), "gw"))
            to_replica, to_gateway = seal.keys(SECRET, ours, nonce)
            writer.write(frames.frame(Kind.HELLO, 0, hello) + seal.Sealer(to_replica).seal(
                frames.frame(Kind.REQUEST, 1, frames.encode(request()))))
            replies = FrameReader()
            replies.opener = seal.Opener(to_gateway)
            kinds: list[int] = []
            while Kind.END not in kinds:
                kinds += [kind for kind, _, _ in replies.feed(
                    await asyncio.wait_for(reader.read(4096), 2.0))]
            assert Kind.HEAD in kinds  # served
            hellos.append((nonce, hello))
            writer.close()
        assert hellos[0][0] != hellos[1][0]
        # a peer that recorded a HELLO replays it on a connection of its own, opened with the
        # same gateway nonce: the replica's nonce is new, so the HELLO is refused, unserved
        reader, writer, _ = await _challenged(replica.port, gateway_nonce=ours)
        writer.write(frames.frame(Kind.HELLO, 0, hellos[0][1])
                     + frames.frame(Kind.REQUEST, 1, frames.encode(request())))
        assert await asyncio.wait_for(reader.read(), 2.0) == b""
        assert len(replica.requests) == 2
        writer.close()
    run(scenario())


def test_the_frame_limit_rises_between_frames_of_one_read() -> None:
    # HELLO and a first request usually come in one read: the limit a HELLO raises applies to
    # the next frame of the same read
    reader = FrameReader(frames.MAX_HELLO_PAYLOAD)
    small, large = b"h" * 10, b"r" * (frames.MAX_HELLO_PAYLOAD + 1000)
    data = (frames.HEADER.pack(len(small), 0, Kind.HELLO) + small
            + frames.HEADER.pack(len(large), 1, Kind.REQUEST) + large)
    got = []
    for kind, _, payload in reader.feed(data):
        got.append((kind, len(payload)))
        reader.max_payload = frames.MAX_PAYLOAD
    assert got == [(Kind.HELLO, 10), (Kind.REQUEST, len(large))]
    with pytest.raises(frames.ProtocolError):
        list(FrameReader(frames.MAX_HELLO_PAYLOAD).feed(data))  # without the HELLO's raise


def test_full_or_draining_replica_refuses_without_starting() -> None:
    async def scenario() -> None:
        replica = ScriptedReplica("r1", [Step("head", 200, True), Step("hang")], capacity=1)
        link = await linked(replica)
        busy = link.open(request())
        assert isinstance(await busy.head, Head)
        assert await link.open(request()).head == Refused("full")
        replica.server.set_state("draining")
        await until(lambda: link.state == "draining")
        replica.state = "draining"
        assert await link.open(request()).head == Refused("draining")
        assert len(replica.requests) == 1  # refused requests never reached the handler
    run(scenario())


def test_every_gateway_hears_the_adapters_at_connect_and_when_they_change() -> None:
    async def scenario() -> None:
        replica = ScriptedReplica("r1", whole(200, {}))
        await replica.start()
        replica.server.set_adapters(frames.Adapters(["x"], [{"x": 1}]))
        heard: list[frames.Adapters] = []
        link = ReplicaLink(replica.name, "127.0.0.1", replica.port, SECRET, "gw-1")
        link.on_adapters = lambda said: heard.append(said.adapters)
        local = replica.server.local_link("r1")
        await link.connect()
        await until(lambda: heard == [frames.Adapters(["x"], [{"x": 1}])])
        assert local.adapters == frames.Adapters(["x"], [{"x": 1}])
        replica.server.set_adapters(frames.Adapters(["x", "y"], [{}]))
        await until(lambda: len(heard) == 2)
        assert heard[1] == link.adapters == local.adapters == frames.Adapters(["x", "y"], [{}])
    run(scenario())


def test_cancel_stops_the_replicas_handler_and_frees_its_slot() -> None:
    async def scenario() -> None:
        replica = ScriptedReplica("r1", [Step("head", 200, True), Step("hang")])
        link = await linked(replica)
        stream = link.open(request())
        await stream.head
        assert replica.in_flight == 1
        stream.cancel()
        await until(lambda: replica.outcomes == ["cancelled"])
        assert replica.in_flight == 0
        with pytest.raises(LinkLost):
            await stream.end
    run(scenario())


def test_gateway_going_away_cancels_its_requests() -> None:
    async def scenario() -> None:
        replica = ScriptedReplica("r1", [Step("head", 200, True), Step("hang")])
        link = await linked(replica)
        await link.open(request()).head
        link.close()
        await until(lambda: replica.outcomes == ["cancelled"])
        assert replica.in_flight == 0 and replica.server.gateways() == 0
    run(scenario())


def test_replica_failures_reach_the_stream() -> None:
    async def scenario() -> None:
        replica = ScriptedReplica("r1", [Step("head", 200, True), Step("fail")],
                                  [Step("head", 200, True), Step("raise")],
                                  [Step("head", 200, True), Step("hang")])
        link = await linked(replica)
        for _ in range(2):  # the engine failed / the handler raised: FAILED after the head
            stream = link.open(request())
            await stream.head
            with pytest.raises(ReplyFailed):
                await stream.end
        stream = link.open(request())
        await stream.head
        replica.server.close()  # the replica process dies: the connection drops
        with pytest.raises(LinkLost):
            await stream.end
        assert link.state == "closed"
        with pytest.raises(LinkLost):
            link.open(request())
    run(scenario())


def test_a_local_request_cancelled_from_elsewhere_fails_its_stream() -> None:
    """A handler's task cancelled by something other than the gateway (the replica's loop
    shutting down): the stream fails as lost at once instead of waiting for its deadline."""
    async def scenario() -> None:
        replica = ScriptedReplica("r1", [Step("head", 200, True), Step("hang")])
        link = replica.server.local_link("r1")
        stream = link.open(request())
        await stream.head
        next(iter(link._tasks.values())).cancel()
        with pytest.raises(LinkLost):
            await stream.end
        await until(lambda: replica.in_flight == 0)
    run(scenario())


def test_replica_hears_held_counts_from_every_gateway() -> None:
    async def scenario() -> None:
        replica = ScriptedReplica("r1", whole(200, {}))
        first = await linked(replica)
        second = ReplicaLink("r1", "127.0.0.1", replica.port, SECRET, "gw-2")
        await second.connect()
        first.send_held(3)
        second.send_held(2)
        await until(lambda: replica.server.held() == 5)
        second.close()
        await until(lambda: replica.server.held() == 3)
    run(scenario())


def test_frames_of_one_loop_turn_leave_in_one_write() -> None:
    """Many streams answered in the same turn of the replica's loop: one write (the engine
    answers all running requests in the same step)."""
    async def scenario() -> None:
        replica = ScriptedReplica("r1", whole(200, {"ok": 1}))
        link = await linked(replica)
        writes = []
        await until(lambda: replica.server.gateways() == 1)
        connection = next(iter(replica.server._connections))
        transport = connection._transport
        original = transport.write
        transport.write = lambda data: (writes.append(len(data)), original(data))
        streams = [link.open(request(str(i))) for i in range(20)]
        for stream in streams:
            await stream.end
        assert len(writes) <= 4, writes  # 60 frames (head, data, end x 20)
    run(scenario())


def test_a_local_link_serves_by_calls_as_a_socket_would() -> None:
    """The replica in the gateway's own process (gateway.colocate): the same replies, refusals,
    held counts and state as over a socket, and its requests fail as lost when it stops."""
    async def scenario() -> None:
        replica = ScriptedReplica("r1", whole(200, {"text": "a"}, Usage(3, 1, 0)),
                                  [Step("head", 200, True), Step("hang")], capacity=2)
        await replica.start()
        link = replica.server.local_link("r1")
        whole_reply = link.open(request("a"))
        assert await whole_reply.head == Head(200, False, "r1")
        assert await whole_reply.end == Usage(3, 1, 0)
        assert json.loads(whole_reply.body()) == {"text": "a"}
        await until(lambda: replica.in_flight == 0)  # its slot is freed once its task ended
        hanging = [link.open(request()) for _ in range(2)]
        for stream in hanging:
            assert isinstance(await stream.head, Head)
        assert await link.open(request()).head == Refused("full")
        assert replica.in_flight == 2 and link.open_streams == 2
        remote = await linked(replica)
        link.send_held(3)
        remote.send_held(2)
        await until(lambda: replica.server.held() == 5)
        replica.server.set_state("draining")
        assert link.state == "draining"
        hanging[0].cancel()
        await until(lambda: replica.in_flight == 1)
        replica.server.close()  # the replica stops
        with pytest.raises(LinkLost):
            await hanging[1].end
        await until(lambda: replica.outcomes == ["done", "cancelled", "cancelled"])
        assert link.state == "closed" and replica.in_flight == 0
        with pytest.raises(LinkLost):
            link.open(request())
    run(scenario())


def _rogue_challenge(said: str, gateway_nonce: bytes) -> bytes:
    """What a peer that is not replica r1 answers a gateway's OPEN with."""
    nonce = b"n" * frames.NONCE_BYTES
    proof = {"another secret": frames.replica_proof(b"x" * 32, gateway_nonce, nonce, "r1"),
             "another replica's proof": frames.replica_proof(SECRET, gateway_nonce, nonce, "r2"),
             "another connection's proof": frames.replica_proof(SECRET, b"o" * 16, nonce, "r1"),
             }.get(said)
    version = frames.VERSION + 1 if said == "a newer version" else frames.VERSION
    if said in ("a short nonce", "a newer version"):
        nonce = b"n" * (8 if said == "a short nonce" else frames.NONCE_BYTES)
        proof = frames.replica_proof(SECRET, gateway_nonce, nonce, "r1")
    return frames.frame(Kind.CHALLENGE, 0, frames.encode(frames.Challenge(nonce, proof, version)))


@pytest.mark.parametrize("said", ["nothing", "a frame before its challenge", "another secret",
                                  "another replica's proof", "another connection's proof",
                                  "a short nonce", "a newer version"])
def test_a_peer_that_does_not_prove_it_is_the_replica_gets_nothing_but_the_open(said) -> None:
    # a process that took a replica's address, or anyone answering for it, learns no prompt:
    # the link fails at connect and sends no HELLO and no request
    async def scenario() -> None:
        heard = asyncio.get_running_loop().create_future()

        async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if said == "a frame before its challenge":
                writer.write(frames.frame(Kind.STATE, 0, frames.encode(frames.State("ready"))))
            header = await reader.readexactly(frames.HEADER.size)
            opened = frames.decode(Kind.OPEN, await reader.readexactly(
                frames.HEADER.unpack(header)[0]))
            if said not in ("nothing", "a frame before its challenge"):
                writer.write(_rogue_challenge(said, opened.nonce))
            heard.set_result(await reader.read())  # all the link says after its OPEN

        rogue = await asyncio.start_server(peer, "127.0.0.1", 0)
        link = ReplicaLink("r1", "127.0.0.1", rogue.sockets[0].getsockname()[1], SECRET, "gw-1")
        with pytest.raises(LinkLost):
            await link.connect(timeout_s=0.5)
        assert link.state == "closed"
        assert await asyncio.wait_for(heard, 2.0) == b""
        with pytest.raises(LinkLost):
            link.open(request())
        rogue.close()
    run(scenario())


def test_the_links_hello_answers_the_challenge_and_carries_no_secret() -> None:
    # what ReplicaLink puts on the wire, read by a peer that answers it as replica r1 does
    async def scenario() -> None:
        nonce, said = b"n" * frames.NONCE_BYTES, asyncio.get_running_loop().create_future()

        async def frame(reader: asyncio.StreamReader) -> tuple[int, bytes, bytes]:
            header = await reader.readexactly(frames.HEADER.size)
            length, _, kind = frames.HEADER.unpack(header)
            payload = await reader.readexactly(length)
            return kind, header + payload, payload

        async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            kind, first, payload = await frame(reader)
            assert kind == Kind.OPEN
            theirs = frames.decode(Kind.OPEN, payload).nonce
            proof = frames.replica_proof(SECRET, theirs, nonce, "r1")
            writer.write(frames.frame(Kind.CHALLENGE, 0, frames.encode(
                frames.Challenge(nonce, proof))))
            kind, second, hello = await frame(reader)
            said.set_result((theirs, kind, first + second, hello))

        server = await asyncio.start_server(replica, "127.0.0.1", 0)
        link = ReplicaLink("r1", "127.0.0.1", server.sockets[0].getsockname()[1], SECRET, "gw-1")
        await link.connect()
        theirs, kind, wire, payload = await asyncio.wait_for(said, 2.0)
        hello = frames.decode(Kind.HELLO, payload)
        assert kind == Kind.HELLO and SECRET not in wire and len(theirs) == frames.NONCE_BYTES
        assert hello == Hello(frames.hello_proof(SECRET, nonce, theirs, "gw-1"), "gw-1")
        link.close()
        server.close()
    run(scenario())
