"""LoRA adapters behind one endpoint: tokenfab's adapter-aware kv_aware against routers that do
not know adapters, in front of two engines of the same settings, in one run.

Workload (seeded): 8 adapters of the tiny model (`tokenfab model tiny --lora 8`), popularity
Zipf(s) over them; each adapter has its own system prompts (2 of 12 blocks of 32 single-token
words), and each request is one of its adapter's system prompts and 2 blocks of its own, asking
for 32 tokens (`ignore_eos`, greedy, streamed with usage). Poisson arrivals; the same draws at
every rate, stretched. Every engine runs LoRA with `max_loras` 2 and `max_cpu_loras` 2: at most
two adapters in a batch and two loaded, so where requests land decides how often an engine
waits for a slot or loads an adapter.

Systems, each before two engines (one pinned core each, eager, block 32, the same KV cache
bytes, prefix caching and LoRA on):
- sglang-router (round_robin, cache_aware) and vllm-router (cache_aware) before two vLLM OpenAI
  servers started with `--enable-lora` and the 8 adapters (`--lora-modules`);
- tokenfab, one unified pool of 2 replicas serving the gateway themselves (`gateway.colocate`),
  with the adapters declared in the topology: round_robin; kv_aware with `router.adapters:
  ignore` (hashes and places as if every request ran on the base model); kv_aware aware of
  adapters (hashes with the adapter, counts loads and batch slots: router/adapters.py).
- Ray Serve LLM's own LoRA multiplexing would be a baseline, but it loads adapters only from
  cloud storage (`LoraConfig.dynamic_lora_loading_path`: s3://, gs://, abfss://, azure://),
  which this machine cannot reach: the run records what its LoraConfig answers for the local
  adapters folder.

Per record: TTFT p50/p90/p99 (send -> first chunk with a token), output tok/s (completion tokens
/ (last end - first send)), hit rate (the engines' cached_tokens / prompt_tokens), adapter loads
per 100 requests. tokenfab's loads are counted by its replicas (each load is explicit, timed);
a vLLM server reports none, so the baselines' are estimated from `vllm:lora_requests_info`
polled every 50 ms on each engine: an adapter seen running that is not among the engine's last
`max_cpu_loras` running ones counts as a load (a load between two polls can be missed, which
favours the baselines). Baselines run first (servers started once, routers one at a time), then
tokenfab (a deployment per setup), `--repeats` times over; caches start cold per replay (a new
word namespace; the baselines' engines also reset their prefix caches).

The floor, measured on the baselines' engines while idle at each repeat: the TTFT of a request
whose system prompt is cached and whose adapter is loaded, and of one whose adapter was evicted
(it loads); and the fewest loads any router can make for the workload's adapter sequence
(Belady's eviction over the engines' places). Where every router must load for 10 or more of
100 requests, no TTFT p90 is below a loading request's TTFT: a target under it is reported as
below the floor.

    .venv/bin/python benchmarks/lora.py [--rates 3,9] [--requests 200] [--repeats 1]
        [--setups ...] [--zipf 1.1] [--kv-cache 24MiB] [--raw DIR]

Writes benchmarks/results/lora.json and lora.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common.baseline import (Session, reset_prefix_caches, routed, start_engine,
                                        wait_ready)
from benchmarks.common.client import no_collection, one_request
from benchmarks.common.cluster import deployed, remove
from benchmarks.common.machine import prioritise_client
from benchmarks.common.results import RESULTS, write
from benchmarks.common.traces import BLOCK_TOKENS, Prompts, single_token_words
from orchestrator import cluster
from orchestrator.config import Topology, parse_topology
from orchestrator.pool_config import parse_bytes
from pools.tiny_lora import adapter_name, ensure_tiny_adapter
from pools.tiny_model import ensure_tiny_model
from tokenfab.stats import percentile

MODEL = Path("~/.cache/tokenfab/models/tiny-llama").expanduser()
ADAPTERS, MAX_LORAS, RANK = 8, 2, 8
SYSTEM_PROMPTS, SYSTEM_BLOCKS, USER_BLOCKS, MAX_TOKENS = 2, 12, 2, 32
BASELINES = (("sglang-router", "round_robin"), ("sglang-router", "cache_aware"),
             ("vllm-router", "cache_aware"))
OURS = (("tokenfab", "round_robin"), ("tokenfab", "kv_aware_adapter_blind"),
        ("tokenfab", "kv_aware"))
FLOOR = ("sglang-router", "cache_aware_all_resident")  # engines with max_loras = ADAPTERS
SETUPS = BASELINES + OURS + (FLOOR,)
ENGINE_PORTS, ROUTER_PORT, PROMETHEUS_PORT, GATEWAY_PORT = (8171, 8172), 8181, 8191, 8033
CLUSTER = {"node_ip": "127.0.0.1", "address": "127.0.0.1:6394",
           "dashboard_url": "http://127.0.0.1:8282", "num_cpus": 2, "serve_control_loop_s": 0.5}
POLL_S = 0.05


# --- The workload -----------------------------------------------------------------------------

def workload(count: int, zipf: float, seed: int) -> list[dict[str, Any]]:
    """Requests as {adapter, hash_ids, at}: `at` is the arrival at 1 request/s (unit-rate
    Poisson); a replay at rate r sends each at `at / r`."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** zipf for rank in range(ADAPTERS)]
    at, rows = 0.0, []
    for n in range(count):
        adapter = rng.choices(range(ADAPTERS), weights)[0]
        system = rng.randrange(SYSTEM_PROMPTS)
        base = (adapter * SYSTEM_PROMPTS + system) * SYSTEM_BLOCKS
        own = [10_000_000 + n * USER_BLOCKS + i for i in range(USER_BLOCKS)]
        rows.append({"adapter": adapter_name(adapter), "at": at,
                     "hash_ids": [base + i for i in range(SYSTEM_BLOCKS)] + own})
        at += rng.expovariate(1.0)
    return rows


