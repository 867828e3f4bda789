"""Builds the Ray Serve application of a topology: one deployment per pool behind the gateway.

Serve imports `orchestrator.app:build_app` with `args={"topology": {...}}` (declarative deploys,
KubeRay's RayService and `tokenfab up` all go through it). No business logic lives here.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from orchestrator.gateway.colocated import PoolReplicaWithIngress
from orchestrator.gateway.ingress import GATEWAY_DRAIN_TIMEOUT_S, Gateway
from orchestrator.config import (ModelSpec, PoolSpec, Topology, parse_topology,
                                 pool_deployment_name)
from pools.deployment import PoolReplica, ReplicaSettings
from pools.engine import EngineSpec, LoraSettings
from tokenfab.errors import TopologyError

HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 30.0
# a pool replica taken down lets its engine finish what it runs (generations: up to this long);
# an ingress drains in GATEWAY_DRAIN_TIMEOUT_S (requests it took, wherever they run)
REPLICA_DRAIN_TIMEOUT_S = 120.0
HEAD_NODE_RESOURCE = "node:__internal_head__"  # Ray's own resource of the head node
DECISION_SINK = "pools.registry:record_scale"  # where the autoscaler's decisions are kept
# How Serve runs tokenfab's replicas. Requests reach them over the data channel, not through
# Serve, so Serve's per-request machinery only costs: its metrics export loop (every 100 ms in
# each replica; 0.3% of a core each here) is off, the few Serve calls record directly; and the
# replica's code runs on Serve's own event loop rather than a thread of its own, one Python
# thread fewer taking turns at the GIL with the request path (every call here is async).
#
# Ray starts worker processes at its daemons' niceness plus 15 (`worker_niceness`), so a replica,
# its engine and the gateway would run at background priority beside the raylet, GCS and
# dashboard (about 6% of a core here): on a busy node every daemon wakeup preempts a decode step
# or a token relay. The request path runs at the daemons' priority instead, as Ray's own job
# supervisor does for its driver.
REPLICA_ENV = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "0",
               "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
               "RAY_worker_niceness": "0"}


def engine_spec(topology: Topology, pool: PoolSpec) -> EngineSpec:
    model = topology.model_of(pool)
    return EngineSpec(
        model_name=model.name,
        model_path=model.resolved_path,
        generate=model.generate,
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        engine_args=topology.engine_args | pool.engine_args,
        kv_cache_bytes=pool.resources.kv_cache_bytes,
        tensor=pool.parallel.tensor,
        data=pool.parallel.data,
        expert=pool.parallel.expert,
        parallel_backend=pool.parallel.backend,
        lora=lora_settings(model),
    )


def lora_settings(model: ModelSpec) -> LoraSettings | None:
    """vLLM's LoRA settings of every engine of the model, and its tiny adapters to generate."""
    lora = model.lora
    if lora is None:
        return None
    return LoraSettings(
        max_loras=lora.max_loras, max_cpu_loras=lora.resident, max_rank=lora.max_rank,
        generate=tuple((a.resolved_path, a.generate) for a in lora.adapters
                       if a.generate is not None))


def replica_settings(topology: Topology, pool: PoolSpec) -> ReplicaSettings:
    return ReplicaSettings(
        app=topology.name,
        pool=pool.name,
        role=pool.role,
        node_ip=topology.cluster.node_ip,
        cpus=pool.resources.cpus,
        gpus=pool.resources.gpus,
        pin_cores=pool.resources.pin_cores,
        kv_events=topology.kv_events.enabled,
        kv_events_transport=topology.kv_events.transport,
        drain_timeout_s=REPLICA_DRAIN_TIMEOUT_S,
        nixl_progress_delay_us=topology.disaggregation.nixl_progress_delay_us,
        max_ongoing_requests=pool.max_ongoing_requests,
        ranks=pool.parallel.ranks,
        data=pool.parallel.data,
        parallel_backend=pool.parallel.backend,
        ray_resources=dict(pool.resources.ray_resources),
    )


