"""The replica registry's entries over an in-memory stand-in for the GCS key-value store: what a
reader lists, on its own clock, and what it deletes. (tests/integration/test_migration.py runs
the same code against a real GCS.)"""

from __future__ import annotations

import asyncio
import types

import msgspec
import pytest

from autoscaler.records import ScaleRecord
from pools import registry
from pools.engine import LoadSnapshot
from pools.registry import DELETE_AFTER_TTLS, IngressReport, Registry, ReplicaReport


class FakeGcs:
    """The GCS client's key-value calls that the registry uses, in one namespace."""

    def __init__(self) -> None:
        self.kv: dict[bytes, bytes] = {}

    async def async_internal_kv_put(self, key, value, overwrite, namespace, timeout=None):
        self.kv[key] = value
        return True

    async def async_internal_kv_del(self, key, by_prefix, namespace, timeout=None):
        return int(self.kv.pop(key, None) is not None)

    async def async_internal_kv_keys(self, prefix, namespace, timeout=None):
        return [k for k in self.kv if k.startswith(prefix)]

    async def async_internal_kv_multi_get(self, keys, namespace, timeout=None):
        return {k: self.kv[k] for k in keys if k in self.kv}


class Clocks:
    """The registry's wall clock (writers' stamps) and monotonic clock (readers' judgement)."""

    def __init__(self) -> None:
        self.wall, self.mono = 1_000_000.0, 50.0

    def time(self) -> float:
        return self.wall

    def monotonic(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


@pytest.fixture
def gcs(monkeypatch: pytest.MonkeyPatch) -> FakeGcs:
    fake = FakeGcs()
    monkeypatch.setattr(registry, "gcs_client", lambda: fake)
    return fake


@pytest.fixture
def clocks(monkeypatch: pytest.MonkeyPatch) -> Clocks:
    clocks = Clocks()
    monkeypatch.setattr(registry, "time", types.SimpleNamespace(time=clocks.time,
                                                                monotonic=clocks.monotonic))
    return clocks


def _report(replica_id: str, in_flight: int = 0) -> ReplicaReport:
    return ReplicaReport(app="a", pool="main", role="unified", replica_id=replica_id,
                         node_ip="127.0.0.1", pid=0, cores=[], state="ready",
                         load=LoadSnapshot(in_flight=in_flight))


async def _settle() -> None:
    """Let the deletes a reader left running in the background finish."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_report_is_listed_while_rewritten_then_dropped_then_deleted(gcs, clocks) -> None:
    async def run() -> None:
        writer, reader = Registry("a"), Registry("a", ttl_s=10.0)
        await writer.report(_report("r1", in_flight=2))
        [listed] = await reader.snapshot()
        assert (listed.replica_id, listed.load.in_flight) == ("r1", 2)
        for _ in range(3):  # rewritten every 5 s: listed throughout
            clocks.advance(5.0)
            await writer.report(_report("r1"))
            assert [r.replica_id for r in await reader.snapshot()] == ["r1"]
        clocks.advance(10.5)  # its writer stopped
        assert await reader.snapshot() == []
        assert gcs.kv, "dropped from the listing, not yet deleted"
        clocks.advance(DELETE_AFTER_TTLS * 10.0)
        assert await reader.snapshot() == []
        await _settle()
        assert gcs.kv == {}

    asyncio.run(run())


def test_freshness_is_judged_on_the_readers_clock_not_the_writers(gcs, clocks) -> None:
    """A writer whose clock is 40 s behind (another node) is listed while it writes."""
    async def run() -> None:
        reader = Registry("a", ttl_s=10.0)
        for _ in range(4):
            clocks.wall -= 40.0
            await Registry("a").report(_report("slow-clock"))
            clocks.wall += 40.0
            assert [r.replica_id for r in await reader.snapshot()] == ["slow-clock"]
            clocks.advance(3.0)

    asyncio.run(run())


def test_an_entry_long_dead_when_first_seen_is_not_listed_and_is_deleted(gcs, clocks) -> None:
    async def run() -> None:
        await Registry("a").report(_report("crashed"))
        clocks.advance(DELETE_AFTER_TTLS * 10.0 + 1.0)
        await Registry("a").report(_report("alive"))
        assert [r.replica_id for r in await Registry("a", ttl_s=10.0).snapshot()] == ["alive"]
        await _settle()
        assert list(gcs.kv) == [b"registry/a/replica/alive"]

    asyncio.run(run())


def test_apps_and_kinds_do_not_see_each_other(gcs, clocks) -> None:
    async def run() -> None:
        await Registry("a").report(_report("r1"))
        await Registry("a2").report(_report("r2"))
        await Registry("a").announce(IngressReport("g1", "127.0.0.1:1"))
        assert [r.replica_id for r in await Registry("a").snapshot()] == ["r1"]
        assert [r.replica_id for r in await Registry("a2").snapshot()] == ["r2"]
        assert [i.replica_id for i in await Registry("a").ingresses()] == ["g1"]
        assert await Registry("a2").ingresses() == []
        await Registry("a").forget("g1")
        assert await Registry("a").ingresses() == []

    asyncio.run(run())


def test_an_unreadable_entry_is_skipped_and_deleted(gcs, clocks) -> None:
    async def run() -> None:
        await Registry("a").report(_report("r1"))
        gcs.kv[b"registry/a/replica/old"] = msgspec.msgpack.encode({"replica_id": 3})
        assert [r.replica_id for r in await Registry("a").snapshot()] == ["r1"]
        await _settle()
        assert list(gcs.kv) == [b"registry/a/replica/r1"]

    asyncio.run(run())


def test_record_scale_writes_on_the_running_loop_and_without_one(gcs, clocks) -> None:
    def record(pool: str, desired: int) -> ScaleRecord:
        return ScaleRecord(pool=pool, current=1, desired=desired, reason="test", at=0.0,
                           min_replicas=1, max_replicas=4, ttft_p90_s=1.0, itl_p90_s=0.1)

    registry.record_scale("a", record("outside", 2))  # no loop in this thread: a plain call

    async def run() -> None:
        registry.record_scale("a", record("inside", 3))  # as in Serve's controller loop
        await _settle()
        assert [(r.pool, r.desired) for r in await Registry("a").scaling()] == [
            ("inside", 3), ("outside", 2)]

    asyncio.run(run())
