"""The OpenAI routes, and the dispatch of every path to its route.

A completions or chat request goes: API key -> body (size, JSON, model) -> the tenant's shape
(cache salt, default output length) -> tokens and route keys (only when limits or the policy
read them; a thread hop for long prompts) -> admission (limits, fair queue) -> a counted
completions prompt replaced by its token ids (engine_body) -> the topology's flow. This module
owns the admission ticket: it is settled once, with the usage the flow returns, however the
request ends.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from itertools import accumulate
from typing import Any

import msgspec

from orchestrator.gateway.adapters import AdapterCatalog
from orchestrator.gateway.admin import Admin
from orchestrator.gateway.dispatch import NO_REPLICA, OVERLOADED
from orchestrator.gateway.admission import Admission
from orchestrator.gateway.errors import GatewayError, send_error
from orchestrator.gateway.flows import Flow, client_salt
from orchestrator.gateway.responder import HttpRequest, Responder
from orchestrator.gateway.metrics import UNKNOWN_MODEL, UNKNOWN_TENANT, GatewayMetrics
from orchestrator.gateway.relay import Call
from orchestrator.config import Topology
from pools.tokenizer import PromptTokenCounter
from channel.frames import AdapterRef
from router.wire import RouteKey
from tokenfab.errors import PromptError

# Under Serve's logger, so lines land in the replica's log with Serve's own.
logger = logging.getLogger("ray.serve").getChild("tokenfab.access")
# An access line goes where Serve's own access lines go: the replica's log file only (not also
# stderr, which Ray's log monitor tails and publishes line by line), and not at all under
# Serve's `enable_access_log: false`.
ACCESS_LINE = {"log_to_stderr": False, "serve_access_log": True}

OPENAI = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


# Bodies up to this size are tokenised and hashed on the event loop. Measured here (the tiny
# model's fast tokenizer): an 11-character prompt costs 21 us and a 600-character one 160 us,
# while the hop through asyncio.to_thread costs 170 us idle and 0.4-0.6 ms at p50 in a loaded
# gateway. Longer prompts go to the thread, where the tokenizer releases the GIL.
INLINE_TOKENIZE_BYTES = 512  # at most ~150 us of the loop
MAX_JSON_DEPTH = 64  # an OpenAI body nests under 10 levels; tool schemas a few more
# A string, or an unterminated one to the end: every '"' starts a match, so the scan is linear
_JSON_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = [1 if b in b"[{" else -1 if b in b"]}" else 0 for b in range(256)]


def too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a JSON text nests more than `limit` levels, read from its bytes before any parser
    recurses into it. Bodies with few brackets (most: one prompt string) cost two byte counts;
    others a scan with the strings taken out.

    Example (limit 2): b'{"a": [[1]]}' -> True; b'{"a": [1, "[[[["]}' -> False.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _JSON_STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0) > limit


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's


def check_roles(body: dict[str, Any]) -> None:
    """A chat request's messages have OpenAI's roles, or the request gets a 400 naming the
    message (vLLM's own server takes any role; OpenAI's API does not). Messages that are not
    objects, or a `messages` that is not a list, are left to the engine's validation.

    Example: {"messages": [{"role": "user"}, {"role": "wizard"}]} -> 400, messages[1].role.
    """
    messages = body.get("messages")
    for index, message in enumerate(messages if isinstance(messages, list) else ()):
        if isinstance(message, dict) and message.get("role") not in CHAT_ROLES:
            role = message.get("role")
            problem = "field required" if role is None else \
                f"{repr(role)[:40]} is not one of {', '.join(CHAT_ROLES)}"
            raise GatewayError(400, f"messages[{index}].role: {problem}",
                               f"messages[{index}].role")


def _single(prompts: list[list[int]] | None) -> list[int] | None:
    """The token ids of a request with one prompt; None for a batch (no one prefix to follow,
    routed by load) or when they were not counted."""
    return prompts[0] if prompts is not None and len(prompts) == 1 else None


# Engine arguments under which vLLM's tokenizer may not be the one the gateway loads (the model
# path's, with its defaults): prompts then go to the engine as the client sent them.
_ENGINE_TOKENIZER_ARGS = frozenset({"tokenizer", "tokenizer_mode", "tokenizer_revision",
                                    "revision", "skip_tokenizer_init"})


def gateway_tokenizer_is_engines(topology: Topology) -> bool:
    """Whether every pool's engine tokenises prompts as the gateway does: no engine argument
    names another tokenizer or another way of loading it (_ENGINE_TOKENIZER_ARGS)."""
    return not any(_ENGINE_TOKENIZER_ARGS & (topology.engine_args | pool.engine_args).keys()
                   for pool in topology.pools)


def engine_body(endpoint: str, body: dict[str, Any], prompts: list[list[int]] | None
                ) -> dict[str, Any]:
    """The body the engine is sent: a completions prompt the gateway already tokenised goes as
    its token ids, so the replica does not tokenise it again (vLLM does that on a thread pool:
    the same work a second time, and a hop to a thread and back per request). Only for one text
    prompt, and not where an option makes vLLM read the text (`echo`) or tokenise it otherwise
    than the gateway did (`add_special_tokens: false`, `truncate_prompt_tokens`). A prompt that
    tokenises to nothing stays text, so that vLLM answers it with its own error for an empty
    prompt rather than the one for an empty list.

    Example: ("completions", {"prompt": "Hi"}, [[1, 6324]]) -> {"prompt": [1, 6324]};
    with "echo": true, or for a chat, the body as it was.
    """
    if endpoint != "completions" or prompts is None or len(prompts) != 1 or not prompts[0] \
            or not isinstance(body.get("prompt"), str) or body.get("echo") \
            or body.get("add_special_tokens", True) is not True \
            or body.get("truncate_prompt_tokens") is not None:
        return body
    return body | {"prompt": prompts[0]}


# What a tenant's explain answer shows: its request's blocks and its own cache on each replica.
# The load figures (queued prefill tokens, requests in flight, KV usage, the estimates, scores
# and ranking built on them) are every tenant's requests; polled, they would show the sizes of
# others' prompts as they arrive.
TENANT_FIELDS = ("pool", "policy", "prompt_tokens", "block_size", "block_hashes")
TENANT_CANDIDATE_FIELDS = ("replica", "cached_tokens", "approx_cached_tokens")


def tenant_view(answer: dict[str, Any]) -> dict[str, Any]:
    """A pool's explain answer as a tenant sees it (TENANT_FIELDS, TENANT_CANDIDATE_FIELDS)."""
    return {field: answer[field] for field in TENANT_FIELDS} | {"candidates": [
        {field: c[field] for field in TENANT_CANDIDATE_FIELDS} for c in answer["candidates"]]}


