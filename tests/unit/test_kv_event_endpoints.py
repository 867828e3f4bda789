"""KV event endpoints of a replica: ipc for one node; tcp on the node's address, through the
forwarder, with vLLM's real publisher behind it (live stream and replay)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import zmq.asyncio

from pools.kv_events import EventForwarder, plan_endpoints
from router.event_sync import ReplicaEventStream
from router.index import KVBlockIndex, ReplicaId


def test_ipc_plan_is_node_local(tmp_path: Path) -> None:
    plan = plan_endpoints("ipc", tmp_path / "r", "127.0.0.1")
    assert plan.public == plan.engine == f"ipc://{tmp_path}/r.kv"
    assert plan.replay == f"ipc://{tmp_path}/r.replay"


def test_tcp_forwarder_serves_the_engine_stream_on_the_node_address(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    plan = plan_endpoints("tcp", tmp_path / "r", "127.0.0.1")
    assert plan.engine.startswith("ipc://")
    assert plan.public.startswith("tcp://127.0.0.1:") and plan.replay.startswith("tcp://127.0.0.1:")
    publisher = ZmqEventPublisher(data_parallel_rank=0, endpoint=plan.engine,
                                  replay_endpoint=plan.replay)
    EventForwarder(plan).start()
    context = zmq.asyncio.Context()

    async def follow() -> None:
        index = KVBlockIndex()
        stream = ReplicaEventStream(ReplicaId("r"), plan.public, plan.replay, index, context)
        await asyncio.sleep(0.5)  # the subscription reaches the forwarder
        assert await stream.catch_up() == 1
        store([3])
        deadline = time.monotonic() + 5
        while stream.stats.batches < 2 and time.monotonic() < deadline:
            await stream.poll(0.1)
        assert index.longest_prefix([1, 2]) == {"r": 2} and index.blocks_of(ReplicaId("r")) == 3
        assert stream.stats.duplicates == 0 and stream.stats.gaps_cleared == 0
        stream.close()

    try:
        def store(hashes: list[int]) -> None:
            publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
                lora_id=None, medium="GPU", lora_name=None)]))

        store([1, 2])  # before anyone follows: only the replay endpoint has it
        time.sleep(0.3)
        asyncio.run(follow())
    finally:
        publisher.shutdown()
        context.destroy(linger=0)
