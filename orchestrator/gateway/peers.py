"""One `/metrics` answer for all ingress replicas, whichever of them the scrape reached.

Each ingress replica keeps its own registry (its requests, queues, block map). With several of
them behind one port (`SO_REUSEPORT`) or one Service, a scrape reaches one at random; answering
from that one alone made counters jump between scrapes. So every ingress replica serves its own
series to the others over the data channel (channel/: the application's secret, nothing
unauthenticated), announces that address in the registry, and the one that is scraped asks the
others and answers with all of them. Every sample carries the replica it came from as
`ingress`, so each series is always one replica's, and monotonic; `sum without (ingress)` gives
the application's totals. A peer that does not answer in time is left out of that scrape (its
series go stale for one scrape, never backwards).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from channel.client import ReplicaLink
from channel.frames import Request, Usage
from channel.server import ChannelServer, ReplySink
from orchestrator.gateway.dispatch import ReplicaDirectory
from pools.registry import INGRESS_TTL_S, IngressReport

logger = logging.getLogger(__name__)

INGRESS_LABEL = "ingress"
ANNOUNCE_S = INGRESS_TTL_S / 3
SERIES = "metrics"  # the one request a peer serves


class _SeriesHandler:
    """Serves this replica's series to the other ingress replicas (channel.server.Handler)."""

    def __init__(self, replica_id: str, render: Callable[[], bytes]) -> None:
        self._replica_id, self._render = replica_id, render

    def admit(self) -> str | None:
        return None

    async def serve(self, request: Request, reply: ReplySink) -> None:
        if request.endpoint != SERIES:
            reply.failed(f"unknown request {request.endpoint!r}")
            return
        reply.head(200, False, self._replica_id)
        reply.data(self._render())
        reply.end(Usage())

    def release(self) -> None:
        pass


def ingress_name(replica_id: str) -> str:
    """What an ingress replica's series channel proves itself as (frames.replica_proof)."""
    return f"ingress/{replica_id}"


class IngressPeers:
    """This ingress replica's part of the shared `/metrics`. Runs on the ingress's event loop."""

    def __init__(self, replica_id: str, secret: bytes, render: Callable[[], bytes],
                 directory: ReplicaDirectory) -> None:
        self._replica_id, self._secret, self._render = replica_id, secret, render
        self._directory = directory
        # named apart from a pool channel of the same replica (colocated): neither answers for
        # the other
        self._server = ChannelServer(secret, _SeriesHandler(replica_id, render),
                                     ingress_name(replica_id))
        self._announcer: asyncio.Task[None] | None = None
        self.address = ""

    async def start(self, host: str) -> None:
        port = await self._server.start(host)
        self.address = f"{host}:{port}"
        self._announcer = asyncio.create_task(self._announce_forever(), name="ingress-announce")

    async def _announce_forever(self) -> None:
        report = IngressReport(self._replica_id, self.address)
        while True:
            try:
                await self._directory.announce(report)
            except Exception as exc:  # noqa: BLE001 - announced again at the next turn
                logger.warning("could not announce ingress %s: %r", self._replica_id, exc)
            await asyncio.sleep(ANNOUNCE_S)

    async def exposition(self, timeout_s: float = 2.0) -> bytes:
        """Every ingress replica's series that answered within `timeout_s`, labelled."""
        series = {self._replica_id: self._render()}
        try:
            peers = [p for p in await self._directory.ingresses(timeout_s)
                     if p.replica_id != self._replica_id]
        except Exception as exc:  # noqa: BLE001 - this replica's series beat a failed scrape
            logger.warning("replica registry unavailable; /metrics of this ingress only: %r", exc)
            peers = []
        fetched = await asyncio.gather(*(self._fetch(p, timeout_s) for p in peers),
                                       return_exceptions=True)
        for peer, result in zip(peers, fetched):
            if isinstance(result, bytes):
                series[peer.replica_id] = result
            else:
                logger.warning("ingress %s did not give its series: %r", peer.replica_id, result)
        return merge(series)

    async def _fetch(self, peer: IngressReport, timeout_s: float) -> bytes:
        host, port = peer.channel.rsplit(":", 1)
        link = ReplicaLink(ingress_name(peer.replica_id), host, int(port), self._secret,
                           self._replica_id)
        try:
            await link.connect(timeout_s)
            stream = link.open(Request(SERIES, b""))
            await asyncio.wait_for(stream.end, timeout_s)
            return stream.body()
        finally:
            link.close()

    def close(self) -> None:
        if self._announcer is not None:
            self._announcer.cancel()
        self._server.close()


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge(series: dict[str, bytes]) -> bytes:
    """Expositions by ingress replica -> one exposition, each sample labelled with its replica
    (families regrouped: the text format wants each family's samples together)."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(series.items()):
        for family in text_string_to_metric_families(text.decode()):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            merged.samples += [sample._replace(labels={**sample.labels, INGRESS_LABEL: replica})
                               for sample in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)
