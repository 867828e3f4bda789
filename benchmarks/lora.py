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
from benchmarks.common.cluster import deployed, local_head, remove, tiny_model_dir, tiny_topology
from benchmarks.common.machine import prioritise_client
from benchmarks.common.results import RESULTS, write
from benchmarks.common.traces import BLOCK_TOKENS, Prompts, single_token_words
from benchmarks.lora_report import (ADAPTERS, BASELINES, FLOOR, MAX_LORAS, MAX_TOKENS, RANK,
                                    SETUPS, SYSTEM_BLOCKS, SYSTEM_PROMPTS, USER_BLOCKS, floor_of,
                                    markdown, medians, verdict)
from orchestrator import cluster
from orchestrator.config import Topology
from orchestrator.pool_config import parse_bytes
from pools.tiny_lora import adapter_name, ensure_tiny_adapter
from pools.tiny_model import ensure_tiny_model
from tokenfab.stats import percentile_or_none

MODEL = tiny_model_dir()
ENGINE_PORTS, ROUTER_PORT, PROMETHEUS_PORT, GATEWAY_PORT = (8171, 8172), 8181, 8191, 8033
CLUSTER = local_head(6394, 8282, serve_control_loop_s=0.5)
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


# --- One replay's record ----------------------------------------------------------------------

def summarize(results: list[dict[str, Any]], loads: int) -> dict[str, Any]:
    ok = [r for r in results if r["status"] == 200 and r["chunks"]]
    usages = [r["usage"] for r in ok]
    prompt = sum(u.get("prompt_tokens", 0) for u in usages)
    cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages)
    output = sum(u.get("completion_tokens", 0) for u in usages)
    ttft = [r["chunks"][0][0] for r in ok]
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    return {"ttft_p50_s": percentile_or_none(ttft, 50), "ttft_p90_s": percentile_or_none(ttft, 90),
            "ttft_p99_s": percentile_or_none(ttft, 99), "output_tok_s": output / wall,
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
    lora = {"max_loras": MAX_LORAS, "max_cpu_loras": MAX_LORAS, "max_rank": RANK,
            "adapters": [{"name": adapter_name(i), "path": str(path)}
                         for i, path in enumerate(paths)]}
    return tiny_topology(
        f"lora-{policy.replace('_', '-')}"[:31],
        [{"name": "main", "role": "unified", "replicas": 2, "max_ongoing_requests": 256,
          "resources": {"cpus": 1, "kv_cache_bytes": kv_cache, "pin_cores": True}}],
        router={"policy": policy.removesuffix("_adapter_blind"),
                "adapters": "ignore" if blind else "aware"},
        gateway={"port": GATEWAY_PORT, "colocate": True}, cluster=CLUSTER,
        block_size=BLOCK_TOKENS, model={"path": str(MODEL), "lora": lora})


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
