"""Topology files: the pydantic models that describe a tokenfab deployment, and their loader.

One YAML file says which model to serve, which pools of engines run it, and how they are reached.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.adapter_config import AdapterSpec, LoraSpec, resolved_path
from orchestrator.strict import Strict as _Strict
# The gateway, pool, router, tenant and admission sections live in their own modules; they are
# part of this document (GatewaySpec and PoolSpec re-exported: the gateway takes the schema from
# here)
from orchestrator.gateway_config import GatewaySpec as GatewaySpec
from orchestrator.pool_config import PoolSpec as PoolSpec, check_owned
from orchestrator.router_config import RouterSpec
from orchestrator.tenant_config import AdmissionSpec, AuthSpec, TenantSpec
from tokenfab.errors import TopologyError

# config.json fields that count a mixture-of-experts model's routed experts (Mixtral and gpt-oss,
# Qwen-MoE, DeepSeek); a dense model has none of them
MOE_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")

class ModelSpec(_Strict):
    """The model every pool serves."""

    name: str = Field(min_length=1, description="Name clients use in the `model` field.")
    path: str = Field(
        min_length=1,
        description="Local directory or hub id of the checkpoint. `~` is expanded.",
    )
    generate: Literal["tiny", "tiny-moe"] | None = Field(
        None, description="Generate this tiny random-weight model at `path` if it is missing."
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Weight and activation dtype."
    )
    max_model_len: int = Field(2048, gt=0, description="Longest prompt plus output, in tokens.")
    lora: LoraSpec | None = Field(
        None, description="LoRA adapters of this model (null: none, and none can be loaded).")

    @property
    def resolved_path(self) -> str:
        return resolved_path(self.path)

    @property
    def adapters(self) -> list[AdapterSpec]:
        """The adapters declared with the topology."""
        return self.lora.adapters if self.lora else []

    def is_moe(self) -> bool | None:
        """Whether the model is a mixture of experts: from `generate`, or from the checkpoint's
        config.json where it is on this machine; None when neither says (a hub id)."""
        if self.generate is not None:
            return self.generate == "tiny-moe"
        config = Path(self.resolved_path) / "config.json"
        try:
            fields = json.loads(config.read_text())
        except (OSError, ValueError):
            return None
        return any((fields.get(key) or 0) > 1 for key in MOE_EXPERT_FIELDS)


class DisaggregationSpec(_Strict):
    """How requests flow through prefill and decode pools (ignored by unified topologies)."""

    min_prompt_tokens: int = Field(
        256, ge=0, description="Requests that leave decode fewer tokens than this to compute "
        "(short prompts, or prompts whose prefix decode holds) skip the prefill pool.",
    )
    decode_cache_ttl_s: float = Field(
        300.0, gt=0, description="How long a prefix sent to decode counts as cached there, where "
        "the decode pool's router follows no KV events (round_robin, least_loaded, "
        "prefix_approx, or backend ray); with them, what decode's engines report decides (a "
        "data-parallel decode pool under router.dp_ranks: engine reports nothing: every prompt of "
        "min_prompt_tokens or more then takes the prefill leg).",
    )
    prefill_timeout_s: float = Field(
        30.0, gt=0, description="Deadline of the prefill leg; past it decode recomputes the prompt."
    )
    nixl_progress_delay_us: int = Field(
        0, ge=0, description="Sleep of NIXL's progress thread between polls; 0 spins (lowest "
        "latency, one busy core per engine). CPU replicas want ~1000.",
    )


class KVEventsSpec(_Strict):
    """Publication of each engine's KV cache events (consumed by the KV-aware router)."""

    enabled: bool = Field(True, description="Publish KV cache events from every engine.")
    transport: Literal["tcp", "ipc"] = Field(
        "tcp", description="tcp: each replica serves its engine's events on its node's address "
        "(routers on any node can follow them). ipc: node-local sockets only (single node).")