def body(row: dict[str, Any], prompts: Prompts) -> dict[str, Any]:
    return {"model": row["adapter"], "prompt": prompts.prompt(row), "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}


async def replay(url: str, rows: list[dict[str, Any]], prompts: Prompts,
                 rate: float) -> list[dict[str, Any]]:
    bodies = [body(row, prompts) for row in rows]  # built before the clock starts
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    with no_collection():
        async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False,
                                     limits=limits) as client:
            began, tasks = time.monotonic(), []
            for row, request in zip(rows, bodies):
                await asyncio.sleep(max(0.0, began + row["at"] / rate - time.monotonic()))
                tasks.append(asyncio.create_task(one_request(client, request)))
            return list(await asyncio.gather(*tasks))


# --- Adapter loads ----------------------------------------------------------------------------

_LORA_INFO = re.compile(r'^vllm:lora_requests_info\{([^}]*)\}\s+(\S+)', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def running_adapters(metrics: str) -> list[str]:
    """The adapters running now, from the latest `vllm:lora_requests_info` series (its value is
    when it was set; vLLM keeps the older label sets)."""
    latest = max(((float(value), dict(_LABEL.findall(labels)))
                  for labels, value in _LORA_INFO.findall(metrics)),
                 key=lambda item: item[0], default=(0.0, {}))[1]
    return [a for a in latest.get("running_lora_adapters", "").split(",") if a]


class LoadSampler:
    """Polls each engine's adapters every POLL_S and counts loads against an LRU of
    `capacity` running adapters per engine (see the module docstring)."""

    def __init__(self, urls: list[str], capacity: int) -> None:
        self.urls, self.capacity = urls, capacity
        self.lru: dict[str, list[str]] = {url: [] for url in urls}
        self.loads = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        with httpx.Client(timeout=5, trust_env=False) as client:
            while not self._stop.wait(POLL_S):
                for url in self.urls:
                    try:
                        running = running_adapters(client.get(f"{url}/metrics").text)
                    except httpx.HTTPError:
                        continue
                    self.seen(url, running)

    def seen(self, url: str, running: list[str]) -> None:
        lru = self.lru[url]
        for adapter in running:
            if adapter in lru:
                lru.remove(adapter)
            else:
                self.loads += 1
            lru.append(adapter)
        del lru[:-self.capacity]

    def __enter__(self) -> LoadSampler:
        self.loads = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def tokenfab_loads(url: str) -> int:
    reports = httpx.get(f"{url}/tokenfab/replicas", timeout=10, trust_env=False).json()
    return sum(report["adapter_loads"] for report in reports)


# --- The floor --------------------------------------------------------------------------------

def fewest_loads(sequence: list[str], places: int) -> int:
    """The fewest adapter loads any router can make for this sequence of requests' adapters,
    over engines that hold `places` adapters in all, starting empty: Belady's optimal eviction
    on one cache of `places` (two engines' caches, however requests are split between them,
    never hold more, and splitting only adds loads)."""
    held: set[str] = set()
    loads = 0
    for at, adapter in enumerate(sequence):
        if adapter in held:
            continue
        loads += 1
        if len(held) >= places:
            def next_use(name: str) -> int:
                return next((i for i in range(at + 1, len(sequence)) if sequence[i] == name),
                            len(sequence))
            held.remove(max(held, key=next_use))
        held.add(adapter)
    return loads


# --- One replay's record ----------------------------------------------------------------------

def _pct(values: list[float], q: float) -> float | None:
    return percentile(values, q) if values else None


def summarize(results: list[dict[str, Any]], loads: int) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200 and r["chunks"]]
    usages = [r["usage"] for r in ok]
    prompt = sum(u.get("prompt_tokens", 0) for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    output = sum(u.get("completion_tokens", 0) for u in usages)
    ttft = [r["chunks"][0][0] for r in ok]
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    return {"ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
            "ttft_p99_s": _pct(ttft, 99), "output_tok_s": output / wall,
            "adapter_loads_per_100": 100 * loads / len(results),
            "hit_rate": cached / prompt if prompt else 0.0, "requests": len(results),
            "failed": len(results) - len(ok),
            "errors": sorted({r["error"][:200] for r in results if r["error"]})[:3]}


# --- The systems ------------------------------------------------------------------------------

def adapters() -> list[Path]:
    ensure_tiny_model(MODEL)
    return [ensure_tiny_adapter(MODEL, Path(f"{MODEL}-lora") / adapter_name(i), i)
            for i in range(ADAPTERS)]


def engine_lora_args(paths: list[Path], max_loras: int = MAX_LORAS) -> tuple[str, ...]:
    modules = [f"{adapter_name(i)}={path}" for i, path in enumerate(paths)]
    return ("--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(max_loras),
            "--max-lora-rank", str(RANK), "--lora-modules", *modules)


def topology(policy: str, kv_cache: str, paths: list[Path]) -> Topology:
    blind = policy.endswith("_adapter_blind")
    return parse_topology({
        "name": f"lora-{policy.replace('_', '-')}"[:31],
        "model": {"name": "tiny", "path": str(MODEL), "generate": "tiny", "dtype": "bfloat16",
                  "max_model_len": 2048, "lora": {
                      "max_loras": MAX_LORAS, "max_cpu_loras": MAX_LORAS, "max_rank": RANK,
                      "adapters": [{"name": adapter_name(i), "path": str(path)}
                                   for i, path in enumerate(paths)]}},
        "engine_args": {"enforce_eager": True, "block_size": BLOCK_TOKENS},
        "pools": [{"name": "main", "role": "unified", "replicas": 2, "max_ongoing_requests": 256,
                   "resources": {"cpus": 1, "kv_cache_bytes": kv_cache, "pin_cores": True}}],
        "router": {"policy": policy.removesuffix("_adapter_blind"),
                   "adapters": "ignore" if blind else "aware"},
        "gateway": {"host": "127.0.0.1", "port": GATEWAY_PORT, "colocate": True},
        "cluster": CLUSTER,
    }, f"lora benchmark ({policy})")


_SERVE_LLM_PROBE = """
import sys
from ray.serve.llm import LLMConfig, LoraConfig
try:
    LoraConfig(dynamic_lora_loading_path=sys.argv[1])
except Exception as exc:
    errors = getattr(exc, "errors", None)
    print(errors()[0]["msg"] if errors else repr(exc))
"""


def ray_serve_llm(adapters: Path) -> str:
    """Why Ray Serve LLM's own LoRA multiplexing cannot serve the adapters here ('' if it
    could): its import error, or what its LoraConfig says of a local adapters folder."""
    probe = subprocess.run([sys.executable, "-c", _SERVE_LLM_PROBE, str(adapters)],
                           capture_output=True, text=True, timeout=300)
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines()
        return f"import ray.serve.llm: {lines[-1] if lines else probe.returncode}"
    answer = probe.stdout.strip().splitlines()
    return f"LoraConfig(dynamic_lora_loading_path={str(adapters)!r}): {answer[-1]}" \
        if answer else ""


class Bench:
    def __init__(self, args: argparse.Namespace, rows: list[dict[str, Any]],
                 paths: list[Path]) -> None:
        self.args, self.rows, self.paths = args, rows, paths
        self.words = single_token_words(str(MODEL))
        self.records: list[dict[str, Any]] = []

    def _replays(self, system: str, policy: str, url: str, repeat: int,
                 loads_of: Any) -> None:
        setup = SETUPS.index((system, policy))
        asyncio.run(replay(url, self.rows[:4], Prompts(self.words, 50_000 + setup), 4.0))
        for index, rate in enumerate(self.args.rates):
            namespace = 1 + repeat * 1000 + setup * 100 + index
            print(f"{system} {policy} at {rate:g} req/s (repeat {repeat + 1}): "
                  f"{len(self.rows)} requests")
            with loads_of() as counter:
                results = asyncio.run(replay(url, self.rows, Prompts(self.words, namespace),
                                             rate))
            if self.args.raw:  # each request: its adapter, replica, send time and TTFT
                raw = Path(self.args.raw) / f"{system}-{policy}-{rate:g}-{repeat}.json"
                raw.write_text(json.dumps([
                    {"adapter": row["adapter"], "replica": r["replica"], "sent": r["sent"],
                     "status": r["status"], "ttft_s": r["chunks"][0][0] if r["chunks"] else None,
                     "done": r["done"], "usage": r["usage"]} for row, r in zip(self.rows, results)]))
            record = {"system": system, "policy": policy, "repeat": repeat,
                      "load": "low" if index == 0 else "high", "rate": rate,
                      **summarize(results, counter.loads), "adapter_loads_counted":
                      "sampled" if system != "tokenfab" else "by the replicas"}
            self.records.append(record)
            print("  ", json.dumps({k: v for k, v in record.items() if k != "errors"}))

    def baselines(self, setups: list[tuple[str, str]], repeat: int, logs: Path,
                  max_loras: int = MAX_LORAS) -> None:
        """The baseline routers before 2 vLLM servers, one at a time. The floor runs with
        `max_loras` = ADAPTERS: every adapter stays loaded and in every batch."""
        kv_bytes = parse_bytes(self.args.kv_cache)
        session = Session()
        urls = [f"http://127.0.0.1:{port}" for port in ENGINE_PORTS]
        try:
            engines = [start_engine(session, str(MODEL), core, port, kv_bytes, logs,
                                    engine_lora_args(self.paths, max_loras))
                       for core, port in enumerate(ENGINE_PORTS)]
            print(f"baselines: starting 2 vLLM servers with the adapters, max_loras {max_loras}")
            for url, engine in zip(urls, engines):
                wait_ready(url, engine, 900, "/health")
            sampler = LoadSampler(urls, max_loras)  # the engines' LRU, across routers

            def loads_of() -> LoadSampler:
                reset_prefix_caches(urls)
                return sampler

            for offset, (system, policy) in enumerate(setups):
                port = ROUTER_PORT + SETUPS.index((system, policy))
                with routed(session, system, policy.removesuffix("_all_resident"), port,
                            PROMETHEUS_PORT + offset, urls, logs) as url:
                    self._replays(system, policy, url, repeat, loads_of)
        finally:
            session.close()

    def tokenfab(self, policies: list[str], repeat: int) -> None:
        specs = [topology(policy, self.args.kv_cache, self.paths) for policy in policies]
        try:
            cluster.start_head(specs[0].cluster)
            for policy, spec in zip(policies, specs):
                print(f"tokenfab {policy}: deploying")
                url = deployed(spec)
                self._replays("tokenfab", policy, url, repeat, lambda u=url: _Counted(u))
                remove(spec)
        finally:
            cluster.stop_ray(specs[0].cluster.dashboard_url)


class _Counted:
    """The loads tokenfab's replicas counted over a replay."""

    def __init__(self, url: str) -> None:
        self.url, self.loads = url, 0

    def __enter__(self) -> _Counted:
        self._before = tokenfab_loads(self.url)
        return self

    def __exit__(self, *exc: Any) -> None:
        time.sleep(1.5)  # replicas report every second
        self.loads = tokenfab_loads(self.url) - self._before


# --- Report -----------------------------------------------------------------------------------

FIELDS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "output_tok_s", "adapter_loads_per_100",
          "hit_rate")


