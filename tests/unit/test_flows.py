"""Dispatch and the two flows against scripted replicas on the real data channel (no engines):
placement, holding, refusals and deadlines, the relay to the client, and every branch of the
prefill/decode flow with an exact expected outcome. Real legs, NIXL transfers and engine-side
recompute are exercised in tests/integration/test_pd.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from channel.frames import Usage
from orchestrator.gateway.dispatch import PoolDispatcher, ReplicaDirectory
from orchestrator.gateway.errors import GatewayError
from orchestrator.gateway.flows import DisaggregatedFlow, UnifiedFlow
from orchestrator.gateway.http import Responder
from orchestrator.gateway.relay import Call
from kvtransfer.metrics import TransferMetrics
from kvtransfer.nixl import SideChannel, connector_config, reserve_side_channel
from kvtransfer.params import REMOTE_DECODE, decode_body, is_transferable, prefill_body
from orchestrator.config import DisaggregationSpec
from router.policies import build_policy
from router.service import RoutingService
from tests.unit.replicas import SECRET, ScriptedReplica, Step, streamed, whole

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p1", "remote_block_ids": [1, 2],
          "remote_host": "127.0.0.1", "remote_port": 5600}
BODY = {"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": True,
        "stream_options": {"include_usage": True}}
DECODED = streamed(b"data: 1\n\n", b"data: 2\n\n", usage=Usage(500, 2, 0))


class Client:
    """The client's end of the connection, as the responder sees it."""

    def __init__(self) -> None:
        self.data, self.closed = bytearray(), False

    def write(self, data: bytes) -> None:
        self.data += data

    def response(self) -> tuple[int, dict[str, str], bytes]:
        head, _, body = bytes(self.data).partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        if headers.get("transfer-encoding") == "chunked":
            decoded, rest = b"", body
            while rest:
                size, _, rest = rest.partition(b"\r\n")
                decoded, rest = decoded + rest[:int(size, 16)], rest[int(size, 16) + 2:]
            body = decoded
        return int(lines[0].split()[1]), headers, body


def pool(name: str, *replicas: ScriptedReplica, policy: str = "round_robin",
         max_ongoing: int = 64, wake=None, retries: int = 0, service: RoutingService | None = None,
         shed_waiting: int | None = None) -> PoolDispatcher:
    service = service or RoutingService(name, build_policy(policy), lambda size: None)

    async def no_wake() -> None:
        pass

    dispatcher = PoolDispatcher(name, service, max_ongoing, SECRET, "gw", wake or no_wake,
                                ReplicaDirectory("t"), retries, shed_waiting)
    dispatcher.update([r.report(name) for r in replicas])
    return dispatcher


async def connected(*pools: PoolDispatcher) -> None:
    deadline = time.monotonic() + 5
    while not all(p.ready_replicas() == len(p._links) for p in pools):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def call(body: dict[str, Any], tokens: int | None = 500, timeout_s: float = 5.0) -> Call:
    ids = None if tokens is None else [hash(body.get("prompt")) % 1000 + i for i in range(tokens)]
    return Call("req-1", "completions", body, ids, Responder(Client(), True, True),
                time.monotonic(), timeout_s)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def serve(flow, request: Call) -> Usage | None:
    return await flow.serve(request, flow.keys("req-1", request.tokens, None))


def pd(prefill_scripts: list[list[Step]], decode_scripts: list[list[Step]] = (DECODED,),
       prefill_timeout_s: float = 0.3):
    async def make():
        prefill = await ScriptedReplica("p1", *prefill_scripts).start() \
            if prefill_scripts else None
        decode = await ScriptedReplica("d1", *decode_scripts).start()
        pools = (pool("prefill", *([prefill] if prefill else [])), pool("decode", decode))
        await connected(*pools)
        spec = DisaggregationSpec(min_prompt_tokens=100, prefill_timeout_s=prefill_timeout_s)
        flow = DisaggregatedFlow(*pools, spec, TransferMetrics(CollectorRegistry()))
        return flow, prefill, decode
    return make()


def test_unified_request_is_placed_relayed_and_its_usage_returned() -> None:
    async def scenario() -> None:
        replica = await ScriptedReplica("r1", DECODED).start()
        main = pool("main", replica)
        await connected(main)
        request = call(BODY)
        usage = await serve(UnifiedFlow(main), request)
        status, headers, body = request.responder._connection.response()
        assert (status, headers["x-tokenfab-replica"], headers["x-request-id"]) == (200, "r1",
                                                                                    "req-1")
        assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        assert usage == Usage(500, 2, 0)
        assert request.first_token_s is not None and len(request.gaps) == 1
        assert replica.requests == [("completions", BODY)]
        assert main.service.in_flight("r1") == 0  # finished: counted off again
        assert request.reached_engine and request.stream_error is None
    run(scenario())


