"""KV event endpoints of a replica: ipc for one node, in a directory only its user enters; tcp on
the node's address through the replica's CURVE relay, with vLLM's real publisher behind it (live
stream and replay). A subscriber without the application's client key gets nothing."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from channel.secret import CurveKeys
from pools.kv_events import EventRelay, KVEventEndpoints, engine_endpoints, socket_dir
from router.event_sync import EventCredentials, ReplicaEventStream
from router.index import KVBlockIndex, ReplicaId

KEYS = CurveKeys.derive(b"k" * 32)
CREDENTIALS = EventCredentials(KEYS.server_public, KEYS.client_public, KEYS.client_secret)


def test_ipc_endpoints_are_node_local_in_a_private_directory(tmp_path: Path) -> None:
    directory = socket_dir(tmp_path / "kv")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    plan = engine_endpoints(directory / "r")
    assert plan.public == plan.engine == f"ipc://{directory}/r.kv"
    assert plan.replay == plan.engine_replay == f"ipc://{directory}/r.replay"
    (tmp_path / "kv").chmod(0o755)  # loosened by someone: made private again
    assert stat.S_IMODE(socket_dir(tmp_path / "kv").stat().st_mode) == 0o700


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[KVEventEndpoints, object]]:
    """vLLM's publisher on ipc, one batch already published (only the replay has it), and the
    replica's relay on 127.0.0.1."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    engine = engine_endpoints(socket_dir(tmp_path / "kv") / "r")
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=engine.engine,
                                  replay_endpoint=engine.engine_replay)
    relay = EventRelay(engine, "127.0.0.1", KEYS).start()
    _store(publisher, [1, 2])
    time.sleep(0.3)
    try:
        yield relay.endpoints, publisher
    finally:
        publisher.shutdown()
        relay.close()


def _store(publisher, hashes: list[int]) -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=[7] * 16, block_size=16,
        lora_id=None, medium="GPU", lora_name=None)]))


def test_relay_serves_stream_and_replay_to_the_key_holder(relay) -> None:
    endpoints, publisher = relay
    assert endpoints.engine.startswith("ipc://")
    assert endpoints.public.startswith("tcp://127.0.0.1:")
    assert endpoints.replay.startswith("tcp://127.0.0.1:")
    context = zmq.asyncio.Context()

    async def follow() -> None:
        index = KVBlockIndex()
        stream = ReplicaEventStream(ReplicaId("r"), endpoints.public, endpoints.replay, index,
                                    context, credentials=CREDENTIALS)
        assert await stream.catch_up() == 1
        deadline = time.monotonic() + 10
        while stream.stats.batches < 2 and time.monotonic() < deadline:
            _store(publisher, [3])  # until the subscription has reached the relay
            await stream.poll(0.2)
        assert index.longest_prefix([1, 2]) == {"r": 2} and index.blocks_of(ReplicaId("r")) == 3
        assert stream.stats.gaps_cleared == 0
        stream.close()

    try:
        asyncio.run(follow())
    finally:
        context.destroy(linger=0)


@pytest.mark.parametrize("keys", ["none", "another client key"])
def test_relay_gives_nothing_without_the_client_key(relay, keys: str) -> None:
    """Plain ZMQ, or CURVE with the server's public key but a client key of one's own: no
    batch on the stream, no answer from the replay, while the key holder gets both."""
    endpoints, publisher = relay
    context = zmq.Context()
    own = CurveKeys.derive(os.urandom(32))

    def dial(kind: int, endpoint: str, credentials: EventCredentials | None) -> zmq.Socket:
        socket = context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            socket.setsockopt(zmq.SUBSCRIBE, b"")
        if credentials is not None:
            credentials.apply(socket, endpoint)
        socket.connect(endpoint)
        return socket

    intruder = None if keys == "none" else EventCredentials(
        KEYS.server_public, own.client_public, own.client_secret)
    try:
        spy = dial(zmq.SUB, endpoints.public, intruder)
        spy_replay = dial(zmq.DEALER, endpoints.replay, intruder)
        try:  # queued until a handshake completes, which it never does
            spy_replay.send_multipart((b"", (0).to_bytes(8, "big")), zmq.NOBLOCK)
        except zmq.Again:
            pass
        reader = dial(zmq.SUB, endpoints.public, CREDENTIALS)
        reader_replay = dial(zmq.DEALER, endpoints.replay, CREDENTIALS)
        reader_replay.send_multipart((b"", (0).to_bytes(8, "big")))
        assert reader_replay.poll(5000, zmq.POLLIN), "the key holder's replay got no answer"
        assert reader_replay.recv_multipart()[2] == (0).to_bytes(8, "big")
        received = 0
        deadline = time.monotonic() + 10
        while received < 3 and time.monotonic() < deadline:
            _store(publisher, [received + 10])
            if reader.poll(200, zmq.POLLIN):
                reader.recv_multipart()
                received += 1
        assert received == 3, "the key holder's subscription got no batches"
        assert not spy.poll(500, zmq.POLLIN), "a subscriber without the key received a batch"
        assert not spy_replay.poll(0, zmq.POLLIN), "a replay without the key was answered"
    finally:
        context.destroy(linger=0)
