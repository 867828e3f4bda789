"""A short fidelity check against a running deployment: calibrate on it, then replay one trace
window through it and through the simulator, and compare (the suite runs it; the full comparison
is benchmarks/sim_fidelity.py).

Calibration: the idle probes of `sim.calibrate`, then a calibration replay of other conversations
(`fit_to_replay`). The window's prompts are `block_size` single-token words per hash id, the
same words for the same id, so prompts share exactly the blocks their hash ids share.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import numpy as np

from sim import workload
from sim.calibrate import QUANTILES, Prober, calibrate, fit_to_replay
from sim.params import EngineParams
from sim.run import replay
from tokenfab.stats import percentile

METRICS = ("ttft_p50_s", "ttft_p90_s", "hit_rate")


def real_replay(base_url: str, model: str, words: list[str], rows: list[dict[str, Any]],
                rate: float, *, block_size: int, max_ids: int, namespace: int,
                output_tokens: int) -> dict[str, float]:
    """`rows` sent to the gateway at their trace times rescaled to `rate`; TTFT p50/p90 and
    the engines' own hit rate."""

    prober = Prober(base_url, model, words, block_size)

    def chunk(hash_id: int) -> list[str]:
        rng = random.Random(namespace * 1_000_003 + hash_id)
        return [rng.choice(words) for _ in range(block_size)]

    async def send(client: httpx.AsyncClient, row: dict[str, Any], due: float) -> dict:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        return await prober.one(client, [w for h in row["hash_ids"][:max_ids] for w in chunk(h)],
                                output_tokens)

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120, trust_env=False) as client:
            start = time.monotonic() + 0.5
            return await asyncio.gather(*(
                send(client, row, start + at)
                for row, at in zip(rows, workload.arrival_offsets(rows, rate))))

    return _summary(asyncio.run(run()))


def _summary(results: list[dict[str, Any]]) -> dict[str, float]:
    ttft = np.array([r["ttft"] for r in results])
    prompt = sum(r["prompt_tokens"] for r in results)
    return {"ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "hit_rate": sum(r["cached"] for r in results) / prompt if prompt else 0.0}


def simulated_replay(params: EngineParams, policy: str, replicas: int,
                     rows: list[dict[str, Any]], rate: float, *, max_ids: int, namespace: int,
                     output_tokens: int, ttft_target_s: float = 0.0) -> dict[str, float]:
    def make(index: int, start: float) -> list:
        return workload.requests(rows, rate, tokens_per_id=params.block_size,
                                 block_size=params.block_size,
                                 max_prompt_tokens=max_ids * params.block_size + 1,
                                 output_tokens=lambda row: output_tokens, start=start,
                                 exact_ids=True, namespace=namespace)

    result = replay(params, policy, replicas, make, ttft_target_s=ttft_target_s)
    return {m: result[m] for m in (*METRICS, *QUANTILES)}  # what fit_to_replay reads


def check(base_url: str, model: str, words: list[str], *, policy: str, replicas: int,
          block_size: int, kv_blocks: int, max_model_len: int, window: list[dict[str, Any]],
          calibration: list[dict[str, Any]], rate: float, output_tokens: int = 8,
          repeats: int = 1, max_ids: int | None = None,
          ttft_target_s: float = 0.0) -> dict[str, Any]:
    """Calibrate on the deployment at `base_url` (its /v1), then the window, real and simulated:
    {"sim": {...}, "real": {...}, "profile": EngineParams}. Prompts keep at most `max_ids` hash
    ids (as many as the context holds by default). The simulated router has the deployment's
    TTFT target, `ttft_target_s`."""
    max_ids = max_ids or (max_model_len - output_tokens - 1) // block_size
    probed, _, _ = calibrate(base_url, model, words, block_size=block_size, kv_blocks=kv_blocks,
                             max_num_batched_tokens=2048, max_num_seqs=128,
                             max_model_len=max_model_len, start_latency_s=0.0,
                             name="fidelity-check", repeats=repeats)
    shared = {"max_ids": max_ids, "output_tokens": output_tokens}
    measured = real_replay(base_url, model, words, calibration, rate, block_size=block_size,
                           namespace=1, **shared)
    target = {"ttft_target_s": ttft_target_s}
    params, _, _ = fit_to_replay(probed, [(lambda p: simulated_replay(
        p, policy, replicas, calibration, rate, namespace=1, **shared, **target), measured)])
    real = real_replay(base_url, model, words, window, rate, block_size=block_size,
                       namespace=2, **shared)
    sim = simulated_replay(params, policy, replicas, window, rate, namespace=2, **shared,
                           **target)
    return {"sim": sim, "real": real, "profile": params}
