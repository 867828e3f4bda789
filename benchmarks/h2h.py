"""Head to head: tokenfab against sglang-router and vllm-router in front of vLLM, in one run.

Every system stands before two engines of the tiny model (one pinned core each, eager, block 32,
the same KV cache bytes, prefix caching on) and replays the same sample of a Mooncake-format
trace. Baselines: two standalone vLLM OpenAI servers behind sglang-router (round_robin,
cache_aware) or vllm-router (cache_aware). tokenfab: a local Ray head and one `unified` pool of
2 replicas, routed round_robin or kv_aware, serving the gateway themselves (`gateway.colocate`;
`--gateway process`: a gateway process). The two never run together.

Repeats: the whole set of (system, policy, load) is replayed `--repeats` times (3 by default),
interleaved so that drift on the machine hits every system: each repeat starts the baselines'
servers and runs their routers one at a time, then starts Ray and deploys tokenfab's policies one
at a time; odd repeats run tokenfab first. Each figure is reported as the median of the repeats
with its min-max range, and a ratio is called a win or a loss only where the ranges do not
overlap (intervals.py); otherwise it is a tie.

Loads: `--rates`, and, unless `--no-knee`, two around round_robin's knee, found in the first
repeat by replaying sglang-router round_robin at rising rates (x1.4 from the highest given) until
its TTFT p90 exceeds the target (`--slo-factor` times the floor's p90): that rate and the last
one that met it. Every other policy's first front then searches on from the highest load so far
in the same way, so each policy's knee lies inside the loads. Goodput: the highest rate
at which a system's TTFT p90 stays within that target with no failed request, interpolated
between the measured rates in each repeat (h2h_figures.with_goodput).

Windows: `--window trace` samples the trace by conversation root (every request whose first
block belongs to a seeded random share of roots, in trace order, about 115 requests by default);
`--window no-reuse` keeps that sample's arrivals and lengths but gives every request blocks of its
own, so nothing is shared and no router can win by placement: what is left is the request path.
Each 512-token block id becomes 32 single-token words (one engine block), prompts are capped at
60 blocks (1,920 tokens), every request asks for 32 tokens (`ignore_eos`, greedy, streamed with
usage). Arrival times are the trace's, rescaled to each rate. Caches start cold in every replay:
each gets its own word namespace, and the baselines' engines also reset their prefix caches.

Per record: TTFT (send -> first chunk carrying a token), E2E (send -> end of stream), ITL (gaps
between tokens: with `return_token_ids` a chunk of k tokens adds its gap from the previous token
chunk once and 0 for the other k-1; if any front strips token ids, every system falls back to
per-chunk gaps), output tok/s (completion tokens / (last end - first send)), hit rate (the
engines' own cached_tokens / prompt_tokens), CPU over the replay window from /proc per process,
all threads: `dataplane_cpu_ms_per_token` is the data path's CPU (router or Serve proxy, gateway,
vLLM API servers or pool replicas; not the `VLLM::` engine processes) per output token, and
`background_cpu_pct` is Ray's own daemons as % of one core (see process_cpu.py for the rule).
The same processes' CPU is also sampled for 3 s before each replay, with no request running
(`idle_dataplane_cpu_pct`, `idle_background_cpu_pct`): what the path costs whatever the load.
`client_waited_s`: how long the client's event loop was runnable but waited for a CPU during the
replay (its latencies are late by that much); `stall_cluster_max`: the most requests that got
all their tokens in one instant with first tokens within 5 ms of each other (a stall, then a
flush).

First, the floor: each request alone, in trace order, straight to one idle vLLM server of the
same settings whose KV cache holds every block of the sample (so each gets the infinite-cache
bound's hits), one output token. Behind any router on these engines a request's first token comes
no sooner, so neither does any TTFT percentile.

The client runs in a scheduling group of its own at a raised priority and each stack in one
session (one group) of its own, so no system gains or loses by how it groups its processes (see
`machine.prioritise_client`), and its event loop stays on one core during replays
(`--client-core`, see `machine.on_core`: woken on both cores, it waited up to 240 ms behind two
ingresses); `--unprioritised` leaves the client in the shell's group at its priority, on any
core (to reproduce a co-located client's stalls). Before each replay the script waits (up to
5 min) until processes outside the stack under test use under 15% of a core, and it repeats
(twice at most, in a fresh namespace) a replay during which they used more than
`--max-other-pct` (10%) of a core.

    .venv/bin/python benchmarks/h2h.py [--rates 1.4,3.5,6] [--repeats 3] [--window trace]
        [--systems floor,sglang-router,vllm-router,tokenfab] [--policies round_robin,...]
        [--kv-cache 24MiB] [--trace FILE] [--limit N] [--raw DIR] [--unprioritised]

About 25 minutes a repeat on 2 cores. Writes benchmarks/results/h2h.json (`--window no-reuse`:
h2h-noreuse.json), and the .md and .png beside it (`--out` names the JSON). Helpers in common/:
traces (sampling, prompts), process_cpu (CPU per process and its role), baseline (vLLM servers
and routers), client (requests and replays); beside it: h2h_figures.py (figures, repeats,
goodput), h2h_report.py (ratios, Markdown, chart).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from benchmarks.common import process_cpu
from benchmarks.common.baseline import (Session, kv_bytes_per_token, reset_prefix_caches, routed,
                                        start_engine, wait_ready)
from benchmarks.common.client import MAX_TOKENS, one_at_a_time, replay, warm_up
from benchmarks.common.cluster import TINY_MODEL_PATH, deployed, local_head, remove, tiny_topology
from benchmarks.common.machine import (check_loopback, client_core, on_core, prioritise_client,
                                       renice_engines, stray_processes, unprioritised, wait_quiet,
                                       waited_for_cpu_s)
from benchmarks.common import results
from benchmarks.common.results import RESULTS, TRACE
from benchmarks.common.traces import (BLOCK_TOKENS, MAX_BLOCKS, Prompts, sample_by_root,
                                      single_token_words, upper_bound_hit_rate, without_reuse)
from benchmarks.h2h_figures import record, ttft_p90, with_goodput
from tokenfab.stats import percentile_or_none
from benchmarks.h2h_report import markdown, plot, ratios
from orchestrator import cluster
from orchestrator.config import Topology

MODEL = TINY_MODEL_PATH
SETUPS = (("sglang-router", "round_robin"), ("sglang-router", "cache_aware"),
          ("vllm-router", "cache_aware"), ("tokenfab", "round_robin"), ("tokenfab", "kv_aware"))
ENGINE_PORTS, ROUTER_PORT, PROMETHEUS_PORT, GATEWAY_PORT = (8141, 8142), 8151, 8161, 8031
FLOOR_PORT, FLOOR_PASSES = 8143, 2
CLUSTER = local_head(6393, 8281, serve_control_loop_s=0.5)  # as deploy/topologies/local.yaml
RETRIES = 2  # replays repeated because processes outside the stack took the cores meanwhile


@dataclass
class Front:
    """One system and policy, reachable at `url`; `reset` empties the engines' prefix caches
    (None where the caches cannot be reset and namespaces alone keep runs apart)."""

    system: str
    policy: str
    url: str
    reset: Callable[[], None] | None = None
    pids: set[int] = field(default_factory=set)  # processes listening on the front's port


# --- Measuring one run ------------------------------------------------------------------------

def measure(front: Front, requests: list[dict[str, Any]], prompts: Prompts, rate: float,
            profile: Path | None, client_core: int | None) -> dict[str, Any]:
    """Replay at `rate` through the front; the results and every process's CPU over the window."""
    before = process_cpu.snapshot()
    profiler = process_cpu.profile_dataplane(
        front.pids, f"{front.system}-{front.policy}-{rate:g}", before, profile) \
        if profile else None
    started, client_waited = time.monotonic(), waited_for_cpu_s()  # the event loop's thread
    with on_core(client_core):
        results = asyncio.run(replay(front.url, requests, prompts, rate))
    window, client_waited = time.monotonic() - started, waited_for_cpu_s() - client_waited
    after = process_cpu.snapshot()
    if profiler:
        profiler.join()
    used = process_cpu.cpu_seconds(before, after)
    waited = process_cpu.waited_seconds(before, after)
    procs = {proc.pid: proc for proc in after.values()}
    categories = process_cpu.classify(procs, front.pids, os.getpid())
    return {"results": results, "window_s": window, "cpu": used, "categories": categories,
            "waited": waited, "client_waited_s": client_waited}


