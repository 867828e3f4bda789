"""Event streams against vLLM's real ZMQ publisher (in process, ipc sockets): in-order apply,
late join and dropped subscriptions recovered through replay, clear when replay is impossible,
a corrupted batch read again from the replay, or the replica cleared when it cannot be."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from router.event_sync import ReplicaEventStream
from router.index import KVBlockIndex, ReplicaId

R = ReplicaId("r")


@pytest.fixture
def publisher_factory(tmp_path: Path):
    from vllm.distributed.kv_events import ZmqEventPublisher

    publishers = []

    def make(replay: bool = True) -> ZmqEventPublisher:
        publisher = ZmqEventPublisher(
            data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/pub{len(publishers)}",
            replay_endpoint=f"ipc://{tmp_path}/replay{len(publishers)}" if replay else None)
        publishers.append(publisher)
        return publisher

    yield make
    for publisher in publishers:
        publisher.shutdown()


def publish(publisher, *hash_groups: list[int]) -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    for hashes in hash_groups:
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
            lora_id=None, medium="GPU", lora_name=None)]))
    time.sleep(0.2)  # the publisher thread sends asynchronously


def follow(publisher, index: KVBlockIndex, context: zmq.Context) -> ReplicaEventStream:
    config = publisher.get_publisher_config()
    stream = ReplicaEventStream(R, config.endpoint, config.replay_endpoint, index, context)
    time.sleep(0.3)  # let the subscription reach the publisher
    return stream


def drain(stream: ReplicaEventStream, batches: int) -> None:
    """Poll until `batches` have been applied in all (or 5 s passed)."""
    async def poll() -> None:
        deadline = time.monotonic() + 5
        while stream.stats.batches < batches and time.monotonic() < deadline:
            await stream.poll(0.1)

    asyncio.run(poll())


def test_late_join_replays_history(publisher_factory) -> None:
    publisher, index, context = publisher_factory(), KVBlockIndex(), zmq.asyncio.Context()
    publish(publisher, [1], [2], [3])            # nobody listens yet: only the replay buffer has them
    stream = follow(publisher, index, context)
    publish(publisher, [4])
    drain(stream, 4)
    assert index.longest_prefix([1, 2, 3, 4]) == {R: 4}
    assert index.blocks_of(R) == 4
    assert (stream.stats.gaps_recovered, stream.stats.gaps_cleared) == (1, 0)
    stream.close()
    context.destroy()


def test_dropped_subscription_is_recovered_in_order(publisher_factory) -> None:
    publisher, index, context = publisher_factory(), KVBlockIndex(), zmq.asyncio.Context()
    stream = follow(publisher, index, context)
    publish(publisher, [1], [2])
    drain(stream, 2)
    stream.close()                                # the subscription drops...
    publish(publisher, [3], [4])                  # ...and misses these
    stream.resubscribe()
    time.sleep(0.3)
    publish(publisher, [5])
    drain(stream, 5)
    assert index.blocks_of(R) == 5 and stream.stats.batches == 5
    assert stream.stats.gaps_recovered == 1
    stream.close()
    context.destroy()


def test_gap_without_replay_clears_the_replica(publisher_factory) -> None:
    publisher, index, context = publisher_factory(replay=False), KVBlockIndex(), zmq.asyncio.Context()
    index.add(R, [100, 101], "GPU")               # state from before the gap: no longer trusted
    publish(publisher, [1])
    stream = follow(publisher, index, context)
    publish(publisher, [2])
    drain(stream, 1)
    assert index.longest_prefix([100]) == {}
    assert index.blocks_of(R) == 1                # only what arrived after the gap
    assert stream.stats.gaps_cleared == 1
    stream.close()
    context.destroy()


def stored_batch(*hashes: int) -> bytes:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
        lora_id=None, medium="GPU", lora_name=None)]))


def removed_batch(*hashes: int) -> bytes:
    from vllm.distributed.kv_events import BlockRemoved, KVEventBatch

    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[BlockRemoved(
        block_hashes=list(hashes), medium="GPU")]))


def corrupt(payload: bytes) -> bytes:
    return b"\x93garbage" + payload[9:]


def test_a_corrupted_batch_is_read_again_from_the_replay(publisher_factory, tmp_path) -> None:
    """vLLM's publisher sends store [1, 2, 3], remove [2, 3], store [4]; the second batch is
    corrupted on its way (a relay in between). Skipping it would leave 2 and 3 in the map, which
    the replica no longer holds; the stream fetches it again and the map is exact."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    publisher, index, context = publisher_factory(), KVBlockIndex(), zmq.asyncio.Context()
    config, relay_context = publisher.get_publisher_config(), zmq.Context()
    upstream = relay_context.socket(zmq.SUB)
    upstream.setsockopt(zmq.SUBSCRIBE, b"")
    upstream.connect(config.endpoint)
    relay = relay_context.socket(zmq.PUB)
    relay.bind(f"ipc://{tmp_path}/relay")
    stream = ReplicaEventStream(R, f"ipc://{tmp_path}/relay", config.replay_endpoint, index,
                                context)
    time.sleep(0.3)
    for event in (BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=[],
                              block_size=16, lora_id=None, medium="GPU", lora_name=None),
                  BlockRemoved(block_hashes=[2, 3], medium="GPU"),
                  BlockStored(block_hashes=[4], parent_block_hash=None, token_ids=[],
                              block_size=16, lora_id=None, medium="GPU", lora_name=None)):
        publisher.publish(KVEventBatch(ts=time.time(), events=[event]))
    for n in range(3):
        assert upstream.poll(5000), "the publisher sent nothing"
        topic, seq, payload = upstream.recv_multipart()
        relay.send_multipart((topic, seq, corrupt(payload) if n == 1 else payload))
    drain(stream, 3)
    assert index.longest_prefix([1, 2]) == {R: 1} and index.longest_prefix([4]) == {R: 1}
    assert index.blocks_of(R) == 2
    assert (stream.stats.malformed, stream.stats.gaps_recovered, stream.stats.gaps_cleared) == \
        (1, 1, 0)
    stream.close()
    relay_context.destroy(linger=0)
    context.destroy(linger=0)


