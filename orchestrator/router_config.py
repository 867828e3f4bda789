"""A topology's router section: how the gateway picks a replica of each pool (see
orchestrator.config for the whole document)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from orchestrator.strict import Strict as _Strict


class RouterSpec(_Strict):
    """How the gateway picks a replica of a pool (decode pools whose ranks Ray places:
    least_loaded).

    Formulas and worked examples: router/README.md.
    """

    policy: Literal["kv_aware", "prefix_approx", "round_robin", "least_loaded"] = Field(
        "kv_aware",
        description="kv_aware: lowest estimated time to first token from the engines' KV events "
        "and a TTFT model fitted online, with affinity to where the prefix was sent, within "
        "the TTFT target (ttft_target_s), and new "
        "prompts placed where the prefix caches have the most free or cold room. "
        "prefix_approx: prefix affinity from the router's own past decisions, balanced by queue "
        "length. round_robin: in turn, one turn per node shared by its ingresses. "
        "least_loaded: power of two choices on requests in flight "
        "(Ray Serve's default router).",
    )
    weights: dict[str, float] = Field(
        default_factory=dict,
        description="Scorer weights replacing the policy's defaults (kv_aware: {ttft: 1, "
        "approx_prefix: 1, cache_room: 1}; "
        "prefix_approx: {approx_prefix: 1, queue: 0.5}). Scorers: prefix, approx_prefix, queue, "
        "kv_usage, ttft, delay, cache_room.",
    )
    dp_ranks: Literal["route", "engine"] = Field(
        "route", description="Engines with data-parallel ranks (pools[].parallel.data > 1). "
        "route: each rank is a routing target of its own (its KV cache, KV events and load), "
        "and the request runs on the rank the policy chose. engine: requests are placed on "
        "replicas only and each engine's own balancer picks the rank, unaware of prefixes (a "
        "baseline: what a rank-agnostic router gets); the ranks' KV events are not followed.")
    adapters: Literal["aware", "ignore"] = Field(
        "aware", description="LoRA adapters (model.lora). aware: a request's blocks are hashed "
        "with its adapter, as the engines hash them (a prefix cached under one adapter is no "
        "hit for another), and each replica's estimated time to first token counts the "
        "measured load of an adapter it does not hold. ignore: routed as if every request ran "
        "on the base model (a baseline: what an adapter-blind router gets).")
    max_in_flight: int | None = Field(
        None, ge=1, description="A replica with this many requests in flight takes no more "
        "requests while another replica has room, however much of the prompt it holds. Unset: "
        "each replica's engine max_num_seqs (a full batch), as the replica reports it, and 64 "
        "until it has.")
    ttft_target_s: float | None = Field(
        None, ge=0, description="kv_aware: a replica whose estimated time to first token for "
        "the request exceeds this is not chosen while another's does not, however much of "
        "the prompt it holds (a popular prefix would otherwise queue on its holder). Unset: "
        "the pool's TTFT target (autoscaler.ttft_p90_s, or the pool's own); 0: none.")
    tie_tolerance: float = Field(
        0.05, ge=0, lt=1, description="Replicas scoring within this fraction of the best are "
        "picked at random among themselves.")
    max_candidates: int = Field(
        64, ge=0, description="Replicas scored per request (each costs the router a few "
        "microseconds): in a larger pool, those holding the longest prefixes of the request "
        "(up to half) and a random sample of the others; the rest are fallbacks. 0 scores "
        "every replica. round_robin ignores it.")
    in_flight_cost_tokens: float = Field(
        128.0, ge=0, description="kv_aware prior, until fitted from observed first tokens: each "
        "request in flight on a replica counts as this many prompt tokens of work ahead.")
    prefill_tokens_per_s: float = Field(
        4000.0, gt=0, description="kv_aware prior, until fitted: prefill throughput of a replica.")
    history_ttl_s: float = Field(
        300.0, gt=0, description="prefix_approx: how long a dispatched prefix counts as cached.")
    max_history_entries: int = Field(
        1_000_000, ge=1000, description="Bound on (block, replica) pairs in the history of "
        "prefixes this router sent (approx_prefix: kv_aware, prefix_approx), per pool, in each "
        "ingress replica; every 4th block of a prompt is kept, and the blocks sent least "
        "recently are forgotten first. About 170 bytes each. At 1,024 replicas and 768 req/s "
        "of long prompts, the default bound lost reuse (see docs/simulator.md).")
    breaker_failures: int = Field(
        3, ge=1, description="A replica whose requests fail this many times (before they are "
        "answered) within breaker_window_s is not chosen for breaker_open_s (its circuit breaker "
        "opens), unless no other replica is left.")
    breaker_window_s: float = Field(30.0, gt=0, description="See breaker_failures.")
    breaker_open_s: float = Field(
        10.0, gt=0, description="How long an open breaker keeps its replica out; then one request "
        "probes it, and a failure doubles the time (up to 8x).")
    max_index_entries: int = Field(
        1_000_000, ge=1000, description="Bound on (block, replica) pairs in the block map of "
        "each pool, in each ingress replica; the least recently stored blocks are forgotten "
        "first. About 300 bytes each (tokenfab_router_index_bytes): the default is at most "
        "0.3 GB, room for 16 replicas of 60,000 blocks.")

    @field_validator("weights")
    @classmethod
    def _known_scorers(cls, weights: dict[str, float]) -> dict[str, float]:
        from router.scorers import SCORERS

        unknown = sorted(set(weights) - set(SCORERS))
        if unknown:
            raise ValueError(f"unknown scorer(s) {unknown}; known: {sorted(SCORERS)}")
        if any(weight < 0 for weight in weights.values()):
            raise ValueError("scorer weights must be >= 0")
        return weights
