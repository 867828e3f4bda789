"""A small Ray actor where every replica reports what a router or `tokenfab status` needs.

Replicas push a ReplicaReport every second; entries not refreshed within `ttl_s` are dropped, so a
crashed or removed replica disappears on its own. Readers get plain snapshots.

The actor is detached: an actor that is not dies with the process that created it, and a replica
that dies (Serve replaces one whose engine failed) would take every other replica's reports, the
ingress announcements and the autoscaler's records with it. It ends itself once nobody has
reported to it for `idle_exit_s` (its application was removed).
"""

from __future__ import annotations

import threading
import time

import msgspec
import ray

from autoscaler.records import ScaleRecord
from pools.engine import LoadSnapshot

NAMESPACE = "tokenfab"
REPORT_INTERVAL_S = 1.0
INGRESS_TTL_S = 15.0  # an ingress replica that has not announced itself for this long is gone
IDLE_EXIT_S = 300.0  # a registry nobody reported to for this long ends (its app is gone)


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
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    block_size: int = 0  # KV cache block size (0 until the engine has started)
    kv_blocks: int = 0  # KV cache capacity in blocks, of each data-parallel rank (0 until started)
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


class IngressReport(msgspec.Struct, frozen=True):
    """An ingress (gateway) replica: where the others ask for its series (see gateway.peers)."""

    replica_id: str
    channel: str  # host:port of its channel server
    reported_at: float = 0.0


def registry_name(app: str) -> str:
    return f"registry-{app}"


@ray.remote(num_cpus=0, max_concurrency=64)
class ReplicaRegistry:
    """Owner of the replica table of one application."""

    def __init__(self, ttl_s: float = 10.0, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self._ttl_s = ttl_s
        self._reports: dict[str, ReplicaReport] = {}
        self._scaling: dict[str, ScaleRecord] = {}
        self._ingresses: dict[str, IngressReport] = {}
        self._heard = time.monotonic()
        threading.Thread(target=self._exit_when_idle, args=(idle_exit_s,), name="idle-exit",
                         daemon=True).start()

    def _exit_when_idle(self, idle_exit_s: float) -> None:
        while (idle := time.monotonic() - self._heard) < idle_exit_s:
            time.sleep(idle_exit_s - idle)
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def announce(self, report: IngressReport) -> None:
        self._heard = time.monotonic()
        self._ingresses[report.replica_id] = msgspec.structs.replace(report,
                                                                     reported_at=time.time())

    def ingresses(self) -> list[IngressReport]:
        cutoff = time.time() - INGRESS_TTL_S
        self._ingresses = {k: r for k, r in self._ingresses.items() if r.reported_at >= cutoff}
        return sorted(self._ingresses.values(), key=lambda r: r.replica_id)

    def report(self, report: ReplicaReport) -> None:
        self._heard = time.monotonic()
        self._reports[report.replica_id] = msgspec.structs.replace(report, reported_at=time.time())

    def record_scale(self, record: ScaleRecord) -> None:
        self._scaling[record.pool] = record

    def scaling(self) -> list[ScaleRecord]:
        return sorted(self._scaling.values(), key=lambda r: r.pool)

    def forget(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)
        self._ingresses.pop(replica_id, None)

    def snapshot(self) -> list[ReplicaReport]:
        cutoff = time.time() - self._ttl_s
        self._reports = {k: r for k, r in self._reports.items() if r.reported_at >= cutoff}
        return sorted(self._reports.values(), key=lambda r: (r.pool, r.replica_id))


def get_registry(app: str) -> ray.actor.ActorHandle:
    """The application's registry, created on first use by whichever process asks first."""
    return ReplicaRegistry.options(
        name=registry_name(app), namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()


def record_scale(app: str, record: ScaleRecord) -> None:
    """Where the autoscaler writes its decisions (autoscaler.records.DecisionSink). Called in the
    Serve controller, not on any request path."""
    get_registry(app).record_scale.remote(record)