@pytest.mark.parametrize(("script", "status"), [([Step("fail")], 503), ([Step("hang")], 504)],
                         ids=["failed", "timed-out"])
def test_a_leg_that_fails_before_its_head_leaves_no_load_behind(script: list[Step],
                                                                status: int) -> None:
    """Found by the gateway's fuzz test: each FAILED reply (an engine error on a bad body) kept
    its count on the replica, so after `max_ongoing` of them no request could be placed there."""
    async def scenario() -> None:
        replica = await ScriptedReplica("r1", *[script] * 3, DECODED).start()
        main = pool("main", replica, max_ongoing=2)
        await connected(main)
        for _ in range(3):  # more failures than the replica's slots
            with pytest.raises(GatewayError) as info:
                await serve(UnifiedFlow(main), call(BODY, timeout_s=0.2))
            assert info.value.status == status
            assert main.service.in_flight("r1") == 0
        assert await serve(UnifiedFlow(main), call(BODY)) == Usage(500, 2, 0)  # still placed
    run(scenario())


FAILS_BEFORE_HEAD = [Step("fail")]
FAILS_BEFORE_BYTES = [Step("head", 200, streaming=True), Step("fail")]  # head, then nothing
FAILS_AFTER_BYTES = [Step("head", 200, streaming=True), Step("token", payload=b"data: 1\n\n"),
                     Step("fail")]


@pytest.mark.parametrize("script", [FAILS_BEFORE_HEAD, FAILS_BEFORE_BYTES],
                         ids=["before-head", "before-bytes"])
def test_a_replica_that_fails_before_any_byte_is_left_out_and_the_request_retried(
        script: list[Step]) -> None:
    """Engine dead on r1: every request that round robin sends there fails before the client
    got a byte, goes to r2 and is answered whole; r1 is tried at most once per request."""
    async def scenario() -> None:
        broken = await ScriptedReplica("r1", script).start()
        healthy = await ScriptedReplica("r2", DECODED).start()
        main = pool("main", broken, healthy, retries=2)
        await connected(main)
        for _ in range(4):
            request = call(BODY)
            assert await serve(UnifiedFlow(main), request) == Usage(500, 2, 0)
            status, headers, body = request.responder._connection.response()
            assert (status, headers["x-tokenfab-replica"]) == (200, "r2")
            assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            assert request.stream_error is None
        assert 1 <= len(broken.requests) <= 4 and len(healthy.requests) == 4
        assert main.service.in_flight("r1") == main.service.in_flight("r2") == 0
    run(scenario())


@pytest.mark.parametrize(("retries", "replicas"), [(0, 2), (2, 1), (2, 2)],
                         ids=["no-retries", "no-other-replica", "every-replica-failed"])
def test_no_retry_left_answers_503_at_once(retries: int, replicas: int) -> None:
    async def scenario() -> None:
        broken = [await ScriptedReplica(f"r{i}", FAILS_BEFORE_HEAD).start()
                  for i in range(replicas)]
        main = pool("main", *broken, retries=retries)
        await connected(main)
        started = time.monotonic()
        with pytest.raises(GatewayError) as info:
            await serve(UnifiedFlow(main), call(BODY, timeout_s=5))
        assert info.value.status == 503 and time.monotonic() - started < 1  # no waiting
        tried = sum(len(r.requests) for r in broken)
        assert tried == min(retries + 1, replicas)
    run(scenario())


def test_a_replica_that_fails_after_bytes_were_sent_ends_the_stream_in_band() -> None:
    """Bytes reached the client: no retry (that is migration), an in-stream error instead."""
    async def scenario() -> None:
        broken = await ScriptedReplica("r1", FAILS_AFTER_BYTES).start()
        healthy = await ScriptedReplica("r2", DECODED).start()
        main = pool("main", broken, healthy, retries=2)
        await connected(main)
        request = call(BODY)
        assert await serve(UnifiedFlow(main), request) is None
        status, headers, body = request.responder._connection.response()
        assert (status, headers["x-tokenfab-replica"], request.stream_error) == (200, "r1", 503)
        assert body.startswith(b"data: 1\n\ndata: {\"error\"") and healthy.requests == []
    run(scenario())


def test_long_prompt_is_prefilled_then_decoded_with_the_params() -> None:
    async def scenario() -> None:
        flow, prefill, decode = await pd([whole(200, {"kv_transfer_params": PARAMS})])
        request = call(BODY)
        assert await serve(flow, request) == Usage(500, 2, 0)
        assert request.responder._connection.response()[2].count(b"data: ") == 3
        assert prefill.requests == [("completions", {"model": "tiny", "prompt": "x",
                                                      "max_tokens": 1,
                                                      "kv_transfer_params": REMOTE_DECODE})]
        assert decode.requests == [("completions", BODY | {"kv_transfer_params": PARAMS})]
        assert dict(flow.metrics.tally) == {"requests_disaggregated": 1}
    run(scenario())


