"""The benchmarks' streaming client: one streamed request timed chunk by chunk (`one_request`,
which every benchmark that times tokens uses), request bodies, replays at a trace's pace or one
request at a time, and waiting for a front to answer. `streams.py` reads a stream's content
(token ids, logprobs) for the token-identity checks.
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from benchmarks.common.traces import Prompts, arrival_offsets

MAX_TOKENS = 32


def body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}


async def one_request(client: httpx.AsyncClient, request: dict[str, Any],
                      path: str = "/v1/completions") -> dict[str, Any]:
    """One streamed request read to its end. `chunks`: each chunk with a choice (the first is the
    first token, its text possibly empty) as (seconds since `sent`, tokens in it, or None when
    the chunk has no token_ids); `status` 599 when the connection failed."""
    sent, chunks, usage, status, error, replica = time.monotonic(), [], {}, 0, "", None
    try:
        async with client.stream("POST", path, json=request) as response:
            status = response.status_code
            replica = response.headers.get("x-tokenfab-replica")
            if status != 200:
                error = (await response.aread()).decode(errors="replace")[:300]
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                at = time.monotonic() - sent
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    ids = chunk["choices"][0].get("token_ids")
                    chunks.append((at, None if ids is None else len(ids)))
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except httpx.HTTPError as exc:
        status, error = 599, repr(exc)
    return {"sent": sent, "done": time.monotonic(), "status": status, "chunks": chunks,
            "usage": usage, "error": error, "replica": replica}


@contextmanager
def no_collection() -> Iterator[None]:
    """No cyclic garbage collection while requests are timed. The client holds about 370,000
    objects (the trace, the prompts, earlier runs, its libraries), and one full collection among
    them stalled its event loop for 150 ms during a measured replay: every stream open then
    shows that gap in its ITL or TTFT, charged to the system under test. Garbage is collected
    before the requests and collection resumes after them."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


async def replay(url: str, requests: list[dict[str, Any]], prompts: Prompts,
                 rate: float) -> list[dict[str, Any]]:
    bodies = [body(prompts.prompt(row)) for row in requests]  # built before the clock starts
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    with no_collection():
        async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False,
                                     limits=limits) as client:
            began, tasks = time.monotonic(), []
            for at, request in zip(arrival_offsets(requests, rate), bodies):
                await asyncio.sleep(max(0.0, began + at - time.monotonic()))
                tasks.append(asyncio.create_task(one_request(client, request)))
            return list(await asyncio.gather(*tasks))


async def one_at_a_time(url: str, requests: list[dict[str, Any]],
                        prompts: Prompts) -> list[dict[str, Any]]:
    """Each request alone, in trace order, the next sent when the last has ended (one output
    token each: the floor's TTFTs)."""
    with no_collection():
        async with httpx.AsyncClient(base_url=url, timeout=600, trust_env=False) as client:
            return [await one_request(client, body(prompts.prompt(row), max_tokens=1))
                    for row in requests]


def warm_up(url: str, requests: list[dict[str, Any]], prompts: Prompts) -> bool:
    """A few requests through the front; True when every chunk carried token ids."""
    results = asyncio.run(replay(url, requests[:4], prompts, rate=4.0))
    bad = [r for r in results if r["status"] != 200 or not r["chunks"]]
    if bad:
        raise RuntimeError(f"{url}: warm-up failed: {bad[0]['status']} {bad[0]['error']}")
    return all(n is not None for r in results for _, n in r["chunks"])
