"""The contract between a pool replica and the engine inside it, and the wire types it returns.

Everything above `pools/` (gateway, router, request flow) sees engines only through these types.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any, Literal, Protocol, TypeGuard, get_args

import msgspec

from channel.frames import AdapterRef

Endpoint = Literal["completions", "chat"]
_ENDPOINTS = frozenset(get_args(Endpoint))


def is_endpoint(name: str) -> TypeGuard[Endpoint]:
    """Whether `name` (a request's, from the channel) is an endpoint engines serve."""
    return name in _ENDPOINTS


class EngineSpec(msgspec.Struct, frozen=True):
    """Everything one replica needs to build its engine; derived from the topology by the app."""

    model_name: str
    model_path: str
    generate: str | None = None  # "tiny" or "tiny-moe": build it at model_path if missing
    dtype: str = "auto"
    max_model_len: int = 2048
    engine_args: dict[str, Any] = msgspec.field(default_factory=dict)
    kv_cache_bytes: int | None = None
    tensor: int = 1  # tensor-parallel ranks of each data-parallel rank
    data: int = 1  # data-parallel ranks: each its own KV cache and routing target
    expert: bool = False  # experts sharded across all ranks
    parallel_backend: str = "mp"  # "ray": vLLM places the ranks across nodes itself
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_transfer_config: dict[str, Any] | None = None  # NixlConnector settings (kvtransfer.nixl)
    lora: LoraSettings | None = None  # the engine runs LoRA adapters (None: it cannot)


class LoraSettings(msgspec.Struct, frozen=True):
    """vLLM's LoRA settings of an engine, and the tiny adapters to generate where missing."""

    max_loras: int = 2  # adapters in one batch
    max_cpu_loras: int = 2  # adapters kept loaded (least recently used evicted first)
    max_rank: int = 16
    generate: tuple[tuple[str, int], ...] = ()  # (path, tiny adapter number)


class ReplyHead(msgspec.Struct, frozen=True):
    """First item of every reply stream: the HTTP status and whether SSE chunks follow.

    After a head with `streaming=False` exactly one item follows: the JSON body (a response object
    or an OpenAI error object). After `streaming=True`, each item is one SSE event,
    `data: ...\\n\\n`.
    """

    status: int
    streaming: bool
    replica_id: str = ""


class TokenTrace:
    """The generated tokens of one streamed request (one choice), as the engine produces them.

    `take` hands out the tokens of the outputs since its last call; the replica sends them with
    the chunk that carries them, so the gateway knows which tokens its client has. A token can
    be part of a character that a later token completes (byte-level vocabularies): it is sent
    at once all the same, with no text, as vLLM's own server sends it; a continuation from it
    gets the character's text when it completes (pools.vllm_engine continues the detokenizer).

    `resume` makes the request a continuation: those tokens were generated before (elsewhere)
    and become part of its prompt; the engine generates what is left of `max_tokens`.
    """

    __slots__ = ("resume", "_ready")

    def __init__(self, resume: tuple[int, ...] = ()) -> None:
        self.resume = resume
        self._ready: list[int] = []

    def add(self, ids: Iterable[int]) -> None:
        """One engine output's tokens (several steps' when vLLM merged them)."""
        self._ready.extend(ids)

    def take(self) -> list[int]:
        """The tokens added since the last call."""
        ids, self._ready = self._ready, []
        return ids


class LoadSnapshot(msgspec.Struct, frozen=True):
    """One replica's load, as its engine last reported it (refreshed every engine step).

    `kv_cache_usage` is in [0, 1]; `prefix_cache_hit_rate` is hits / queried tokens since start.
    Prompt tokens are counted by where their KV came from (computed here, this engine's prefix
    cache, or a KV transfer); the kv_transfer_* counters are the decode side's pulls. All
    counters are totals since the engine started.
    """

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    in_flight: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_local_hit: int = 0
    prompt_tokens_transferred: int = 0
    generation_tokens: int = 0
    kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        if not self.prefix_cache_queries:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


class Latency(msgspec.Struct, frozen=True):
    """One replica's latencies and output rate over its engine's recent window (the
    autoscaler's, SIGNAL_WINDOW_S): first tokens of requests that got one in it, and the mean
    gap between tokens of requests that ended in it; zeros when none did."""

    ttft_p50_s: float = 0.0
    ttft_p90_s: float = 0.0
    itl_p50_s: float = 0.0
    itl_p90_s: float = 0.0
    generation_tokens_per_s: float = 0.0


class Engine(Protocol):
    """An engine serving OpenAI requests. One instance per replica; all methods run on one loop.

    `reply` yields a ReplyHead then bytes (see ReplyHead). Closing the iterator early (client gone)
    aborts the engine request. Errors caused by the request come back as 4xx replies, never raised;
    a dead engine raises EngineDeadError. With a `trace`, the engine adds each step's generated
    tokens and text to it before it yields the bytes that carry them, and resumes from
    `trace.resume`. With data-parallel ranks, `rank` chooses the one that runs the request
    (None: the engine's own balancer does). With an `adapter`, the request runs with that LoRA
    adapter (the body's `model` names it), loaded first where the engine does not hold it.
    """

    block_size: int  # the KV cache's block size in tokens, once started (0 before)
    kv_blocks: int  # the KV cache's capacity in blocks (each rank's), once started (0 before)
    max_num_seqs: int  # requests one batch runs (each rank's), once started (0 before)
    dead: bool  # the engine failed and will not answer again

    async def start(self) -> None: ...

    def reply(self, endpoint: Endpoint, body: dict[str, Any], trace: TokenTrace | None = None,
              rank: int | None = None, adapter: AdapterRef | None = None
              ) -> AsyncIterator[ReplyHead | bytes]: ...

    async def check_health(self) -> None: ...

    def load(self) -> LoadSnapshot: ...

    def rank_loads(self) -> list[LoadSnapshot]: ...  # per data-parallel rank, in rank order

    def signals(self) -> Any: ...  # autoscaler.signals.ReplicaSignals

    def latency(self) -> Latency: ...

    def shutdown(self) -> None: ...
