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


class ReplicaView(msgspec.Struct, frozen=True):
    """One replica as the registry reports it (refreshed about once a second)."""

    replica: ReplicaId
    pool: str
    state: str = "ready"
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    block_size: int = 0  # 0 until the engine has started
    kv_blocks: int = 0  # KV cache capacity in blocks (0 until the engine has started)
    in_flight: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    engine_cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache
    engine_prompt_tokens: int = 0  # prompt tokens the engine saw (computed + cached + pulled)
