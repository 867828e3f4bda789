"""Soak: hours of traffic in minutes, with engines dying under it. Nothing may be lost.

Two unified replicas of the tiny model take an open-loop Poisson load at `--load` of their
measured capacity, greedy streams only (completions and chats, prompts of 40 to 1,200 tokens, some
sharing a prefix), while one engine (`VLLM::EngineCore`, the replica with the most requests in
flight) is SIGKILLed every `--kill-every` seconds. Serve replaces the replica; meanwhile the
gateway retries what had not started and migrates what had (gateway.retries, gateway.migrate).

Every request's tokens, text and usage are checked against the same request run alone and
uninterrupted before the soak (the reference; `divergence`: a token may differ only where the
two runs' logprobs show a near-tie). Reported: requests sent, completed, failed (an HTTP error or
an error event in the stream) and mismatched (completed, but not as the reference); TTFT and
end-to-end p50/p99 per window of `--kill-every` seconds; resident memory of the gateway, the pool
replicas and the engines, sampled every `--rss-every` seconds, with its slope (a leak shows as a
slope that does not level off; each kill restarts one replica's processes).

The engines run in float32 (`--dtype`): in bfloat16, a prompt computed at once and the same tokens
computed one by one differ in the last bits, enough for the random tiny model's near-ties (exact
ties, in bfloat16's few bits) to pick other tokens after a migration
(benchmarks/resume_identity.py).

    .venv/bin/python benchmarks/soak.py [--minutes 30 --kill-every 300 --load 0.8]

Writes benchmarks/results/soak.json, soak.md and soak.png (needs the `bench` extra; `--replot`
draws the PNG again from the JSON). The suite runs `soak()` for a few
minutes (tests/integration/test_migration.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from benchmarks.common.cluster import local_head, tiny_topology
from benchmarks.common.results import RESULTS, command, write
from benchmarks.common.streams import Stream, divergence, greedy, stream
from tokenfab.stats import percentile_or_none

MODEL = "tiny"
PROCESSES = ("gateway", "replicas", "engines", "ray")
WARMUP_S = 120.0  # a process's first seconds, left out of its slope (imports, caches, first requests)
MIN_SPAN_S = 300.0  # a slope needs this long after the warm-up


# --- The workload -----------------------------------------------------------------------------

_WORDS = ("river stone light market seven quiet engine paper green north window table music "
          "forty silver garden road cloud harbour lantern copper meadow signal winter").split()


def workload(count: int, seed: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """`count` distinct greedy streamed requests: completions and chats, prompts of about 40 to
    1,200 tokens, a third of them behind one of four shared prefixes (cache hits for the router),
    32 to 96 output tokens, all of them generated (`ignore_eos`). Half ask for the usage chunk
    (the others' usage is checked by the gateway's accounting, not here)."""
    rng = random.Random(seed)
    shared = [" ".join(rng.choice(_WORDS) for _ in range(150)) for _ in range(4)]
    requests = []
    for index in range(count):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(12, 300)))
        text = f"{rng.choice(shared)} {index}: {words}" if index % 3 == 0 else f"{index}: {words}"
        body: dict[str, Any] = {"model": MODEL, "max_tokens": rng.randint(32, 96),
                                "temperature": 0, "ignore_eos": True, "stream": True}
        if index % 2:
            body["stream_options"] = {"include_usage": True}
        if index % 4 in (1, 2):
            requests.append(("chat", greedy("chat", body | {
                "messages": [{"role": "user", "content": text}]})))
        else:
            requests.append(("completions", greedy("completions", body | {"prompt": text})))
    return requests


async def reference(client: httpx.AsyncClient, requests: list[tuple[str, dict[str, Any]]],
                    concurrency: int = 2) -> list[Stream]:
    """Each request run alone (at most `concurrency` at once), uninterrupted."""
    gate = asyncio.Semaphore(concurrency)

    async def one(endpoint: str, body: dict[str, Any]) -> Stream:
        async with gate:
            result = await stream(client, endpoint, body)
        assert result.ok, f"reference request failed: {result.status} {result.errors}"
        return result

    return list(await asyncio.gather(*(one(e, b) for e, b in requests)))


async def capacity(client: httpx.AsyncClient, requests: list[tuple[str, dict[str, Any]]],
                   seconds: float, concurrency: int = 16) -> float:
    """Requests per second the deployment completes with `concurrency` streams always open."""
    done, until, rng = 0, time.monotonic() + seconds, random.Random(1)

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < until:
            result = await stream(client, *rng.choice(requests))
            done += result.ok
    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.monotonic() - started)


# --- The stack's processes --------------------------------------------------------------------

def _role(process: psutil.Process, app: str, gcs_port: int | None) -> str | None:
    try:
        title = " ".join(process.cmdline()) or process.name()
    except psutil.Error:
        return None
    if title.startswith("VLLM::") or process.name().startswith("VLLM::"):
        return "engines"
    if title.startswith(f"ray::ServeReplica:{app}:gateway"):
        return "gateway"
    if title.startswith(f"ray::ServeReplica:{app}:pool-"):
        return "replicas"
    if gcs_port is not None and (title.startswith(("ray::ServeController", "ray::ProxyActor"))
                                 or ("ray" in title and str(gcs_port) in title)):
        return "ray"  # the cluster's daemons: GCS, raylet, dashboard and agents, Serve's own
    return None


def rss_by_process(app: str, gcs_port: int | None) -> dict[int, tuple[str, str, float]]:
    """Each of the stack's processes: pid -> (role, name, resident memory in MB)."""
    out = {}
    for process in psutil.process_iter():
        role = _role(process, app, gcs_port)
        if role is not None:
            try:
                out[process.pid] = (role, process.name(), process.memory_info().rss / 2**20)
            except psutil.Error:
                pass
    return out


