"""Prefill/decode disaggregation for one request: prefill on one pool with `max_tokens=1`, then
decode on the other, which pulls the prompt's KV cache over NIXL and streams the answer.

Every failure of the prefill leg (replica gone, deadline passed, no KV parameters) falls back to
decode computing the prompt itself; the client gets the same answer, a little later.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec
import ray
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from kvtransfer.metrics import TransferMetrics
from kvtransfer.params import decode_body, is_transferable, prefill_body
from orchestrator.config import DisaggregationSpec
from pools.engine import Endpoint, ReplyHead
from pools.tokenizer import PromptTokenCounter
from router.recent_prefixes import RecentPrefixes

if TYPE_CHECKING:
    from orchestrator.routing import PoolRouters

_LEG_ERRORS = (ray.exceptions.RayError, RayServeException, StopAsyncIteration)


class PDFlow:
    """Runs requests through a prefill pool and a decode pool (one handle per pool)."""

    def __init__(self, prefill: list[tuple[str, DeploymentHandle]], decode: list[DeploymentHandle],
                 spec: DisaggregationSpec, counter: PromptTokenCounter,
                 metrics: TransferMetrics, routers: PoolRouters | None = None) -> None:
        self._prefill, self._decode = itertools.cycle(prefill), itertools.cycle(decode)
        self._spec, self._counter, self.metrics = spec, counter, metrics
        self._routers = routers
        self._on_decode = RecentPrefixes(ttl_s=spec.decode_cache_ttl_s)

    async def reply(self, endpoint: Endpoint, body: dict[str, Any]) -> AsyncIterator[ReplyHead | bytes]:
        """Same stream shape as a pool replica's reply (see pools.engine.ReplyHead)."""
        params = None
        tokens = await self._tokens(endpoint, body)
        if self._worth_disaggregating(tokens):
            outcome = await self._prefill_leg(endpoint, body, tokens)
            if isinstance(outcome, list):  # the request itself is invalid: answer as decode would
                for item in outcome:
                    yield item
                return
            params = outcome
        self.metrics.path("disaggregated" if params else "decode_only")
        if tokens:
            self._on_decode.record(tokens)  # decode will hold these blocks, pulled or computed
        decode = next(self._decode).options(stream=True).reply.remote(endpoint, decode_body(body, params))
        try:
            async for item in decode:
                yield item
        finally:
            decode.cancel()  # client gone: abort on the decode engine too

    async def _tokens(self, endpoint: Endpoint, body: dict[str, Any]) -> list[int] | None:
        if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
            self.metrics.skipped("multiple_choices")
            return None
        tokens = await asyncio.to_thread(self._counter.tokens, endpoint, body)
        if tokens is None:
            self.metrics.skipped("unknown_prompt")
        return tokens

    def _worth_disaggregating(self, tokens: list[int] | None) -> bool:
        """Only when decode would otherwise compute at least `min_prompt_tokens` itself.

        Example (min 256): a 2,000-token prompt whose first 1,920 tokens decode was recently sent
        leaves 80 to compute: decode does that faster than a prefill leg plus a transfer.
        """
        if tokens is None:
            return False
        if len(tokens) < self._spec.min_prompt_tokens:
            self.metrics.skipped("short_prompt")
            return False
        if len(tokens) - self._on_decode.cached_tokens(tokens) < self._spec.min_prompt_tokens:
            self.metrics.skipped("cached_on_decode")
            return False
        return True

    async def _prefill_leg(self, endpoint: Endpoint, body: dict[str, Any],
                           tokens: list[int]) -> Any:
        """KV transfer params, a client-error reply to pass on as is, or None to recompute."""
        started = time.monotonic()
        pool, handle = next(self._prefill)
        key = await self._routers.key(pool, endpoint, body, tokens) if self._routers else None
        leg = handle.options(stream=True).reply.remote(endpoint, prefill_body(body), route=key)
        try:
            head, payload = await asyncio.wait_for(_two_items(leg), self._spec.prefill_timeout_s)
            if self._routers is not None and head.status == 200:
                self._routers.first_token(pool, key)  # its one token marks the prefill's end
        except asyncio.TimeoutError:
            self.metrics.fallback("prefill_timeout")
            return None
        except _LEG_ERRORS:
            self.metrics.fallback("prefill_failed")
            return None
        finally:
            leg.cancel()
            if self._routers is not None:
                self._routers.finished(pool, key)
        self.metrics.prefill_latency(time.monotonic() - started)
        if 400 <= head.status < 500:
            return [head, payload]
        if head.status != 200:
            self.metrics.fallback("prefill_error")
            return None
        params = msgspec.json.decode(payload).get("kv_transfer_params")
        if not is_transferable(params):
            self.metrics.fallback("no_kv_params")
            return None
        return params


async def _two_items(stream: Any) -> tuple[ReplyHead, bytes]:
    head = await stream.__anext__()
    return head, await stream.__anext__()
