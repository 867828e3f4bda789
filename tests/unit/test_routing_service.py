"""The routing service following replicas' real vLLM ZMQ publishers (in process, ipc sockets):
replicas that appear are subscribed (joining late, history replayed), their blocks steer the
ranking, replicas that leave are dropped from the map; metrics follow."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.hashing import PrefixBlockHasher
from router.index import ReplicaId
from router.metrics import RouterMetrics
from router.policies import build_policy
from router.service import RoutingService
from router.wire import ReplicaView, RouteKey

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


def view(name: ReplicaId, publisher, kv_blocks: int = 0) -> ReplicaView:
    config = publisher.get_publisher_config()
    return ReplicaView(replica=name, pool="main", kv_events_endpoint=config.endpoint,
                       kv_replay_endpoint=config.replay_endpoint, block_size=BLOCK,
                       kv_blocks=kv_blocks)


async def wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_follows_replicas_ranks_by_their_blocks_and_drops_those_that_leave(publishers) -> None:
    hasher = PrefixBlockHasher(BLOCK)
    prompt = list(range(100, 100 + 4 * BLOCK))
    hashes = hasher.block_hashes(prompt)
    store(publishers[B], hashes)  # published before the router exists: recovered by replay
    time.sleep(0.2)
    views = [view(A, publishers[A]), view(B, publishers[B])]
    registry = CollectorRegistry()
    service = RoutingService("main", build_policy("kv_aware"), PrefixBlockHasher,
                             RouterMetrics(registry))

    async def scenario() -> None:
        service.set_replicas(views)
        await wait_for(lambda: service.replicas().get(B, {}).get("cached_blocks") == 4)
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

        await asyncio.sleep(0.3)  # a's subscription reaches its publisher
        store(publishers[A], hashes[:2])  # a now holds half of it too
        await wait_for(lambda: service.replicas()[A]["cached_blocks"] == 2)
        service.set_replicas(views[:1])  # b leaves (scaled down, or restarted under a new id)
        assert B not in service.replicas() and service.index_entries() == 2
        assert service.rank(key, [A]) == [A]
        service.record_metrics()
        assert registry.get_sample_value("tokenfab_router_event_batches_total",
                                         {"pool": "main"}) == 1  # a's; b's left with b
        assert registry.get_sample_value("tokenfab_router_followed_replicas",
                                         {"pool": "main"}) == 1

    try:
        asyncio.run(scenario())
    finally:
        service.stop()


def test_policies_without_prefixes_hash_nothing_and_follow_no_events(publishers) -> None:
    service = RoutingService("main", build_policy("round_robin"), PrefixBlockHasher)

    async def scenario() -> None:
        key = service.route_key("r", list(range(64)))  # no replica yet: no block size
        assert (key.prompt_tokens, key.block_size, key.block_hashes) == (64, 0, [])
        ranked = service.rank(key, [B, A])
        assert ranked in ([A, B], [B, A])
        assert (service.in_flight(ranked[0]), service.in_flight(ranked[1])) == (1, 0)  # counted
        assert service.rank(service.route_key("r1", [1]), [B, A]) == ranked[::-1]  # in turn
        service.set_replicas([view(A, publishers[A])])
        key = service.route_key("r2", list(range(64)))
        assert (key.block_size, key.block_hashes) == (BLOCK, [])  # round robin reads no prefix
        assert service.replicas()[A]["event_batches"] == 0 and not service._tasks

    asyncio.run(scenario())
    service.stop()


def test_two_ingress_replicas_build_the_same_map(publishers) -> None:
    """Each ingress process runs its own service on the same event streams: same map, same
    ranking, without talking to each other."""
    hasher = PrefixBlockHasher(BLOCK)
    prompt = list(range(500, 500 + 3 * BLOCK))
    views = [view(A, publishers[A]), view(B, publishers[B])]
    services = [RoutingService("main", build_policy("kv_aware"), PrefixBlockHasher)
                for _ in range(2)]

    async def scenario() -> None:
        for service in services:
            service.set_replicas(views)
        await asyncio.sleep(0.5)  # both subscriptions reach the publishers
        store(publishers[A], hasher.block_hashes(prompt)[:1])
        store(publishers[B], hasher.block_hashes(prompt))
        await wait_for(lambda: all(s.index_entries() == 4 for s in services))
        keys = [s.route_key(f"r{i}", prompt) for i, s in enumerate(services)]
        assert [s.explain(k)["ranked"][0] for s, k in zip(services, keys)] == [B, B]
        assert services[0].replicas() == services[1].replicas()

    try:
        asyncio.run(scenario())
    finally:
        for service in services:
            service.stop()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_new_conversations_fill_both_caches_after_one_slow_sample(publishers) -> None:
    """The light-load collapse: two idle replicas of 64 blocks, one measured slow once (1 s for
    a 4-block prompt), then a stream of new conversation roots, each answered in 50 ms wherever
    it goes. Judged on speed alone, every root goes to the other replica, and the slow one
    never gets the sample that would clear it. Both caches must fill."""
    hasher, clock = PrefixBlockHasher(BLOCK), Clock()
    service = RoutingService("main", build_policy("kv_aware", rng=random.Random(0)),
                             PrefixBlockHasher, clock=clock)
    placed: Counter[ReplicaId] = Counter()

    async def serve(request_id: str, prompt: list[int], replica: ReplicaId | None,
                    seconds: float) -> ReplicaId:
        key = service.route_key(request_id, prompt)
        replica = replica or service.rank(key, [A, B])[0]
        service.dispatched(key, replica)
        blocks = service.replicas()[replica]["cached_blocks"]
        store(publishers[replica], hasher.block_hashes(prompt))  # as the engine does
        await wait_for(lambda: service.replicas()[replica]["cached_blocks"] == blocks + 4)
        clock.now += seconds
        service.first_token(request_id)
        service.finished(request_id)
        clock.now += 0.5
        return replica

    async def scenario() -> None:
        service.set_replicas([view(A, publishers[A], 64), view(B, publishers[B], 64)])
        await asyncio.sleep(0.5)  # the subscriptions reach the publishers
        await serve("slow", list(range(10_000, 10_000 + 4 * BLOCK)), A, 1.0)
        for n in range(24):
            start = 20_000 + 1000 * n
            placed[await serve(f"root-{n}", list(range(start, start + 4 * BLOCK)), None, 0.05)] += 1

    try:
        asyncio.run(scenario())
    finally:
        service.stop()
    assert min(placed[A], placed[B]) >= 8, placed


def test_a_stream_that_fails_is_followed_anew_and_the_map_rebuilt(publishers) -> None:
    """A batch the map cannot apply stops the replica's stream task: its map entries are cleared,
    `/ready` and `/tokenfab/router` see it restarting, and a second later it is subscribed
    again and caught up from the replica's buffer."""
    service = RoutingService("main", build_policy("kv_aware"), PrefixBlockHasher)
    index, failures = service._index, []
    apply = index.apply

    def apply_failing_once(replica, batch) -> None:
        if not failures:
            failures.append(replica)
            raise RuntimeError("a bug in applying this batch")
        apply(replica, batch)

    index.apply = apply_failing_once
    seen: set[str] = set()

    async def scenario() -> None:
        service.set_replicas([view(A, publishers[A])])
        await asyncio.sleep(0.5)
        service.dispatched(service.route_key("running", list(range(2 * BLOCK))), A)
        store(publishers[A], [1, 2, 3])
        await wait_for(lambda: bool(failures))
        await wait_for(lambda: seen.add(service.replicas()[A]["events"]) or
                       service.replicas()[A]["cached_blocks"] == 3)
        assert service.stream_health() == {"expected": 1, "following": 1}
        assert service.in_flight(A) == 1  # the engine did not restart: its requests still count

    try:
        asyncio.run(scenario())
    finally:
        service.stop()
    assert seen >= {"restarting", "following"}


