"""Circuit breakers: the state machine on an injected clock, and the dispatcher leaving a
replica whose requests keep failing out of its choices; and load shedding (scripted replicas,
real channel)."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from orchestrator.gateway.flows import UnifiedFlow
from router.breaker import CircuitBreakers
from router.metrics import RouterMetrics
from router.policies import build_policy
from router.service import RoutingService
from tests.unit.replicas import ScriptedReplica, Step
from tests.unit.test_flows import BODY, DECODED, call, connected, pool, run, serve


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_failures_in_the_window_probes_then_closes_or_backs_off() -> None:
    clock = Clock()
    breakers = CircuitBreakers(failures=3, window_s=10, open_s=5, clock=clock)
    assert not breakers.failed("r") and not breakers.failed("r")
    clock.now += 11  # the first two leave the window
    assert not breakers.failed("r") and not breakers.failed("r")
    assert breakers.allows("r") and breakers.state("r") == "closed"
    assert breakers.failed("r")  # three within 10 s
    assert not breakers.allows("r") and breakers.state("r") == "open"
    clock.now += 5
    assert breakers.allows("r") and breakers.state("r") == "half_open"  # one probe may go
    assert breakers.failed("r")  # the probe failed: open again, twice as long
    clock.now += 9
    assert not breakers.allows("r")
    clock.now += 1
    assert breakers.allows("r")
    breakers.answered("r")  # the probe was answered
    assert breakers.state("r") == "closed" and breakers.trips("r") == 2
    assert breakers.allows("other") and breakers.state("other") == "closed"


def test_a_replica_that_keeps_failing_stops_being_chosen_until_its_probe() -> None:
    async def scenario() -> None:
        broken = await ScriptedReplica("r1", [Step("fail")]).start()
        healthy = await ScriptedReplica("r2", DECODED).start()
        registry = CollectorRegistry()
        service = RoutingService("main", build_policy("round_robin"), lambda size: None,
                                 RouterMetrics(registry),
                                 breakers=CircuitBreakers(failures=2, window_s=30, open_s=0.5))
        main = pool("main", broken, healthy, retries=2, service=service)
        await connected(main)
        for _ in range(8):
            assert (await serve(UnifiedFlow(main), call(BODY))).completion_tokens == 2
        assert len(broken.requests) == 2  # two failures opened its breaker; then left alone
        assert service.replicas()["r1"]["breaker"] == "open"
        service.record_metrics()
        assert registry.get_sample_value("tokenfab_router_breaker_open",
                                         {"pool": "main", "replica": "r1"}) == 1
        assert registry.get_sample_value("tokenfab_router_breaker_trips_total",
                                         {"pool": "main", "replica": "r1"}) == 1
        await asyncio.sleep(0.6)
        for _ in range(4):  # the probe fails: open again, for 1 s now
            assert (await serve(UnifiedFlow(main), call(BODY))).completion_tokens == 2
        assert len(broken.requests) == 3 and service.replicas()["r1"]["breaker"] == "open"
    run(scenario())


def test_with_every_breaker_open_the_pool_still_serves() -> None:
    """A pool never shuts itself off: with no replica allowed, the breakers are ignored."""
    async def scenario() -> None:
        flaky = await ScriptedReplica("r1", [Step("fail")], [Step("fail")], DECODED).start()
        service = RoutingService("main", build_policy("round_robin"), lambda size: None,
                                 breakers=CircuitBreakers(failures=2, window_s=30, open_s=60))
        main = pool("main", flaky, service=service)
        await connected(main)
        for _ in range(2):
            try:
                await serve(UnifiedFlow(main), call(BODY))
            except Exception:  # noqa: BLE001 - the two scripted failures
                pass
        assert service.replicas()["r1"]["breaker"] == "open"
        started = time.monotonic()
        assert (await serve(UnifiedFlow(main), call(BODY))).completion_tokens == 2
        assert time.monotonic() - started < 1
    run(scenario())


def test_load_shedding_refuses_new_requests_when_every_engine_queue_is_full() -> None:
    """pools[].shed_waiting: with every ready replica reporting that many requests waiting, a
    new request is a 503 with Retry-After at once, sent nowhere; one replica below the bound
    is enough to serve."""
    import msgspec

    from orchestrator.gateway.errors import GatewayError

    async def scenario() -> None:
        replicas = [await ScriptedReplica(f"r{i}", DECODED).start() for i in range(2)]
        main = pool("main", *replicas, shed_waiting=4)

        def report(waiting: list[int]) -> None:
            main.update([msgspec.structs.replace(
                r.report(), load=msgspec.structs.replace(r.report().load, waiting=w))
                for r, w in zip(replicas, waiting)])

        report([4, 7])
        await connected(main)
        started = time.monotonic()
        try:
            await serve(UnifiedFlow(main), call(BODY))
        except GatewayError as exc:
            assert (exc.status, exc.code, exc.headers()) == (503, "overloaded",
                                                             {"retry-after": "1"})
        else:
            raise AssertionError("an overloaded pool took the request")
        assert time.monotonic() - started < 0.5 and not any(r.requests for r in replicas)
        report([4, 3])
        assert (await serve(UnifiedFlow(main), call(BODY))).completion_tokens == 2
    run(scenario())