# --- tokenfab ---------------------------------------------------------------------------------

def topology(policy: str, kv_cache: str, colocate: bool = False) -> Topology:
    return tiny_topology(
        f"h2h-{policy.replace('_', '-')}",
        [{"name": "main", "role": "unified", "replicas": 2, "max_ongoing_requests": 256,
          "resources": {"cpus": 1, "kv_cache_bytes": kv_cache, "pin_cores": True}}],
        router={"policy": policy}, gateway={"port": GATEWAY_PORT, "colocate": colocate},
        cluster=CLUSTER, block_size=BLOCK_TOKENS)


# --- The run ----------------------------------------------------------------------------------

class Bench:
    """Runs every front at every rate, `repeat` by repeat, and keeps the raw runs. A replay's
    word namespace follows from (repeat, setup, rate index, attempt), so a subset run replays
    the same prompts as a full one."""

    def __init__(self, args: argparse.Namespace, requests: list[dict[str, Any]],
                 words: list[str], rates: list[float]) -> None:
        self.args, self.requests, self.words, self.rates = args, requests, words, rates
        self.runs: list[dict[str, Any]] = []
        self.token_ids: dict[str, bool] = {}
        self.sockets: dict[str, dict[str, Any]] = {}
        self.profile = Path(args.profile) if args.profile else None
        self.repeat = 0
        self.slo_s: float | None = None  # TTFT p90 target; set from the floor
        self.knee: dict[str, Any] | None = None  # to find (an empty dict), or found
        self.knees: list[dict[str, Any]] = []  # the other policies' searches, past round_robin's

    def run_front(self, front: Front) -> None:
        setup = SETUPS.index((front.system, front.policy))
        name = f"{front.system} {front.policy}"
        self.token_ids[name] = warm_up(front.url, self.requests,
                                       Prompts(self.words, 10_000 + setup))
        front.pids = process_cpu.port_owners(int(front.url.rsplit(":", 1)[1].split("/")[0]))
        self.sockets[name] = check_loopback(front.pids)
        if self.knee == {} and front.policy == "round_robin":
            self.knee = self.find_knee(front)
        elif self.knee and self.repeat == 0 and front.policy != "round_robin":
            self.knees.append(self.find_knee(front))  # its goodput measured, not censored
        for index, rate in enumerate(self.rates):
            profile = self.profile if (self.profile and front.system == "tokenfab"
                                       and rate == max(self.rates)) else None
            namespace = 1 + self.repeat * 1000 + setup * 100 + index * 10
            run = self._clean_replay(front, rate, namespace, profile)
            run["repeat"] = self.repeat
            self.runs.append(run)
            line = record(run, "token_ids" if self.token_ids[name] else "chunks")
            print("  ", json.dumps({k: v for k, v in line.items() if k != "cpu_breakdown"}))

    def _clean_replay(self, front: Front, rate: float, namespace: int,
                      profile: Path | None) -> dict[str, Any]:
        """A replay, repeated (in a fresh namespace) while processes outside the stack took more
        than `--max-other-pct` of a core during it."""
        for attempt in range(1 + RETRIES):
            run = self._replay(front, rate, namespace + attempt, profile)
            if run["other_cpu_pct"] <= self.args.max_other_pct or attempt == RETRIES:
                break
            print(f"   processes outside the stack took {run['other_cpu_pct']:.0f}% of a "
                  "core during the replay: repeating it")
        return run | {"attempts": attempt + 1}

    def find_knee(self, front: Front) -> dict[str, Any]:
        """Replay this front at rising rates (x1.4 from the highest load so far, at most 8
        steps) until its TTFT p90 misses the target or a request fails; that rate and the one
        before it are added to the loads, so the highest is past this front's knee. Run for
        round_robin's first front, then for every front of another policy in the first repeat:
        one that still meets the target at the highest load would otherwise have a goodput
        known only as "at least". Fronts that ran before a search in that repeat lack the rates
        it added there (their median at those rates is of the later repeats)."""
        rate, probes = max(self.rates), []
        for step in range(8):
            run = self._clean_replay(front, rate, 700_000 + 10 * step, None)
            p90 = ttft_p90(run)
            probes.append({"rate_rps": rate, "ttft_p90_s": p90[0], "failed": p90[1]})
            print(f"   knee probe: {rate:g} req/s, TTFT p90 {p90[0]}, failed {p90[1]}")
            if p90[0] is None or p90[1] or p90[0] > self.slo_s:
                break
            rate = round(rate * 1.4, 1)
        missed = probes[-1]
        # the last rate that met the target and the first that missed bracket the knee, so
        # goodput is interpolated across the knee rather than from far below it
        for probe in probes[-2:]:
            if probe["rate_rps"] not in self.rates:
                self.rates.append(probe["rate_rps"])
        return {"system": front.system, "policy": front.policy, "slo_s": self.slo_s,
                "probes": probes, "past_knee_rps": missed["rate_rps"],
                "missed": bool(missed["failed"] or (missed["ttft_p90_s"] or 1e9) > self.slo_s)}

    def _replay(self, front: Front, rate: float, namespace: int,
                profile: Path | None) -> dict[str, Any]:
        if front.reset:
            front.reset()
        if self.args.engine_nice is not None:
            renice_engines(self.args.engine_nice)
        idle = wait_quiet(front.pids)
        print(f"{front.system} {front.policy} at {rate:g} req/s: replaying "
              f"{len(self.requests)} requests")
        run = measure(front, self.requests, Prompts(self.words, namespace), rate, profile,
                      self.args.core)
        other = sum(used for pid, (_, used) in run["cpu"].items()
                    if run["categories"].get(pid, "other") == "other")
        return run | {"system": front.system, "policy": front.policy, "rate": rate,
                      "repeat": self.repeat,
                      "namespace": namespace, "other_cpu_pct_before": round(idle["other"], 1),
                      "idle_cpu_pct": {k: round(v, 2) for k, v in idle.items()},
                      "other_cpu_pct": 100 * other / run["window_s"]}

    def floor(self, kv_bytes: int, logs: Path) -> dict[str, Any]:
        """What no router in front of these engines can beat: each request alone on an idle
        engine of the same settings whose cache holds everything it has seen (so every request
        gets the infinite-cache bound's hits), straight to vLLM's own server. A request's TTFT
        behind any router is at least its TTFT here, so every percentile is too. The passes are
        in fresh namespaces; a request's floor is its fastest pass (drift only lowers it)."""
        blocks = len({b for row in self.requests for b in row["hash_ids"][:MAX_BLOCKS]})
        blocks += 2 * len(self.requests)  # each request's output, and room to spare
        big = max(kv_bytes, blocks * BLOCK_TOKENS * kv_bytes_per_token(MODEL))
        session = Session()
        url = f"http://127.0.0.1:{FLOOR_PORT}"
        try:
            print(f"floor: one vLLM server with a {big >> 20} MiB KV cache, requests one at a time")
            engine = start_engine(session, str(Path(MODEL).expanduser()), 0, FLOOR_PORT, big, logs)
            wait_ready(url, engine, 900, "/health")
            warm_up(url, self.requests, Prompts(self.words, 9_000))
            with on_core(self.args.core):
                passes = [asyncio.run(one_at_a_time(url, self.requests,
                                                    Prompts(self.words, 9_001 + i)))
                          for i in range(FLOOR_PASSES)]
        finally:
            session.close()
        bad = [r for run in passes for r in run if r["status"] != 200 or not r["chunks"]]
        if bad:
            raise RuntimeError(f"floor: {len(bad)} requests failed: {bad[0]['error']}")
        ttft = [min(run[i]["chunks"][0][0] for run in passes) for i in range(len(self.requests))]
        usages = [r["usage"] for r in passes[0]]
        prompt = sum(u.get("prompt_tokens", 0) for u in usages)
        cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                     for u in usages)
        return {"ttft_p50_s": percentile_or_none(ttft, 50), "ttft_p90_s": percentile_or_none(ttft, 90),
                "ttft_p99_s": percentile_or_none(ttft, 99), "hit_rate": cached / prompt if prompt else 0.0,
                "passes": FLOOR_PASSES, "kv_cache_bytes": big, "ttft_s": ttft}

    def baselines(self, setups: list[tuple[str, str]], kv_bytes: int, logs: Path) -> None:
        session = Session()
        engines = [start_engine(session, str(Path(MODEL).expanduser()), core, port, kv_bytes,
                                logs) for core, port in enumerate(ENGINE_PORTS)]
        urls = [f"http://127.0.0.1:{port}" for port in ENGINE_PORTS]
        try:
            print("baselines: starting 2 vLLM servers")
            for url, engine in zip(urls, engines):
                wait_ready(url, engine, 900, "/health")
            if self.args.stack_load_pct:
                session.spawn([sys.executable, "-c", _STACK_LOAD, str(self.args.stack_load_pct)],
                              {}, logs / "stack-load.log")
            for offset, (system, policy) in enumerate(setups):
                port = ROUTER_PORT + SETUPS.index((system, policy))
                with routed(session, system, policy, port, PROMETHEUS_PORT + offset, urls,
                            logs) as url:
                    reset = lambda: reset_prefix_caches(urls)  # noqa: E731
                    self.run_front(Front(system, policy, url, reset))
                    reset()  # the warm-up and the last run leave nothing behind
        finally:
            session.close()

    def tokenfab(self, policies: list[str]) -> None:
        colocate = self.args.gateway == "colocated"
        specs = [topology(policy, self.args.kv_cache, colocate) for policy in policies]
        try:
            cluster.start_head(specs[0].cluster)
            for policy, spec in zip(policies, specs):
                print(f"tokenfab {policy}: deploying")
                self.run_front(Front("tokenfab", policy, deployed(spec)))
                remove(spec)
        finally:
            cluster.stop_ray(specs[0].cluster.dashboard_url)