def request_id_for(client_id: str | None) -> str:
    """The request's own id, unique whatever the client sent: the router counts each request's
    load under it, so two requests sharing a client's `x-request-id` (one tenant's or two
    tenants') must not count as one. The client's id leads it, so logs find it, and is what
    the answer's `x-request-id` echoes.

    Example: "abc" -> "abc-3f9a1c2e"; None -> a random hex id."""
    suffix = uuid.uuid4().hex
    return f"{client_id}-{suffix[:8]}" if client_id else suffix


class Routes:
    """Answers every request of one ingress replica's HTTP server."""

    def __init__(self, topology: Topology, admission: Admission, flows: dict[str, Flow],
                 metrics: GatewayMetrics, admin: Admin, counters: dict[str, PromptTokenCounter],
                 catalog: AdapterCatalog) -> None:
        """`flows` and `counters`: each model's flow and prompt tokenizer, by model name."""
        self._topology, self._admission, self._flows = topology, admission, flows
        self._catalog = catalog
        self._metrics, self._admin, self._counters = metrics, admin, counters
        self._prefix = topology.gateway.route_prefix.rstrip("/")
        self._timeout_s = topology.gateway.request_timeout_s
        self._needs_tokens = {model: admission.needs_tokens or flow.needs_tokens
                              for model, flow in flows.items()}
        self._send_token_ids = gateway_tokenizer_is_engines(topology)
        self._created = int(time.time())
        self.in_flight = 0  # completions and chats being answered

    async def handle(self, request: HttpRequest, responder: Responder) -> None:
        path = request.path
        if self._prefix:
            if not path.startswith(self._prefix):
                return send_error(responder, 404, f"no route {path}")
            path = path[len(self._prefix):] or "/"
        endpoint = OPENAI.get(path)
        if endpoint is not None:
            if request.method != "POST":
                return send_error(responder, 405, "Method Not Allowed")
            return await self.openai(endpoint, request, responder)
        if path == "/v1/models":
            if request.method != "GET":
                return send_error(responder, 405, "Method Not Allowed")
            try:  # private adapters show to their tenants only: who asks matters
                spec = self._admission.authenticate(request.headers.get("authorization"))
            except GatewayError as exc:
                return exc.send(responder)
            return responder.send(200, msgspec.json.encode(
                {"object": "list", "data": self._catalog.cards(spec, self._created)}))
        await self._admin.handle(path, request, responder, self.explain)

    async def openai(self, endpoint: str, request: HttpRequest, responder: Responder) -> None:
        started = time.monotonic()
        client_id = request.headers.get("x-request-id")
        request_id = request_id_for(client_id)
        tenant, ticket, call, usage, untaken = UNKNOWN_TENANT, None, None, None, False
        self.in_flight += 1
        try:
            spec = self._admission.authenticate(request.headers.get("authorization"))
            tenant = spec.name
            body = self.read_body(request, endpoint)
            model, adapter = self._catalog.resolve(spec, body["model"])
            body = self._admission.shape(spec, endpoint, body)
            prompts, keys = await self._prepare(request_id, endpoint, body, len(request.body),
                                                model, adapter)
            ticket = await self._admission.admit(spec, endpoint, body, prompts)
            if self._send_token_ids:
                body = engine_body(endpoint, body, prompts)
            call = Call(request_id, endpoint, body, _single(prompts), responder, started,
                        self._timeout_s, echo_id=client_id, adapter=adapter)
            usage = await self._flows[model].serve(call, keys)
        except GatewayError as exc:
            # no replica took it, on any leg: it costs the tenant nothing. A 504 or a client
            # that left while an engine had it is charged (a whole reply's head comes last).
            untaken = exc.code in (NO_REPLICA, OVERLOADED) and not (call and call.reached_engine)
            if not responder.started:
                exc.send(responder, {"x-request-id": client_id or request_id})
        finally:
            self.in_flight -= 1
            if ticket is not None:
                self._admission.finish(ticket, usage, refund=untaken)
            if responder.started:  # a stream that broke counts as its error, not its head
                status = (call and call.stream_error) or responder.status
                self._record(request_id, tenant, endpoint, status, started, call, usage,
                             ticket.queued_s if ticket else 0.0)

    def read_body(self, request: HttpRequest, endpoint: str) -> dict[str, Any]:
        limit = self._topology.gateway.max_body_bytes
        if request.too_large:
            raise GatewayError(413, f"request body is larger than {limit} bytes")
        if too_deep(request.body):
            raise GatewayError(400, f"request body is nested more than {MAX_JSON_DEPTH} levels "
                               "deep", code="too_deep")
        try:
            body = msgspec.json.decode(request.body)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise GatewayError(400, f"request body is not valid JSON (UTF-8): {exc}") from exc
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise GatewayError(400, "model: field required", "model")
        if not isinstance(model, str):
            raise GatewayError(400, "model: expected a string", "model")
        if "kv_transfer_params" in body:  # it names engines and blocks: other tenants' KV
            raise GatewayError(400, "kv_transfer_params: set by the gateway between its pools; "
                               "a request may not carry it", "kv_transfer_params")
        if endpoint == "chat":
            check_roles(body)
        return body

    async def _prepare(self, request_id: str, endpoint: str, body: dict[str, Any],
                       size: int, model: str, adapter: AdapterRef | None
                       ) -> tuple[list[list[int]] | None, dict[str, RouteKey]]:
        """Each prompt's token ids (if anything reads them) and the model's flow's route keys.
        A body of `size` bytes up to INLINE_TOKENIZE_BYTES is counted on the loop: the hop to
        a thread and back costs more than its tokens (see INLINE_TOKENIZE_BYTES)."""
        salt = client_salt(body)
        if not self._needs_tokens[model]:
            return None, self._flows[model].keys(request_id, None, salt, adapter)
        if size <= INLINE_TOKENIZE_BYTES:
            return self._tokens_and_keys(request_id, endpoint, body, salt, model, adapter)
        return await asyncio.to_thread(self._tokens_and_keys, request_id, endpoint, body, salt,
                                       model, adapter)

    def _tokens_and_keys(self, request_id: str, endpoint: str, body: dict[str, Any],
                         salt: str | None, model: str, adapter: AdapterRef | None
                         ) -> tuple[list[list[int]] | None, dict[str, RouteKey]]:
        """Where limits read the prompt, counting fails closed: a prompt that cannot be read is
        refused (400, naming the field), and a tokenizer that fails refuses the request (503),
        never admits it uncounted. Where only routing reads it, such a request (an image part,
        say) is routed by load. A batch of prompts is routed by load (no one prefix)."""
        try:
            prompts: list[list[int]] | None = self._counters[model].prompts(endpoint, body)
        except PromptError as exc:
            if self._admission.needs_tokens:
                raise GatewayError(400, exc.message, exc.field, code="invalid_prompt") from None
            prompts = None  # only routing reads it: route by load, the engine judges the body
        except Exception:  # noqa: BLE001 - the tokenizer itself failed
            logger.exception("request_id=%s: counting the prompt's tokens failed", request_id)
            if self._admission.needs_tokens:
                raise GatewayError(503, "the gateway could not count the prompt's tokens; "
                                   "retry", code="tokenizer_unavailable") from None
            prompts = None
        return prompts, self._flows[model].keys(request_id, _single(prompts), salt, adapter)

    async def explain(self, endpoint: str, request: HttpRequest) -> dict[str, Any]:
        """How each pool would place this request now (`/tokenfab/route/...`), as the caller's
        own request would be placed: its key names the tenant whose cache salt the request
        carries (401 without one, where auth is on), so the answer shows only the caller's own
        cache, never another tenant's."""
        spec = self._admission.authenticate(request.headers.get("authorization"))
        body = self.read_body(request, endpoint)
        model, adapter = self._catalog.resolve(spec, body["model"])
        body = self._admission.shape(spec, endpoint, body)
        _, keys = await asyncio.to_thread(self._tokens_and_keys, "explain", endpoint, body,
                                          client_salt(body), model, adapter)
        explained = {pool: dispatcher.service.explain(keys[pool])
                     for pool, dispatcher in self._flows[model].pools.items()}
        if self._topology.auth.enabled:  # the replicas' load is other tenants' traffic
            return {pool: tenant_view(answer) for pool, answer in explained.items()}
        return explained

    def _record(self, request_id: str, tenant: str, endpoint: str, status: int, started: float,
                call: Call | None, usage: Any, queued_s: float) -> None:
        elapsed = time.monotonic() - started
        metrics = self._metrics
        # a model the gateway resolved (an answer before that: unread, so no unbounded label)
        model = call.body["model"] if call is not None else UNKNOWN_MODEL
        metrics.requests.labels(tenant, endpoint, str(status), model).inc()
        metrics.latency.labels(tenant, endpoint).observe(elapsed)
        if call is not None and call.first_token_s is not None:
            metrics.ttft.labels(tenant).observe(call.first_token_s)
            itl = metrics.itl.labels(tenant)
            for gap in call.gaps:
                itl.observe(gap)
        logger.info("request_id=%s tenant=%s model=%s endpoint=%s status=%d latency_ms=%.1f "
                    "queue_ms=%.1f replica=%s prompt_tokens=%s completion_tokens=%s "
                    "cached_tokens=%s",
                    request_id, tenant, model, endpoint, status, 1000 * elapsed, 1000 * queued_s,
                    call.replica if call else "-", usage.prompt_tokens if usage else "-",
                    usage.completion_tokens if usage else "-",
                    usage.cached_tokens if usage else "-",
                    extra=ACCESS_LINE)
