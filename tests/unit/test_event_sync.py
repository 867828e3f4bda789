"""Event streams against vLLM's real ZMQ publisher (in process, ipc sockets): in-order apply,
late join and dropped subscriptions recovered through replay, clear when replay is impossible,
a malformed batch skipped without losing the order."""

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


def test_malformed_batch_is_skipped_and_the_order_kept(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    def batch(hashes: list[int]) -> bytes:
        return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
            lora_id=None, medium="GPU", lora_name=None)]))

    sync_context, context, index = zmq.Context(), zmq.asyncio.Context(), KVBlockIndex()
    publisher = sync_context.socket(zmq.PUB)
    publisher.bind(f"ipc://{tmp_path}/pub")
    stream = ReplicaEventStream(R, f"ipc://{tmp_path}/pub", None, index, context)
    time.sleep(0.3)
    for seq, payload in enumerate([batch([1]), b"\x93garbage", batch([2])]):
        publisher.send_multipart((b"kv-events", seq.to_bytes(8, "big"), payload))

    async def follow() -> None:
        task = asyncio.create_task(stream.run())
        deadline = time.monotonic() + 5
        while stream.stats.batches < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()

    asyncio.run(follow())
    assert (stream.stats.batches, stream.stats.malformed, stream.stats.gaps_cleared) == (2, 1, 0)
    assert index.blocks_of(R) == 2
    publisher.close()
    sync_context.destroy(linger=0)
    context.destroy(linger=0)
