"""Helpers of the autoscaling tests: closed-loop load, and the replica counts Serve reports."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from orchestrator import deploy
from orchestrator.config import Topology, pool_deployment_name
from orchestrator.status import gateway_url


def running(topology: Topology, pool: str) -> int:
    """RUNNING replicas of a pool, as Serve reports them."""
    app = deploy.ServeClient(topology.cluster.dashboard_url).application(topology.name) or {}
    deployment = (app.get("deployments") or {}).get(pool_deployment_name(pool)) or {}
    return sum(1 for r in deployment.get("replicas") or [] if r["state"] == "RUNNING")


def wait_for(topology: Topology, pool: str, replicas: int, bound_s: float,
             watch: dict[str, int] | None = None) -> float:
    """Seconds until `pool` runs `replicas`; fails past `bound_s`, or if a pool in `watch`
    leaves its count ({pool: replicas}) meanwhile."""
    started = time.monotonic()
    while running(topology, pool) != replicas:
        elapsed = time.monotonic() - started
        assert elapsed < bound_s, (f"{pool} not at {replicas} replicas after {bound_s} s "
                                   f"(now {running(topology, pool)}): {_decisions(topology)}")
        for other, count in (watch or {}).items():
            assert running(topology, other) == count, f"{other} left {count} replicas"
        time.sleep(1)
    return time.monotonic() - started


def wait_served(topology: Topology, pool: str, replicas: int, bound_s: float = 60) -> float:
    """Seconds until `replicas` ready replicas of `pool` have each served prompt tokens (its
    engine's own count, as the registry reports it); fails past `bound_s`."""
    started, root = time.monotonic(), gateway_url(topology)
    while True:
        ready = [r for r in httpx.get(f"{root}/tokenfab/replicas", trust_env=False,
                                      timeout=10).json()
                 if r["pool"] == pool and r["state"] == "ready"]
        if sum(_prompt_tokens(r["load"]) > 0 for r in ready) >= replicas:
            return time.monotonic() - started
        assert time.monotonic() - started < bound_s, f"{pool}: a replica served nothing: {ready}"
        time.sleep(0.5)


def _prompt_tokens(load: dict[str, Any]) -> int:
    """Prompt tokens a replica's engine saw: computed, from its prefix cache, or transferred."""
    return sum(load[k] for k in ("prompt_tokens_computed", "prompt_tokens_local_hit",
                                 "prompt_tokens_transferred"))


def _decisions(topology: Topology) -> str:
    """The autoscaler's last decisions and the signals behind them, for a failure's message."""
    try:
        return httpx.get(f"{gateway_url(topology)}/tokenfab/autoscaler", trust_env=False,
                         timeout=10).text[:2000]
    except httpx.HTTPError as exc:
        return f"(the autoscaler's decisions could not be read: {exc!r})"


class Load:
    """`clients` threads sending completions back to back, or each at most one per `pace_s`
    seconds; every status is kept. `prompt(client, n)` makes each request's prompt."""

    def __init__(self, root: str, clients: int, max_tokens: int,
                 prompt: Callable[[int, int], str] = lambda i, n: f"autoscale {i} {n}",
                 pace_s: float = 0.0) -> None:
        self._root, self._max_tokens, self._prompt = root, max_tokens, prompt
        self._pace_s = pace_s
        self.statuses: list[int] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def _client(self, index: int) -> None:
        with httpx.Client(trust_env=False, timeout=300) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                started = time.monotonic()
                try:
                    response = http.post(f"{self._root}/v1/completions", json={
                        "model": "tiny", "prompt": self._prompt(index, n),
                        "max_tokens": self._max_tokens, "ignore_eos": True})
                    self.statuses.append(response.status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)
                if self._pace_s:
                    self._stop.wait(max(0.0, self._pace_s - (time.monotonic() - started)))

    def answered_more(self, count: int, bound_s: float = 60) -> None:
        """Wait until `count` more requests than now have been answered."""
        wanted, deadline = len(self.statuses) + count, time.monotonic() + bound_s
        while len(self.statuses) < wanted:
            assert time.monotonic() < deadline, f"{len(self.statuses)} answered, want {wanted}"
            time.sleep(0.1)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)