def test_a_large_pool_scores_a_shortlist_and_still_offers_every_replica() -> None:
    """Past max_candidates the holder of the request's prefix is still found (the longest
    holders are on the shortlist) and every replica is in the answer, the unscored ones as
    fallbacks."""
    from router.events import NO_TOKENS, BlockStored, KVEventBatch

    pool = [ReplicaId(f"r{i}") for i in range(32)]
    policy = build_policy("kv_aware", max_candidates=4, rng=random.Random(0))
    service = RoutingService("main", policy, PrefixBlockHasher, follow_events=False)
    service.set_replicas([ReplicaView(replica=r, pool="main", block_size=BLOCK, kv_blocks=100)
                          for r in pool])
    holder = pool[17]
    service.apply_events(holder, KVEventBatch(0.0, [BlockStored(
        block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=NO_TOKENS, block_size=BLOCK,
        lora_id=None, medium="GPU", lora_name=None)]))
    for i in range(20):
        ranked = service.rank(RouteKey(f"q{i}", 64, BLOCK, [1, 2, 3, 4]), pool)
        assert ranked[0] == holder and sorted(ranked) == sorted(pool)
        service.finished(f"q{i}")
    firsts = Counter(service.rank(RouteKey(f"n{i}", 64, BLOCK, [9]), pool)[0] for i in range(200))
    assert len(firsts) > 16  # new prompts spread over the pool, not over a fixed four


