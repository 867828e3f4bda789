"""Engines that die mid-stream (topology-migration.yaml: two replicas, float32): every stream goes
on, on the other replica, token for token as an uninterrupted run, and is charged once; then a
short soak kills engines under load (benchmarks/soak.py)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from benchmarks.soak import kill_engine, soak
from benchmarks.streams import Stream, divergence, greedy, stream
from orchestrator.config import Topology
from orchestrator.status import gateway_url
from tests.integration.conftest import ROOT, up
from tests.promql import scrape

TOPOLOGY = ROOT / "tests/integration/topology-migration.yaml"
STREAMS = 32
MAX_TOKENS = 640  # each stream lasts many seconds: the kill lands mid-stream


@pytest.fixture(scope="module")
def migrating(ray_cluster) -> Topology:
    with up(TOPOLOGY) as topology:
        yield topology


def _requests() -> list[tuple[str, dict]]:
    """Greedy streams that all generate their `max_tokens` (so each is long enough to be cut):
    half completions, half chats, every one asking for its usage and its tokens' logprobs."""
    requests = []
    for i in range(STREAMS):
        words = " ".join(f"w{(i * 13 + j) % 97}" for j in range(20 + 7 * i))
        body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        if i % 2:
            requests.append(("chat", greedy("chat", body | {
                "messages": [{"role": "user", "content": words}]})))
        else:
            requests.append(("completions", greedy("completions", body | {
                "prompt": f"stream {i}: {words}"})))
    return requests


def _tokens(root: str) -> dict[str, float]:
    return {kind: sum(s.value for s in scrape(f"{root}/metrics")
                      if s.name == "tokenfab_gateway_tokens_total" and s.labels["kind"] == kind)
            for kind in ("prompt", "completion")}


def _migrations(root: str) -> dict[str, float]:
    return {s.labels["outcome"]: s.value for s in scrape(f"{root}/metrics")
            if s.name == "tokenfab_router_migrations_total"}


