"""Where every replica reports what a router or `tokenfab status` needs: entries of Ray's GCS
key-value store, one per replica, per ingress and per pool's latest scaling decision.

Replicas write their ReplicaReport every second. A reader lists an entry while it sees it
rewritten within its time to live, on the reader's own clock, so a crashed or removed replica
disappears on its own; it deletes one unchanged for DELETE_AFTER_TTLS times as long. The store is
the GCS's own: it outlives any replica, and it costs no process of its own (an actor did before:
a Ray worker's fixed wake-ups, about 1% of a core, on every deployment). Writes and reads are the
GCS client's asynchronous calls, never blocking an event loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec

from autoscaler.records import ScaleRecord
from channel.secret import NAMESPACE  # the cluster secrets' namespace, shared
from pools.engine import Latency, LoadSnapshot
from tokenfab.ray_compat import gcs_client

logger = logging.getLogger("ray.serve").getChild("tokenfab.registry")

REPORT_INTERVAL_S = 1.0
INGRESS_TTL_S = 15.0  # an ingress replica that has not announced itself for this long is gone


class RankReport(msgspec.Struct, frozen=True):
    """One data-parallel rank of a replica's engine: a routing target of its own, with its own
    KV cache, event stream and load."""

    rank: int
    load: LoadSnapshot
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None


class ReplicaReport(msgspec.Struct, frozen=True):
    """One replica as it describes itself."""

    app: str
    pool: str
    role: str
    replica_id: str
    node_ip: str
    pid: int
    cores: list[int]
    state: str  # "starting", "ready", "draining", "failed" (its engine died)
    load: LoadSnapshot
    latency: Latency = msgspec.field(default_factory=Latency)  # over the engine's recent window
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    block_size: int = 0  # KV cache block size (0 until the engine has started)
    kv_blocks: int = 0  # KV cache capacity in blocks, of each data-parallel rank (0 until started)
    max_num_seqs: int = 0  # requests one batch runs, in each data-parallel rank (0 until started)
    side_channel: str | None = None  # NIXL side channel host:port of prefill/decode engines
    started_s: float = 0.0
    engine_start_s: float = 0.0
    reported_at: float = 0.0
    channel: str | None = None  # host:port of its data channel, once the engine is ready
    # With data-parallel ranks (more than one), each rank; `load` is then all ranks' together and
    # the kv_events endpoints above are unset (each rank has its own)
    ranks: list[RankReport] = msgspec.field(default_factory=list)
    # A mixture-of-experts engine with enable_return_routed_experts: routing decisions per expert
    # index since it started (pools.vllm_engine.ExpertLoad); empty otherwise
    expert_tokens: list[int] = msgspec.field(default_factory=list)
    # LoRA adapters the engine holds loaded, least recently used first (pools.adapters), the
    # median seconds a load took lately, the loads since it started, and the adapters with
    # requests running in its batches (every gateway's; for operators: the router counts its
    # own requests, which it knows at once)
    adapters: list[str] = msgspec.field(default_factory=list)
    adapter_load_s: float = 0.0
    adapter_loads: int = 0


class AdapterRecord(msgspec.Struct, frozen=True):
    """A LoRA adapter loaded at run time (`tokenfab adapter load`): every gateway replica serves
    what these entries say, the topology's declared adapters besides."""

    name: str
    path: str  # as engines load it (resolved once, by the admin route that took it)
    parent: str  # the model it adapts
    tenants: list[str] | None = None  # private to these tenants (None: public)
    loaded_at: float = 0.0


class IngressReport(msgspec.Struct, frozen=True):
    """An ingress (gateway) replica: where the others ask for its series (see gateway.peers)."""

    replica_id: str
    channel: str  # host:port of its channel server
    reported_at: float = 0.0


NAMESPACE_KEY = NAMESPACE.encode()
TIMEOUT_S = 2.0  # a registry call that takes longer fails (the caller keeps what it knew)
# A reader deletes an entry that has not changed for this many times its time to live (or that
# was written this long ago by the writer's clock when the reader first sees it): far enough
# past the time to live that a writer still alive has long written again
DELETE_AFTER_TTLS = 6
_Struct = TypeVar("_Struct", bound=msgspec.Struct)
_Reported = TypeVar("_Reported", ReplicaReport, IngressReport)
# deletes and writes nobody awaits (a task needs a holder)
_background: set[asyncio.Task[None]] = set()


def _in_background(coroutine: Coroutine[Any, Any, None], what: str) -> None:
    task = asyncio.get_running_loop().create_task(coroutine)
    _background.add(task)

    def done(task: asyncio.Task[None]) -> None:
        _background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("replica registry: could not %s: %r", what, task.exception())

    task.add_done_callback(done)


