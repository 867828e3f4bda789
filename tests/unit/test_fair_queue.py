"""The fair queue: shares by weight on tokens, priority classes, bounds, no credit from idling."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from orchestrator.gateway.errors import GatewayError
from orchestrator.gateway.fair_queue import FairQueue


async def _served_order(queue: FairQueue, requests: list[tuple[str, float, float, str]],
                        slots: int) -> list[str]:
    """Queue every request behind `slots` blockers, then free slots one at a time; return the
    tenants in the order they were admitted."""
    for _ in range(slots):
        await queue.acquire("blocker", 0)
    order: list[str] = []

    async def one(tenant: str, cost: float, weight: float, priority: str) -> None:
        await queue.acquire(tenant, cost, weight, priority)
        order.append(tenant)

    tasks = []
    for request in requests:
        tasks.append(asyncio.create_task(one(*request)))
        await asyncio.sleep(0)  # enqueue in this order
    queue.release("blocker", 0, 0)
    admitted = 0
    while admitted < len(requests):
        await asyncio.sleep(0)
        while admitted < len(order):
            tenant, cost, weight, _ = next(r for r in requests if r[0] == order[admitted])
            admitted += 1
            queue.release(tenant, cost, cost, weight)
    await asyncio.gather(*tasks)
    return order


def test_light_tenant_is_not_starved_by_a_heavy_one() -> None:
    queue = FairQueue(capacity=1, max_queued=100, timeout_s=5)
    requests = [("heavy", 100, 1.0, "normal")] * 10 + [("light", 100, 1.0, "normal")]
    order = asyncio.run(_served_order(queue, requests, slots=1))
    assert order.index("light") <= 1  # at most one heavy request ahead of it


def test_backlogged_tenants_share_tokens_by_weight() -> None:
    queue = FairQueue(capacity=1, max_queued=1000, timeout_s=5)
    requests = [("a", 100, 2.0, "normal")] * 60 + [("b", 100, 1.0, "normal")] * 60
    order = asyncio.run(_served_order(queue, requests, slots=1))
    first = Counter(order[:60])  # while both are backlogged
    assert first["a"] == pytest.approx(2 * first["b"], abs=2)


def test_tokens_not_requests_are_what_is_shared() -> None:
    queue = FairQueue(capacity=1, max_queued=1000, timeout_s=5)
    requests = [("big", 400, 1.0, "normal")] * 20 + [("small", 100, 1.0, "normal")] * 80
    order = asyncio.run(_served_order(queue, requests, slots=1))
    first = Counter(order[:50])
    assert 400 * first["big"] == pytest.approx(100 * first["small"], rel=0.15)


def test_higher_priority_class_goes_first() -> None:
    queue = FairQueue(capacity=1, max_queued=100, timeout_s=5)
    requests = [("batch", 10, 1.0, "low")] * 3 + [("web", 10, 1.0, "normal")] * 2 + \
        [("pager", 10, 1.0, "high")]
    order = asyncio.run(_served_order(queue, requests, slots=1))
    assert order == ["pager", "web", "web", "batch", "batch", "batch"]


def test_idle_tenant_does_not_bank_credit() -> None:
    async def scenario() -> list[str]:
        queue = FairQueue(capacity=1, max_queued=100, timeout_s=5)
        for _ in range(20):  # a alone for a while: its counter grows to 2000
            await queue.acquire("a", 100)
            queue.release("a", 100, 100)
        # b was idle; now both are backlogged: b is lifted, so they alternate instead of b
        # taking the next 20 slots
        requests = [("a", 100, 1.0, "normal")] * 10 + [("b", 100, 1.0, "normal")] * 10
        return await _served_order(queue, requests, slots=1)

    order = asyncio.run(scenario())
    assert Counter(order[:10])["b"] <= 6


def test_bounds_full_queue_timeout_and_abandon() -> None:
    async def scenario() -> None:
        queue = FairQueue(capacity=1, max_queued=1, timeout_s=0.2)
        await queue.acquire("a", 1)
        waiting = asyncio.create_task(queue.acquire("a", 1))
        await asyncio.sleep(0)
        with pytest.raises(GatewayError) as info:
            await queue.acquire("a", 1)
        assert info.value.status == 429 and info.value.code == "queue_full"
        with pytest.raises(GatewayError) as info:
            await waiting
        assert info.value.status == 503 and info.value.code == "queue_timeout"
        assert queue.queued("a") == 0
        abandoned = asyncio.create_task(queue.acquire("b", 1))
        await asyncio.sleep(0)
        abandoned.cancel()
        with pytest.raises(asyncio.CancelledError):
            await abandoned
        assert queue.queued("b") == 0
        queue.release("a", 1, 1)
        assert queue.in_flight == 0
        assert await queue.acquire("c", 1) == 0.0

    asyncio.run(scenario())


def test_no_capacity_means_no_queue() -> None:
    async def scenario() -> None:
        queue = FairQueue(capacity=None, max_queued=0, timeout_s=1)
        for _ in range(100):
            assert await queue.acquire("a", 1000) == 0.0

    asyncio.run(scenario())
