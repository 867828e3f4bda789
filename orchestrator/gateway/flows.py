"""One flow per topology shape, behind one interface: where an admitted request goes and how its
reply comes back.

- `UnifiedFlow`: one pool; the router picks the replica, the reply is relayed.
- `DisaggregatedFlow`: prefill on one pool with `max_tokens=1`, then decode on the other, which
  pulls the prompt's KV cache over NIXL and streams the answer. Every failure of the prefill leg
  (replica gone, deadline passed, no KV parameters) falls back to decode computing the prompt
  itself: the client gets the same answer, a little later.

A flow never touches the admission ticket: the route that admitted the request settles it with
the usage the flow returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any, Protocol

import msgspec

from channel.client import ReplyStream
from channel.frames import AdapterRef, Request, Usage
from orchestrator.gateway.dispatch import PoolDispatcher
from orchestrator.gateway.errors import GatewayError, ReplicaFailed
from orchestrator.gateway.migration import continuation_body, not_resumable
from orchestrator.gateway.relay import Call, TokenClock, end_in_stream, relay
from kvtransfer.metrics import TransferMetrics
from kvtransfer.params import decode_body, is_transferable, prefill_body
from orchestrator.config import DisaggregationSpec
from router.index import ReplicaId
from router.recent_prefixes import RecentPrefixes, skip_prefill
from router.wire import RouteKey
from tokenfab.errors import LinkLost, ReplyFailed

_encode = msgspec.json.encode


class Flow(Protocol):
    """Serves admitted requests. `keys` is CPU work (hashing) that the caller runs off the event
    loop, once per request, before `serve`."""

    @property
    def pools(self) -> Mapping[str, PoolDispatcher]:
        """The flow's pools, by name."""

    @property
    def needs_tokens(self) -> bool:
        """Whether `keys` and `serve` read the prompt's token ids."""

    def keys(self, request_id: str, tokens: list[int] | None, salt: str | None,
             adapter: AdapterRef | None = None) -> dict[str, RouteKey]: ...

    async def serve(self, call: Call, keys: dict[str, RouteKey]) -> Usage | None:
        """Answer the call (or raise GatewayError before any byte of an answer was sent); the
        reply's usage, or None when it is unknown (then the admission keeps what it charged)."""


def client_salt(body: dict[str, Any]) -> str | None:
    """The (shaped) body's cache salt: the one the engines get, which routing hashes with."""
    salt = body.get("cache_salt")
    return salt if isinstance(salt, str) else None


def _keys(pools: Mapping[str, PoolDispatcher], request_id: str, tokens: list[int] | None,
          salt: str | None, adapter: AdapterRef | None) -> dict[str, RouteKey]:
    lora = (adapter.name, adapter.path) if adapter is not None else None
    return {name: pool.service.route_key(request_id, tokens, salt, lora)
            for name, pool in pools.items()}


def cache_key(call: Call) -> str | None:
    """What, besides the tokens, keeps one prompt's KV cache apart from another's: the cache
    salt and the adapter (engines hash both into every block)."""
    salt, adapter = client_salt(call.body), call.adapter
    if adapter is None:
        return salt
    return f"{salt or ''}\0lora\0{adapter.name}\0{adapter.path}"


async def _leg(pool: PoolDispatcher, call: Call, key: RouteKey, body: dict[str, Any]
               ) -> Usage | None:
    """One pool's part of the call. A replica that fails is left out and the request goes to
    another, up to `pool.retries` times, waiting (within the deadline) for one if the pool has
    no other now: before any byte reached the client, the request itself;
    after, a continuation of its stream from the tokens the client has (gateway.migration), when
    the request can be continued. Otherwise the client gets the error: as the answer, or as the
    stream's last event."""
    resumable = pool.migrate and not_resumable(call.endpoint, body) is None
    if resumable and "request_id" not in body:
        body = body | {"request_id": call.request_id}  # chunk ids stay the same when continued
    request = Request(call.endpoint, _encode(body), track_tokens=resumable, adapter=call.adapter)
    clock = TokenClock(call, lambda: pool.service.first_token(key.request_id))
    failed: set[ReplicaId] = set()
    sent: list[int] = []  # the tokens the client has
    while True:
        try:
            deadline = call.deadline if request.resume is None \
                else time.monotonic() + call.timeout_s  # a continuation: a new reply
            stream, head = await pool.open(request, key, deadline, frozenset(failed))
            call.reached_engine = True
            try:
                return await relay(call, stream, head, clock)
            finally:
                pool.finished(key)
                sent += stream.ids
        except ReplicaFailed as exc:
            replica = ReplicaId(exc.replica)
            pool.failed(replica)
            failed.add(replica)
            retry = len(failed) <= pool.retries  # on a replica not tried yet: one listed, or
            # one that appears within the deadline (Serve replacing the failed one)
            if not call.responder.started:
                if retry:
                    continue
                raise
            if resumable and retry:
                pool.service.migration("resumed")
                request = Request(call.endpoint, _encode(continuation_body(body)),
                                  track_tokens=True, resume=tuple(sent), adapter=call.adapter)
                continue
            pool.service.migration("exhausted" if resumable else "not_resumable")
            end_in_stream(call, exc)
            return None
        except GatewayError as exc:
            if not call.responder.started:
                raise
            if request.resume is not None:
                pool.service.migration("failed")
            end_in_stream(call, exc)
            return None


