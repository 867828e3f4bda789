"""A pool replica: one Ray Serve replica running one engine in-process.

It pins the engine to its own cores, answers OpenAI requests that gateways send on its data
channel (channel/), reports its load to the registry and its signals to Serve's autoscaler, and
drains before it goes away. Serve owns its life: placement, health checks, scaling, stopping.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import msgspec
import ray
from ray import serve

from channel.secret import channel_secret, event_keys
from channel.frames import Request
from channel.server import ChannelServer, ReplySink
from kvtransfer import nixl_tuning
from kvtransfer.nixl import SideChannel, connector_config, reserve_side_channel
from pools import engine_watchdog
from pools.adapters import AdapterBoard
from pools.cores import CoreClaim, claim_cores
from pools.engine import (Endpoint, EngineSpec, LoadSnapshot, ReplyHead, TokenTrace,
                          is_endpoint)
from pools.vllm_compat import rank_endpoint
from pools.kv_events import EventRelay, KVEventEndpoints, engine_endpoints, socket_dir
from pools.registry import REPORT_INTERVAL_S, RankReport, Registry, ReplicaReport
from pools.usage import StreamMeter, usage_of, with_stream_usage
from tokenfab.errors import EngineError, openai_error
from tokenfab.ray_compat import bind_serve_grpc_to_node_address

logger = logging.getLogger(__name__)
bind_serve_grpc_to_node_address()  # before Serve starts this replica's gRPC server

SOCKET_DIR = Path(os.environ.get("TOKENFAB_SOCKET_DIR", f"/tmp/tokenfab-{os.getuid()}/kv"))


class ReplicaSettings(msgspec.Struct, frozen=True):
    """How the replica places itself; derived from the pool's resources by the app builder."""

    app: str
    pool: str
    role: str
    node_ip: str | None
    cpus: float
    gpus: int
    pin_cores: bool
    kv_events: bool
    kv_events_transport: str = "tcp"
    drain_timeout_s: float = 60.0
    nixl_progress_delay_us: int = 0
    max_ongoing_requests: int = 64  # more at once are refused (the gateway holds or reroutes)
    ranks: int = 1  # the engine's workers: tensor x data ranks, each on its share of the cores
    data: int = 1  # data-parallel ranks: each a routing target with its own KV cache and events
    parallel_backend: str = "mp"  # "ray": vLLM places the ranks on nodes in placement groups
    ray_resources: dict[str, float] = msgspec.field(default_factory=dict)  # the pool's own


def nodes_offering(resources: dict[str, float], nodes: list[dict[str, Any]]) -> list[str]:
    """Addresses of the alive nodes (as `ray.nodes()` lists them) that offer every one of the
    pool's Ray custom resources: on Kubernetes, the nodes of its role's worker group."""
    return sorted(node["NodeManagerAddress"] for node in nodes if node.get("Alive")
                  and all(node.get("Resources", {}).get(name, 0) > 0 for name in resources))


def _ensure_generated_model(spec: EngineSpec) -> None:
    from pools.tiny_lora import ensure_tiny_adapter
    from pools.tiny_model import ensure_tiny_model

    if spec.generate:
        ensure_tiny_model(Path(spec.model_path), moe=spec.generate == "tiny-moe")
    for path, index in spec.lora.generate if spec.lora else ():
        ensure_tiny_adapter(Path(spec.model_path), Path(path), index)


async def _check_listening(channel: SideChannel, timeout_s: float = 5.0) -> None:
    for port in channel.ports:  # one per data-parallel rank
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(channel.host, port), timeout_s)
        except (TimeoutError, OSError) as exc:
            raise EngineError(f"NIXL side channel {channel.host}:{port} unreachable: "
                              f"{exc}") from exc
        writer.close()


