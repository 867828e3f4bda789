"""A topology's pools: each pool's replicas, their resources, how each replica's engine is split
across devices, and the byte sizes they are given in (see orchestrator.config for the whole
document)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator, model_validator

from orchestrator.strict import Strict as _Strict

PoolRole = Literal["unified", "prefill", "decode"]

# Engine arguments that tokenfab derives from its own fields: setting them in `engine_args`
# would silently fight the topology, so they are refused with a pointer to the right field.
OWNED_ENGINE_ARGS: dict[str, str] = {
    "model": "model.path",
    "served_model_name": "model.name",
    "dtype": "model.dtype",
    "max_model_len": "model.max_model_len",
    "kv_cache_memory_bytes": "pools[].resources.kv_cache_bytes",
    "kv_events_config": "kv_events",
    "kv_transfer_config": "pools[].role",
    "tensor_parallel_size": "pools[].parallel.tensor",
    "data_parallel_size": "pools[].parallel.data",
    "enable_expert_parallel": "pools[].parallel.expert",
    "data_parallel_backend": "pools[].parallel.backend",
    "enable_lora": "model.lora",
    "max_loras": "model.lora.max_loras",
    "max_cpu_loras": "model.lora.max_cpu_loras",
    "max_lora_rank": "model.lora.max_rank",
}

_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_bytes(value: Any) -> int:
    """Accept 536870912, "512MiB", "0.5GiB" or "2GB" and return bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a byte size such as 512MiB, not a boolean")
    if isinstance(value, int):
        return value
    match = _BYTES_RE.match(str(value))
    if not match:
        raise ValueError(f"expected a byte size such as 512MiB or 2GiB, got {value!r}")
    number, unit = match.groups()
    unit = (unit or "").lower().removesuffix("b")
    return int(float(number) * _UNITS[unit])