async def replicas(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    response = await client.get("/tokenfab/replicas")
    response.raise_for_status()
    return response.json()


async def kill_busiest_engine(client: httpx.AsyncClient, wait_for: int, timeout_s: float
                              ) -> str | None:
    """SIGKILL the EngineCore of the ready replica with the most requests in flight, once
    `wait_for` replicas are ready (None if they were not within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ready = [r for r in await replicas(client) if r["state"] == "ready"]
        if len(ready) >= wait_for:
            break
        if time.monotonic() > deadline:
            return None
        await asyncio.sleep(1.0)
    victim = max(ready, key=lambda r: r["load"]["in_flight"])
    kill_engine(victim["pid"])
    return victim["replica_id"]


def kill_engine(replica_pid: int) -> None:
    """SIGKILL the EngineCore of the pool replica whose process is `replica_pid`."""
    core = next(p for p in psutil.Process(replica_pid).children()
                if p.name() == "VLLM::EngineCore")
    core.send_signal(signal.SIGKILL)


# --- The soak ---------------------------------------------------------------------------------

def per_process(rss: list[tuple[float, dict[int, tuple[str, str, float]]]]
                ) -> list[dict[str, Any]]:
    """Each process's resident memory over its life: first and last sample, and its slope after
    WARMUP_S (None where it lived less than MIN_SPAN_S after that: a replica a kill replaced).

    Example: a process sampled at 0, 60, ..., 600 s growing 1 MB a minute -> slope +10.0."""
    lives: dict[int, list[tuple[float, float]]] = {}
    names: dict[int, tuple[str, str]] = {}
    for at, processes in rss:
        for pid, (role, name, mb) in processes.items():
            lives.setdefault(pid, []).append((at, mb))
            names[pid] = (role, name)
    out = []
    for pid, samples in lives.items():
        settled = [(t, mb) for t, mb in samples if t >= samples[0][0] + WARMUP_S]
        long_enough = settled and settled[-1][0] - settled[0][0] >= MIN_SPAN_S
        slope = _slope_per_10min(settled) if long_enough else None
        out.append({"pid": pid, "role": names[pid][0], "name": names[pid][1],
                    "from_s": round(samples[0][0], 1), "to_s": round(samples[-1][0], 1),
                    "first_mb": round(samples[0][1], 1), "last_mb": round(samples[-1][1], 1),
                    "slope_mb_per_10min": None if slope is None else round(slope, 2),
                    "samples": [[round(t, 1), round(mb, 1)] for t, mb in samples]})
    return sorted(out, key=lambda p: (PROCESSES.index(p["role"]), p["from_s"], p["pid"]))


def _slope_per_10min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) samples, in MB per 10 minutes."""
    if len(samples) < 3:
        return None
    xs, ys = [t for t, _ in samples], [m for _, m in samples]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    return 600 * sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else None


async def soak(root: str, app: str, *, seconds: float, kill_every_s: float, load: float = 0.8,
               rss_every_s: float = 10.0, distinct: int = 48, capacity_s: float = 30.0,
               replicas_expected: int = 2, seed: int = 0, gcs_port: int | None = None
               ) -> dict[str, Any]:
    """Run the soak against the deployment at `root` (its app named `app`); the summary. Ray's
    daemons are counted where `gcs_port` names the cluster's."""
    requests = workload(distinct, seed)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=root, timeout=600, trust_env=False,
                                 limits=limits) as client:
        expected = await reference(client, requests)
        rate = load * await capacity(client, requests, capacity_s)
        rng = random.Random(seed)
        start = time.monotonic()
        kills: list[dict[str, Any]] = []
        rss: list[tuple[float, dict[int, tuple[str, str, float]]]] = []

        async def killer() -> None:
            for at in [kill_every_s * k for k in range(1, int(seconds // kill_every_s) + 1)]:
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                if time.monotonic() - start >= seconds:
                    return
                # a replica killed before may still be starting (over a minute, on 2 busy cores)
                victim = await kill_busiest_engine(client, replicas_expected,
                                                   start + seconds - time.monotonic())
                kills.append({"at_s": round(time.monotonic() - start, 1), "replica": victim})

        async def sampler() -> None:
            while time.monotonic() - start < seconds:
                rss.append((time.monotonic() - start,
                            await asyncio.to_thread(rss_by_process, app, gcs_port)))
                await asyncio.sleep(rss_every_s)

        async def one(index: int, at: float) -> tuple[int, Stream]:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            return index, await stream(client, *requests[index])

        arrivals, at = [], rng.expovariate(rate)
        while at < seconds:
            arrivals.append((rng.randrange(distinct), at))
            at += rng.expovariate(rate)
        background = [asyncio.create_task(killer()), asyncio.create_task(sampler())]
        results = await asyncio.gather(*(one(i, a) for i, a in arrivals))
        for task in background:
            task.cancel()
    return summarize(results, expected, start, kills, rss, seconds, kill_every_s, rate, load)


def summarize(results: list[tuple[int, Stream]], expected: list[Stream], start: float,
              kills: list[dict[str, Any]],
              rss: list[tuple[float, dict[int, tuple[str, str, float]]]],
              seconds: float, window_s: float, rate: float, load: float) -> dict[str, Any]:
    failed = [s for _, s in results if not s.ok]
    mismatched = [(i, s, why) for i, s in results
                  if s.ok and (why := divergence(s, expected[i])) is not None]
    split = [(i, s) for i, s in results if s.ok and len(s.chunk_ids) != 1]
    windows = []
    for w in range(max(1, int(-(-seconds // window_s)))):
        inside = [s for _, s in results if s.ok and w * window_s <= s.sent - start < (w + 1) * window_s]
        ttft = [s.first_token - s.sent for s in inside if s.first_token is not None]
        e2e = [s.finished - s.sent for s in inside]
        windows.append({"from_s": w * window_s, "requests": len(inside),
                        "ttft_p50_s": percentile_or_none(ttft, 50),
                        "ttft_p99_s": percentile_or_none(ttft, 99),
                        "e2e_p50_s": percentile_or_none(e2e, 50),
                        "e2e_p99_s": percentile_or_none(e2e, 99)})
    return {
        "sent": len(results), "completed": len(results) - len(failed), "failed": len(failed),
        "mismatched": len(mismatched), "split_chunk_ids": len(split), "kills": len(kills),
        "kill_log": kills, "rate_rps": round(rate, 3), "load": load, "seconds": seconds,
        "windows": windows,
        "rss_mb": [{"at_s": round(t, 1), **{role: round(sum(mb for r, _, mb in m.values()
                                                          if r == role), 1)
                                             for role in PROCESSES}} for t, m in rss],
        "rss_processes": per_process(rss),
        "failures": [{"at_s": round(s.sent - start, 1), "took_s": round(s.finished - s.sent, 1),
                      "status": s.status, "replica": s.replica, "error": s.errors[:1]}
                     for s in failed][:10],
        "mismatches": [{"request": i, "why": why, "got": s.text[:80],
                        "want": expected[i].text[:80]} for i, s, why in mismatched][:10],
    }


# --- The benchmark ----------------------------------------------------------------------------

def topology(dtype: str) -> Any:
    return tiny_topology(
        "soak", [{"name": "main", "role": "unified", "replicas": 2,
                  "resources": {"cpus": 1, "kv_cache_bytes": "256MiB", "pin_cores": True}}],
        router={"policy": "kv_aware"}, gateway={"port": 8030}, cluster=local_head(6391, 8285),
        model={"name": MODEL, "dtype": dtype})


def _f(value: float | None, scale: float = 1.0) -> str:
    return "–" if value is None else f"{value * scale:.0f}"


def markdown(result: dict[str, Any]) -> str:
    r = result
    lines = [
        "# Soak: engines killed under load",
        "",
        f"{r['seconds'] / 60:.0f} minutes at {r['load']:.0%} of measured capacity "
        f"({r['rate_rps']} req/s), "
        + (f"one engine SIGKILLed every {r['window_s']:.0f} s" if r["kills"] else
           "no engine killed") + f", {r['dtype']}. Written by `benchmarks/soak.py`; "
        f"command: `{r['command']}`.",
        "",
        "| sent | completed | failed | mismatched | kills |",
        "|---|---|---|---|---|",
        f"| {r['sent']} | {r['completed']} | {r['failed']} | {r['mismatched']} | {r['kills']} |",
        "",
        "Latency of the requests sent in each window (ms):",
        "",
        "| window from | requests | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 |",
        "|---|---|---|---|---|---|",
    ]
    for w in r["windows"]:
        lines.append(f"| {w['from_s']:.0f} s | {w['requests']} | {_f(w['ttft_p50_s'], 1e3)} | "
                     f"{_f(w['ttft_p99_s'], 1e3)} | {_f(w['e2e_p50_s'], 1e3)} | "
                     f"{_f(w['e2e_p99_s'], 1e3)} |")
    lines += ["", f"Resident memory per process (each kill replaces one replica and its "
              f"engine): the slope after its first {WARMUP_S:.0f} s, where it lived "
              f"{MIN_SPAN_S:.0f} s more; `ray` is the cluster's own daemons.", "",
              "| role | process | sampled from - to (s) | RSS first -> last (MB) | "
              "slope (MB per 10 min) |", "|---|---|---|---|---:|"]
    for p in r["rss_processes"]:
        slope = p["slope_mb_per_10min"]
        lines.append(f"| {p['role']} | {p['name']} ({p['pid']}) | {p['from_s']:.0f} - "
                     f"{p['to_s']:.0f} | {p['first_mb']:.0f} -> {p['last_mb']:.0f} | "
                     + ("– (too short)" if slope is None else f"{slope:+.2f}") + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    windows = result["windows"]
    mids = [w["from_s"] + result["window_s"] / 2 for w in windows]
    for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"),
                       ("e2e_p99_s", "E2E p99")):
        top.plot(mids, [w[key] or 0 for w in windows], marker="o", label=label)
    top.set_ylabel("seconds")
    top.legend()
    samples = result["rss_mb"]
    for process in PROCESSES:
        bottom.plot([s["at_s"] for s in samples], [s[process] for s in samples], label=process)
    bottom.set_ylabel("RSS (MB)")
    bottom.set_xlabel("seconds into the soak")
    bottom.legend()
    for kill in result["kill_log"]:
        for axis in (top, bottom):
            axis.axvline(kill["at_s"], color="red", alpha=0.3)
    fig.suptitle("Soak: one engine SIGKILLed at each red line")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:

    from benchmarks.common.cluster import deployed, remove
    from orchestrator import cluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds")
    parser.add_argument("--load", type=float, default=0.8, help="share of measured capacity")
    parser.add_argument("--rss-every", type=float, default=10.0, help="seconds")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--name", default="soak", help="results/<name>.{json,md,png}")
    parser.add_argument("--replot", action="store_true",
                        help="only draw results/<name>.png again from results/<name>.json")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads((RESULTS / f"{args.name}.json").read_text()), RESULTS / f"{args.name}.png")
        return
    spec = topology(args.dtype)
    cluster.start_head(spec.cluster)
    try:
        root = deployed(spec)
        result = asyncio.run(soak(root, spec.name, seconds=args.minutes * 60,
                                  kill_every_s=args.kill_every, load=args.load,
                                  rss_every_s=args.rss_every,
                                  gcs_port=int(spec.cluster.address.rsplit(":", 1)[1])))
        remove(spec)
    finally:
        cluster.stop_ray(spec.cluster.dashboard_url)
    result |= {"window_s": args.kill_every, "dtype": args.dtype,
               "command": command()}
    print(write(RESULTS / f"{args.name}.json", result, markdown, plot))


if __name__ == "__main__":
    main()
