"""Replays through a simulated cluster, and what a benchmark reports of them."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from router.index import BYTES_PER_ENTRY
from sim.cluster import SimCluster
from sim.engine import SimRequest
from sim.loop import EventLoop
from sim.params import EngineParams
from tokenfab.stats import percentile

MakeReplay = Callable[[int, float], list[SimRequest]]  # (replay index, start time) -> requests


def replay(params: EngineParams, policy: str, replicas: int, make: MakeReplay, replays: int = 1,
           **cluster: Any) -> dict[str, Any]:
    """`replays` replays one after another (the next starts when the last one's requests have
    ended, as the routing benchmark runs them), on one cluster; their summary."""
    loop = EventLoop()
    sim = SimCluster(loop, params, policy, replicas, **cluster)
    began, requests, spans = time.perf_counter(), [], []
    for index in range(replays):
        start = loop.now
        batch = make(index, start)
        sim.submit(batch)
        loop.run()
        requests += batch
        spans.append(loop.now - start)
    wall = time.perf_counter() - began
    return summary(policy, requests, sim, sum(spans), wall)


def summary(policy: str, requests: list[SimRequest], sim: SimCluster, sim_s: float,
            wall_s: float) -> dict[str, Any]:
    done = [r for r in requests if r.first_token is not None and r.finished is not None]
    ttft = np.array([r.first_token - r.arrival for r in done])
    itl = np.array([r.itl_sum_s / r.itl_count for r in done if r.itl_count])  # mean gap each
    prompt = sum(r.prompt_tokens for r in done)
    decisions_ms = np.array(sim.decision_ns or [0]) / 1e6
    per_replica = Counter(r.replica for r in done)
    return {
        "policy": policy, "replicas": len({r.replica for r in requests}),
        "requests": len(requests), "unfinished": len(requests) - len(done),
        "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50), "itl_p90_s": percentile(itl, 90),
        "itl_p99_s": percentile(itl, 99),
        "hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        "output_tok_s": sum(r.output_tokens for r in done) / sim_s if sim_s else 0.0,
        "busiest_replica_share": max(per_replica.values()) / len(done) if done else 0.0,
        "preempted": sum(r.preemptions > 0 for r in done),
        "decision_p50_ms": percentile(decisions_ms, 50),
        "decision_p99_ms": percentile(decisions_ms, 99),
        "router_ms_per_request": (sum(sim.decision_ns) + sim.apply_ns) / 1e6 / len(requests)
        if requests else 0.0,
        "index_entries_peak": sim.peak_index_entries,
        "index_bytes_peak": sim.peak_index_entries * BYTES_PER_ENTRY,
        "history_entries_peak": sim.peak_history_entries,
        "sim_s": sim_s, "wall_s": wall_s, "sim_speedup": sim_s / wall_s if wall_s else 0.0,
        "per_request": [{"id": r.request_id, "replica": r.replica, "prompt": r.prompt_tokens,
                         "cached": r.cached_tokens, "ttft": r.first_token - r.arrival,
                         "queued": r.engine_arrival - r.arrival} for r in done],
    }