# Bytes, or a size such as "512MiB": what editors and Helm's values schema accept too.
ByteSize = Annotated[int, Field(gt=0), WithJsonSchema({"anyOf": [
    {"type": "integer", "exclusiveMinimum": 0},
    {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGTkmgt]i?[Bb]?|[Bb])?\s*$"}]})]


class Resources(_Strict):
    """What one replica of a pool gets."""

    cpus: float = Field(1.0, gt=0, description="CPU cores reserved in Ray for one replica.")
    gpus: int = Field(
        0, ge=0, description="GPUs the replica's engine uses: parallel.tensor x parallel.data "
        "(0: CPU).")
    kv_cache_bytes: ByteSize | None = Field(
        None, description="KV cache size per replica (e.g. 256MiB). Required on CPU."
    )
    pin_cores: bool = Field(
        True, description="On CPU, pin each replica's engine to cores no other replica uses."
    )
    ray_resources: dict[str, float] = Field(
        default_factory=dict, description="Extra Ray custom resources, e.g. to pin to a node."
    )

    @field_validator("kv_cache_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return None if value is None else parse_bytes(value)


class PoolTargets(_Strict):
    """A pool's own autoscaling targets; each one left out is the topology's `autoscaler` value.
    Prefill and decode pools usually want different ones (a prefill replica serves fewer
    concurrent requests than a decode replica)."""

    ttft_p90_s: float | None = Field(None, gt=0, description="TTFT target (prefill, unified).")
    itl_p90_s: float | None = Field(None, gt=0, description="Inter-token latency target "
                                    "(decode, unified).")
    max_kv_usage: float | None = Field(None, gt=0, le=1, description="KV usage that asks for more.")
    target_ongoing_requests: float | None = Field(
        None, gt=0, description="Requests one replica of this pool serves within the targets.")
    max_waiting_per_replica: float | None = Field(
        None, ge=0, description="Waiting requests per replica that count as a burst.")
    capacity_rps: float | None = Field(
        None, ge=0, description="Requests/s one replica of this pool serves within the targets "
        "(the plan's capacity; python -m sim capacity).")


class ParallelSpec(_Strict):
    """How one replica's engine is split across devices (cores on CPU, GPUs on GPU).

    Each of the `data` ranks runs its own copy of attention with its own KV cache, and the router
    places each request on a (replica, rank); `tensor` splits every rank's layers; `expert`
    shards a mixture-of-experts model's experts across all `tensor` x `data` ranks (vLLM's
    expert parallelism, an all-to-all every step). See docs/moe-dp.md.
    """

    tensor: int = Field(1, ge=1, description="Tensor-parallel ranks of each data-parallel rank.")
    data: int = Field(
        1, ge=1, description="Data-parallel ranks in one replica: attention replicated, a KV cache "
        "each, each a routing target of its own.")
    expert: bool = Field(
        False, description="Expert parallelism: experts sharded across all tensor x data ranks "
        "(mixture-of-experts models only; GPU only).")
    backend: Literal["mp", "ray"] = Field(
        "mp", description="mp: every rank in the replica's node, beside the replica (its "
        "resources are all ranks'). ray: vLLM places the ranks in Ray placement groups itself, "
        "across nodes (wide expert parallelism); the replica then reserves no GPU. GPU only.")

    @property
    def ranks(self) -> int:
        """Devices one replica's engine spans: tensor x data."""
        return self.tensor * self.data


class PoolSpec(_Strict):
    """A set of identical engine replicas with one role."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,30}$", description="Pool name (DNS-like).")
    role: PoolRole = Field("unified", description="unified, prefill or decode.")
    model: str | None = Field(
        None, description="The model this pool serves (a name in `models`); null: the "
        "topology's only model.")
    replicas: int = Field(1, ge=1, description="Replicas at deploy time.")
    min_replicas: int | None = Field(None, ge=0, description="Autoscaling lower bound.")
    max_replicas: int | None = Field(None, ge=1, description="Autoscaling upper bound.")
    resources: Resources = Field(default_factory=Resources)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="vLLM engine arguments for this pool only."
    )
    max_ongoing_requests: int = Field(64, ge=1, description="Requests one replica accepts.")
    shed_waiting: int | None = Field(
        None, ge=1, description="Load shedding: when every ready replica of the pool reports at "
        "least this many requests waiting in its engine's queue, a new request gets 503 with "
        "Retry-After at once (not charged) instead of waiting; requests already sent finish. "
        "Off when unset.")
    autoscaling: PoolTargets = Field(
        default_factory=PoolTargets, description="This pool's autoscaling targets, over the "
        "topology's autoscaler section.")

    @field_validator("engine_args")
    @classmethod
    def _own_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_owned(value)

    @model_validator(mode="after")
    def _bounds(self) -> PoolSpec:
        low, high = self.min_replicas, self.max_replicas
        if low is not None and high is not None and low > high:
            raise ValueError(f"min_replicas={low} is larger than max_replicas={high}")
        if self.min_replicas is not None and self.replicas < self.min_replicas:
            raise ValueError(f"replicas={self.replicas} is below min_replicas={self.min_replicas}")
        if self.max_replicas is not None and self.replicas > self.max_replicas:
            raise ValueError(f"replicas={self.replicas} is above max_replicas={self.max_replicas}")
        if self.resources.gpus == 0 and self.resources.kv_cache_bytes is None:
            raise ValueError("resources.kv_cache_bytes is required on CPU (gpus: 0)")
        return self

    @model_validator(mode="after")
    def _parallel_fits(self) -> PoolSpec:
        parallel, resources = self.parallel, self.resources
        ranks = parallel.ranks
        if resources.gpus and resources.gpus != ranks:
            raise ValueError(f"resources.gpus: {resources.gpus} GPUs for parallel.tensor x "
                             f"parallel.data = {parallel.tensor} x {parallel.data} = {ranks} "
                             f"ranks; each rank takes one GPU")
        if parallel.expert and ranks == 1:
            raise ValueError("parallel.expert: expert parallelism needs more than one rank "
                             "(parallel.tensor x parallel.data > 1)")
        if resources.gpus == 0:
            on_cpu = "this pool runs on CPU (resources.gpus: 0)"
            if parallel.expert:
                raise ValueError("parallel.expert: GPU only (vLLM's CPU backend has no "
                                 f"expert-parallel MoE kernel); {on_cpu}")
            if parallel.backend == "ray":
                raise ValueError("parallel.backend: GPU only (vLLM's CPU backend has no Ray "
                                 f"executor); {on_cpu}")
            if ranks > 1 and resources.cpus < ranks:  # one rank may take a share of a core
                raise ValueError(f"resources.cpus: {resources.cpus:g} for {ranks} ranks "
                                 "(parallel.tensor x parallel.data); each rank needs a core")
            if ranks > 1 and resources.pin_cores and int(resources.cpus) % ranks:
                raise ValueError(f"resources.cpus: {int(resources.cpus)} pinned cores do not split "
                                 f"evenly across {ranks} ranks (parallel.tensor x parallel.data)")
        return self


def check_owned(args: dict[str, Any]) -> dict[str, Any]:
    for key in args:
        if key in OWNED_ENGINE_ARGS:
            raise ValueError(f"{key} is set by tokenfab: use {OWNED_ENGINE_ARGS[key]}")
    return args
