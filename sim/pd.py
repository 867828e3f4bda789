"""Prefill and decode pools in simulation, joined as tokenfab's gateway joins them.

A request whose prompt would leave decode at least `min_prompt_tokens` to compute (the gateway's
rule, `router.recent_prefixes.skip_prefill`, over what decode's block map holds or, where decode's
router follows no events, the prefixes recently sent to decode) first
goes to the prefill pool with one output token; its blocks stay on that engine. When it ends, the
same request goes to the decode pool, whose engine pulls the prompt's KV when it admits it:
`transfer_latency_s + tokens x params.kv_bytes_per_token / transfer_bytes_per_s`, then frees the
prefill engine's blocks. Other requests go to decode alone, which computes their prompts. Each
pool is a `SimCluster` routing with tokenfab's own `RoutingService`, so each learns its engines'
blocks from their events: decode's from what it pulled and computed.

The client's first token is decode's (the prefill leg's one token stays in the gateway), so a
disaggregated request's TTFT is its prefill leg, the pull and decode's first step, with each
leg's request overhead.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from router.recent_prefixes import BLOCK_TOKENS, CAPACITY_BLOCKS, RecentPrefixes, skip_prefill
from router.wire import RouteKey
from sim.cluster import SimCluster
from sim.engine import SimRequest
from sim.loop import EventLoop
from sim.params import EngineParams
from tokenfab.errors import SimConfigError
from tokenfab.stats import percentile

PREFILL, DECODE = "prefill", "decode"


class SimPDCluster:
    """A prefill pool and a decode pool behind one simulated gateway. Owned by the loop."""

    def __init__(self, loop: EventLoop, params: EngineParams, policy: str, prefill: int,
                 decode: int, *, transfer_bytes_per_s: float, transfer_latency_s: float = 0.0,
                 min_prompt_tokens: int = 256, decode_cache_ttl_s: float = 300.0,
                 **cluster: Any) -> None:
        if transfer_bytes_per_s <= 0:
            raise SimConfigError("transfer_bytes_per_s: must be > 0")
        if params.kv_bytes_per_token <= 0:
            raise SimConfigError(f"profile {params.name}: kv_bytes_per_token is not set, and P/D "
                             "needs it to time the KV pulls")
        self.loop, self.params = loop, params
        self.transfer_bytes_per_s, self.transfer_latency_s = (transfer_bytes_per_s,
                                                              transfer_latency_s)
        self.min_prompt_tokens = min_prompt_tokens
        self.prefill = SimCluster(loop, params, policy, prefill, pool=PREFILL, prefix="p",
                                  on_finished=self._prefilled, **cluster)
        self.decode = SimCluster(loop, params, policy, decode, pool=DECODE, prefix="d",
                                 pull_s=self.pull_s, on_pulled=self._pulled, **cluster)
        # the gateway's memory of what decode was sent, in the engine's blocks: as many tokens
        # (its blocks are 64 tokens; here a prefix counts to the engine block, not to 64)
        # (where decode's router follows no block map: the gateway does the same)
        self._on_decode = None if self.decode.service.follows_events else RecentPrefixes(
            block_tokens=params.block_size,
            capacity_blocks=CAPACITY_BLOCKS * BLOCK_TOKENS // params.block_size,
            ttl_s=decode_cache_ttl_s, clock=loop.clock)
        self._legs: dict[str, SimRequest] = {}  # prefill leg id -> its request
        self.skipped: dict[str, int] = {"short_prompt": 0, "cached_on_decode": 0}
        self.disaggregated = 0

    def pull_s(self, tokens: int) -> float:
        return (self.transfer_latency_s
                + tokens * self.params.kv_bytes_per_token / self.transfer_bytes_per_s)

    def submit(self, requests: Iterable[SimRequest]) -> None:
        for request in requests:
            self.loop.at(request.arrival, lambda r=request: self._arrive(r))

    def _cached_on_decode(self, request: SimRequest) -> int:
        """What the gateway's `DisaggregatedFlow` counts: decode's block map, where its router
        reads one (`RoutingService.cached_tokens`), else the prefixes it recently sent there."""
        service = self.decode.service
        if self._on_decode is None:
            return service.cached_tokens(RouteKey(request.request_id, request.prompt_tokens,
                                                  self.params.block_size,
                                                  list(request.block_hashes))) or 0
        return self._on_decode.cached_blocks(request.block_hashes) * self.params.block_size

    def _arrive(self, request: SimRequest) -> None:
        hashes = request.block_hashes
        reason = skip_prefill(request.prompt_tokens, lambda: self._cached_on_decode(request),
                              self.min_prompt_tokens)
        if reason is not None:
            self.skipped[reason] += 1
            self._to_decode(request)
            return
        self.disaggregated += 1
        leg = SimRequest(f"{request.request_id}/prefill", request.arrival, request.prompt_tokens,
                         hashes, 1, hold_kv=True)
        self._legs[leg.request_id] = request
        self.prefill.route_now(leg)

    def _prefilled(self, leg: SimRequest) -> None:
        request = self._legs.pop(leg.request_id)
        request.remote_kv, request.prefill_leg = True, leg
        self._to_decode(request)

    def _to_decode(self, request: SimRequest) -> None:
        if self._on_decode is not None:
            self._on_decode.record_blocks(request.block_hashes)
        self.decode.route_now(request)

    def _pulled(self, request: SimRequest) -> None:
        """Decode has the prompt's KV: prefill lets go of it."""
        leg = request.prefill_leg
        replica = self.prefill.replicas.get(leg.replica)
        if replica is not None:
            replica.engine.release(leg.request_id)


