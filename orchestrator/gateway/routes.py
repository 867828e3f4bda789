"""The OpenAI-compatible HTTP ingress: checks the envelope of a request, forwards it to a pool
replica through Ray Serve, and relays the reply (JSON or server-sent events) with deadlines.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import ray
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtransfer.metrics import TransferMetrics
from orchestrator.admission import Admission, Ticket
from orchestrator.api_errors import GatewayError, error_response
from orchestrator import pool_metrics
from orchestrator.config import Topology
from orchestrator.gateway_metrics import UNKNOWN_TENANT, GatewayMetrics
from orchestrator.pd_flow import PDFlow
from orchestrator.routing import PoolRouters
from orchestrator.tenancy import Tenants
from orchestrator.usage import StreamMeter, Usage, request_usage, usage_of
from pools.engine import Endpoint, ReplyHead, openai_error
from pools.registry import get_registry
from pools.tokenizer import PromptTokenCounter

# Under Serve's logger, so lines land in the replica's log with Serve's request id beside ours.
logger = logging.getLogger("ray.serve").getChild("tokenfab.access")


class _EndOfReply(GatewayError):
    """The replica's reply stream ended."""

    def __init__(self) -> None:
        super().__init__(503, "pool replica closed the reply early")


def _sse_error(message: str) -> bytes:
    return b"data: " + msgspec.json.encode(openai_error(503, message)) + b"\n\n"


async def _close(replies: Any) -> None:
    """Stop a reply stream: a Serve response is cancelled, the P/D flow's generator closed."""
    if isinstance(replies, DeploymentResponseGenerator):
        replies.cancel()
    else:
        await replies.aclose()


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