def medians(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (system, policy, load): the median of the repeats, and their range."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["system"], record["policy"], record["load"]), []).append(record)
    out = []
    for (system, policy, load), runs in groups.items():
        row = {"system": system, "policy": policy, "load": load, "rate": runs[0]["rate"],
               "repeats": len(runs)}
        for field in FIELDS:
            values = [r[field] for r in runs if r[field] is not None]
            row[field] = statistics.median(values) if values else None
            row[f"{field}_range"] = [min(values), max(values)] if values else None
        out.append(row)
    return out


def floor_of(rows: list[dict[str, Any]], requests: list[dict[str, Any]]) -> dict[str, Any]:
    """What the workload costs every router: the fewest adapter loads (Belady's eviction over
    the engines' places) and the prompts that no cache holds yet (each system prompt's first
    request), per 100 requests; and per load, the TTFT p90 of sglang-router cache_aware before
    engines that keep every adapter resident (no load, no slot wait: the floor)."""
    sequence = [row["adapter"] for row in requests]
    first_seen = {tuple(row["hash_ids"][:SYSTEM_BLOCKS]) for row in requests}
    floor: dict[str, Any] = {
        "fewest_loads_per_100": 100 * fewest_loads(sequence, 2 * MAX_LORAS) / len(requests),
        "first_prompts_per_100": 100 * len(first_seen) / len(requests)}
    for row in rows:
        if (row["system"], row["policy"]) == FLOOR:
            floor[row["load"]] = {"ttft_p90_s": row["ttft_p90_s"],
                                  "ttft_p90_s_range": row["ttft_p90_s_range"]}
    return floor


def verdict(rows: list[dict[str, Any]], floor: dict[str, Any]) -> list[str]:
    """tokenfab's adapter-aware kv_aware against the best baseline at each load: TTFT p90 at
    most 0.7x, output tok/s at least 1.0x (the targets), whether the repeats' ranges are apart,
    whether the target is below the floor; and against its adapter-blind self."""
    lines = []
    for load in ("low", "high"):
        at = [r for r in rows if r["load"] == load]
        ours = next((r for r in at if (r["system"], r["policy"]) == ("tokenfab", "kv_aware")), None)
        base = [r for r in at if (r["system"], r["policy"]) in BASELINES]
        if ours is None or not base:
            continue
        best_p90 = min(base, key=lambda r: r["ttft_p90_s"])
        best_tok = max(base, key=lambda r: r["output_tok_s"])
        p90 = ours["ttft_p90_s"] / best_p90["ttft_p90_s"]
        tok = ours["output_tok_s"] / best_tok["output_tok_s"]
        (low, high), (base_low, base_high) = ours["ttft_p90_s_range"], best_p90["ttft_p90_s_range"]
        apart = "a win, ranges apart" if high < base_low else \
            "a loss, ranges apart" if low > base_high else "ranges overlap: no claim"
        lines.append(
            f"{load} load ({ours['rate']:g} req/s): TTFT p90 {p90:.2f}x the best baseline's "
            f"({best_p90['system']} {best_p90['policy']}; {apart}; target <= 0.70: "
            f"{'met' if p90 <= 0.7 else 'not met'}); output tok/s {tok:.3f}x the best "
            f"({best_tok['system']} {best_tok['policy']}; target >= 1.00: "
            f"{'met' if tok >= 1.0 else 'not met'})")
        target_s, resident = 0.7 * best_p90["ttft_p90_s"], floor.get(load)
        if resident and target_s < resident["ttft_p90_s"]:
            below = "below the floor in every repeat" \
                if target_s < resident["ttft_p90_s_range"][0] else "below the floor's median"
            lines.append(
                f"{load} load: the target, {target_s * 1000:.1f} ms, is {below}: with every "
                f"adapter resident (no load, no slot wait), sglang-router cache_aware's TTFT p90 "
                f"was {resident['ttft_p90_s'] * 1000:.1f} ms "
                f"[{resident['ttft_p90_s_range'][0] * 1000:.1f}-"
                f"{resident['ttft_p90_s_range'][1] * 1000:.1f}]")
        rates = [r["output_tok_s"] for r in at]
        lines.append(
            f"{load} load: output tok/s of every system, the floor's included, within "
            f"{(max(rates) - min(rates)) / max(rates):.1%} of each other: a replay of fixed "
            f"arrivals that every system keeps up with delivers the tokens offered: this figure "
            f"separates no system")
        blind = next((r for r in at if r["policy"] == "kv_aware_adapter_blind"), None)
        if blind:
            lines.append(f"{load} load: against tokenfab kv_aware with the adapter ignored, TTFT "
                         f"p90 {ours['ttft_p90_s'] / blind['ttft_p90_s']:.2f}x, adapter loads "
                         f"{ours['adapter_loads_per_100']:.1f} against "
                         f"{blind['adapter_loads_per_100']:.1f} per 100 requests")
    return lines


def _f(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    rows = result["records"]
    lines = ["# LoRA adapters: adapter-aware routing against adapter-blind routers", "",
             f"{result['date']}, commit {result['commit']}. {result['requests']} requests, "
             f"{ADAPTERS} adapters (Zipf s={result['zipf']}), max_loras {MAX_LORAS}, "
             f"max_cpu_loras {MAX_LORAS}, 2 engines; median of {result['repeats']} "
             "repeat(s), range in brackets. Written by benchmarks/lora.py.", "",
             "| system | policy | load | req/s | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | "
             "output tok/s | adapter loads /100 | hit rate |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["load"] != "low", SETUPS.index((r["system"],
                                                                         r["policy"])))):
        p90 = r["ttft_p90_s_range"]
        lines.append(
            f"| {r['system']} | {r['policy']} | {r['load']} | {r['rate']:g} | "
            f"{_f(r['ttft_p50_s'], 1000, 0)} | {_f(r['ttft_p90_s'], 1000, 0)} "
            f"[{_f(p90[0], 1000, 0)}-{_f(p90[1], 1000, 0)}] | {_f(r['ttft_p99_s'], 1000, 0)} | "
            f"{_f(r['output_tok_s'], 1, 1)} | {_f(r['adapter_loads_per_100'], 1, 1)} | "
            f"{_f(r['hit_rate'], 1, 3)} |")
    lines += ["", *[f"- {line}" for line in result["verdict"]]]
    floor = result["floor"]
    lines += ["", f"Every router loads at least {floor['fewest_loads_per_100']:.1f} adapters per "
              f"100 requests of this workload (Belady's eviction over the engines' "
              f"{2 * MAX_LORAS} places, from empty), and computes "
              f"{floor['first_prompts_per_100']:.1f} of 100 prompts whole (each system prompt's first request). The floor row "
              f"({FLOOR[1]}) runs sglang-router cache_aware before engines started with max_loras "
              f"{ADAPTERS}: no load, no slot wait."]
    lines += ["", "tokenfab's adapter loads are counted by its replicas; the baselines' are "
              "sampled from vLLM's `vllm:lora_requests_info` every 50 ms (a load between two "
              "samples is missed, in the baselines' favour)."]
    if result["ray_serve_llm"]:
        lines += ["", f"Ray Serve LLM was not run: {result['ray_serve_llm']}"]
    return "\n".join(lines) + "\n"


