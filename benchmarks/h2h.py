"""Head to head: tokenfab against sglang-router and vllm-router in front of vLLM, in one run.

Every system stands before two engines of the tiny model (one pinned core each, eager, block 32,
the same KV cache bytes, prefix caching on) and replays the same sample of a Mooncake-format
trace. Baselines: two standalone vLLM OpenAI servers behind sglang-router (round_robin,
cache_aware) or vllm-router (cache_aware). tokenfab: a local Ray head and one `unified` pool of
2 replicas, routed round_robin or kv_aware, serving the gateway themselves (`gateway.colocate`;
`--gateway process`: a gateway process). Baselines run first (servers started once, routers one
at a time), then tokenfab (one deployment per policy); the two never run together.

The trace is sampled by conversation root (every request whose first block belongs to a seeded
random share of roots, in trace order, about 115 requests by default); each 512-token block id
becomes 32 single-token words (one engine block), prompts are capped at 60 blocks (1,920 tokens),
every request asks for 32 tokens (`ignore_eos`, greedy, streamed with usage). Arrival times are
the trace's, rescaled to each rate. Caches start cold in every (system, policy, load): each gets
its own word namespace, and the baselines' engines also reset their prefix caches before a run.

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

First, the floor: each request alone, in trace order, straight to one idle vLLM server of the
same settings whose KV cache holds every block of the sample (so each gets the infinite-cache
bound's hits), one output token. Behind any router on these engines a request's first token comes
no sooner, so neither does any TTFT percentile; the ratios say how far each system is from it, and
whether a target set against a baseline lies below it.

The client runs in a scheduling group of its own at a raised priority and each stack in one
session (one group) of its own, so no system gains or loses by how it groups its processes (see
`machine.prioritise_client`). The machine is shared, so before each replay the script waits (up
to 5 min) until processes outside the stack under test use under 15% of a core, and it repeats
(twice at most, in a fresh namespace) a replay during which they used more than
`--max-other-pct` (10%) of a core; each record keeps those shares, its attempts and the CPU of
every process it saw.

    .venv/bin/python benchmarks/h2h.py [--rates 1.4,3.5] [--kv-cache 24MiB] [--trace FILE]
        [--systems floor,sglang-router,vllm-router,tokenfab] [--policies round_robin,...]
        [--limit N] [--profile DIR] [--raw DIR] [--engine-nice N] [--gateway colocated|process]

About 20 minutes on 2 cores. Writes benchmarks/results/h2h.json, and h2h.md and h2h.png beside it
(`--out` names the JSON). `--profile DIR` runs py-spy on tokenfab's data-path processes during its
highest-rate replays (which perturbs those records). Helpers: traces.py (sampling, prompts),
process_cpu.py (CPU per process and its role), baseline_stack.py (vLLM servers and routers),
h2h_client.py (requests and replays), h2h_report.py (ratios, Markdown, chart).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import process_cpu
from baseline_stack import (Session, kv_bytes_per_token, reset_prefix_caches, routed,
                            start_engine, wait_ready)
from h2h_client import MAX_TOKENS, one_at_a_time, replay, warm_up
from h2h_report import markdown, plot, ratios
from harness import deployed, remove
from machine import (check_loopback, prioritise_client, renice_engines, stray_processes,
                     wait_quiet)
from orchestrator import cluster
from orchestrator.config import Topology, parse_topology
from traces import (BLOCK_TOKENS, MAX_BLOCKS, Prompts,
                    sample_by_root, single_token_words, upper_bound_hit_rate)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
TRACE = ROOT.parent / "shared/traces/synthetic_trace.jsonl"
MODEL = "~/.cache/tokenfab/models/tiny-llama"
SETUPS = (("sglang-router", "round_robin"), ("sglang-router", "cache_aware"),
          ("vllm-router", "cache_aware"), ("tokenfab", "round_robin"), ("tokenfab", "kv_aware"))
ENGINE_PORTS, ROUTER_PORT, PROMETHEUS_PORT, GATEWAY_PORT = (8141, 8142), 8151, 8161, 8031
FLOOR_PORT, FLOOR_PASSES = 8143, 2
CLUSTER = {"node_ip": "127.0.0.1", "address": "127.0.0.1:6393",
           "dashboard_url": "http://127.0.0.1:8281", "num_cpus": 2,
           "serve_control_loop_s": 0.5}  # as deploy/topologies/local.yaml
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
            profile: Path | None) -> dict[str, Any]:
    """Replay at `rate` through the front; the results and every process's CPU over the window."""
    before = process_cpu.snapshot()
    profiler = _profile(front, rate, before, profile) if profile else None
    started = time.monotonic()
    results = asyncio.run(replay(front.url, requests, prompts, rate))
    window = time.monotonic() - started
    after = process_cpu.snapshot()
    if profiler:
        profiler.join()
    used = process_cpu.cpu_seconds(before, after)
    procs = {proc.pid: proc for proc in after.values()}
    categories = process_cpu.classify(procs, front.pids, os.getpid())
    return {"results": results, "window_s": window, "cpu": used, "categories": categories}


