"""Engines that die mid-stream (topology-migration.yaml: two replicas, float32): every stream goes
on, on the other replica, token for token as an uninterrupted run, and is charged once; then a
short soak kills engines under load (benchmarks/soak.py)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.common.streams import Stream, divergence, greedy, stream
from benchmarks.soak import kill_engine, soak
from orchestrator.config import Topology
from orchestrator.deploy import ServeClient
from orchestrator.status import gateway_url
from tests.integration.conftest import ROOT, TOKENFAB, up
from tests.promql import scrape

TOPOLOGY = ROOT / "tests/integration/topology-migration.yaml"
STREAMS = 32
MAX_TOKENS = 640  # each stream lasts many seconds: the kill lands mid-stream
KILL_RUNS = 3  # runs in which the kill may land where it cuts no stream mid-way


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


def _await_both_ready(root: str) -> None:
    """Until both replicas report ready (a killed one is being replaced; the registry answers
    throughout: it outlives a killed replica)."""
    deadline = time.monotonic() + 300
    while True:
        response = httpx.get(f"{root}/tokenfab/replicas", trust_env=False, timeout=30)
        assert response.status_code == 200, response.text
        if sum(r["state"] == "ready" for r in response.json()) == 2:
            return
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(1)


class EngineKiller(threading.Thread):
    """SIGKILLs the EngineCore of the first replica through which the gateway is streaming
    `started` requests: in flight there, past their first token (the router's `streaming`, from
    /tokenfab/router). The gateway decides whether a cut stream is continued (it had sent bytes)
    or re-sent whole (it had not), so its view is the trigger. Engine-side counts ran seconds
    ahead of what the replicas relayed on 2 busy cores, and the client's own streams, filled by
    a loop reading 32 streams, seconds behind. Polled from a thread of its own, stopped with
    the run."""

    def __init__(self, root: str, started: int) -> None:
        super().__init__(daemon=True)
        self.root, self.started = root, started
        self.victim: str | None = None
        self.seen: int | None = None  # the victim's streaming requests when it was killed
        self.error: BaseException | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.root, trust_env=False, timeout=30) as client:
                pids = {r["replica_id"]: r["pid"] for r in client.get("/tokenfab/replicas").json()
                        if r["state"] == "ready"}
                while not self.stop.is_set():
                    pools = client.get("/tokenfab/router").json()["pools"].values()
                    for replica, view in ((r, v) for p in pools for r, v in p["replicas"].items()):
                        if view["streaming"] >= self.started and replica in pids:
                            kill_engine(pids[replica])
                            self.victim, self.seen = replica, view["streaming"]
                            return
                    self.stop.wait(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


async def _all(root: str, requests: list[tuple[str, dict]],
               killer: EngineKiller | None = None) -> list[Stream]:
    """Run every request at once; with a `killer`, started once they were sent and stopped when
    they ended."""
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=root, timeout=300, trust_env=False,
                                 limits=limits) as client:
        tasks = [asyncio.create_task(stream(client, endpoint, body))
                 for endpoint, body in requests]
        if killer is not None:
            killer.start()
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            if killer is not None:
                killer.stop.set()


def test_a_kill_during_streaming_loses_nothing(migrating: Topology) -> None:
    """32 greedy streams over two replicas; one engine is SIGKILLed while they stream. Every
    stream completes, token for token what the same requests gave uninterrupted (up to a
    near-tie of the two runs' logprobs: `divergence`), with one chunk id and the usage of one
    request; the gateway charged each once; the streams cut on the dead engine were continued
    on the other replica.

    A kill can still miss the middle of every stream (it lands as the streams end, or before
    the victim's streams reached their clients: those are re-sent whole). Such a run must lose
    nothing all the same; the test then waits for the replacement replica and runs again, up
    to KILL_RUNS times, until a kill cut streams that were continued."""
    root, requests = gateway_url(migrating), _requests()
    reference = asyncio.run(_all(root, requests))
    assert all(s.ok for s in reference), [s.errors for s in reference if not s.ok]
    missed = []
    for _ in range(KILL_RUNS):
        _await_both_ready(root)
        before, migrated_before = _tokens(root), _migrations(root).get("resumed", 0)
        killer = EngineKiller(root, started=STREAMS // 8)
        streams = asyncio.run(_all(root, requests, killer))
        killer.join()
        assert killer.error is None, killer.error

        assert [s.errors for s in streams if not s.ok] == []
        assert all(s.done and len(s.chunk_ids) == 1 for s in streams)
        assert [divergence(got, want) for got, want in zip(streams, reference)] == [None] * STREAMS
        assert all(len(s.tokens) == s.usage["completion_tokens"] == MAX_TOKENS for s in streams)
        after = _tokens(root)
        assert after["completion"] - before["completion"] == MAX_TOKENS * STREAMS  # charged once
        assert after["prompt"] - before["prompt"] == sum(s.usage["prompt_tokens"]
                                                         for s in reference)
        # every stream continued had its first bytes from the victim
        on_victim = [s for s in streams if s.replica == killer.victim]
        resumed = _migrations(root).get("resumed", 0) - migrated_before
        assert resumed <= len(on_victim), (resumed, killer.seen, len(on_victim))
        if resumed >= 1:
            return
        missed.append({"victim": killer.victim, "streaming": killer.seen,
                       "first_bytes_there": len(on_victim)})
    pytest.fail(f"no kill in {KILL_RUNS} runs cut a stream mid-way: {missed}")


def test_registry_entries_outlive_their_writer_and_expire(migrating: Topology) -> None:
    """The replica registry is the GCS's key-value store: what a process reported stays readable
    after it exits (a replica Serve replaces); unchanged past its time to live, a reader no longer
    lists it, and later deletes it. (It runs while Serve replaces the replica the test before
    killed, before the soak.)"""
    import ray

    from pools.registry import NAMESPACE_KEY, Registry
    from tokenfab.ray_compat import gcs_client

    address, app = migrating.cluster.address, "registry-expiry-test"
    write = (f"import asyncio, ray; from pools.engine import LoadSnapshot; "
             f"from pools.registry import IngressReport, Registry, ReplicaReport; "
             f"ray.init(address='{address}', log_to_driver=False, logging_level='ERROR', "
             f"_node_ip_address='127.0.0.1'); r = Registry('{app}'); "
             f"asyncio.run(r.report(ReplicaReport(app='{app}', pool='main', role='unified', "
             f"replica_id='gone', node_ip='127.0.0.1', pid=0, cores=[], state='ready', "
             f"load=LoadSnapshot(in_flight=3)))); "
             f"asyncio.run(r.announce(IngressReport('gone', '127.0.0.1:1')))")
    subprocess.run([sys.executable, "-c", write], check=True, cwd=ROOT, timeout=120)
    ray.init(address=address, log_to_driver=False, logging_level="ERROR",
             _node_ip_address="127.0.0.1")
    try:
        async def check() -> None:
            registry, short = Registry(app), Registry(app, ttl_s=3.0)
            [report] = await registry.snapshot()  # its writer has exited
            assert (report.replica_id, report.load.in_flight) == ("gone", 3)
            assert [i.channel for i in await registry.ingresses()] == ["127.0.0.1:1"]
            assert await Registry("registry-expiry").snapshot() == []  # a prefix of the app
            assert [r.replica_id for r in await short.snapshot()] == ["gone"]  # first sight
            deadline = time.monotonic() + 60
            while await short.snapshot():  # unchanged for its 3 s time to live: dropped
                assert time.monotonic() < deadline, "the report did not expire"
                await asyncio.sleep(0.2)
            key = f"registry/{app}/replica/gone".encode()
            while await gcs_client().async_internal_kv_exists(key, NAMESPACE_KEY, timeout=5):
                assert time.monotonic() < deadline, "the expired report was not deleted"
                await short.snapshot()  # the reader deletes it once 18 s unchanged
                await asyncio.sleep(0.2)
            assert await registry.snapshot() == []
            await registry.forget("gone")
            assert await registry.ingresses() == []

        asyncio.run(check())
    finally:
        ray.shutdown()


def test_top_shows_the_pool_and_a_killed_replica_failing_then_replaced(
        migrating: Topology) -> None:
    """`tokenfab top` in a real terminal (tmux, read back with capture-pane): both replicas of
    the pool; after one's engine is killed, that replica failing, then another in its place and
    both running."""
    tmux = shutil.which("tmux")
    assert tmux, "tmux is needed to test `tokenfab top` in a terminal"
    root = gateway_url(migrating)
    _await_both_ready(root)  # the previous test's victim is being replaced
    serve = ServeClient(migrating.cluster.dashboard_url)  # Serve's view: live replicas only
    pids = {r["replica_id"]: r["pid"] for r in
            serve.application(migrating.name)["deployments"]["pool-main"]["replicas"]
            if r["state"] == "RUNNING"}
    assert len(pids) == 2, pids
    session = f"tokenfab-top-{os.getpid()}"
    # tmux hands the pane COLUMNS=80 when its client's output is not a terminal (pytest's
    # capture), which rich would believe over the pane's own 200 columns
    command = ["env", "-u", "COLUMNS", "-u", "LINES", TOKENFAB, "top", "--app", migrating.name,
               "--interval", "0.5", "--dashboard", migrating.cluster.dashboard_url]
    subprocess.run([tmux, "new-session", "-d", "-s", session, "-x", "200", "-y", "40",
                    shlex.join(command)], check=True)

    def rows() -> dict[str, str]:
        """The screen's replica rows, by replica id."""
        screen = subprocess.run([tmux, "capture-pane", "-p", "-t", session], capture_output=True,
                                text=True, check=True).stdout
        cells = ([c.strip() for c in line.split("│")[1:-1]] for line in screen.splitlines())
        return {c[0]: " ".join(c[1:3]) for c in cells if len(c) > 3 and c[0] != "REPLICA"}

    def until(what: str, ok, timeout_s: float) -> dict[str, str]:
        deadline, seen = time.monotonic() + timeout_s, {}
        while time.monotonic() < deadline:
            seen = rows()
            if ok(seen):
                return seen
            time.sleep(0.25)
        raise AssertionError(f"{what}: the screen's rows were {seen}")

    try:
        until("both replicas running", lambda r: set(pids) <= set(r) and all(
            r[p] == "RUNNING healthy" for p in pids), 30)
        victim = sorted(pids)[0]
        kill_engine(pids[victim])
        until("the killed replica failing", lambda r: victim in r and r[victim] != "RUNNING healthy",
              90)
        until("another replica in its place, both running", lambda r: victim not in r and len(r) == 2
              and all(state == "RUNNING healthy" for state in r.values()), 300)
    finally:
        subprocess.run([tmux, "kill-session", "-t", session], check=False)


def test_short_soak_kills_engines_under_load_and_loses_nothing(migrating: Topology) -> None:
    """benchmarks/soak.py for 190 s: an engine killed at 65 s, and another at 130 s or once the
    replica killed first is back (its replacement took over 90 s from the kill here, the engine
    starting beside the load), under 80% of measured capacity; every request completes as its
    uninterrupted reference."""
    root = gateway_url(migrating)
    _await_both_ready(root)  # the previous test's victim is being replaced
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