def replay(params: EngineParams, policy: str, prefill: int, decode: int,
           requests: list[SimRequest], **pd: Any) -> dict[str, Any]:
    """One replay through a P/D cluster, and its summary."""
    loop = EventLoop()
    sim = SimPDCluster(loop, params, policy, prefill, decode, **pd)
    began = time.perf_counter()
    sim.submit(requests)
    loop.run()
    return summary(policy, requests, sim, loop.now - min(r.arrival for r in requests),
                   time.perf_counter() - began)


def summary(policy: str, requests: list[SimRequest], sim: SimPDCluster, sim_s: float,
            wall_s: float) -> dict[str, Any]:
    """What `sim.run.summary` reports of a unified pool, for the two pools together; the hit
    rate counts the prompt tokens no engine computed (a disaggregated request's are the prefill
    engine's hits: decode computes one token of a pulled prompt)."""
    done = [r for r in requests if r.first_token is not None and r.finished is not None]
    ttft = np.array([r.first_token - r.arrival for r in done])
    itl = np.array([r.itl_sum_s / r.itl_count for r in done if r.itl_count])
    prompt = sum(r.prompt_tokens for r in done)
    legs = [r for r in done if r.remote_kv]
    direct = [r for r in done if not r.remote_kv]
    prefill_hits = sum(r.prefill_leg.cached_tokens for r in legs)
    direct_hits = sum(r.cached_tokens for r in direct)
    not_computed = prefill_hits + direct_hits
    pulled = [r for r in done if r.pulled_tokens]
    pulls = np.array([r.pull_s for r in pulled])
    decisions = np.array((sim.prefill.decision_ns + sim.decode.decision_ns) or [0]) / 1e6
    return {
        "policy": policy, "prefill_replicas": len(sim.prefill.replicas),
        "decode_replicas": len(sim.decode.replicas),
        "requests": len(requests), "unfinished": len(requests) - len(done),
        "disaggregated": sim.disaggregated, "skipped": dict(sim.skipped),
        **{f"ttft_p{q}_s": percentile(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_s": percentile(itl, q) for q in (50, 90, 99)},
        "hit_rate": not_computed / prompt if prompt else 0.0,
        # of the disaggregated requests' prompts, what the prefill engines had; of the others',
        # what the decode engines had
        "prefill_leg_hit_rate": _share(prefill_hits, legs),
        "decode_only_hit_rate": _share(direct_hits, direct),
        "output_tok_s": sum(r.output_tokens for r in done) / sim_s if sim_s else 0.0,
        "pulled_gb": sum(r.pulled_tokens for r in pulled) * sim.params.kv_bytes_per_token / 1e9,
        "pull_p50_s": percentile(pulls, 50), "pull_p90_s": percentile(pulls, 90),
        "preempted": sum(r.preemptions > 0 for r in done),
        "decision_p99_ms": percentile(decisions, 99),
        "sim_s": sim_s, "wall_s": wall_s, "sim_speedup": sim_s / wall_s if wall_s else 0.0,
    }


def _share(hits: int, requests: list[SimRequest]) -> float:
    prompt = sum(r.prompt_tokens for r in requests)
    return hits / prompt if prompt else 0.0