class PoolReplica:
    """Serve deployment class of every pool; the app builder names one deployment per pool."""

    # Serve awaits an async constructor, which typing cannot say (__init__ must return None)
    async def __init__(self, spec: EngineSpec,  # type: ignore[misc]
                       settings: ReplicaSettings) -> None:
        from pools.vllm_engine import VllmEngine  # vLLM is imported only inside replicas

        self._settings = settings
        self._started = time.time()
        self._replica_id = serve.get_replica_context().replica_id.unique_id
        self._node_ip = settings.node_ip or ray.util.get_node_ip_address()
        self._cores = self._place_engine()
        self._side_channel: SideChannel | None = None
        self._state = "starting"
        self._engine_start_s = 0.0
        self._in_flight = 0
        self._arrivals = 0  # requests taken, for the autoscaler's forecast
        self._rank_in_flight = [0] * settings.data
        self._kv_events: list[KVEventEndpoints] = []  # one per data-parallel rank
        self._event_relays: list[EventRelay] = []
        if settings.kv_events:
            spec = await self._with_kv_events(spec)
        spec = self._with_kv_transfer(spec)
        if settings.parallel_backend == "ray" and settings.ray_resources:
            # vLLM places the ranks on any node with free GPUs; keep them on the pool's nodes
            nodes = nodes_offering(settings.ray_resources, await asyncio.to_thread(ray.nodes))
            os.environ["VLLM_RAY_DP_PLACEMENT_NODE_IPS"] = ",".join(nodes)
        self._spec = spec
        self._engine = VllmEngine(spec)
        self._channel: ChannelServer | None = None
        self._channel_address: str | None = None
        self._board: AdapterBoard | None = None  # with LoRA: tells the gateways the adapters
        self._registry = Registry(settings.app)
        self._reporter = asyncio.create_task(self._report_forever(), name="registry-reporter")
        if spec.generate or (spec.lora and spec.lora.generate):
            await asyncio.to_thread(_ensure_generated_model, spec)
        await self._engine.start()
        self._channel = ChannelServer(await asyncio.to_thread(channel_secret, settings.app), self,
                                      self._replica_id)
        port = await self._channel.start(self._node_ip)
        self._channel_address = f"{self._node_ip}:{port}"
        if self._engine.adapters is not None:
            self._board = AdapterBoard(self._engine.adapters, settings.data,
                                       self._channel.set_adapters)
        self._engine_start_s = time.time() - self._started
        self._state = "ready"
        logger.info("replica %s of pool %s ready in %.1f s", self._replica_id, settings.pool,
                    self._engine_start_s)

    def _place_engine(self) -> CoreClaim | None:
        os.environ["VLLM_HOST_IP"] = self._node_ip
        os.environ[engine_watchdog.ENV] = str(os.getpid())  # its engine dies with it
        if self._settings.gpus or not self._settings.pin_cores:
            return None
        claim = claim_cores(max(1, int(self._settings.cpus)))
        if claim is None:
            logger.warning("no free cores to pin replica %s; the engine shares cores",
                           self._replica_id)
            return None
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = claim.omp_bind_ranks(self._settings.ranks)
        return claim

    async def _with_kv_events(self, spec: EngineSpec) -> EngineSpec:
        """Each data-parallel rank publishes on ipc sockets of its own
        (pools.vllm_compat.register_rank_event_endpoints); with the tcp transport each rank's
        stream gets a relay of its own."""
        engine = engine_endpoints(socket_dir(SOCKET_DIR) / self._replica_id)
        ranks = [KVEventEndpoints(*(rank_endpoint(endpoint, rank) for endpoint in (
            engine.engine, engine.engine_replay, engine.public, engine.replay)))
            for rank in range(self._settings.data)]
        self._kv_events = ranks
        if self._settings.kv_events_transport == "tcp":
            keys = await asyncio.to_thread(event_keys, self._settings.app)
            self._event_relays = [EventRelay(rank, self._node_ip, keys).start() for rank in ranks]
            self._kv_events = [relay.endpoints for relay in self._event_relays]
        return msgspec.structs.replace(spec, kv_events_endpoint=engine.engine,
                                       kv_events_replay_endpoint=engine.engine_replay)

    def _with_kv_transfer(self, spec: EngineSpec) -> EngineSpec:
        config = connector_config(self._settings.role, self._replica_id, self._settings.gpus > 0)
        if config is None:
            return spec
        self._side_channel = reserve_side_channel(self._node_ip, ranks=self._settings.data)
        os.environ.update(self._side_channel.env())
        if self._node_ip.startswith("127."):  # UCX would listen on every interface otherwise
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        if self._settings.nixl_progress_delay_us:
            os.environ[nixl_tuning.ENV] = str(self._settings.nixl_progress_delay_us)
        return msgspec.structs.replace(spec, kv_transfer_config=config)

    # -- the data channel (channel.server.Handler) ----------------------------------------------

    def admit(self) -> str | None:
        if self._state != "ready":
            return self._state
        if self._in_flight >= self._settings.max_ongoing_requests:
            return "full"
        self._in_flight += 1
        self._arrivals += 1
        return None

    def release(self) -> None:
        self._in_flight -= 1

    async def serve(self, request: Request, reply: ReplySink) -> None:
        """One request from a gateway: the engine's reply, relayed as it comes, then its usage."""
        endpoint = request.endpoint
        if not is_endpoint(endpoint):
            reply.failed(f"unknown request {endpoint!r}")
            return
        body, keep_usage = with_stream_usage(msgspec.json.decode(request.body))
        resume = request.resume
        meter = StreamMeter(keep_usage, resumed=None if resume is None else len(resume))
        tracked, streaming = request.track_tokens, False
        trace = TokenTrace(resume or ()) if tracked or resume is not None else None
        with self._counted_on(request.rank), self._running(request):
            async for item in self._engine.reply(endpoint, body, trace, request.rank,
                                                 request.adapter):
                if isinstance(item, ReplyHead):
                    streaming = item.streaming
                    reply.head(item.status, streaming, self._replica_id)
                elif streaming:
                    chunk, token = meter.feed(item)
                    if chunk and token and tracked:  # the ids go with the chunk that has them
                        assert trace is not None  # made for every tracked request
                        reply.tokens(chunk, trace.take())
                    elif chunk:
                        reply.data(chunk, token)
                    if reply.paused:  # its client reads nothing: the engine's outputs wait
                        await reply.resumed()
                else:
                    meter.usage = usage_of(item)  # zeros for an error body
                    reply.data(item)
        reply.end(meter.usage)

    @contextmanager
    def _counted_on(self, rank: int | None) -> Iterator[None]:
        """The request is in flight on this data-parallel rank while the block runs."""
        counted = rank if rank is not None and 0 <= rank < len(self._rank_in_flight) else None
        if counted is not None:
            self._rank_in_flight[counted] += 1
        try:
            yield
        finally:
            if counted is not None:
                self._rank_in_flight[counted] -= 1

    def _running(self, request: Request) -> AbstractContextManager[None]:
        """The request's adapter is in flight here while the block runs (the gateways hear)."""
        if self._board is None or request.adapter is None:
            return nullcontext()
        return self._board.running(request.adapter.name, request.rank)

    # -- Serve handle methods ----------------------------------------------------------------

    async def reply(self, endpoint: Endpoint, body: dict[str, Any]
                    ) -> AsyncIterator[ReplyHead | bytes]:
        """Answer one OpenAI request through a Serve handle (tools and tests; gateways use the
        channel): see pools.engine.ReplyHead for the stream's shape."""
        if self._state != "ready":
            yield ReplyHead(503, streaming=False)
            yield msgspec.json.encode(openai_error(503, "replica is draining; retry"))
            return
        self._in_flight += 1
        self._arrivals += 1
        try:
            async for item in self._engine.reply(endpoint, body):
                if isinstance(item, ReplyHead):
                    item = msgspec.structs.replace(item, replica_id=self._replica_id)
                yield item
        finally:
            self._in_flight -= 1

    async def wake(self) -> None:
        """A gateway holds requests for this pool while it has no replica: a call that Serve
        queues until a replica exists is what makes its autoscaler count them (scale from 0)."""

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and replaces it.

        Replicas that take part in KV transfer must also answer on their NIXL side channel, or
        peers could not fetch their agent metadata.
        """
        if self._state != "ready":
            return
        if self._engine.dead and not self._busy():
            # It will never answer again. Serve replaces a replica whose check fails only after
            # 3 failures in a row (10-15 s at our period), but one whose process is gone at
            # once: end it, once the requests it held have had their errors.
            logger.error("replica %s: its engine died; ending the replica so that Serve "
                         "replaces it now", self._replica_id)
            _end_process()
        await self._engine.check_health()
        if self._side_channel is not None:
            await _check_listening(self._side_channel)

    def _busy(self) -> bool:
        """Whether requests still depend on this process (its engine's, here)."""
        return self._in_flight > 0

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Polled by Serve for the pool's autoscaling policy (autoscaler.serve_policy)."""
        if self._state != "ready":
            return {}
        signals = msgspec.structs.replace(
            self._engine.signals(), in_flight=float(self._in_flight),
            arrivals=float(self._arrivals),
            held=float(self._channel.held() if self._channel else 0))
        return msgspec.structs.asdict(signals)

    def _load(self) -> LoadSnapshot:
        return msgspec.structs.replace(self._engine.load(), in_flight=self._in_flight)

    def _ranks(self) -> list[RankReport]:
        """Each data-parallel rank's load and event endpoints (none for a one-rank engine)."""
        if self._settings.data == 1:
            return []
        loads = self._engine.rank_loads()  # one per rank once the engine has started
        reports = []
        for rank in range(self._settings.data):
            load = loads[rank] if rank < len(loads) else LoadSnapshot()
            events = self._kv_events[rank] if self._kv_events else None
            reports.append(RankReport(
                rank=rank, load=msgspec.structs.replace(load, in_flight=self._rank_in_flight[rank]),
                kv_events_endpoint=events.public if events else None,
                kv_replay_endpoint=events.replay if events else None))
        return reports

    def report(self) -> ReplicaReport:
        ranked = self._settings.data > 1
        events = None if ranked or not self._kv_events else self._kv_events[0]
        return ReplicaReport(
            app=self._settings.app, pool=self._settings.pool, role=self._settings.role,
            replica_id=self._replica_id, node_ip=self._node_ip, pid=os.getpid(),
            cores=self._cores.cores if self._cores else [], load=self._load(),
            latency=self._engine.latency(),
            state="failed" if self._state == "ready" and self._engine.dead else self._state,
            kv_events_endpoint=events.public if events else None,
            kv_replay_endpoint=events.replay if events else None,
            block_size=self._engine.block_size, kv_blocks=self._engine.kv_blocks,
            max_num_seqs=self._engine.max_num_seqs,
            started_s=self._started,
            side_channel=f"{self._side_channel.host}:{self._side_channel.port}"
            if self._side_channel else None,
            engine_start_s=self._engine_start_s, channel=self._channel_address,
            ranks=self._ranks(),
            expert_tokens=list(self._engine.experts.tokens) if self._engine.experts else [],
            adapters=slots.held if (slots := self._engine.adapters) else [],
            adapter_load_s=slots.load_s if slots else 0.0,
            adapter_loads=slots.loads if slots else 0,
        )

    async def _report_forever(self) -> None:
        while True:
            try:
                if self._state == "ready" and self._engine.adapters is not None:
                    self._engine.adapters.sync(await self._engine.loaded_adapters())
                await self._registry.report(self.report())
            except Exception as exc:  # noqa: BLE001 - reported again at the next turn
                logger.warning("could not report replica %s: %r", self._replica_id, exc)
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def __del__(self) -> None:
        """Drain: tell the gateways to send nothing more, finish in-flight requests, then stop
        the engine."""
        self._stop_taking()
        await self._finish()

    def _stop_taking(self) -> None:
        """Tell the gateways to send nothing more."""
        self._state = "draining"
        if self._channel is not None:
            self._channel.set_state("draining")

    async def _finish(self) -> None:
        """Finish the requests in flight (within the drain timeout), then stop the engine."""
        deadline = time.monotonic() + self._settings.drain_timeout_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self._reporter.cancel()
        if self._channel is not None:
            self._channel.close()
        try:  # else its entry expires
            await self._registry.forget(self._replica_id)
        except Exception:  # noqa: BLE001 - the GCS may be going away with the cluster
            pass
        await asyncio.to_thread(self._engine.shutdown)
        for relay in self._event_relays:
            await asyncio.to_thread(relay.close)
        if self._cores:
            self._cores.release()
        if self._in_flight:
            logger.warning("replica %s stopped with %d requests still running (drain timeout)",
                           self._replica_id, self._in_flight)


def _end_process() -> None:
    """End this replica's process now: Serve sees its actor die (engine_watchdog ends the dead
    engine's leftover processes; the claimed cores are freed with the process)."""
    logging.shutdown()
    os._exit(1)