def _profile(front: Front, rate: float, snap: dict, out: Path) -> threading.Thread:
    """py-spy on one data-path Python process of each title, 15 s from 5 s into the replay."""
    procs = {p.pid: p for p in snap.values()}
    categories = process_cpu.classify(procs, front.pids, os.getpid())
    chosen: dict[str, int] = {}
    for pid, category in sorted(categories.items()):
        if category == "dataplane":
            chosen.setdefault(procs[pid].title.split()[0], pid)
    out.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).with_name("py-spy"))

    def run() -> None:
        time.sleep(5)
        jobs = []
        for title, pid in chosen.items():
            role = re.sub(r"[^A-Za-z0-9.-]+", "_", title)
            name = f"{front.system}-{front.policy}-{rate:g}-{role}-{pid}.txt"
            jobs.append(subprocess.Popen([spy, "record", "-p", str(pid), "-d", "15", "-r", "50",
                                          "-f", "raw", "--nonblocking", "--threads",
                                          "-o", str(out / name)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            print(f"   profiling {title} (pid {pid}) -> {out / name}")
        for job in jobs:
            job.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# --- Summaries --------------------------------------------------------------------------------

def token_times(chunks: list[tuple[float, int | None]], mode: str) -> list[float]:
    """When each token arrived: a chunk of k tokens is k arrivals at its time (mode token_ids),
    or every chunk with a choice is one (mode chunks)."""
    if mode == "token_ids":
        return [at for at, n in chunks for _ in range(n or 0)]
    return [at for at, _ in chunks]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(run: dict[str, Any], mode: str) -> dict[str, Any]:
    results = run["results"]
    times = [token_times(r["chunks"], mode) for r in results]
    ok = [(r, t) for r, t in zip(results, times) if r["status"] == 200 and t]
    usages = [r["usage"] for r, _ in ok]
    prompt = sum(u.get("prompt_tokens", 0) for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    output = sum(u.get("completion_tokens", 0) for u in usages)
    ttft = [t[0] for _, t in ok]
    e2e = [r["done"] - r["sent"] for r, _ in ok]
    gaps = [float(g) for _, t in ok for g in np.diff(t)]
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    chunks = [n for r, _ in ok for _, n in r["chunks"] if n]
    cpu = process_cpu.summary(run, output)
    return {
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "e2e_p50_s": _pct(e2e, 50), "e2e_p90_s": _pct(e2e, 90),
        "itl_p50_s": _pct(gaps, 50), "itl_p90_s": _pct(gaps, 90), "itl_p99_s": _pct(gaps, 99),
        "output_tok_s": output / wall, "hit_rate": cached / prompt if prompt else 0.0,
        "dataplane_cpu_ms_per_token": cpu.pop("dataplane_cpu_ms_per_token"),
        "background_cpu_pct": cpu["cpu_pct_of_core"]["background"],
        "requests": len(results), "failed": len(results) - len(ok),
        "incomplete": sum(u.get("completion_tokens", 0) != MAX_TOKENS for u in usages),
        "errors": sorted({r["error"][:200] for r in results if r["error"]})[:3],
        "prompt_tokens": prompt, "cached_tokens": cached, "output_tokens": output,
        "tokens_per_chunk": float(np.mean(chunks)) if chunks else None,
        "window_s": run["window_s"], **cpu,
    }


# --- tokenfab ---------------------------------------------------------------------------------

def topology(policy: str, kv_cache: str, colocate: bool = False) -> Topology:
    return parse_topology({
        "name": f"h2h-{policy.replace('_', '-')}",
        "model": {"name": "tiny", "path": MODEL, "generate": "tiny", "dtype": "bfloat16",
                  "max_model_len": 2048},
        "engine_args": {"enforce_eager": True, "block_size": BLOCK_TOKENS},
        "pools": [{"name": "main", "role": "unified", "replicas": 2, "max_ongoing_requests": 256,
                   "resources": {"cpus": 1, "kv_cache_bytes": kv_cache, "pin_cores": True}}],
        "router": {"policy": policy},
        "gateway": {"host": "127.0.0.1", "port": GATEWAY_PORT, "colocate": colocate},
        "cluster": CLUSTER,
    }, f"h2h benchmark ({policy})")


# --- The run ----------------------------------------------------------------------------------

class Bench:
    """Runs every front at every rate and keeps the raw runs. A replay's word namespace follows
    from (setup, rate index, attempt), so a subset run replays the same prompts as a full one."""

    def __init__(self, args: argparse.Namespace, requests: list[dict[str, Any]],
                 words: list[str], rates: list[float]) -> None:
        self.args, self.requests, self.words, self.rates = args, requests, words, rates
        self.runs: list[dict[str, Any]] = []
        self.token_ids: dict[str, bool] = {}
        self.sockets: dict[str, dict[str, Any]] = {}
        self.profile = Path(args.profile) if args.profile else None

    def run_front(self, front: Front) -> None:
        setup = SETUPS.index((front.system, front.policy))
        name = f"{front.system} {front.policy}"
        self.token_ids[name] = warm_up(front.url, self.requests,
                                       Prompts(self.words, 10_000 + setup))
        front.pids = process_cpu.port_owners(int(front.url.rsplit(":", 1)[1].split("/")[0]))
        self.sockets[name] = check_loopback(front.pids)
        for index, rate in enumerate(self.rates):
            profile = self.profile if (self.profile and front.system == "tokenfab"
                                       and rate == max(self.rates)) else None
            for attempt in range(1 + RETRIES):
                run = self._replay(front, rate, 1 + setup * 100 + index * 10 + attempt, profile)
                if run["other_cpu_pct"] <= self.args.max_other_pct or attempt == RETRIES:
                    break
                print(f"   processes outside the stack took {run['other_cpu_pct']:.0f}% of a "
                      "core during the replay: repeating it")
            run["attempts"] = attempt + 1
            self.runs.append(run)
            line = record(run, "token_ids" if self.token_ids[name] else "chunks")
            print("  ", json.dumps({k: v for k, v in line.items() if k != "cpu_breakdown"}))

    def _replay(self, front: Front, rate: float, namespace: int,
                profile: Path | None) -> dict[str, Any]:
        if front.reset:
            front.reset()
        if self.args.engine_nice is not None:
            renice_engines(self.args.engine_nice)
        idle = wait_quiet(front.pids)
        print(f"{front.system} {front.policy} at {rate:g} req/s: replaying "
              f"{len(self.requests)} requests")
        run = measure(front, self.requests, Prompts(self.words, namespace), rate, profile)
        other = sum(used for pid, (_, used) in run["cpu"].items()
                    if run["categories"].get(pid, "other") == "other")
        return run | {"system": front.system, "policy": front.policy, "rate": rate,
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
        return {"ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
                "ttft_p99_s": _pct(ttft, 99), "hit_rate": cached / prompt if prompt else 0.0,
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


def record(run: dict[str, Any], mode: str) -> dict[str, Any]:
    rate = run["rate"]
    return {"system": run["system"], "policy": run["policy"], "load": f"{rate:g} req/s",
            "rate_rps": rate, **summarize(run, mode), "namespace": run["namespace"],
            "other_cpu_pct_before": run["other_cpu_pct_before"],
            "idle_dataplane_cpu_pct": run["idle_cpu_pct"]["dataplane"],
            "idle_background_cpu_pct": run["idle_cpu_pct"]["background"],
            "attempts": run["attempts"]}


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
    parser.add_argument("--rates", default="1.4,3.5", help="req/s, comma-separated")
    parser.add_argument("--kv-cache", default="24MiB", help="KV cache bytes per engine")
    parser.add_argument("--systems", default="floor,sglang-router,vllm-router,tokenfab",
                        help="only these systems; floor: each request alone on one idle engine "
                        "that holds every block it has seen (what no router can beat)")
    parser.add_argument("--policies", default="", help="only these policies (default: all)")
    parser.add_argument("--gateway", choices=("colocated", "process"), default="colocated",
                        help="tokenfab's gateway in its pool's replicas (gateway.colocate, the "
                        "default here) or in a process of its own (the topology default)")
    parser.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    parser.add_argument("--out", default=str(RESULTS / "h2h.json"),
                        help="the JSON; the .md and .png go beside it")
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
    args = parser.parse_args()
    scheduling = prioritise_client(args.client_nice)
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
    kv_bytes = topology("round_robin", args.kv_cache).pools[0].resources.kv_cache_bytes
    bench = Bench(args, requests, single_token_words(str(Path(MODEL).expanduser())), rates)
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    floor = bench.floor(kv_bytes, logs) if "floor" in systems else None
    baselines = [s for s in setups if s[0] != "tokenfab"]
    if baselines:
        bench.baselines(baselines, kv_bytes, logs)
    ours = [policy for system, policy in setups if system == "tokenfab"]
    if ours:
        bench.tokenfab(ours)
    write(bench, args, requests, kv_bytes, stray, time.monotonic() - began, scheduling, floor)


def write(bench: Bench, args: argparse.Namespace, requests: list[dict[str, Any]], kv_bytes: int,
          stray: list[str], duration: float, scheduling: dict[str, Any],
          floor: dict[str, Any] | None) -> None:
    chunks_ok = all(n is not None for run in bench.runs for r in run["results"]
                    for _, n in r["chunks"])
    mode = "token_ids" if all(bench.token_ids.values()) and chunks_ok else "chunks"
    prefix = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    records = [record(run, mode) for run in bench.runs]
    result = {
        "records": records,
        "bound_hit_rate": upper_bound_hit_rate(requests),
        "floor": floor,
        "ratios": ratios(records, floor),
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
    if args.raw:
        raw = Path(args.raw)
        raw.mkdir(parents=True, exist_ok=True)
        for run in bench.runs:
            began = min(r["sent"] for r in run["results"])
            rows = [{"sent_s": r["sent"] - began, "done_s": r["done"] - began,
                     "status": r["status"], "chunks": r["chunks"], "usage": r["usage"],
                     "replica": r["replica"]} for r in run["results"]]
            name = f"{run['system']}-{run['policy']}-{run['rate']:g}.json"
            (raw / name).write_text(json.dumps(rows))
        print(f"wrote each request's chunk times to {raw}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    out.with_suffix(".md").write_text(markdown(result))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}, {out.with_suffix('.md')}, {out.with_suffix('.png')}")
    print("\n".join(result["ratios"]))


if __name__ == "__main__":
    main()