class ClusterSpec(_Strict):
    """Where the Ray cluster is and which address this node uses."""

    node_ip: str | None = Field(
        "127.0.0.1",
        description="Address Ray, engines and side channels bind to; null: the address Ray "
        "reports for each node (multi-node clusters).",
    )
    address: str = Field("127.0.0.1:6379", description="GCS address of the Ray head.")
    dashboard_url: str = Field(
        "http://127.0.0.1:8265", description="Ray dashboard, used to deploy and to query status."
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs for a head `up` starts itself.")
    metrics_export_port: int | None = Field(
        None, ge=1, le=65535,
        description="Port of the Ray metrics agent of a head `up` starts itself, where vLLM's "
        "engine series (ray_vllm_*) are scraped; null: Ray picks one.",
    )
    serve_control_loop_s: float | None = Field(
        None, gt=0, le=5,
        description="Period of Ray Serve's controller loop on a head `up` starts itself "
        "(RAY_SERVE_CONTROL_LOOP_INTERVAL_S); null: Serve's 0.1 s. Each loop reads every node's "
        "resources from the GCS: on a one-node head with two cores, 0.5 s cut the idle CPU of "
        "the controller and the GCS from 6.2% to 2.9% of a core, which the engines get back. "
        "Replica state changes are then seen up to that much later.",
    )
    log_monitor: bool = Field(
        False,
        description="Start Ray's log monitor on a head `up` starts itself. It tails every "
        "worker's stdout and stderr files ten times a second and republishes new lines to the "
        "drivers of their jobs; it took 1.25% of a core idle on a two-core node, where the "
        "engines need it. Off, each worker's output stays in its file under the session's "
        "logs/ (where `ray logs`, the dashboard and Serve's own replica logs are read); on, a "
        "driver of yours also prints what its workers print.",
    )


class AutoscalerSpec(_Strict):
    """Sizes every pool whose min_replicas < max_replicas against these targets (the policy is
    explained in autoscaler/policy.py); other pools keep their replica count."""

    enabled: bool = Field(True, description="Scale pools with min_replicas < max_replicas.")
    policy: Literal["tokenfab", "ray_requests"] = Field(
        "tokenfab", description="tokenfab: the signal-based policy (autoscaler/policy.py); "
        "ray_requests: Ray Serve's own ongoing-requests policy with its default delays, "
        "target target_ongoing_requests (a baseline).")
    ttft_p90_s: float = Field(2.0, gt=0, description="TTFT target of prefill and unified pools.")
    itl_p90_s: float = Field(
        0.25, gt=0, description="Inter-token latency target of decode and unified pools.")
    max_kv_usage: float = Field(0.85, gt=0, le=1, description="KV cache usage that asks for more.")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Requests one replica serves within the targets (capacity).")
    max_waiting_per_replica: float = Field(
        4.0, ge=0, description="Waiting requests per replica that count as a burst.")
    scale_down_margin: float = Field(
        0.5, gt=0, lt=1, description="Scale down only when the load (ongoing requests, KV usage, "
        "prefill backlog) is under this share of what one replica fewer serves, and latencies "
        "under 80% of their targets.")
    downscale_delay_s: float = Field(30.0, ge=0, description="Calm time before each step down.")
    idle_to_zero_s: float = Field(
        300.0, gt=0, description="Idle time before a pool with min_replicas 0 goes to zero.")
    capacity_rps: float = Field(
        0.0, ge=0, description="Requests/s one replica serves within the targets, profiled "
        "offline (python -m sim capacity): turns on the plan, which sizes pools for the arrival "
        "rate expected one replica start ahead (autoscaler/forecast.py). 0: no plan.")
    headroom: float = Field(
        0.2, ge=0, le=4, description="The plan sizes for the expected rate x (1 + headroom).")
    replica_start_s: float = Field(
        60.0, gt=0, description="A replica's start time, the plan's horizon until the policy "
        "has measured one.")
    rise_rps_per_s: float = Field(0.0, ge=0, description="The fastest rise of the arrival rate "
        "(req/s per s) the plan keeps in hand over one replica start, since no trend shows early "
        "enough. 0: only a measured trend. Needs capacity_rps, pools that never scale to zero.")
    interval_s: float = Field(1.0, gt=0, description="How often each pool is decided.")
    look_back_s: float = Field(
        5.0, gt=0, description="Window over which replicas' signals are averaged.")


class Topology(_Strict):
    """A whole deployment: its models, their pools, the router and the gateway."""

    # editors see that one of the two is required (the validator says so too)
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra={
        "oneOf": [{"required": ["model"]}, {"required": ["models"]}]})
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,30}$", description="Serve application name.")
    model: ModelSpec | None = Field(None, description="The model every pool serves; or `models`.")
    models: list[ModelSpec] = Field(
        default_factory=list, description="Several models behind one endpoint, each served by "
        "its own pools (pools[].model names it); requests choose by their `model` field. Or "
        "`model`, for one.")
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments shared by every pool."
    )
    pools: list[PoolSpec] = Field(min_length=1, description="Engine pools.")
    router: RouterSpec = Field(default_factory=RouterSpec)
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    disaggregation: DisaggregationSpec = Field(default_factory=DisaggregationSpec)
    kv_events: KVEventsSpec = Field(default_factory=KVEventsSpec)
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    auth: AuthSpec = Field(default_factory=AuthSpec)
    tenants: list[TenantSpec] = Field(default_factory=list, description="Tenants of the gateway.")
    admission: AdmissionSpec = Field(default_factory=AdmissionSpec)
    autoscaler: AutoscalerSpec = Field(default_factory=AutoscalerSpec)

    @field_validator("engine_args")
    @classmethod
    def _shared_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_owned(value)

    @field_validator("pools")
    @classmethod
    def _pool_set(cls, pools: list[PoolSpec]) -> list[PoolSpec]:
        names = [pool.name for pool in pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        for model in dict.fromkeys(pool.model for pool in pools):  # each model's pools
            roles = {pool.role for pool in pools if pool.model == model}
            of = f" (model {model})" if model else ""
            if ("prefill" in roles) != ("decode" in roles):
                raise ValueError(f"a prefill pool needs a decode pool and the other way round{of}")
            if "unified" in roles and len(roles) > 1:
                raise ValueError("unified pools and prefill/decode pools serve separate models"
                                 f"{of}")
        return pools

    @model_validator(mode="after")
    def _models(self) -> Topology:
        if self.model is None and not self.models:
            raise ValueError("model: field required (or models, to serve several)")
        if self.model is not None and self.models:
            raise ValueError("model and models: set one (model for one, models for several)")
        served = self.served
        names = [m.name for m in served] + [a.name for m in served for a in m.adapters]
        if twice := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"models: the name {twice[0]!r} is used twice (models and their "
                             "adapters share the `model` field of requests)")
        models = {m.name for m in served}
        for i, pool in enumerate(self.pools):
            if pool.model is None and len(served) > 1:
                raise ValueError(f"pools.{i}.model ({pool.name}): name the model this pool "
                                 f"serves, one of {sorted(models)}")
            if pool.model is not None and pool.model not in models:
                raise ValueError(f"pools.{i}.model ({pool.name}): no model {pool.model!r} "
                                 f"(models: {sorted(models)})")
        for j, model in enumerate(served):
            if not self.pools_of(model.name):
                where = f"models.{j}" if self.models else "model"
                raise ValueError(f"{where} ({model.name}): no pool serves it")
        return self

    @field_validator("tenants")
    @classmethod
    def _tenant_set(cls, tenants: list[TenantSpec]) -> list[TenantSpec]:
        names = [tenant.name for tenant in tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        keys = [key for tenant in tenants for key in tenant.api_keys]
        if len(set(keys)) != len(keys):
            raise ValueError("an API key digest belongs to two tenants")
        return tenants

    @model_validator(mode="after")
    def _admin_keys_apart(self) -> Topology:
        shared = set(self.auth.admin_keys) & {k for t in self.tenants for k in t.api_keys}
        if shared:
            raise ValueError(f"auth.admin_keys: {sorted(shared)[0]} is also a tenant's API key; "
                             "an admin key must be a key of its own")
        return self

    @model_validator(mode="after")
    def _auth_inputs(self) -> Topology:
        if self.auth.enabled and not self.tenants:
            raise ValueError("auth.enabled needs tenants: declare at least one")
        for i, tenant in enumerate(self.tenants):
            if (rpm := tenant.limits.requests_per_minute) and rpm < self.ingress_replicas():
                raise ValueError(f"tenants.{i}.limits.requests_per_minute ({tenant.name}): {rpm} "
                                 f"< the ingress replicas ({self.ingress_replicas()}) would refuse "
                                 "it forever: each ingress replica's share is under one request")
            served = self.served
            known = {m.name for m in served} | {a.name for m in served for a in m.adapters}
            unknown = set(tenant.models or ()) - known
            if unknown and not any(m.lora for m in served):  # or an adapter loaded at run time
                raise ValueError(f"tenant {tenant.name}: models {sorted(unknown)} are not served "
                                 f"(this topology serves {sorted(known)})")
        return self

    @model_validator(mode="after")
    def _adapters(self) -> Topology:
        tenants = {tenant.name for tenant in self.tenants}
        for j, model in enumerate(self.served):
            for i, adapter in enumerate(model.adapters):
                where = f"{f'models.{j}' if self.models else 'model'}.lora.adapters.{i}"
                if unknown := sorted(set(adapter.tenants or ()) - tenants):
                    raise ValueError(f"{where}.tenants ({adapter.name}): no tenant "
                                     f"{unknown[0]!r} (tenants: {sorted(tenants)})")
                if adapter.generate is not None and model.generate != "tiny":
                    raise ValueError(f"{where}.generate ({adapter.name}): tiny adapters are "
                                     "made for the generated dense tiny model (generate: tiny)")
        return self

    @model_validator(mode="after")
    def _pools_fit_model_and_devices(self) -> Topology:
        for i, pool in enumerate(self.pools):
            model = self.model_of(pool)
            moe = model.is_moe()
            parallel = pool.parallel
            if parallel.expert and moe is False:
                raise ValueError(f"pools.{i}.parallel.expert ({pool.name}): expert parallelism "
                                 f"needs a mixture-of-experts model; {model.path} is dense")
            if moe and parallel.data > 1 and pool.resources.gpus == 0:
                raise ValueError(
                    f"pools.{i}.parallel.data ({pool.name}): {parallel.data} data-parallel ranks "
                    "of a mixture-of-experts model need GPUs: vLLM's CPU backend cannot gather "
                    "across ranks for the experts (NotImplementedError in all_gatherv); on CPU "
                    "an MoE model runs as one rank, or split by parallel.tensor")
            if pool.resources.gpus == 0 and (self.engine_args | pool.engine_args).get(
                    "enable_return_routed_experts"):
                raise ValueError(
                    f"pools.{i}.engine_args.enable_return_routed_experts ({pool.name}): vLLM "
                    "reports routed experts from its GPU model runner only (Model Runner V2, "
                    "which needs Triton); this pool runs on CPU (resources.gpus: 0)")
            if parallel.backend == "ray" and self.kv_events.enabled \
                    and routing_policy(self, pool) == "kv_aware":
                raise ValueError(
                    f"pools.{i}.parallel.backend ({pool.name}): ray places ranks on other nodes, "
                    "where their KV events stay (vLLM's publisher has no authentication to carry "
                    "them off a node), so the kv_aware router could not follow them; use backend "
                    "mp (a replica per node) for a pool routed by kv_aware, or ray for decode "
                    "pools, which are then routed by load")
        return self

    @model_validator(mode="after")
    def _colocated_gateway(self) -> Topology:
        if not self.gateway.colocate:
            return self
        if len(self.pools) != 1 or self.pools[0].role != "unified":
            raise ValueError("gateway.colocate: the gateway is served from the replicas of a "
                             "single unified pool; this topology has "
                             f"{[f'{p.name} ({p.role})' for p in self.pools]}")
        if self.autoscaled(self.pools[0]) and not self.pools[0].min_replicas:
            raise ValueError(f"gateway.colocate: pool {self.pools[0].name} may scale to zero "
                             "replicas, and with them the gateway: set min_replicas to 1 or more")
        if self.gateway.replicas != 1:
            raise ValueError(f"gateway.replicas: {self.gateway.replicas} with gateway.colocate: "
                             "the pool's replicas are the ingress replicas; leave it out")
        return self

    def ingress_replicas(self) -> int:
        """The most processes that serve the gateway, each enforcing its share of the tenants'
        limits: gateway.replicas, or with gateway.colocate the pool's replicas (its
        max_replicas if autoscaled). Colocated ingresses start at this share and then follow
        their live count."""
        if not self.gateway.colocate:
            return self.gateway.replicas
        pool = self.pools[0]
        return pool.max_replicas if self.autoscaled(pool) and pool.max_replicas else pool.replicas

    @model_validator(mode="after")
    def _router_inputs(self) -> Topology:
        if self.router.policy == "kv_aware" and not self.kv_events.enabled:
            raise ValueError("router.policy kv_aware reads the engines' KV events: set "
                             "kv_events.enabled to true or choose prefix_approx")
        return self

    @model_validator(mode="after")
    def _rise_needs_a_plan(self) -> Topology:
        spec, field = self.autoscaler, "autoscaler.rise_rps_per_s"
        if spec.rise_rps_per_s <= 0:
            return self
        planned = [p for p in self.pools if self.autoscaled(p) and self.targets(p).capacity_rps]
        if not spec.enabled or spec.policy != "tokenfab":
            raise ValueError(f"{field} is kept in hand by tokenfab's plan: it needs "
                             "autoscaler.enabled and autoscaler.policy tokenfab")
        if not planned:
            raise ValueError(f"{field} is kept in hand by the plan, which no autoscaled pool "
                             "has: set autoscaler.capacity_rps (or a pool's "
                             "autoscaling.capacity_rps)")
        if idle := next((p for p in planned if p.min_replicas == 0), None):
            raise ValueError(f"{field}: pool {idle.name} may scale to zero, and the rise kept "
                             "in hand would hold replicas while it is idle: set its "
                             "min_replicas to 1 or more")
        return self

    def targets(self, pool: PoolSpec) -> AutoscalerSpec:
        """The autoscaler's settings for one pool: the topology's, with the pool's own targets."""
        own = pool.autoscaling.model_dump(exclude_none=True)
        return self.autoscaler.model_copy(update=own) if own else self.autoscaler

    def autoscaled(self, pool: PoolSpec) -> bool:
        """Whether the autoscaler sizes this pool."""
        return (self.autoscaler.enabled and pool.min_replicas is not None
                and pool.max_replicas is not None and pool.min_replicas < pool.max_replicas)

    def pool(self, name: str) -> PoolSpec:
        return next(pool for pool in self.pools if pool.name == name)

    @property
    def served(self) -> list[ModelSpec]:
        """Every model of the topology (`models`, or the one `model`)."""
        return self.models or ([self.model] if self.model is not None else [])

    def model_of(self, pool: PoolSpec) -> ModelSpec:
        """The model a pool serves."""
        served = self.served
        return served[0] if pool.model is None else next(m for m in served if m.name == pool.model)

    def pools_of(self, model: str) -> list[PoolSpec]:
        """The pools that serve `model`, in topology order."""
        return [pool for pool in self.pools if self.model_of(pool).name == model]


def pool_deployment_name(pool: str) -> str:
    """The Serve deployment that runs a pool's replicas."""
    return f"pool-{pool}"


def routing_policy(topology: Topology, pool: PoolSpec) -> str:
    """The policy that places requests on this pool's replicas: the router's, in every pool
    whose engines' KV events the gateway can follow. A decode replica's cache matters as a
    prefill replica's does: it pulls only what it does not hold (vLLM's connector counts its own
    prefix hits first), and the turns whose prefix decode holds skip the prefill pool and go to
    it alone. A decode pool whose ranks Ray places on other nodes keeps its events there, so it
    is placed by load (any other pool routed by kv_aware must not do so: `Topology` says why)."""
    if pool.role == "decode" and pool.parallel.backend == "ray":
        return "least_loaded"
    return topology.router.policy


def format_errors(source: str, exc: ValidationError) -> list[str]:
    """One line per error: `file: field.path: message`."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = error["msg"].removeprefix("Value error, ")
        lines.append(f"{source}: {where}: {message}")
    return lines


def parse_topology(data: Any, source: str = "<topology>") -> Topology:
    """Validate an already-parsed document; raise TopologyError naming source and fields."""
    if not isinstance(data, dict):
        raise TopologyError([f"{source}: (top level): expected a mapping of fields"])
    try:
        return Topology.model_validate(data)
    except ValidationError as exc:
        raise TopologyError(format_errors(source, exc)) from exc


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise TopologyError([f"{path}: cannot read: {exc.strerror}"]) from exc
    except yaml.YAMLError as exc:
        raise TopologyError([f"{path}: not valid YAML: {exc}"]) from exc
    return parse_topology(data, str(path))


def topology_schema() -> dict[str, Any]:
    return Topology.model_json_schema()