def report(source: Path, out: Path) -> None:
    """The verdict and the Markdown of a results file, written again (its records unchanged)."""
    result = json.loads(source.read_text())
    workload_rows = workload(result["requests"], result["zipf"], result["seed"])
    result["floor"] = floor_of(result["records"], workload_rows)
    result["verdict"] = verdict(result["records"], result["floor"])
    print(write(out, result, markdown))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="3,9", help="low,high req/s (9: near saturation)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--kv-cache", default="24MiB")
    parser.add_argument("--setups", default=",".join(f"{s}:{p}" for s, p in SETUPS))
    parser.add_argument("--client-nice", type=int, default=-10)
    parser.add_argument("--out", default=str(RESULTS / "lora.json"))
    parser.add_argument("--raw", default=None, help="folder for each replay's requests")
    parser.add_argument("--report", default=None, metavar="JSON",
                        help="write the Markdown and verdict again from a results file (no run)")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the floor (engines that keep every adapter resident)")
    args = parser.parse_args()
    if args.report:
        report(Path(args.report), Path(args.out))
        return
    args.rates = [float(r) for r in args.rates.split(",")]
    setups = [tuple(s.split(":", 1)) for s in args.setups.split(",")]
    scheduling = prioritise_client(args.client_nice)
    paths = adapters()
    bench = Bench(args, workload(args.requests, args.zipf, args.seed), paths)
    serve_llm = ray_serve_llm(Path(f"{MODEL}-lora"))
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as logs:
        for repeat in range(args.repeats):
            if base := [s for s in setups if s in BASELINES]:
                bench.baselines(base, repeat, Path(logs))
            if not args.no_floor:
                bench.baselines([FLOOR], repeat, Path(logs), max_loras=ADAPTERS)
            if ours := [p for s, p in setups if s == "tokenfab"]:
                bench.tokenfab(ours, repeat)
    summary = medians(bench.records)
    floor = floor_of(summary, bench.rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    result = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "requests": args.requests,
              "zipf": args.zipf, "seed": args.seed, "rates": args.rates, "repeats": args.repeats,
              "kv_cache": args.kv_cache, "scheduling": scheduling, "ray_serve_llm": serve_llm,
              "records": summary, "runs": bench.records, "floor": floor,
              "verdict": verdict(summary, floor)}
    out = Path(args.out)
    print(write(out, result, markdown))


if __name__ == "__main__":
    main()