class UnifiedFlow:
    def __init__(self, pool: PoolDispatcher) -> None:
        self._pool = pool
        self.pools = {pool.pool: pool}

    @property
    def needs_tokens(self) -> bool:
        return self._pool.service.policy.uses_prefixes

    def keys(self, request_id: str, tokens: list[int] | None, salt: str | None,
             adapter: AdapterRef | None = None) -> dict[str, RouteKey]:
        return _keys(self.pools, request_id, tokens, salt, adapter)

    async def serve(self, call: Call, keys: dict[str, RouteKey]) -> Usage | None:
        return await _leg(self._pool, call, keys[self._pool.pool], call.body)


class DisaggregatedFlow:
    """A prefill pool and a decode pool (the first of each in the topology)."""

    def __init__(self, prefill: PoolDispatcher, decode: PoolDispatcher, spec: DisaggregationSpec,
                 metrics: TransferMetrics) -> None:
        self._prefill, self._decode, self._spec, self.metrics = prefill, decode, spec, metrics
        self.pools = {prefill.pool: prefill, decode.pool: decode}
        # what decode holds: its engines' KV events, where its router follows them (they report
        # evictions); else the prompts sent to it lately
        self._on_decode = None if decode.service.follows_events \
            else RecentPrefixes(ttl_s=spec.decode_cache_ttl_s)

    @property
    def needs_tokens(self) -> bool:
        return True

    def keys(self, request_id: str, tokens: list[int] | None, salt: str | None,
             adapter: AdapterRef | None = None) -> dict[str, RouteKey]:
        return _keys(self.pools, request_id, tokens, salt, adapter)

    async def serve(self, call: Call, keys: dict[str, RouteKey]) -> Usage | None:
        params: dict[str, Any] | None = None
        decode_key = keys[self._decode.pool]
        if self._worth_disaggregating(call, decode_key):
            prefilled = await self._prefill_leg(call, keys[self._prefill.pool])
            if isinstance(prefilled, Usage):  # the request itself is invalid: answered as is
                return prefilled
            params = prefilled
        self.metrics.path("disaggregated" if params else "decode_only")
        if call.tokens and self._on_decode is not None:
            self._on_decode.record(call.tokens, cache_key(call))  # decode holds them
        return await _leg(self._decode, call, decode_key, decode_body(call.body, params))

    def _worth_disaggregating(self, call: Call, decode_key: RouteKey) -> bool:
        """Only when decode would otherwise compute at least `min_prompt_tokens` itself
        (`skip_prefill`), for one choice of a prompt whose tokens are known."""
        body, tokens = call.body, call.tokens
        if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
            self.metrics.skipped("multiple_choices")
            return False
        if tokens is None:
            self.metrics.skipped("unknown_prompt")
            return False

        def cached_on_decode() -> int:
            if self._on_decode is not None:
                return self._on_decode.cached_tokens(tokens, cache_key(call))
            return self._decode.service.cached_tokens(decode_key) or 0

        reason = skip_prefill(len(tokens), cached_on_decode, self._spec.min_prompt_tokens)
        if reason is not None:
            self.metrics.skipped(reason)
            return False
        return True

    async def _prefill_leg(self, call: Call, key: RouteKey) -> dict[str, Any] | Usage | None:
        """KV transfer params; or, for a request the engine refused as invalid, the usage of
        that error answer, already sent; or None: decode recomputes."""
        started = time.monotonic()
        pool = self._prefill
        deadline = min(call.deadline, started + self._spec.prefill_timeout_s)
        request = Request(call.endpoint, _encode(prefill_body(call.body)), adapter=call.adapter)
        try:
            stream, head = await pool.open(request, key, deadline)
            call.reached_engine = True
            try:
                if head.status == 200:  # its one token marks the prefill's end
                    pool.service.first_token(key.request_id)
                await _whole(stream, deadline)
            finally:
                pool.finished(key)
        except GatewayError as exc:
            self.metrics.fallback("prefill_timeout" if exc.status == 504 else "prefill_failed")
            return None
        self.metrics.prefill_latency(time.monotonic() - started)
        if 400 <= head.status < 500:
            call.responder.send(head.status, stream.body(), call.headers(head.replica_id))
            return Usage()
        if head.status != 200:
            self.metrics.fallback("prefill_error")
            return None
        params = msgspec.json.decode(stream.body()).get("kv_transfer_params")
        if not is_transferable(params):
            self.metrics.fallback("no_kv_params")
            return None
        return params


async def _whole(stream: ReplyStream, deadline: float) -> None:
    """Wait for the end of a whole reply (its head came), within the deadline."""
    try:
        await asyncio.wait_for(stream.end, max(0.0, deadline - time.monotonic()))
    except TimeoutError as exc:
        stream.cancel()
        raise GatewayError(504, "prefill leg timed out") from exc
    except (LinkLost, ReplyFailed) as exc:
        raise GatewayError(503, f"prefill leg failed: {exc}") from exc