@pytest.mark.parametrize(("tokens", "body", "reason"), [
    (99, BODY, "skipped_short_prompt"),
    (None, BODY, "skipped_unknown_prompt"),
    (500, BODY | {"n": 2}, "skipped_multiple_choices"),
], ids=["short", "unreadable", "n>1"])
def test_requests_that_skip_the_prefill_pool(tokens: int | None, body: dict, reason: str) -> None:
    async def scenario() -> None:
        flow, prefill, decode = await pd([whole(200, {})])
        await serve(flow, call(body, tokens))
        assert prefill.requests == [] and decode.requests == [("completions", body)]
        assert dict(flow.metrics.tally) == {reason: 1, "requests_decode_only": 1}
    run(scenario())


@pytest.mark.parametrize(("script", "reason"), [
    ([Step("fail")], "fallback_prefill_failed"),
    ([Step("hang")], "fallback_prefill_timeout"),
    (whole(503, {"error": {}}), "fallback_prefill_error"),
    (whole(200, {"kv_transfer_params": None}), "fallback_no_kv_params"),
    (whole(200, {"kv_transfer_params": PARAMS | {"remote_block_ids": []}}),
     "fallback_no_kv_params"),
], ids=["replica-failed", "deadline", "server-error", "no-params", "no-blocks"])
def test_failed_prefill_falls_back_to_decode_recompute(script: list[Step], reason: str) -> None:
    async def scenario() -> None:
        flow, prefill, decode = await pd([script])
        assert await serve(flow, call(BODY)) == Usage(500, 2, 0)
        assert decode.requests == [("completions", BODY)]  # no kv_transfer_params: recompute
        assert dict(flow.metrics.tally) == {reason: 1, "fallbacks": 1, "requests_decode_only": 1}
        await asyncio.sleep(0.05)
        assert prefill.in_flight == 0  # a prefill leg that hung was cancelled on the replica
    run(scenario())


def test_prefill_pool_without_replicas_falls_back_at_its_deadline() -> None:
    async def scenario() -> None:
        flow, _, decode = await pd([], prefill_timeout_s=0.2)
        started = time.monotonic()
        await serve(flow, call(BODY))
        assert 0.2 <= time.monotonic() - started < 2
        assert dict(flow.metrics.tally)["fallback_prefill_failed"] == 1
        assert len(decode.requests) == 1
    run(scenario())


def test_prompt_recently_sent_to_decode_skips_the_prefill_pool() -> None:
    async def scenario() -> None:
        flow, prefill, _ = await pd([whole(200, {"kv_transfer_params": PARAMS})])
        for prompt in ("x", "x", "y"):
            await serve(flow, call(BODY | {"prompt": prompt}))
        assert [body["prompt"] for _, body in prefill.requests] == ["x", "y"]
        assert dict(flow.metrics.tally) == {
            "requests_disaggregated": 2, "skipped_cached_on_decode": 1, "requests_decode_only": 1}
    run(scenario())


def test_invalid_request_is_answered_by_prefill_error_not_sent_twice() -> None:
    async def scenario() -> None:
        flow, _, decode = await pd([whole(400, {"error": {"message": "bad"}})])
        request = call(BODY)
        assert await serve(flow, request) == Usage()
        status, _, body = request.responder._connection.response()
        assert (status, json.loads(body)) == (400, {"error": {"message": "bad"}})
        assert decode.requests == []
    run(scenario())


def test_client_leaving_cancels_the_decode_request() -> None:
    async def scenario() -> None:
        flow, _, decode = await pd([whole(200, {"kv_transfer_params": PARAMS})],
                                   [[Step("head", 200, True), Step("token", payload=b"a"),
                                     Step("hang")]])
        task = asyncio.create_task(serve(flow, call(BODY)))
        while not decode.requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()  # what the HTTP server does when the client's connection closes
        with pytest.raises(asyncio.CancelledError):
            await task
        while decode.outcomes != ["cancelled"]:
            await asyncio.sleep(0.01)
        assert decode.in_flight == 0
    run(scenario())


def test_full_replicas_hold_the_request_until_one_frees_and_replicas_hear_it() -> None:
    async def scenario() -> None:
        replica = await ScriptedReplica("r1", [Step("head", 200, True), Step("hang")],
                                        streamed(b"data: 1\n\n"), capacity=1).start()
        main = pool("main", replica)
        await connected(main)
        flow = UnifiedFlow(main)
        first = asyncio.create_task(serve(flow, call(BODY)))
        while not replica.in_flight:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(serve(flow, call(BODY | {"prompt": "y"})))
        while replica.server.held() != 1:  # the held request is told to the replica
            await asyncio.sleep(0.01)
        assert main.held == 1 and not second.done()
        first.cancel()
        assert await second == Usage()
        assert main.held == 0
    run(scenario())