class Registry:
    """One application's entries in the GCS key-value store (namespace `tokenfab`, keys
    `registry/<app>/replica/<id>`, `registry/<app>/ingress/<id>`, `registry/<app>/scale/<pool>`,
    `registry/<app>/adapter/<name>`).

    Whether an entry is fresh is judged on the reader's clock: it is listed while its writer has
    rewritten it within the time to live, as this reader saw it change (nodes' clocks need not
    agree). An entry seen for the first time counts as just written, unless its own timestamp is
    older than DELETE_AFTER_TTLS times the time to live."""

    def __init__(self, app: str, ttl_s: float = 10.0, timeout_s: float = TIMEOUT_S) -> None:
        self._prefix = f"registry/{app}/"
        self._ttl_s, self._timeout_s = ttl_s, timeout_s
        self._changed: dict[bytes, tuple[float, float]] = {}  # key -> (reported_at, seen change)

    def _key(self, kind: str, name: str) -> bytes:
        return f"{self._prefix}{kind}/{name}".encode()

    async def _put(self, key: bytes, entry: msgspec.Struct) -> None:
        await gcs_client().async_internal_kv_put(key, msgspec.msgpack.encode(entry), True,
                                           NAMESPACE_KEY, timeout=self._timeout_s)

    async def _delete(self, key: bytes) -> None:
        await gcs_client().async_internal_kv_del(key, False, NAMESPACE_KEY, timeout=self._timeout_s)

    async def _entries(self, kind: str, type_: type[_Struct]) -> dict[bytes, _Struct]:
        """The entries of `kind`; one that does not decode as `type_` (written by another
        version) is skipped and deleted."""
        gcs, prefix = gcs_client(), self._key(kind, "")
        keys = await gcs.async_internal_kv_keys(prefix, NAMESPACE_KEY, timeout=self._timeout_s)
        if not keys:
            return {}
        values = await gcs.async_internal_kv_multi_get(keys, NAMESPACE_KEY,
                                                       timeout=self._timeout_s)
        entries = {}
        for key, value in values.items():
            try:
                entries[key] = msgspec.msgpack.decode(value, type=type_)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("replica registry: deleting %s, unreadable: %s", key, exc)
                _in_background(self._delete(key), f"delete {key!r}")
        return entries

    async def report(self, report: ReplicaReport) -> None:
        await self._put(self._key("replica", report.replica_id),
                        msgspec.structs.replace(report, reported_at=time.time()))

    async def announce(self, report: IngressReport) -> None:
        await self._put(self._key("ingress", report.replica_id),
                        msgspec.structs.replace(report, reported_at=time.time()))

    async def forget_ingress(self, replica_id: str) -> None:
        await self._delete(self._key("ingress", replica_id))

    async def forget(self, replica_id: str) -> None:
        await asyncio.gather(self._delete(self._key("replica", replica_id)),
                             self._delete(self._key("ingress", replica_id)))

    async def snapshot(self) -> list[ReplicaReport]:
        """Every replica rewritten within the time to live, by pool and id."""
        reports = await self._fresh("replica", ReplicaReport, self._ttl_s)
        return sorted(reports, key=lambda r: (r.pool, r.replica_id))

    async def ingresses(self) -> list[IngressReport]:
        return sorted(await self._fresh("ingress", IngressReport, INGRESS_TTL_S),
                      key=lambda r: r.replica_id)

    async def scaling(self) -> list[ScaleRecord]:
        return sorted((await self._entries("scale", ScaleRecord)).values(),
                      key=lambda r: r.pool)

    async def record_scale(self, record: ScaleRecord) -> None:
        await self._put(self._key("scale", record.pool), record)

    async def adapters(self) -> list[AdapterRecord]:
        """The adapters loaded at run time, by name (they stay until unloaded)."""
        return sorted((await self._entries("adapter", AdapterRecord)).values(),
                      key=lambda r: r.name)

    async def add_adapter(self, record: AdapterRecord) -> None:
        await self._put(self._key("adapter", record.name),
                        msgspec.structs.replace(record, loaded_at=time.time()))

    async def remove_adapter(self, name: str) -> None:
        await self._delete(self._key("adapter", name))

    async def _fresh(self, kind: str, type_: type[_Reported], ttl_s: float) -> list[_Reported]:
        """The entries rewritten within `ttl_s`, as this reader saw them change. Those unchanged
        for DELETE_AFTER_TTLS times as long are deleted, in the background: their writer is gone
        (a replica that crashed, or an application removed)."""
        now, wall, prefix = time.monotonic(), time.time(), self._key(kind, "")
        entries = await self._entries(kind, type_)
        fresh = []
        for key, entry in entries.items():
            last = self._changed.get(key)
            if last is None or last[0] != entry.reported_at:
                seen = now
                if last is None and wall - entry.reported_at > DELETE_AFTER_TTLS * ttl_s:
                    seen = now - (DELETE_AFTER_TTLS + 1) * ttl_s  # long gone even with skew
                self._changed[key] = last = (entry.reported_at, seen)
            unchanged_s = now - last[1]
            if unchanged_s <= ttl_s:
                fresh.append(entry)
            elif unchanged_s > DELETE_AFTER_TTLS * ttl_s:
                self._changed.pop(key)
                _in_background(self._delete(key), f"delete {key!r}")
        for key in [k for k in self._changed if k.startswith(prefix) and k not in entries]:
            del self._changed[key]
        return fresh


def record_scale(app: str, record: ScaleRecord) -> None:
    """Where the autoscaler writes its decisions (autoscaler.records.DecisionSink). Called in the
    Serve controller's control loop, not on any request path: the write is left to run on that
    loop, not waited for (a plain call where this thread runs no loop)."""
    registry = Registry(app)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(registry.record_scale(record))
        return
    _in_background(registry.record_scale(record), f"record the scaling of pool {record.pool}")
