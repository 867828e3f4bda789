"""Step times of a real engine, measured through a running tokenfab gateway, fitted to the law of
`sim.params.EngineParams`.

Three kinds of probe, each on prompts of fresh random single-token words (nothing cached unless
the probe means it):
- prefill: one request alone, prompts of 1 to 60 blocks. Its TTFT is the request overhead plus one
  prefill step; its later tokens, one decode step each beside no other request.
- cached prefill: the same prompt again but for its last blocks: the step computes only those,
  reading the cached ones (separates the per-token cost from the attention's).
- batch decode: N requests at once; each replica's requests decode side by side (the reply's
  `x-tokenfab-replica` header says where each went), one step per token.

Each observation is a row (overhead?, 1, new tokens, seqs, KV tokens, attention pairs) -> seconds;
a least-squares fit with every coefficient kept >= 0 gives the profile.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from sim.params import EngineParams

MIN_OBSERVED_S = 1e-3
BATCH_SETTLE_S = 0.4
FEATURES = ("request_overhead_s", "step_base_s", "per_token_s", "per_seq_s", "per_kv_token_s",
            "per_attn_pair_s", "overhead_per_stream_s")


@dataclass
class Observation:
    """Seconds of `steps` engine steps that together computed these (possibly fractional: a
    probe that waited on average half a step in progress), plus the request's overhead if it is
    a TTFT, beside `streams` other requests on its replica."""

    overhead: bool  # a TTFT: the request's overhead is in it
    new_tokens: float
    seqs: float
    kv_tokens: float
    attn_pairs: float
    seconds: float
    steps: float = 1.0
    streams: int = 0

    def row(self) -> list[float]:
        return [float(self.overhead), self.steps, self.new_tokens, self.seqs, self.kv_tokens,
                self.attn_pairs, float(self.overhead) * self.streams]


def single_token_words(model_path: str) -> list[str]:
    """Words the tokenizer at `model_path` encodes as exactly one token after a space: prompts
    of exactly as many tokens as words."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(Path(model_path).expanduser()))
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text.startswith(" ") and text[1:].isalpha() and \
                tokenizer(text, add_special_tokens=False).input_ids == [token_id]:
            words.append(text)
    return words