class EngineKiller(threading.Thread):
    """SIGKILLs the victim replica's EngineCore once `started` of the streams being read have
    their first tokens from it: a cut after the client has bytes is what a continuation
    carries on. Nothing on the server side tells that: the engine's running requests and
    generated tokens run seconds ahead of what its replica relays on 2 busy cores (a kill on
    them cut streams before their first byte, which the gateway only sends elsewhere). A thread
    of its own, watching the streams as the client's event loop fills them: a timer on that
    loop, seconds behind with 32 streams on 2 shared cores, fired after most streams ended."""

    def __init__(self, pid: int, victim: str, streams: list[Stream], started: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.victim, self.streams, self.started = pid, victim, streams, started
        self.seen: int | None = None  # the victim's streams with tokens when it was killed
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                begun = sum(1 for s in self.streams if s.replica == self.victim and s.tokens)
                if begun >= self.started:
                    kill_engine(self.pid)
                    self.seen = begun
                    return
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


async def _all(root: str, requests: list[tuple[str, dict]],
               killer: EngineKiller | None = None) -> list[Stream]:
    """Run every request at once; with a `killer`, into its streams, started once they were
    sent."""
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    outs = killer.streams if killer is not None else [Stream(endpoint) for endpoint, _ in requests]
    async with httpx.AsyncClient(base_url=root, timeout=300, trust_env=False,
                                 limits=limits) as client:
        tasks = [asyncio.create_task(stream(client, endpoint, body, out))
                 for (endpoint, body), out in zip(requests, outs, strict=True)]
        if killer is not None:
            killer.start()
        return list(await asyncio.gather(*tasks))


def test_a_kill_during_streaming_loses_nothing(migrating: Topology) -> None:
    """32 greedy streams over two replicas; one engine is SIGKILLed while they stream. Every
    stream completes, token for token what the same requests gave uninterrupted (up to a
    near-tie of the two runs' logprobs: `divergence`), with one chunk id and the usage of one
    request; the gateway charged each once; the streams cut on the dead engine were continued
    on the other replica."""
    root, requests = gateway_url(migrating), _requests()
    reference = asyncio.run(_all(root, requests))
    assert all(s.ok for s in reference), [s.errors for s in reference if not s.ok]
    before, migrated_before = _tokens(root), _migrations(root).get("resumed", 0)
    victim = Counter(s.replica for s in reference).most_common(1)[0][0]  # where prefixes are
    pid = next(r["pid"] for r in httpx.get(f"{root}/tokenfab/replicas", trust_env=False).json()
               if r["replica_id"] == victim)
    killer = EngineKiller(pid, victim, [Stream(endpoint) for endpoint, _ in requests],
                          started=STREAMS // 8)
    streams = asyncio.run(_all(root, requests, killer))
    killer.join()
    assert killer.error is None and killer.seen is not None, killer.error  # killed mid-stream

    assert [s.errors for s in streams if not s.ok] == []
    assert all(s.done and len(s.chunk_ids) == 1 for s in streams)
    assert [divergence(got, want) for got, want in zip(streams, reference)] == [None] * STREAMS
    assert all(len(s.tokens) == s.usage["completion_tokens"] == MAX_TOKENS for s in streams)
    # every stream whose first bytes came from the victim was cut there and continued
    on_victim = [s for s in streams if s.replica == victim]
    migrations = _migrations(root)
    assert 1 <= migrations.get("resumed", 0) - migrated_before <= len(on_victim), \
        (migrations, killer.seen, len(on_victim))
    after = _tokens(root)
    assert after["completion"] - before["completion"] == MAX_TOKENS * STREAMS  # charged once
    assert after["prompt"] - before["prompt"] == sum(s.usage["prompt_tokens"] for s in reference)


def test_the_registry_outlives_its_creator_and_ends_once_idle(migrating: Topology) -> None:
    """The replica registry is detached: the process that created it may die (a replica Serve
    replaces) and every other replica's reports stay; nobody reporting for `idle_exit_s`, it
    ends. (It runs while Serve replaces the replica the test before killed, before the soak.)"""
    import ray

    from pools.registry import NAMESPACE

    address, name = migrating.cluster.address, "registry-idle-test"
    create = (f"import ray; from pools.registry import NAMESPACE, ReplicaRegistry; "
              f"ray.init(address='{address}', log_to_driver=False, logging_level='ERROR', "
              f"_node_ip_address='127.0.0.1'); r = ReplicaRegistry.options(name='{name}', "
              f"namespace=NAMESPACE, lifetime='detached').remote(idle_exit_s=5); "
              f"ray.get(r.snapshot.remote())")
    subprocess.run([sys.executable, "-c", create], check=True, cwd=ROOT, timeout=120)
    ray.init(address=address, log_to_driver=False, logging_level="ERROR",
             _node_ip_address="127.0.0.1")
    try:
        handle = ray.get_actor(name, namespace=NAMESPACE)  # its creator has exited
        assert ray.get(handle.snapshot.remote()) == []
        deadline = time.monotonic() + 60
        while True:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break  # gone
            assert time.monotonic() < deadline, "the idle registry did not end"
            time.sleep(0.5)
    finally:
        ray.shutdown()


def test_short_soak_kills_engines_under_load_and_loses_nothing(migrating: Topology) -> None:
    """benchmarks/soak.py for 190 s: an engine killed at 65 s, and another at 130 s or once the
    replica killed first is back (its replacement took over 90 s from the kill here, the engine
    starting beside the load), under 80% of measured capacity; every request completes as its
    uninterrupted reference."""
    root = gateway_url(migrating)

    def both_ready() -> bool:  # the registry answers throughout (it outlived the killed replica)
        response = httpx.get(f"{root}/tokenfab/replicas", trust_env=False, timeout=30)
        assert response.status_code == 200, response.text
        return sum(r["state"] == "ready" for r in response.json()) == 2
    deadline = time.monotonic() + 300
    while not both_ready():  # the previous test's victim is being replaced
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(1)
    result = asyncio.run(soak(root, migrating.name, seconds=190, kill_every_s=65, load=0.8,
                              rss_every_s=5, distinct=24, capacity_s=15))
    shown = json.dumps({key: result[key] for key in ("failures", "mismatches", "kill_log",
                                                     "windows", "rate_rps")}) + _serve_events()
    assert result["kills"] == 2 and all(k["replica"] for k in result["kill_log"]), shown
    assert (result["failed"], result["mismatched"], result["split_chunk_ids"]) == (0, 0, 0), shown
    assert result["completed"] == result["sent"] > 0


def _serve_events(limit: int = 60) -> str:
    """The Serve logs' warnings and errors (health checks, replicas replaced, engines dead),
    shown when the soak fails: CI keeps nothing else of the run."""
    events = []
    for path in Path("/tmp/ray/session_latest/logs/serve").glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            stamped = re.match(r"(INFO|WARNING|ERROR) (\S+ \S+) ", line)
            if stamped and "request_id=" not in line and (
                    stamped[1] != "INFO" or "eplica" in line or "died" in line):
                events.append((stamped[2], line[:300]))
    return "\nserve logs:\n" + "\n".join(line for _, line in sorted(events)[-limit:])