def autoscaling_config(topology: Topology, pool: PoolSpec) -> dict[str, Any]:
    """Serve's autoscaling for a pool: tokenfab's policy (autoscaler.serve_policy) with the
    topology's targets (and the pool's own). Serve's own delays are off: the policy keeps its
    own."""
    spec = topology.targets(pool)
    if spec.policy == "ray_requests":  # Serve's own delays and formula, on our request counts
        return {"min_replicas": pool.min_replicas, "max_replicas": pool.max_replicas,
                "initial_replicas": pool.replicas,
                "target_ongoing_requests": spec.target_ongoing_requests,
                "policy": {"policy_function": "autoscaler.serve_policy:ray_requests_policy"}}
    return {
        "min_replicas": pool.min_replicas, "max_replicas": pool.max_replicas,
        "initial_replicas": pool.replicas,
        "metrics_interval_s": spec.interval_s, "look_back_period_s": spec.look_back_s,
        "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "downscale_to_zero_delay_s": 0.0,
        "policy": {"policy_function": "autoscaler.serve_policy:PoolPolicy", "policy_kwargs": {
            "app": topology.name, "pool": pool.name, "sink": DECISION_SINK, "role": pool.role,
            "min_replicas": pool.min_replicas, "max_replicas": pool.max_replicas,
            "ttft_p90_s": spec.ttft_p90_s, "itl_p90_s": spec.itl_p90_s,
            "max_kv_usage": spec.max_kv_usage, "target_ongoing": spec.target_ongoing_requests,
            "max_waiting_per_replica": spec.max_waiting_per_replica,
            "scale_down_margin": spec.scale_down_margin,
            "downscale_delay_s": spec.downscale_delay_s, "idle_to_zero_s": spec.idle_to_zero_s,
            "capacity_rps": spec.capacity_rps, "headroom": spec.headroom,
            "replica_start_s": spec.replica_start_s, "rise_rps_per_s": spec.rise_rps_per_s,
        }},
    }


def _pool_app(topology: Topology, pool: PoolSpec) -> Application:
    """A pool's deployment; with `gateway.colocate`, its replicas serve the gateway too."""
    resources = pool.resources
    if topology.autoscaled(pool):
        extra = {"num_replicas": "auto", "autoscaling_config": autoscaling_config(topology, pool)}
    else:
        extra = {"num_replicas": pool.replicas}
    colocated = topology.gateway.colocate
    deployment = serve.deployment(PoolReplicaWithIngress if colocated else PoolReplica).options(
        name=pool_deployment_name(pool.name),
        max_ongoing_requests=pool.max_ongoing_requests,
        ray_actor_options={
            "num_cpus": resources.cpus,
            # backend ray: vLLM reserves its ranks' GPUs in placement groups of its own
            "num_gpus": 0 if pool.parallel.backend == "ray" else resources.gpus,
            "resources": dict(resources.ray_resources),
            "runtime_env": {"env_vars": REPLICA_ENV},
        },
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        graceful_shutdown_wait_loop_s=1.0,
        # colocated: the ingress's requests finish first (some on other replicas)
        graceful_shutdown_timeout_s=REPLICA_DRAIN_TIMEOUT_S
        + (GATEWAY_DRAIN_TIMEOUT_S if colocated else 0),
        **extra,
    )
    args = (engine_spec(topology, pool), replica_settings(topology, pool))
    if colocated:
        return deployment.bind(*args, topology.model_dump(mode="json"))
    return deployment.bind(*args)


def build_topology_app(topology: Topology) -> Application:
    pools = {pool.name: _pool_app(topology, pool) for pool in topology.pools}
    if topology.gateway.colocate:  # one pool, whose replicas are the ingress
        return next(iter(pools.values()))
    gateway = serve.deployment(Gateway).options(
        name="gateway",
        num_replicas=topology.gateway.replicas,
        # on the head node, where the gateway's address is (its replicas share the port)
        ray_actor_options={"num_cpus": 0, "resources": {HEAD_NODE_RESOURCE: 0.001},
                           "runtime_env": {"env_vars": REPLICA_ENV}},
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GATEWAY_DRAIN_TIMEOUT_S + 10,
    )
    return gateway.bind(topology.model_dump(mode="json"), pools)


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application builder (import path `orchestrator.app:build_app`)."""
    if "topology" not in args:
        raise TopologyError(["args: missing `topology` (a topology document)"])
    return build_topology_app(parse_topology(args["topology"], "args.topology"))