class Prober:
    """Sends the probes to `base_url` (a gateway's /v1) for `model`, prompts of `words`."""

    def __init__(self, base_url: str, model: str, words: list[str], block_size: int,
                 seed: int = 0, headers: dict[str, str] | None = None) -> None:
        self.base_url, self.model, self.words, self.block = base_url, model, words, block_size
        self._rng = random.Random(seed)
        self._headers = headers or {}

    def fresh(self, blocks: int) -> list[str]:
        """`blocks` x block_size random words, as no earlier probe used them (with the BOS token
        the engine adds, `blocks` full blocks and one token)."""
        return [self._rng.choice(self.words) for _ in range(blocks * self.block)]

    async def one(self, client: httpx.AsyncClient, words: list[str],
                  max_tokens: int) -> dict[str, Any]:
        body = {"model": self.model, "prompt": "".join(words), "stream": True,
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        sent, stamps, usage = time.monotonic(), [], {}
        async with client.stream("POST", "/completions", json=body,
                                 headers=self._headers) as response:
            if response.status_code != 200:
                raise RuntimeError(f"probe failed: {response.status_code} "
                                   f"{(await response.aread())[:200]!r}")
            replica = response.headers.get("x-tokenfab-replica", "")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    stamps.append(time.monotonic())
                if chunk.get("usage"):
                    usage = chunk["usage"]
        if len(stamps) < 2:
            raise RuntimeError(f"probe got {len(stamps)} token chunks; need 2 or more")
        return {"ttft": stamps[0] - sent, "stamps": stamps, "replica": replica,
                "prompt_tokens": usage.get("prompt_tokens", 0), "tokens": max_tokens,
                "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}

    async def run(self, prefill_blocks: list[int], batch_sizes: list[int], repeats: int,
                  decode_tokens: int = 48) -> list[Observation]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120, trust_env=False,
                                     limits=limits) as client:
            out = []
            for _ in range(repeats):
                for blocks in prefill_blocks:
                    out += await self._prefill(client, blocks)
                for n in batch_sizes:
                    out += await self._batch(client, n, decode_tokens)
            return out

    async def _prefill(self, client: httpx.AsyncClient, blocks: int) -> list[Observation]:
        prompt = self.fresh(blocks)
        alone = await self.one(client, prompt, 8)
        out = [_ttft(alone, alone["prompt_tokens"], 0), _decode(alone, [alone["prompt_tokens"]])]
        if blocks >= 4:  # the same prompt but its last quarter: a prefill over a cached prefix
            keep = blocks - blocks // 4
            for _ in range(2):  # a round-robin gateway sends one of two to the replica that has it
                again = await self.one(client, prompt[:keep * self.block]
                                       + self.fresh(blocks - keep), 2)
                if again["cached"]:
                    out.append(_ttft(again, again["prompt_tokens"] - again["cached"],
                                     again["cached"]))
                    break
        return out

    async def _batch(self, client: httpx.AsyncClient, n: int, tokens: int) -> list[Observation]:
        batch = [asyncio.create_task(self.one(client, self.fresh(2), tokens)) for _ in range(n)]
        await asyncio.sleep(BATCH_SETTLE_S)  # their prefills done: they decode side by side
        probe = await self.one(client, self.fresh(1), 2)
        results = await asyncio.gather(*batch)
        per_replica = Counter(r["replica"] for r in results)
        out = [_loaded_ttft(probe, results, tokens)]
        for replica, count in per_replica.items():
            mine = [r for r in results if r["replica"] == replica]
            # side by side from their first token to the first of them to end
            start = max(r["stamps"][0] for r in mine)
            end = min(r["stamps"][-1] for r in mine)
            inside = [t for t in mine[0]["stamps"] if start <= t <= end]
            if len(inside) < 4:
                continue
            step = (inside[-1] - inside[0]) / (len(inside) - 1)
            context = mine[0]["prompt_tokens"] + tokens // 2
            out.append(Observation(False, count, count, count * context, count * context, step))
        return out


def _loaded_ttft(probe: dict[str, Any], batch: list[dict[str, Any]], tokens: int) -> Observation:
    """A one-block request sent while `batch` decodes: it waits on average half a decode step of
    the requests on its replica, then prefills in a step beside them."""
    sent = probe["stamps"][0] - probe["ttft"]
    beside = [r for r in batch if r["replica"] == probe["replica"]
              and r["stamps"][0] < sent < r["stamps"][-1]]
    k = len(beside)
    context = (batch[0]["prompt_tokens"] + tokens // 4) if batch else 0
    prompt = probe["prompt_tokens"]
    return Observation(True, 0.5 * k + k + prompt, 0.5 * k + k + 1, 1.5 * k * context + prompt,
                       1.5 * k * context + prompt * prompt / 2, probe["ttft"],
                       steps=1.5 if k else 1.0, streams=k)


def _ttft(result: dict[str, Any], computed: int, cached: int) -> Observation:
    return Observation(True, computed, 1, computed + cached,
                       computed * (cached + computed / 2), result["ttft"])


def _decode(result: dict[str, Any], contexts: list[int]) -> Observation:
    stamps = result["stamps"]
    step = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    context = contexts[0] + len(stamps) // 2
    return Observation(False, 1, 1, context, context, step)


def fit(observations: list[Observation]) -> dict[str, float]:
    """Least squares with every coefficient >= 0 (an active set: a coefficient that comes out
    negative is fixed at 0 and the rest refitted), each row weighted by 1/seconds so that short
    steps count as much as long prefills. A time under MIN_OBSERVED_S is a probe whose tokens
    came in one chunk, not a step, and is left out."""
    observations = [o for o in observations if o.seconds >= MIN_OBSERVED_S]
    rows = np.array([o.row() for o in observations])
    y = np.array([o.seconds for o in observations])
    weights = 1.0 / np.maximum(y, 1e-4)
    active = list(range(rows.shape[1]))
    coef = np.zeros(rows.shape[1])
    while active:
        a = rows[:, active] * weights[:, None]
        solution, *_ = np.linalg.lstsq(a, y * weights, rcond=None)
        if (solution >= 0).all():
            coef[:] = 0
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return dict(zip(FEATURES, (float(c) for c in coef)))


def fit_error(observations: list[Observation], coef: dict[str, float]) -> float:
    """Median relative error of the fitted law on the observations."""
    ratios = _log_ratios(observations, coef)
    return float(np.median(np.abs(np.expm1(ratios))))


def _log_ratios(observations: list[Observation], coef: dict[str, float]) -> np.ndarray:
    observations = [o for o in observations if o.seconds >= MIN_OBSERVED_S]
    x = np.array([o.row() for o in observations])
    predicted = np.maximum(x @ np.array([coef[f] for f in FEATURES]), 1e-6)
    return np.log(np.array([o.seconds for o in observations]) / predicted)


def profile(name: str, coef: dict[str, float], *, block_size: int, kv_blocks: int,
            max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
            start_latency_s: float, source: str) -> EngineParams:
    return EngineParams(name=name, block_size=block_size, kv_blocks=kv_blocks,
                        max_num_batched_tokens=max_num_batched_tokens,
                        max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                        start_latency_s=start_latency_s, source=source, **coef)


PREFILL_BLOCKS = [1, 2, 4, 8, 16, 30, 45, 60]
BATCH_SIZES = [2, 4, 8, 16, 32]


def calibrate(base_url: str, model: str, words: list[str], *, block_size: int, kv_blocks: int,
              max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
              start_latency_s: float, name: str, repeats: int = 3,
              headers: dict[str, str] | None = None) -> tuple[EngineParams, float,
                                                              list[Observation]]:
    """Probe the gateway at `base_url` (its /v1), fit; (profile, median fit error, the
    observations)."""
    prober = Prober(base_url, model, words, block_size, headers=headers)
    blocks = [b for b in PREFILL_BLOCKS if b * block_size < max_model_len - 16]
    observations = asyncio.run(prober.run(blocks, BATCH_SIZES, repeats))
    coef = fit(observations)
    source = (f"python -m sim calibrate: {len(observations)} probes of a real engine through "
              f"the gateway at {base_url} on {time.strftime('%Y-%m-%d')}; start latency "
              f"{start_latency_s:.1f}s measured separately")
    params = profile(name, coef, block_size=block_size, kv_blocks=kv_blocks,
                     max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len, start_latency_s=start_latency_s, source=source)
    return params, fit_error(observations, coef), observations


STEP_SCALES = [0.8 + 0.1 * i for i in range(23)]  # 0.8 .. 3.0
OVERHEADS_S = [0.0025 * i for i in range(1, 21)]  # 2.5 .. 50 ms
PER_STREAM_S = [0.001 * i for i in (0, 1, 2, 3, 4, 6, 8)]  # per request already on the replica
QUANTILES = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")  # fitted, where a real summary has them


def scaled(params: EngineParams, step_scale: float, overhead_s: float,
           per_stream_s: float | None = None) -> EngineParams:
    """The profile with every step-time term times `step_scale`, `overhead_s` per request and,
    if given, `per_stream_s` more per request already on the replica."""
    return msgspec.structs.replace(
        params, step_base_s=params.step_base_s * step_scale,
        per_token_s=params.per_token_s * step_scale, per_seq_s=params.per_seq_s * step_scale,
        per_kv_token_s=params.per_kv_token_s * step_scale,
        per_attn_pair_s=params.per_attn_pair_s * step_scale, request_overhead_s=overhead_s,
        overhead_per_stream_s=params.overhead_per_stream_s if per_stream_s is None
        else per_stream_s)


def fit_to_replay(params: EngineParams,
                  replays: Sequence[tuple[Callable[[EngineParams], dict[str, float]],
                                          dict[str, float]]]) -> tuple[EngineParams, float, float]:
    """The probes fit the law's shape on an idle machine; under a replay's load the engines run
    slower (co-located engines and the request path share cores, caches and memory bandwidth)
    and requests wait longer outside them. This fits one scale of every step term and the
    request overhead to calibration replays (requests the fidelity window does not have), each a
    pair (simulate, real summary): the grid point whose simulated TTFT quantiles are closest
    to the real ones in log terms, over every replay together; the quantiles are those of
    `QUANTILES` the real summary has.

    The p99 is the longest prompts, computed whole: it weighs the scale of the law's per-token
    terms, which p50 (short, cached prompts: mostly overhead) and p90 alone let trade against
    the overhead (a scale that met a calibration replay's p90 overstated the replay's and the
    window's longest prompts by 15% and 13%; sim_fidelity-notes.md, commit f1c38b0).

    What the request path adds grows with the load on a machine whose cores it shares; one
    constant overhead fitted across loads is too high at the low one and too low at the high
    one. Given replays at more than one load, the overhead each request already on the replica
    adds (`overhead_per_stream_s`) is fitted too, with the scale and overhead near the first
    fit's. Returns (profile, step scale, squared log error)."""
    def error_of(candidate: EngineParams) -> float:
        error = 0.0
        for simulate, real in replays:
            sim = simulate(candidate)
            error += sum(math.log(sim[m] / real[m]) ** 2 for m in QUANTILES if m in real)
        return error

    best = min((error_of(scaled(params, scale, overhead)), scale, overhead,
                params.overhead_per_stream_s)
               for scale in STEP_SCALES for overhead in OVERHEADS_S)
    if len(replays) > 1:
        _, near_scale, near_overhead, _ = best
        best = min([best] + [
            (error_of(scaled(params, scale, overhead, per_stream)), scale, overhead, per_stream)
            for scale in (near_scale - 0.1, near_scale, near_scale + 0.1)
            for overhead in (near_overhead - 0.0025 * k for k in range(5))
            for per_stream in PER_STREAM_S if overhead > 0 and scale > 0])
    error, scale, overhead, per_stream = best
    return scaled(params, scale, overhead, per_stream), scale, error