def test_refused_by_one_replica_placed_on_another_and_draining_ones_skipped() -> None:
    async def scenario() -> None:
        full = await ScriptedReplica("a", DECODED, capacity=0).start()
        draining = await ScriptedReplica("b", DECODED).start()
        ok = await ScriptedReplica("c", DECODED).start()
        main = pool("main", full, draining, ok)
        await connected(main)
        draining.server.set_state("draining")
        while main._links["b"].state != "draining":
            await asyncio.sleep(0.01)
        flow = UnifiedFlow(main)
        for _ in range(4):
            request = call(BODY)
            await serve(flow, request)
            assert request.replica == "c"
        assert draining.requests == [] and full.requests == []
    run(scenario())


def test_no_replica_wakes_the_pool_then_the_deadline_answers_503() -> None:
    async def scenario() -> None:
        woken = []

        async def wake() -> None:
            woken.append(time.monotonic())

        main = pool("main", wake=wake)
        started, request = time.monotonic(), call(BODY, timeout_s=0.6)
        with pytest.raises(GatewayError) as refused:
            await serve(UnifiedFlow(main), request)
        assert refused.value.status == 503 and "main" in refused.value.message
        assert refused.value.code == "no_replica" and not request.reached_engine  # refunded
        assert 0.6 <= time.monotonic() - started < 2 and woken
    run(scenario())


def test_a_replica_that_appears_serves_the_held_request() -> None:
    async def scenario() -> None:
        main = pool("main")
        task = asyncio.create_task(serve(UnifiedFlow(main), call(BODY)))
        await asyncio.sleep(0.2)
        replica = await ScriptedReplica("late", DECODED).start()
        main.update([replica.report("main")])
        assert await task == Usage(500, 2, 0)
    run(scenario())


def test_stream_that_stops_producing_ends_with_an_in_stream_timeout() -> None:
    async def scenario() -> None:
        replica = await ScriptedReplica("r1", [Step("head", 200, True),
                                               Step("token", payload=b"data: 1\n\n"),
                                               Step("hang")]).start()
        main = pool("main", replica)
        await connected(main)
        request = call(BODY, timeout_s=0.3)
        assert await serve(UnifiedFlow(main), request) is None
        status, _, body = request.responder._connection.response()
        assert status == 200 and body.startswith(b"data: 1\n\ndata: {")
        assert json.loads(body.split(b"data: ")[2])["error"]["code"] == 504
        assert request.stream_error == 504  # counted as a 504, not as the 200 its head said
        await asyncio.sleep(0.05)
        assert replica.outcomes == ["cancelled"]
    run(scenario())


def test_leg_bodies() -> None:
    chat = {"model": "m", "messages": [], "max_completion_tokens": 9, "n": 1, "stream": True}
    assert prefill_body(chat) == {"model": "m", "messages": [], "max_tokens": 1,
                                  "kv_transfer_params": REMOTE_DECODE}
    assert decode_body(chat, None) == chat
    assert decode_body(chat, PARAMS) == chat | {"kv_transfer_params": PARAMS}
    assert [is_transferable(p) for p in (PARAMS, None, {}, PARAMS | {"remote_engine_id": None})] \
        == [True, False, False, False]


@pytest.mark.parametrize(("role", "gpu", "expected"), [
    ("prefill", False, ("kv_producer", "cpu")),
    ("decode", False, ("kv_consumer", "cpu")),
    ("decode", True, ("kv_consumer", "cuda")),
    ("unified", False, None),
])
def test_connector_config(role: str, gpu: bool, expected: tuple[str, str] | None) -> None:
    config = connector_config(role, "engine-1", gpu)
    if expected is None:
        assert config is None
        return
    assert (config["kv_role"], config["kv_buffer_device"]) == expected
    assert config["engine_id"] == "engine-1"
    assert config["kv_connector"] == "NixlConnector"
    assert config["kv_load_failure_policy"] == "recompute"


def test_side_channel_env() -> None:
    assert SideChannel("127.0.0.2", 5601).env() == {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.2", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}


def test_side_channel_ports_are_outside_the_ephemeral_range() -> None:
    """A port-0 reservation can be taken by an outgoing connection before the engine binds it
    (then vLLM's NIXL listener dies and the engine hangs); outside the range it cannot."""
    low, high = (int(v) for v in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    rng = random.Random(0)
    for _ in range(50):
        port = reserve_side_channel("127.0.0.1", rng).port
        assert not low <= port <= high and port >= 10_000
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when handed out
