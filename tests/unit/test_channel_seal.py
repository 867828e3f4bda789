"""The channel's sealed records (channel/seal.py): what crosses the wire between a gateway and a
replica, read by a relay in the middle, and what a changed, replayed or reordered record does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from channel import frames, seal
from channel.client import ReplicaLink
from channel.frames import Kind, Request, Usage
from tests.unit.replicas import SECRET, ScriptedReplica, streamed
from tokenfab.errors import LinkLost, ProtocolError

PROMPT = "the tenant's private question about the merger"
ANSWER = b"data: the confidential answer\n\n"


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def records(plain: list[bytes], key: bytes = b"k" * 32) -> list[bytes]:
    sealer = seal.Sealer(key)
    return [sealer.seal(p) for p in plain]


def test_records_open_from_any_split_of_the_bytes_in_order() -> None:
    plain = [b"first frames", b"", b"second" * 50, b"x"]
    wire = b"".join(records(plain))
    assert b"first" not in wire and b"second" not in wire
    for cut in range(len(wire)):
        opener = seal.Opener(b"k" * 32)
        assert opener.open(wire[:cut]) + opener.open(wire[cut:]) == b"".join(plain)


@pytest.mark.parametrize("change", ["a flipped byte", "a flipped length", "replayed",
                                    "reordered", "another key", "dropped"])
def test_a_changed_replayed_reordered_or_foreign_record_does_not_open(change: str) -> None:
    first, second = records([b"frame one", b"frame two"])
    wire = {"a flipped byte": first[:-1] + bytes([first[-1] ^ 1]),
            "a flipped length": bytes([first[0], first[1], first[2], first[3] ^ 1]) + first[4:],
            "replayed": first + first,
            "reordered": second + first,
            "another key": records([b"frame one"], key=b"o" * 32)[0],
            "dropped": second}[change]
    opener = seal.Opener(b"k" * 32)
    with pytest.raises(ProtocolError):
        opener.open(wire)
        opener.open(second)  # a length made longer waits for bytes, which then fail to open


def test_a_write_larger_than_a_record_is_cut_into_records() -> None:
    plain = bytes(range(256)) * (seal.RECORD_BYTES // 256 * 2 + 3)
    wire = seal.Sealer(b"k" * 32).seal(plain)
    lengths, offset = [], 0
    while offset < len(wire):
        (length,) = seal.LENGTH.unpack_from(wire, offset)
        lengths.append(length)
        offset += seal.LENGTH.size + length
    assert lengths == [seal.RECORD_BYTES + seal.TAG_BYTES] * 2 + [3 * 256 + seal.TAG_BYTES]
    assert seal.Opener(b"k" * 32).open(wire) == plain


def test_each_connection_and_direction_has_keys_of_its_own() -> None:
    a, b, c = b"a" * frames.NONCE_BYTES, b"b" * frames.NONCE_BYTES, b"c" * frames.NONCE_BYTES
    keys = [*seal.keys(SECRET, a, b), *seal.keys(SECRET, a, c), *seal.keys(SECRET, c, b),
            *seal.keys(b"another secret".ljust(32), a, b)]
    assert len(set(keys)) == len(keys) and all(len(key) == 32 for key in keys)
    assert seal.keys(SECRET, a, b) == seal.keys(SECRET, a, b)


def clear_frames(wire: bytes, count: int) -> tuple[list[tuple[int, bytes]], bytes]:
    """The first `count` frames of `wire` read as plain frames, and the bytes after them."""
    out, offset = [], 0
    for _ in range(count):
        length, _, kind = frames.HEADER.unpack_from(wire, offset)
        start = offset + frames.HEADER.size
        out.append((kind, wire[start:start + length]))
        offset = start + length
    return out, wire[offset:]


async def relayed(replica: ScriptedReplica, tamper: Callable[[bytes], bytes] | None = None,
                  ) -> tuple[ReplicaLink, list[bytes], list[bytes], asyncio.Server]:
    """A link to `replica` through a relay on 127.0.0.1 that records each direction's bytes and
    passes the replica's through `tamper`."""
    await replica.start()
    upstream: list[bytes] = []
    downstream: list[bytes] = []

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, log: list[bytes],
                   change: Callable[[bytes], bytes] | None) -> None:
        while data := await reader.read(65536):
            log.append(data)
            writer.write(change(data) if change else data)
        writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        to_reader, to_writer = await asyncio.open_connection("127.0.0.1", replica.port)
        await asyncio.gather(pump(reader, to_writer, upstream, None),
                             pump(to_reader, writer, downstream, tamper),
                             return_exceptions=True)

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    link = ReplicaLink(replica.name, "127.0.0.1", server.sockets[0].getsockname()[1], SECRET,
                       "gw-1")
    await link.connect()
    return link, upstream, downstream, server


def test_no_prompt_answer_or_token_id_crosses_the_wire_in_the_clear() -> None:
    async def scenario() -> None:
        replica = ScriptedReplica("r1", streamed(ANSWER, ANSWER, usage=Usage(9, 2, 0),
                                                 first_id=424242))
        link, upstream, downstream, server = await relayed(replica)
        stream = link.open(Request("completions", json.dumps({"prompt": PROMPT}).encode(),
                                   track_tokens=True))
        got: list[bytes] = []
        stream.attach(lambda chunk, token: got.append(chunk))
        assert await stream.end == Usage(9, 2, 0)
        assert got[:2] == [ANSWER, ANSWER] and stream.ids == [424242, 424243]
        assert replica.requests[0][1]["prompt"] == PROMPT  # served, through the relay
        sent, received = b"".join(upstream), b"".join(downstream)
        assert b"private question" not in sent and PROMPT.encode() not in sent
        assert b"confidential" not in received and b"completions" not in sent
        assert frames.encode(424242) not in received and SECRET not in sent + received
        # in the clear: the handshake only (OPEN and HELLO up, CHALLENGE down); every byte
        # after it is records that open with this connection's keys
        (opened, hello), up = clear_frames(sent, 2)
        (challenge,), down = clear_frames(received, 1)
        assert (opened[0], hello[0], challenge[0]) == (Kind.OPEN, Kind.HELLO, Kind.CHALLENGE)
        to_replica, to_gateway = seal.keys(SECRET, frames.decode(Kind.OPEN, opened[1]).nonce,
                                           frames.decode(Kind.CHALLENGE, challenge[1]).nonce)
        assert PROMPT.encode() in seal.Opener(to_replica).open(up)
        assert ANSWER in seal.Opener(to_gateway).open(down)
        link.close()
        server.close()
    run(scenario())


def test_a_changed_record_closes_the_link_and_fails_its_streams() -> None:
    async def scenario() -> None:
        flipped = []

        def tamper(data: bytes) -> bytes:  # past the CHALLENGE, flip the last byte once
            if len(data) > 200 and not flipped:
                flipped.append(True)
                return data[:-1] + bytes([data[-1] ^ 1])
            return data

        replica = ScriptedReplica("r1", streamed(b"data: " + b"x" * 300 + b"\n\n"))
        link, _, _, server = await relayed(replica, tamper)
        stream = link.open(Request("completions", b"{}"))
        with pytest.raises(LinkLost):
            await stream.end
        assert flipped and link.state == "closed"
        server.close()
    run(scenario())