def test_unscored_fallbacks_come_before_replicas_the_overload_filter_dropped() -> None:
    from router.events import NO_TOKENS, BlockStored, KVEventBatch

    pool = [ReplicaId(f"r{i}") for i in range(8)]
    policy = build_policy("kv_aware", max_candidates=4, max_in_flight=1, rng=random.Random(0))
    service = RoutingService("main", policy, PrefixBlockHasher, follow_events=False)
    service.set_replicas([ReplicaView(replica=r, pool="main", block_size=BLOCK, kv_blocks=100)
                          for r in pool])
    service.apply_events(pool[0], KVEventBatch(0.0, [BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=NO_TOKENS, block_size=BLOCK,
        lora_id=None, medium="GPU", lora_name=None)]))
    assert service.rank(RouteKey("q0", 64, BLOCK, [1, 2, 3]), pool)[0] == pool[0]
    ranked = service.rank(RouteKey("q1", 64, BLOCK, [1, 2, 3]), pool)  # pool[0] is at 1 now
    assert ranked[-1] == pool[0] and sorted(ranked) == sorted(pool)


def test_without_a_fixed_bound_each_replica_is_full_at_its_engines_batch() -> None:
    """router.max_in_flight unset: a replica reporting max_num_seqs 3 is passed over at 3 in
    flight, however much it holds, and one reporting 256 keeps its prefix's requests at 100;
    one that has not reported yet is full at 64. (Ranked by the prefix alone, so that only the
    filter turns a holder away.)"""
    from router.events import NO_TOKENS, BlockStored, KVEventBatch

    small, large, unknown, idle = (ReplicaId(n) for n in ("small", "large", "unknown", "idle"))
    policy = build_policy("kv_aware", {"prefix": 1.0}, rng=random.Random(0))
    service = RoutingService("main", policy, PrefixBlockHasher, follow_events=True)
    service.set_replicas([ReplicaView(replica=r, pool="main", block_size=BLOCK, kv_blocks=1000,
                                      max_num_seqs=slots)
                          for r, slots in ((small, 3), (large, 256), (unknown, 0), (idle, 8))])
    for serial, replica in enumerate((small, large, unknown)):
        hashes = [10 * serial + i for i in range(1, 5)]
        service.apply_events(replica, KVEventBatch(0.0, [BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=NO_TOKENS, block_size=BLOCK,
            lora_id=None, medium="GPU", lora_name=None)]))

    def kept(serial: int, load: int) -> bool:
        """Whether the holder of the prompt is chosen with `load` requests in flight there."""
        replica = (small, large, unknown)[serial]
        for i in range(load):
            service.dispatched(RouteKey(f"{replica}-{i}", BLOCK, BLOCK, [99]), replica)
            service.first_token(f"{replica}-{i}")
        key = RouteKey(f"q{serial}-{load}", 4 * BLOCK + 1, BLOCK,
                       [10 * serial + i for i in range(1, 5)])
        chosen = service.rank(key, [small, large, unknown, idle])[0]
        for i in range(load):
            service.finished(f"{replica}-{i}")
        return chosen == replica

    assert (kept(0, 2), kept(0, 3)) == (True, False)
    assert (kept(1, 100), kept(2, 63), kept(2, 64)) == (True, True, False)


