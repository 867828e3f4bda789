"""The routing pipeline's contracts: what a scorer sees about each replica, and the plugin seams.

A policy is filters, then weighted scorers, then a picker (see router/policies.py). Every plugin is
a pure function of one `RouteRequest` and a list of `Candidate` snapshots, so each is tested with
tables and no cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from router.index import ReplicaId


class RouteRequest(msgspec.Struct, frozen=True):
    """The request being routed, as far as routing cares."""

    prompt_tokens: int = 0  # 0 when the prompt could not be read (routing falls back to load)
    block_size: int = 1
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)


class Candidate(msgspec.Struct, frozen=True):
    """One replica as the router sees it at decision time.

    `cached_tokens` comes from the global KV block map (engine events); `approx_cached_tokens`
    from this router's own past decisions. `queued_prefill_tokens` is prompt work already sent to
    the replica and not yet answered with a first token. The last three fields are the replica's
    TTFT model, fitted online (router/ttft_model.py). `cache_fill` is the demand on the
    replica's prefix cache relative to its capacity: blocks held, plus blocks stored recently,
    plus the prompt blocks queued there, over its KV blocks (0 when the capacity is unknown).
    What the request's LoRA adapter adds there before its prefill starts (0 for the base model;
    router/adapters.py): `adapter_load_s`, its load where the replica does not hold it, and
    `adapter_slot_s`, the wait for a batch slot where the replica runs as many other adapters
    as a batch can. `batch_slots` is the engine's max_num_seqs, as the replica reports it.
    """

    replica: ReplicaId
    cached_tokens: int = 0
    approx_cached_tokens: int = 0
    queued_prefill_tokens: int = 0
    in_flight: int = 0
    kv_usage: float = 0.0
    prefill_tokens_per_s: float = 4000.0
    in_flight_cost_tokens: float = 128.0
    overhead_s: float = 0.0
    cache_fill: float = 0.0
    adapter_load_s: float = 0.0
    adapter_slot_s: float = 0.0
    batch_slots: int = 0  # requests one engine batch runs there (max_num_seqs; 0: not known)

    def uncached_tokens(self, request: RouteRequest) -> int:
        return max(0, request.prompt_tokens - self.cached_tokens)

    def estimated_ttft_s(self, request: RouteRequest) -> float:
        """Fixed overhead and the adapter's wait, plus the work ahead of the request and its own
        uncached prefill at the replica's prefill throughput. Work ahead is the prefill queued
        there plus, for each request in flight, `in_flight_cost_tokens` (its decode steps slow
        the prefill beside it).

        Example: 3,000 tokens queued, 2 requests in flight at 128 tokens each, a 2,048-token
        prompt with 1,536 cached, 4,000 tokens/s, no overhead: (3,000 + 256 + 512) / 4,000 =
        0.942 s; 0.992 s where its adapter takes 0.05 s to load.
        """
        work = (self.queued_prefill_tokens + self.in_flight * self.in_flight_cost_tokens
                + self.uncached_tokens(request))
        return (self.overhead_s + self.adapter_wait_s
                + work / max(self.prefill_tokens_per_s, 1.0))

    @property
    def adapter_wait_s(self) -> float:
        return self.adapter_load_s + self.adapter_slot_s

    def estimated_delay_s(self, request: RouteRequest) -> float:
        """The waiting that placing the request here adds, summed over the replica's requests:
        its own estimated TTFT, plus, for each request in flight there, the time its uncached
        prefill takes. An engine step carries a running request's next token and a chunk of
        prefill together, so every request running there (and every one queued ahead, which
        runs by then) waits through this prefill one chunk at a time.

        Example: a 2,048-token prompt at 4,000 tokens/s, in-flight cost 128, no overhead. a
        holds 1,536 tokens, has 1,000 queued and 2 in flight: 0.442 + 2 x 512 / 4,000 = 0.698 s.
        b holds nothing, has nothing queued and 4 in flight: 0.640 + 4 x 2,048 / 4,000 = 2.688 s.
        """
        uncached = self.uncached_tokens(request)
        rate = max(self.prefill_tokens_per_s, 1.0)
        return self.estimated_ttft_s(request) + self.in_flight * uncached / rate


class Filter(Protocol):
    """Drops candidates that must not take the request. Must keep at least one when given any
    (a filter that would drop all returns its input unchanged)."""

    name: str

    def filter(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    """Scores every candidate in [0, 1], higher is better; one score per candidate, in order.
    The policy clamps out-of-range scores, so a buggy scorer cannot dominate the weighted sum."""

    name: str

    def score(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[float]: ...


class Picker(Protocol):
    """Orders candidates by preference given their total scores; the first is the choice, the
    rest are fallbacks when it turns out to be full. Owns its own randomness or cursor."""

    name: str

    def rank(self, candidates: Sequence[Candidate], scores: Sequence[float]) -> list[Candidate]: ...


class IdPicker(Picker, Protocol):
    """A picker that reads nothing of the candidates (round robin) and so can order bare ids,
    without a snapshot per replica."""

    def rank_ids(self, replicas: Sequence[ReplicaId]) -> list[ReplicaId]: ...
