"""What travels between the gateway, Ray Serve's request router and the replica registry."""

from __future__ import annotations

import msgspec

from router.events import EngineBlockHash
from router.index import ReplicaId


class RouteKey(msgspec.Struct, frozen=True):
    """A request's routing identity, computed once by the gateway (tokenise, then hash) and
    passed with the request so the request router never tokenises on its own loop."""

    request_id: str
    prompt_tokens: int
    block_size: int
    block_hashes: list[EngineBlockHash]
    adapter: str | None = None  # the LoRA adapter the request runs with (None: the base model)


def target_id(replica: str, rank: int | None) -> ReplicaId:
    """The routing target of a replica's engine, or of one of its data-parallel ranks (each has
    its own KV cache, so each is a target of its own): "r1" or "r1/dp0"."""
    return ReplicaId(replica if rank is None else f"{replica}/dp{rank}")


class ReplicaView(msgspec.Struct, frozen=True):
    """One routing target as the registry reports it (refreshed about once a second): a
    replica's engine, or one data-parallel rank of it (`rank` set; `replica` is then
    `target_id(host, rank)` and `host` the replica that serves it)."""

    replica: ReplicaId
    pool: str
    state: str = "ready"
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    block_size: int = 0  # 0 until the engine has started
    kv_blocks: int = 0  # KV cache capacity in blocks (0 until the engine has started)
    max_num_seqs: int = 0  # requests one engine batch runs (0 until the engine has started)
    in_flight: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    engine_cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache
    engine_prompt_tokens: int = 0  # prompt tokens the engine saw (computed + cached + pulled)
    host: str = ""  # the replica serving a rank ("" for a replica's whole engine)
    rank: int | None = None  # the data-parallel rank, or None: the whole engine
    adapters: tuple[str, ...] = ()  # LoRA adapters the engine holds, least recently used first
    adapter_load_s: float = 0.0  # its median adapter load time lately (0: none measured)
