"""A pool replica whose engine died ends its own process once the requests it held are answered,
so Serve replaces it at once (a failed health check counts only after 3 in a row); until then,
and while its engine lives, its health check is the engine's."""

from __future__ import annotations

import asyncio

import pytest

from tokenfab.errors import EngineDeadError


class _Ended(Exception):
    """Stands for the process's end."""


class _Engine:
    def __init__(self, dead: bool) -> None:
        self.dead = dead

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("engine died")


def _replica(dead: bool, in_flight: int):
    from pools.deployment import PoolReplica

    class Bare(PoolReplica):  # no engine started, none to stop
        def __del__(self) -> None:
            pass

    replica = Bare.__new__(Bare)
    replica._engine, replica._replica_id, replica._state = _Engine(dead), "r1", "ready"
    replica._in_flight, replica._side_channel = in_flight, None
    return replica


@pytest.fixture
def ended(monkeypatch: pytest.MonkeyPatch) -> None:
    def end() -> None:
        raise _Ended
    monkeypatch.setattr("pools.deployment._end_process", end)


def test_a_replica_whose_engine_died_ends_its_process(ended: None) -> None:
    with pytest.raises(_Ended):
        asyncio.run(_replica(dead=True, in_flight=0).check_health())


def test_it_waits_for_the_requests_it_holds_and_fails_its_check_meanwhile(ended: None) -> None:
    with pytest.raises(EngineDeadError):
        asyncio.run(_replica(dead=True, in_flight=2).check_health())


def test_a_live_engine_passes(ended: None) -> None:
    asyncio.run(_replica(dead=False, in_flight=0).check_health())


class _Ingress:
    """A colocated gateway (gateway.colocate) answering `in_flight` requests."""

    def __init__(self, in_flight: int) -> None:
        self.in_flight, self.accepting = in_flight, True

    def check_health(self) -> None:
        pass

    def stop_accepting(self) -> None:
        self.accepting = False


def _colocated(dead: bool, in_flight: int, ingress_in_flight: int):
    from orchestrator.gateway.colocated import PoolReplicaWithIngress

    class Bare(PoolReplicaWithIngress):
        def __del__(self) -> None:
            pass

    replica = Bare.__new__(Bare)
    replica._engine, replica._replica_id, replica._state = _Engine(dead), "r1", "ready"
    replica._in_flight, replica._side_channel = in_flight, None
    replica._ingress = _Ingress(ingress_in_flight)
    return replica


def test_a_colocated_replica_whose_engine_died_ends_after_its_ingress(
        ended: None) -> None:
    """The requests its ingress took are retried or continued on other replicas from this
    process: it ends only once they are answered too."""
    replica = _colocated(dead=True, in_flight=0, ingress_in_flight=1)
    with pytest.raises(EngineDeadError):
        asyncio.run(replica.check_health())
    assert replica._ingress.accepting is False
    replica._ingress.in_flight = 0
    with pytest.raises(_Ended):
        asyncio.run(replica.check_health())


def test_a_colocated_replica_with_a_live_engine_keeps_its_listener(ended: None) -> None:
    replica = _colocated(dead=False, in_flight=0, ingress_in_flight=3)
    asyncio.run(replica.check_health())
    assert replica._ingress.accepting is True
