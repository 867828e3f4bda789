"""The routing service following replicas' real vLLM ZMQ publishers (in process, ipc sockets):
replicas that appear are subscribed (joining late, history replayed), their blocks steer the
ranking, replicas that leave are dropped from the map; metrics follow."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from pools.block_hasher import VllmBlockHasher
from router.index import ReplicaId
from router.metrics import RouterMetrics
from router.policies import build_policy
from router.service import RoutingService
from router.wire import ReplicaView

A, B = ReplicaId("a"), ReplicaId("b")
BLOCK = 16


@pytest.fixture
def publishers(tmp_path: Path):
    from vllm.distributed.kv_events import ZmqEventPublisher

    made = {}
    for name in (A, B):
        made[name] = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{tmp_path}/{name}",
                                       replay_endpoint=f"ipc://{tmp_path}/{name}.replay")
    yield made
    for publisher in made.values():
        publisher.shutdown()


def store(publisher, hashes) -> None:
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=BLOCK,
        lora_id=None, medium="GPU", lora_name=None)]))


def view(name: ReplicaId, publisher) -> ReplicaView:
    config = publisher.get_publisher_config()
    return ReplicaView(replica=name, pool="main", kv_events_endpoint=config.endpoint,
                       kv_replay_endpoint=config.replay_endpoint, block_size=BLOCK)


def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_follows_replicas_ranks_by_their_blocks_and_drops_those_that_leave(publishers) -> None:
    hasher = VllmBlockHasher(BLOCK)
    prompt = list(range(100, 100 + 4 * BLOCK))
    hashes = hasher.block_hashes(prompt)
    store(publishers[B], hashes)  # published before the router exists: recovered by replay
    time.sleep(0.2)
    views = [view(A, publishers[A]), view(B, publishers[B])]
    registry = CollectorRegistry()
    service = RoutingService("main", build_policy("kv_aware"), lambda: list(views),
                             VllmBlockHasher, RouterMetrics(registry), refresh_s=0.1)
    service.start()
    try:
        wait_for(lambda: service.replicas().get(B, {}).get("cached_blocks") == 4)
        key = service.route_key("req-1", prompt)
        assert key.block_hashes == hashes and key.prompt_tokens == 4 * BLOCK
        explained = service.explain(key)  # explaining counts nothing
        assert explained["ranked"][0] == B
        assert {c["replica"]: c["cached_tokens"] for c in explained["candidates"]} == {A: 0, B: 64}
        assert service.rank(key, [A, B]) == [B, A]
        # counted on b at once: an identical request ranked now sees b's request in flight
        # (128 tokens of work) against recomputing 64 tokens on idle a
        assert service.explain(key)["ranked"][0] == A
        assert service.replicas()[B]["caught_up"] == 1

        service.dispatched(key, B)
        assert registry.get_sample_value("tokenfab_router_predicted_cached_tokens_total",
                                         {"pool": "main"}) == 64
        assert registry.get_sample_value("tokenfab_router_decisions_total",
                                         {"pool": "main", "policy": "kv_aware"}) == 1
        service.finished("req-1")

        store(publishers[A], hashes[:2])  # a now holds half of it too
        wait_for(lambda: service.replicas()[A]["cached_blocks"] == 2)
        views.remove(views[1])  # b leaves (scaled down, or restarted under a new id)
        wait_for(lambda: B not in service.replicas())
        assert service.index_entries() == 2
        assert service.rank(key, [A]) == [A]
        assert registry.get_sample_value("tokenfab_router_event_batches_total",
                                         {"pool": "main"}) == 2
    finally:
        service.stop()


def test_no_route_key_before_any_replica_reports_a_block_size() -> None:
    service = RoutingService("main", build_policy("round_robin"), lambda: [], VllmBlockHasher)
    assert service.route_key("r", list(range(64))) is None
    assert service.rank(None, [B, A]) in ([A, B], [B, A])


def test_two_ingress_replicas_build_the_same_map(publishers) -> None:
    """Each ingress process runs its own service on the same event streams: same map, same
    ranking, without talking to each other."""
    hasher = VllmBlockHasher(BLOCK)
    prompt = list(range(500, 500 + 3 * BLOCK))
    views = [view(A, publishers[A]), view(B, publishers[B])]
    services = [RoutingService("main", build_policy("kv_aware"), lambda: list(views),
                               VllmBlockHasher, refresh_s=0.1) for _ in range(2)]
    for service in services:
        service.start()
    try:
        wait_for(lambda: all(len(s.replicas()) == 2 for s in services))
        time.sleep(0.3)  # both subscriptions reach the publishers
        store(publishers[A], hasher.block_hashes(prompt)[:1])
        store(publishers[B], hasher.block_hashes(prompt))
        wait_for(lambda: all(s.index_entries() == 4 for s in services))
        keys = [s.route_key(f"r{i}", prompt) for i, s in enumerate(services)]
        assert [s.explain(k)["ranked"][0] for s, k in zip(services, keys)] == [B, B]
        assert services[0].replicas() == services[1].replicas()
    finally:
        for service in services:
            service.stop()