app = FastAPI(title="tokenfab", docs_url=None, redoc_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


@serve.ingress(app)
class Gateway:
    """One per ingress replica; stateless apart from the round-robin cursor over pools."""

    def __init__(self, topology: dict[str, Any], pools: dict[str, DeploymentHandle]) -> None:
        self._topology = Topology.model_validate(topology)
        self._created = int(time.time())
        self._registry = CollectorRegistry()
        self._routers = PoolRouters(self._topology, serve.get_replica_context().app_name,
                                    self._registry)
        tenants = Tenants.from_topology(self._topology)
        self._metrics = GatewayMetrics(self._registry, tenants.names)
        self._admission = Admission(self._topology, self._metrics, tenants)
        self._pd: PDFlow | None = None
        roles = {pool.name: pool.role for pool in self._topology.pools}
        unified = [(name, handle) for name, handle in pools.items() if roles[name] == "unified"]
        self._unified = itertools.cycle(unified) if unified else None
        if not unified:
            self._pd = PDFlow(
                prefill=[(n, h) for n, h in pools.items() if roles[n] == "prefill"],
                decode=[h for name, h in pools.items() if roles[name] == "decode"],
                spec=self._topology.disaggregation,
                counter=PromptTokenCounter(self._topology.model.resolved_path),
                metrics=TransferMetrics(self._registry),
                routers=self._routers,
            )

    async def _replies(self, endpoint: Endpoint, body: dict[str, Any],
                       tokens: list[int] | None = None) -> Any:
        """The reply stream of one request: from a unified pool's replica the router picks, or
        the P/D flow's."""
        if self._pd is not None:
            return self._pd.reply(endpoint, body)
        pool, handle = next(self._unified)
        key = await self._routers.key(pool, endpoint, body, tokens)
        replies = handle.options(stream=True).reply.remote(endpoint, body, route=key)
        return self._routers.tracked(pool, key, replies) if key is not None else replies

    async def _whole(self, endpoint: Endpoint, body: dict[str, Any],
                     tokens: list[int] | None) -> tuple[ReplyHead, bytes]:
        """A non-streamed request to a unified pool, in one call, within the deadline."""
        pool, handle = next(self._unified)
        key = await self._routers.key(pool, endpoint, body, tokens)
        response = handle.reply_whole.remote(endpoint, body, route=key)
        timeout = self._topology.gateway.request_timeout_s
        try:
            return await asyncio.wait_for(response, timeout)
        except TimeoutError as exc:
            response.cancel()
            raise GatewayError(504, f"no reply from the engine within {timeout:g} s") from exc
        except (ray.exceptions.RayError, RayServeException) as exc:
            logger.warning("pool replica failed: %s", exc)
            raise GatewayError(503, "engine replica unavailable; retry") from exc
        finally:
            self._routers.finished(pool, key)

    def __del__(self) -> None:
        self._routers.close()

    @app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self) -> Response:
        """200 when every pool has a ready replica; 503 naming the pools that have none."""
        try:
            reports = await asyncio.wait_for(
                get_registry(self._topology.name).snapshot.remote(), timeout=2.0)
        except Exception:  # noqa: BLE001 - any failure of the registry means not ready
            return error_response(503, "replica registry unavailable")
        ready = Counter(report.pool for report in reports if report.state == "ready")
        missing = [pool.name for pool in self._topology.pools if not ready[pool.name]]
        if missing:
            return error_response(503, f"no ready replica in pool(s): {', '.join(missing)}")
        return JSONResponse({"status": "ready", "ready_replicas": dict(ready)})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        """This ingress replica's series, then every pool replica's (see pool_metrics)."""
        body = generate_latest(self._registry)
        try:
            reports = await asyncio.wait_for(
                get_registry(self._topology.name).snapshot.remote(), timeout=2.0)
        except Exception:  # a scrape without pool series beats a failed scrape
            logger.warning("replica registry unavailable; /metrics without pool series")
        else:
            body += pool_metrics.render(reports)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/tokenfab/pd")
    async def pd_counters(self) -> dict[str, int]:
        """Counters of the prefill/decode flow (empty for unified topologies)."""
        return dict(self._pd.metrics.tally) if self._pd else {}

    @app.get("/tokenfab/replicas")
    async def replicas(self) -> list[dict[str, Any]]:
        """Every pool replica's self-report (state, cores, load), for `tokenfab status`."""
        reports = await get_registry(self._topology.name).snapshot.remote()
        return [msgspec.to_builtins(report) for report in reports]

    @app.get("/tokenfab/autoscaler")
    async def autoscaler(self) -> list[dict[str, Any]]:
        """The autoscaler's latest decision per autoscaled pool."""
        records = await get_registry(self._topology.name).scaling.remote()
        return [msgspec.to_builtins(record) for record in records]

    @app.get("/tokenfab/router")
    async def router_status(self) -> dict[str, Any]:
        """This ingress replica, and per routed pool: policy, block map size, and per replica
        the blocks the map holds and the state of its event stream."""
        return {"ingress": {"pid": os.getpid(),
                            "replica": serve.get_replica_context().replica_id.unique_id},
                "pools": self._routers.status()}

    @app.post("/tokenfab/route/{endpoint}")
    async def explain_route(self, endpoint: str, request: Request) -> Response:
        """How each routed pool would place this completions or chat request now (nothing is
        sent to an engine): the request's block hashes and every replica's score."""
        if endpoint not in ("completions", "chat"):
            return error_response(404, f"unknown endpoint {endpoint!r}: completions or chat")
        try:
            body = await self._read_body(request)
        except GatewayError as exc:
            return exc.response()
        explained = {}
        for pool, service in self._routers.services.items():
            explained[pool] = service.explain(await self._routers.key(pool, endpoint, body))
        return JSONResponse(explained)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        model = self._topology.model
        card = {"id": model.name, "object": "model", "created": self._created,
                "owned_by": "tokenfab", "root": model.path, "max_model_len": model.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._forward("completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._forward("chat", request)

    async def _forward(self, endpoint: Endpoint, request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        started = time.monotonic()
        tenant, ticket = UNKNOWN_TENANT, None
        try:
            spec = self._admission.authenticate(request.headers.get("authorization"))
            tenant = spec.name
            body = await self._read_body(request)
            ticket, body = await self._admission.admit(spec, endpoint, body)
            response = await self._dispatch(endpoint, body, ticket, started, request_id)
        except GatewayError as exc:
            response = exc.response()
        except BaseException:  # the client went away: nothing to answer, settle the request
            if ticket is not None:
                self._admission.finish(ticket, None)
            raise
        response.headers["x-request-id"] = request_id
        self._metrics.requests.labels(tenant, endpoint, str(response.status_code)).inc()
        if not isinstance(response, StreamingResponse):
            if ticket is not None:
                self._admission.finish(ticket, None)  # a no-op when the reply settled it
            self._log(request_id, tenant, endpoint, response.status_code, started, ticket)
        return response

    def _log(self, request_id: str, tenant: str, endpoint: str, status: int, started: float,
             ticket: Ticket | None, usage: Usage | None = None) -> None:
        elapsed = time.monotonic() - started
        self._metrics.latency.labels(tenant, endpoint).observe(elapsed)
        logger.info("request_id=%s tenant=%s endpoint=%s status=%d latency_ms=%.1f queue_ms=%.1f "
                    "prompt_tokens=%s completion_tokens=%s cached_tokens=%s", request_id, tenant,
                    endpoint, status, 1000 * elapsed, 1000 * (ticket.queued_s if ticket else 0),
                    usage.prompt_tokens if usage else "-",
                    usage.completion_tokens if usage else "-", usage.cached_tokens if usage else "-")

    async def _read_body(self, request: Request) -> dict[str, Any]:
        limit = self._topology.gateway.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise GatewayError(413, f"request body is larger than {limit} bytes")
        raw = await request.body()
        if len(raw) > limit:
            raise GatewayError(413, f"request body is larger than {limit} bytes")
        try:
            body = msgspec.json.decode(raw)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise GatewayError(400, f"request body is not valid JSON (UTF-8): {exc}") from exc
        if not isinstance(body, dict):
            raise GatewayError(400, "request body must be a JSON object")
        model = body.get("model")
        if model is None:
            raise GatewayError(400, "model: field required", "model")
        if model != self._topology.model.name:
            raise GatewayError(404, f"The model `{model}` does not exist.", "model")
        return body

    async def _dispatch(self, endpoint: Endpoint, body: dict[str, Any], ticket: Ticket,
                        started: float, request_id: str) -> Response:
        if not body.get("stream") and self._unified is not None:
            head, payload = await self._whole(endpoint, body, ticket.prompt_tokens)
            usage = usage_of(payload) if head.status == 200 else Usage()  # errors serve nothing
            self._admission.finish(ticket, usage)
            return Response(payload, head.status, {"x-tokenfab-replica": head.replica_id},
                            media_type="application/json")
        body, client_wants_usage = request_usage(body)
        replies = await self._replies(endpoint, body, ticket.prompt_tokens)
        head = await self._next(replies)
        if not isinstance(head, ReplyHead):
            await _close(replies)
            raise GatewayError(503, "pool replica sent no reply head")
        headers = {"x-tokenfab-replica": head.replica_id}
        if not head.streaming:
            payload = await self._next(replies)
            await _close(replies)  # done: let the router count the request as finished
            usage = usage_of(payload) if head.status == 200 else Usage()  # errors serve nothing
            self._admission.finish(ticket, usage)
            return Response(payload, head.status, headers, media_type="application/json")
        meter = StreamMeter(started, client_wants_usage)
        relay = self._relay(replies, meter, endpoint, ticket, request_id)
        # Started here, so that its cleanup (abort, settle the ticket) runs even if the client
        # leaves before the response starts: asyncio finalizes a started generator.
        first = await anext(relay, b"")
        return StreamingResponse(_prepend(first, relay), headers=headers,
                                 media_type="text/event-stream")

    async def _next(self, replies: Any) -> Any:
        """The next item of a reply stream within the request deadline, or a clear 503/504."""
        timeout = self._topology.gateway.request_timeout_s
        try:
            return await asyncio.wait_for(replies.__anext__(), timeout)
        except asyncio.TimeoutError as exc:
            await _close(replies)
            raise GatewayError(504, f"no reply from the engine within {timeout:g} s") from exc
        except StopAsyncIteration as exc:
            raise _EndOfReply() from exc
        except (ray.exceptions.RayError, RayServeException) as exc:
            logger.warning("pool replica failed: %s", exc)
            raise GatewayError(503, "engine replica unavailable; retry") from exc

    async def _relay(self, replies: Any, meter: StreamMeter, endpoint: Endpoint, ticket: Ticket,
                     request_id: str) -> AsyncIterator[bytes]:
        started = meter.started
        try:
            while True:
                try:
                    item = await self._next(replies)
                except _EndOfReply:
                    return
                except GatewayError as exc:  # headers are sent: report the failure in-stream
                    yield _sse_error(exc.message)
                    return
                item = meter.feed(item, time.monotonic())
                if item:
                    yield item
        finally:
            await _close(replies)  # client gone or stream done: abort engine requests still running
            self._admission.finish(ticket, meter.usage)
            name = ticket.tenant.name
            if meter.first_token_s is not None:
                self._metrics.ttft.labels(name).observe(meter.first_token_s)
            for gap in meter.gaps:
                self._metrics.itl.labels(name).observe(gap)
            self._log(request_id, name, endpoint, 200, started, ticket, meter.usage)