# `--stack-load-pct`: busy for that share of every 2 ms, asleep for the rest
_STACK_LOAD = """
import sys, time
busy = 0.002 * float(sys.argv[1]) / 100
while True:
    began = time.perf_counter()
    while time.perf_counter() - began < busy:
        pass
    time.sleep(max(0.0, 0.002 - (time.perf_counter() - began)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE), help="a Mooncake-format JSONL trace")
    parser.add_argument("--root-share", type=float, default=0.03,
                        help="share of conversation roots sampled (0.03: 116 requests)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the root sample")
    parser.add_argument("--rates", default="1.4,3.5,6", help="req/s, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="replays of every point")
    parser.add_argument("--no-knee", action="store_true",
                        help="only --rates (no rate past round_robin's knee is looked for)")
    parser.add_argument("--slo-factor", type=float, default=5.0,
                        help="goodput's target: TTFT p90 at most this times the floor's")
    parser.add_argument("--window", choices=("trace", "no-reuse"), default="trace",
                        help="the sample as it is, or with every request's blocks its own")
    parser.add_argument("--unprioritised", action="store_true",
                        help="leave the client in the shell's scheduling group at its priority")
    parser.add_argument("--kv-cache", default="24MiB", help="KV cache bytes per engine")
    parser.add_argument("--systems", default="floor,sglang-router,vllm-router,tokenfab",
                        help="only these systems; floor: each request alone on one idle engine "
                        "that holds every block it has seen (what no router can beat)")
    parser.add_argument("--policies", default="", help="only these policies (default: all)")
    parser.add_argument("--gateway", choices=("colocated", "process"), default="colocated",
                        help="tokenfab's gateway in its pool's replicas (gateway.colocate, the "
                        "default here) or in a process of its own (the topology default)")
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    parser.add_argument("--out", default="",
                        help="the JSON (default results/h2h.json, or h2h-noreuse.json); the "
                        ".md and .png go beside it")
    parser.add_argument("--max-other-pct", type=float, default=10.0,
                        help="repeat a replay (twice at most) during which processes outside the "
                        "stack under test used more than this %% of a core")
    parser.add_argument("--logs", default="/tmp/h2h-logs", help="baseline servers' logs")
    parser.add_argument("--raw", default="", help="directory: each replay's requests (send and "
                        "end times, chunk times and token counts, usage, tokenfab's replica)")
    parser.add_argument("--profile", default="", help="directory: py-spy the tokenfab data path "
                        "during its highest-rate replays (perturbs those records)")
    parser.add_argument("--stack-load-pct", type=float, default=0.0,
                        help="diagnostic: a process in the baselines' session that keeps this %% "
                        "of one core busy (in 2 ms periods), as a heavier stack would beside the "
                        "engines; it counts as outside the stack (raise --max-other-pct)")
    parser.add_argument("--engine-nice", type=int, default=None,
                        help="diagnostic: every engine thread at this nice before each replay "
                        "(whether the engines lose time to the processes beside them)")
    parser.add_argument("--client-nice", type=int, default=-10,
                        help="the client's scheduling priority (see machine.prioritise_client)")
    parser.add_argument("--client-core", default="last",
                        help="the core the client's event loop runs on during replays: 'last' "
                        "(default), a number, or 'none' (see machine.on_core; --unprioritised "
                        "leaves it to the kernel)")
    parser.add_argument("--report", default="", help="only rewrite the report (medians, "
                        "goodput, ratios, Markdown, chart) from this results JSON")
    args = parser.parse_args()
    if args.report:
        finish(json.loads(Path(args.report).read_text()), Path(args.out or args.report))
        return
    scheduling = unprioritised() if args.unprioritised else prioritise_client(args.client_nice)
    args.core = None if args.unprioritised else client_core(args.client_core)
    scheduling["client_core"] = args.core
    began = time.monotonic()
    rates = [float(r) for r in args.rates.split(",")]
    systems, policies = args.systems.split(","), set(filter(None, args.policies.split(",")))
    setups = [s for s in SETUPS if s[0] in systems and (not policies or s[1] in policies)]
    if not setups and "floor" not in systems:
        parser.error("no (system, policy) left to run")
    stray = stray_processes()
    if stray:
        print("WARNING: serving processes already running:\n  " + "\n  ".join(stray))
    requests = sample_by_root(Path(args.trace), args.root_share, args.seed)
    if args.limit:
        requests = requests[:args.limit]
    if args.window == "no-reuse":
        requests = without_reuse(requests)
    args.out = args.out or str(RESULTS / ("h2h.json" if args.window == "trace"
                                          else "h2h-noreuse.json"))
    kv_bytes = topology("round_robin", args.kv_cache).pools[0].resources.kv_cache_bytes
    bench = Bench(args, requests, single_token_words(str(Path(MODEL).expanduser())), rates)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    floor = bench.floor(kv_bytes, logs) if "floor" in systems else None
    if floor:
        bench.slo_s = args.slo_factor * floor["ttft_p90_s"]
        bench.knee = None if args.no_knee else {}
    baselines = [s for s in setups if s[0] != "tokenfab"]
    ours = [policy for system, policy in setups if system == "tokenfab"]
    for repeat in range(args.repeats):
        bench.repeat = repeat
        blocks = [lambda: bench.baselines(baselines, kv_bytes, logs) if baselines else None,
                  lambda: bench.tokenfab(ours) if ours else None]
        for block in blocks if repeat % 2 == 0 else blocks[::-1]:
            block()
        write(bench, args, requests, kv_bytes, stray, time.monotonic() - began, scheduling, floor)


def write(bench: Bench, args: argparse.Namespace, requests: list[dict[str, Any]], kv_bytes: int,
          stray: list[str], duration: float, scheduling: dict[str, Any],
          floor: dict[str, Any] | None) -> None:
    chunks_ok = all(n is not None for run in bench.runs for r in run["results"]
                    for _, n in r["chunks"])
    mode = "token_ids" if all(bench.token_ids.values()) and chunks_ok else "chunks"
    prefix = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    result = {
        "records": [record(run, mode) for run in bench.runs],
        "bound_hit_rate": upper_bound_hit_rate(requests),
        "floor": floor,
        "slo_s": bench.slo_s,
        "knee": bench.knee, "knees": bench.knees,
        "repeats": bench.repeat + 1,
        "window": args.window,
        "command": f"{prefix}python benchmarks/h2h.py {shlex.join(sys.argv[1:])}".strip(),
        "itl_mode": mode,
        "itl_definition": (
            "gaps between tokens, from the token ids each chunk carries (a chunk of k tokens: its "
            "gap from the previous token chunk, then k-1 zeros)" if mode == "token_ids" else
            "gaps between chunks (some front stripped `return_token_ids`, so every system is "
            "measured per chunk)"),
        "token_ids_passthrough": bench.token_ids,
        "sockets": bench.sockets,
        "stray_processes_at_start": stray,
        "duration_s": duration,
        "settings": {"trace": args.trace, "root_share": args.root_share, "seed": args.seed,
                     "requests": len(requests), "rates_rps": bench.rates, "limit": args.limit,
                     "kv_cache": args.kv_cache, "kv_cache_bytes": kv_bytes,
                     "block_tokens": BLOCK_TOKENS, "max_blocks": MAX_BLOCKS,
                     "max_tokens": MAX_TOKENS, "engine_cores": [0, 1],
                     "profiled": bool(args.profile), "engine_nice": args.engine_nice,
                     "tokenfab_gateway": args.gateway,
                     "scheduling": scheduling},
    }
    finish(result, Path(args.out))
    if args.raw:
        raw = Path(args.raw)
        raw.mkdir(parents=True, exist_ok=True)
        for run in bench.runs:
            began = min(r["sent"] for r in run["results"])
            rows = [{"sent_s": r["sent"] - began, "done_s": r["done"] - began,
                     "status": r["status"], "chunks": r["chunks"], "usage": r["usage"],
                     "replica": r["replica"]} for r in run["results"]]
            name = f"{run['system']}-{run['policy']}-{run['rate']:g}-{run['repeat']}.json"
            (raw / name).write_text(json.dumps(rows))
        print(f"wrote each request's chunk times to {raw}")


def finish(result: dict[str, Any], out: Path) -> None:
    """From `result["records"]` (one per replay, or rows whose `runs` are): the medians, ranges
    and goodput per point, the ratios, and the JSON, Markdown and chart at `out`."""
    runs = [run for row in result["records"] for run in row.get("runs", [row])]
    result["records"] = with_goodput(runs, result["slo_s"])
    result["ratios"] = ratios(result["records"], result["floor"], result["slo_s"])
    results.write(out, result, markdown, plot)
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    print("\n".join(result["ratios"]))


if __name__ == "__main__":
    main()