def test_a_corrupted_batch_without_replay_clears_the_replica(tmp_path: Path) -> None:
    """The same without a replay endpoint: the map forgets the replica rather than keep blocks
    the lost batch may have removed, and goes on with the next batches."""
    sync_context, context, index = zmq.Context(), zmq.asyncio.Context(), KVBlockIndex()
    publisher = sync_context.socket(zmq.PUB)
    publisher.bind(f"ipc://{tmp_path}/pub")
    stream = ReplicaEventStream(R, f"ipc://{tmp_path}/pub", None, index, context)
    time.sleep(0.3)
    batches = [stored_batch(1, 2), corrupt(removed_batch(2)), stored_batch(3)]
    for seq, payload in enumerate(batches):
        publisher.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payload))

    async def follow() -> None:
        task = asyncio.create_task(stream.run())
        deadline = time.monotonic() + 5
        while stream.stats.batches < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()

    asyncio.run(follow())
    assert (stream.stats.batches, stream.stats.malformed, stream.stats.gaps_cleared) == (2, 1, 1)
    assert index.longest_prefix([1]) == {} and index.longest_prefix([3]) == {R: 1}
    publisher.close()
    sync_context.destroy(linger=0)
    context.destroy(linger=0)


def test_each_data_parallel_rank_is_followed_on_its_own_endpoint(tmp_path: Path) -> None:
    """vLLM's publisher for rank 1, configured with the replica's ipc endpoints, publishes on
    the rank's own sockets (pools.vllm_compat.register_rank_event_endpoints, as loaded in every engine process); the map
    keys its blocks by that rank's target. A stream that expects another rank takes none."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    from pools.vllm_compat import rank_endpoint
    from pools.vllm_compat import register_rank_event_endpoints as register
    from router.wire import target_id

    register()
    base, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    publisher = ZmqEventPublisher(data_parallel_rank=1, endpoint=base, replay_endpoint=replay)
    assert publisher.get_publisher_config().endpoint == rank_endpoint(base, 1) == f"{base}_dp1"
    index, context = KVBlockIndex(), zmq.asyncio.Context()
    target, wrong = target_id("r", 1), target_id("r", 0)
    right = ReplicaEventStream(target, rank_endpoint(base, 1), rank_endpoint(replay, 1), index,
                               context, rank=1)
    mixed = ReplicaEventStream(wrong, rank_endpoint(base, 1), None, index, context, rank=0)
    try:
        time.sleep(0.3)  # let the subscriptions reach the publisher
        publish(publisher, [1], [2])
        drain(right, 2)

        async def poll_mixed() -> None:
            deadline = time.monotonic() + 5
            while mixed.stats.malformed < 1 and time.monotonic() < deadline:
                await mixed.poll(0.1)

        asyncio.run(poll_mixed())
        assert index.longest_prefix([1, 2]) == {target: 2}  # "r/dp1", from rank 1's events
        assert (mixed.stats.batches, index.blocks_of(wrong)) == (0, 0)
        assert mixed.stats.malformed >= 1
    finally:
        right.close()
        mixed.close()
        publisher.shutdown()
        context.destroy()
