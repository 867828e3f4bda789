"""/metrics across ingress replicas: whichever replica a scrape reaches answers with every
replica's series, each labelled with its replica, over the real channel on loopback."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.gateway.peers import IngressPeers, merge
from pools.registry import IngressReport

SECRET = b"s" * 32


class Directory:
    """The registry's ingress table, in memory."""

    def __init__(self) -> None:
        self.table: dict[str, IngressReport] = {}

    async def announce(self, report: IngressReport) -> None:
        self.table[report.replica_id] = report

    async def ingresses(self, timeout_s: float = 2.0) -> list[IngressReport]:
        return list(self.table.values())


def _samples(text: bytes, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples if s.name == name}


def _replica(count: int) -> tuple[CollectorRegistry, Counter]:
    registry = CollectorRegistry()
    requests = Counter("tokenfab_gateway_requests", "Requests", ["tenant"], registry=registry)
    requests.labels("alpha").inc(count)
    Histogram("tokenfab_gateway_ttft_seconds", "TTFT", registry=registry,
              buckets=(0.1, 1)).observe(0.5)
    return registry, requests


def test_every_replica_answers_with_all_replicas_series() -> None:
    async def run() -> None:
        directory = Directory()
        replicas = {name: _replica(count) for name, count in (("a", 3), ("b", 5))}
        peers = {name: IngressPeers(name, SECRET, lambda r=registry: generate_latest(r),
                                    directory) for name, (registry, _) in replicas.items()}
        for peer in peers.values():
            await peer.start("127.0.0.1")
        while len(directory.table) < 2:
            await asyncio.sleep(0.01)
        try:
            for answering in peers.values():
                text = await answering.exposition()
                assert _samples(text, "tokenfab_gateway_requests_total") == {
                    (("ingress", "a"), ("tenant", "alpha")): 3.0,
                    (("ingress", "b"), ("tenant", "alpha")): 5.0}
                buckets = _samples(text, "tokenfab_gateway_ttft_seconds_bucket")
                assert buckets[(("ingress", "b"), ("le", "1.0"))] == 1.0
            replicas["b"][1].labels("alpha").inc()  # fresh values, not a snapshot
            text = await peers["a"].exposition()
            assert _samples(text, "tokenfab_gateway_requests_total")[
                (("ingress", "b"), ("tenant", "alpha"))] == 6.0
        finally:
            for peer in peers.values():
                peer.close()

    asyncio.run(run())


def test_a_peer_that_does_not_answer_is_left_out_and_a_stranger_gets_nothing() -> None:
    async def run() -> None:
        directory = Directory()
        registry, _ = _replica(2)
        peer = IngressPeers("a", SECRET, lambda: generate_latest(registry), directory)
        await peer.start("127.0.0.1")
        stranger = IngressPeers("x", b"t" * 32, lambda: b"", Directory())  # another secret
        await directory.announce(IngressReport("gone", "127.0.0.1:1"))  # nothing listens
        try:
            text = await peer.exposition(timeout_s=1.0)
            assert set(_samples(text, "tokenfab_gateway_requests_total")) == {
                (("ingress", "a"), ("tenant", "alpha"))}
            try:
                await stranger._fetch(directory.table["a"], timeout_s=1.0)
            except Exception:  # noqa: BLE001 - dropped without a valid HELLO
                pass
            else:
                raise AssertionError("a peer without the secret got the series")
        finally:
            peer.close()

    asyncio.run(run())


def test_merge_keeps_each_family_together() -> None:
    registry, _ = _replica(1)
    one = generate_latest(registry)
    text = merge({"b": one, "a": one}).decode()
    helps = [line for line in text.splitlines() if line.startswith("# HELP")]
    assert sorted(helps) == sorted(line for line in one.decode().splitlines()
                                   if line.startswith("# HELP"))  # each family once
    lines = [line for line in text.splitlines() if line.startswith("tokenfab_gateway_requests_total")]
    assert lines == ['tokenfab_gateway_requests_total{ingress="a",tenant="alpha"} 1.0',
                     'tokenfab_gateway_requests_total{ingress="b",tenant="alpha"} 1.0']