def test_cached_tokens_count_a_replica_the_request_can_go_to() -> None:
    """What decode holds, for the P/D gateway's skip: the block map's longest prefix on a
    replica the policy could choose now (not one its overload filter or breaker drops), less the
    last token's block of a prompt held whole; None without events."""
    from router.events import NO_TOKENS, BlockRemoved, BlockStored, KVEventBatch

    a, b, c = ReplicaId("a"), ReplicaId("b"), ReplicaId("c")
    policy = build_policy("kv_aware", max_in_flight=2, rng=random.Random(0))
    service = RoutingService("decode", policy, PrefixBlockHasher, follow_events=True)
    service.set_replicas([ReplicaView(replica=r, pool="decode", block_size=BLOCK, kv_blocks=100)
                          for r in (a, b, c)])
    for replica, hashes in ((a, [1, 2, 3, 4]), (b, [1, 2])):
        service.apply_events(replica, KVEventBatch(0.0, [BlockStored(
            block_hashes=hashes, parent_block_hash=None, token_ids=NO_TOKENS, block_size=BLOCK,
            lora_id=None, medium="GPU", lora_name=None)]))
    key = RouteKey("q", 4 * BLOCK, BLOCK, [1, 2, 3, 4])
    assert service.cached_tokens(key) == 3 * BLOCK  # all of it on a; its last block recomputed
    assert service.cached_tokens(RouteKey("q", 4 * BLOCK + 5, BLOCK, [1, 2, 3, 4])) == 4 * BLOCK
    for i in range(2):  # a at its in-flight bound while b and c have room: b's 2 blocks count
        service.dispatched(RouteKey(f"r{i}", BLOCK, BLOCK, [9]), a)
    assert service.cached_tokens(key) == 2 * BLOCK
    for i in range(2):  # every replica at the bound: the filter keeps all, a counts again
        service.dispatched(RouteKey(f"s{i}", BLOCK, BLOCK, [9]), b)
        service.dispatched(RouteKey(f"t{i}", BLOCK, BLOCK, [9]), c)
    assert service.cached_tokens(key) == 3 * BLOCK
    service.apply_events(a, KVEventBatch(1.0, [BlockRemoved(block_hashes=[3, 4], medium=None)]))
    assert service.cached_tokens(key) == 2 * BLOCK  # an eviction the engine reports ends it
    unfed = RoutingService("decode", build_policy("least_loaded"), PrefixBlockHasher)
    assert unfed.cached_tokens(key) is None


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _loaded(weights: dict[str, float], slow: ReplicaId | None = None) -> RoutingService:
    """Replicas a and b on a clock of the test's own; `slow`'s first tokens measured 3x slower
    than the other's (10 each); then a runs three requests (their prompts done) and b has one
    600-token prompt queued."""
    policy = build_policy("kv_aware", weights, rng=random.Random(0))
    clock = _Clock()
    service = RoutingService("main", policy, PrefixBlockHasher, follow_events=False, clock=clock)
    service.set_replicas([ReplicaView(replica=r, pool="main", block_size=BLOCK, kv_blocks=1000)
                          for r in (A, B)])
    if slow is not None:
        for i in range(10):
            for replica in (A, B):
                service.dispatched(RouteKey(f"sample-{replica}{i}", 1000, BLOCK, []), replica)
                clock.advance(0.81 if replica == slow else 0.27)
                service.first_token(f"sample-{replica}{i}")
                service.finished(f"sample-{replica}{i}")
    for i in range(3):
        service.dispatched(RouteKey(f"running{i}", 0, BLOCK, []), A)
    service.dispatched(RouteKey("queued", 600, BLOCK, []), B)
    return service


NEW = RouteKey("new", 1024, BLOCK, list(range(100, 164)))


def test_the_delay_score_sends_a_long_new_prompt_past_the_replica_running_most() -> None:
    """A new 1,024-token prompt waits less on a (0.372 s against 0.458 s at the TTFT model's
    prior: 4,000 tokens/s, 128 tokens a request in flight, 0.02 s), but on a three requests
    would wait through its prefill and on b one (1.140 s against 0.714 s in all): `ttft`
    alone picks a, `delay` b."""
    assert _loaded({"ttft": 1.0}).rank(NEW, [A, B])[0] == A
    assert _loaded({"delay": 1.0}).rank(NEW, [A, B])[0] == B


def test_the_delay_score_reads_each_replicas_fitted_ttft_model() -> None:
    """The same, with b's first tokens measured 3x slower than a's: b's estimate grows past
    a's (the explanation's numbers), and `rank` sees it too."""
    service = _loaded({"delay": 1.0}, slow=B)
    explained = {c["replica"]: c["estimated_delay_s"] for c in service.explain(NEW)["candidates"]}
    assert explained[A] < explained[B]
    assert service.rank(NEW, [A, B])[0] == A


def test_kv_aware_routes_within_each_pools_ttft_target() -> None:
    """The router's TTFT target is the pool's own, the topology's, `router.ttft_target_s` when
    set, and none at 0."""
    from prometheus_client import CollectorRegistry

    from orchestrator.config import Topology
    from orchestrator.gateway.ingress import routing_service
    from router.metrics import RouterMetrics

    def targets(router: dict) -> dict[str, list[float]]:
        topology = Topology.model_validate({
            "name": "pd", "model": {"name": "m", "path": "/m"}, "router": router,
            "pools": [{"name": "prefill", "role": "prefill", "min_replicas": 1,
                       "max_replicas": 4, "resources": {"gpus": 1},
                       "autoscaling": {"ttft_p90_s": 0.5}},
                      {"name": "decode", "role": "decode", "min_replicas": 1, "max_replicas": 4,
                       "resources": {"gpus": 1}}],
            "autoscaler": {"ttft_p90_s": 1.0}})
        metrics = RouterMetrics(CollectorRegistry())
        return {pool.name: [f.target_s for f in routing_service(topology, pool, metrics)
                            .policy.filters if f.name == "ttft_target"]
                for pool in topology.pools}

    assert targets({}) == {"prefill": [0.5], "decode": [1.0]}
    assert targets({"ttft_target_s": 3}) == {"prefill": [3.0], "decode": [3.0]}
    assert targets({"ttft_target_s": 0}) == {"prefill": [], "decode": []}
