"""Dispatch and the two flows against scripted replicas on the real data channel (no engines):
placement, holding, refusals and deadlines, the relay to the client, and every branch of the
prefill/decode flow with an exact expected outcome. Every test runs twice: the replicas reached
over the channel's sockets, and by calls as a replica in the gateway's own process
(channel.local, `gateway.colocate`). Real legs, NIXL transfers and engine-side recompute are
exercised in tests/integration/test_pd.py.
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

import msgspec

from channel.frames import Usage
from orchestrator.gateway.dispatch import PoolDispatcher, ReplicaDirectory
from orchestrator.gateway.errors import GatewayError
from orchestrator.gateway.flows import DisaggregatedFlow, UnifiedFlow
from orchestrator.gateway.responder import Responder
from orchestrator.gateway.relay import Call
from kvtransfer.metrics import TransferMetrics
from kvtransfer.nixl import SideChannel, connector_config, reserve_side_channel
from kvtransfer.params import REMOTE_DECODE, decode_body, is_transferable, prefill_body
from orchestrator.config import DisaggregationSpec
from pools.engine import LoadSnapshot
from pools.registry import RankReport, ReplicaReport
from router.events import BlockRemoved, BlockStored, KVEventBatch
from router.hashing import PrefixBlockHasher
from router.metrics import RouterMetrics
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
        self.flow = None  # told when the client stops and starts reading (it always reads here)

    def write(self, data: bytes) -> None:
        self.data += data

    def watch(self, flow) -> None:
        self.flow = flow

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


LINKS = {"kind": "tcp"}


@pytest.fixture(autouse=True, params=["tcp", "local"])
def links(request: pytest.FixtureRequest) -> None:
    """How `pool` reaches the replicas it starts with."""
    LINKS["kind"] = request.param


def pool(name: str, *replicas: ScriptedReplica, policy: str = "round_robin",
         max_ongoing: int = 64, wake=None, retries: int = 0, service: RoutingService | None = None,
         shed_waiting: int | None = None, migrate: bool = True, ranks: dict[str, int] | None = None,
         route_ranks: bool = True) -> PoolDispatcher:
    service = service or RoutingService(name, build_policy(policy), lambda size: None)

    async def no_wake() -> None:
        pass

    local = {r.name: r.server.local_link(r.name) for r in replicas} \
        if LINKS["kind"] == "local" else None
    dispatcher = PoolDispatcher(name, service, max_ongoing, SECRET, "gw", wake or no_wake,
                                ReplicaDirectory("t"), retries, shed_waiting, migrate, route_ranks,
                                local)
    dispatcher.update([with_ranks(r.report(name), (ranks or {}).get(r.name, 1)) for r in replicas])
    return dispatcher


def with_ranks(report: ReplicaReport, ranks: int) -> ReplicaReport:
    """The report of a replica whose engine has `ranks` data-parallel ranks."""
    if ranks == 1:
        return report
    return msgspec.structs.replace(report, ranks=[
        RankReport(rank, LoadSnapshot()) for rank in range(ranks)])


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
        # the engine names the stream's chunks after the request id (kept if continued)
        assert replica.requests == [("completions", BODY | {"request_id": "req-1"})]
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


def test_data_parallel_ranks_are_targets_and_each_request_carries_its_rank() -> None:
    """A replica with two ranks is two routing targets on one link; the request tells the
    replica which rank runs it. With dp_ranks `engine`, the replica is one target and its
    engine picks."""
    async def scenario(route_ranks: bool) -> list[int | None]:
        replica = await ScriptedReplica("r1", DECODED).start()
        main = pool("main", replica, ranks={"r1": 2}, route_ranks=route_ranks)
        await connected(main)
        for _ in range(4):
            assert await serve(UnifiedFlow(main), call(BODY)) == Usage(500, 2, 0)
        targets = sorted(main.service.replicas())
        assert targets == (["r1/dp0", "r1/dp1"] if route_ranks else ["r1"])
        return [request.rank for request in replica.received]

    assert run(scenario(True)) == [0, 1, 0, 1]  # round robin over the ranks
    assert run(scenario(False)) == [None] * 4


def test_a_failed_replica_is_left_out_with_all_its_ranks() -> None:
    """Its engine is dead: the retry goes to another replica, not to its other rank, and the
    failure counts against each rank's circuit breaker."""
    async def scenario() -> None:
        broken = await ScriptedReplica("r1", FAILS_BEFORE_HEAD).start()
        healthy = await ScriptedReplica("r2", DECODED).start()
        main = pool("main", broken, healthy, retries=1, ranks={"r1": 2})
        await connected(main)
        for _ in range(3):
            request = call(BODY)
            assert await serve(UnifiedFlow(main), request) == Usage(500, 2, 0)
            assert request.responder._connection.response()[1]["x-tokenfab-replica"] == "r2"
        # with one retry, a second try on r1's other rank would have failed the request
        assert 1 <= len(broken.requests) <= 3 and len(healthy.requests) == 3
        for _ in range(3):  # breaker_failures (3 by default) more failures of r1
            main.failed("r1")
        breakers = {t: r["breaker"] for t, r in main.service.replicas().items()}
        assert breakers == {"r1/dp0": "open", "r1/dp1": "open", "r2": "closed"}
    run(scenario())


def test_no_retry_left_answers_503_at_once() -> None:
    async def scenario() -> None:
        broken = [await ScriptedReplica(f"r{i}", FAILS_BEFORE_HEAD).start() for i in range(2)]
        main = pool("main", *broken, retries=0)
        await connected(main)
        started = time.monotonic()
        with pytest.raises(GatewayError) as info:
            await serve(UnifiedFlow(main), call(BODY, timeout_s=5))
        assert info.value.status == 503 and time.monotonic() - started < 1  # no waiting
        assert info.value.code == "replica_failed"
        assert sum(len(r.requests) for r in broken) == 1
    run(scenario())


@pytest.mark.parametrize("replicas", [1, 2], ids=["no-other-replica", "every-replica-failed"])
def test_a_retry_waits_for_a_replica_not_tried_until_the_deadline(replicas: int) -> None:
    """Retries left, but every listed replica failed this request: it waits for another (Serve
    replacing one, the registry listing one it had not read yet), then 503 at its deadline."""
    async def scenario() -> None:
        broken = [await ScriptedReplica(f"r{i}", FAILS_BEFORE_HEAD).start()
                  for i in range(replicas)]
        main = pool("main", *broken, retries=2)
        await connected(main)
        started = time.monotonic()
        with pytest.raises(GatewayError) as info:
            await serve(UnifiedFlow(main), call(BODY, timeout_s=0.5))
        assert info.value.status == 503 and info.value.code == "no_replica"
        assert 0.5 <= time.monotonic() - started < 2
        assert [len(r.requests) for r in broken] == [1] * replicas  # each tried once
    run(scenario())


@pytest.mark.parametrize("script", [FAILS_BEFORE_HEAD, FAILS_AFTER_BYTES],
                         ids=["retried", "continued"])
def test_a_replica_listed_after_the_failure_serves_the_request(script: list[Step]) -> None:
    """The only listed replica fails; the registry then lists another (Serve's replacement, or
    one the gateway had not read yet): the request goes on there, before or after bytes."""
    async def scenario() -> None:
        broken = await ScriptedReplica("r1", script).start()
        main = pool("main", broken, retries=2, service=counted())
        await connected(main)
        request = call(BODY)
        task = asyncio.create_task(serve(UnifiedFlow(main), request))
        while not broken.requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert not task.done()  # waiting for a replica it has not tried
        late = await ScriptedReplica("r2", DECODED).start()
        main.update([broken.report("main"), late.report("main")])
        assert await task == Usage(500, 2, 0)
        assert len(late.requests) == 1 and request.stream_error is None
        assert (late.received[0].resume is None) == (script is FAILS_BEFORE_HEAD)
    run(scenario())


@pytest.mark.parametrize("migrate, body", [
    (False, BODY),  # migration switched off
    (True, BODY | {"stop": ["\n"]}),  # text held back for the stop string would be lost
    (True, BODY | {"n": 2}),  # the ids are one choice's
], ids=["migrate_off", "stop_strings", "several_choices"])
def test_a_stream_that_cannot_be_continued_ends_in_band(migrate: bool, body: dict) -> None:
    """Bytes reached the client and the request cannot be continued: an in-stream error."""
    async def scenario() -> None:
        broken = await ScriptedReplica("r1", FAILS_AFTER_BYTES).start()
        healthy = await ScriptedReplica("r2", DECODED).start()
        main = pool("main", broken, healthy, retries=2, migrate=migrate, service=counted())
        await connected(main)
        request = call(body)
        assert await serve(UnifiedFlow(main), request) is None
        status, headers, body_ = request.responder._connection.response()
        assert (status, headers["x-tokenfab-replica"], request.stream_error) == (200, "r1", 503)
        assert body_.startswith(b"data: 1\n\ndata: {\"error\"") and healthy.requests == []
        assert not broken.received[0].track_tokens  # nothing to track: no ids on the wire
        assert migrations(main) == {"not_resumable": 1}
    run(scenario())


def with_id(body: dict[str, Any]) -> dict[str, Any]:
    """The body as a replica gets it: a stream that can be continued names its chunks."""
    return body if body.get("n") else body | {"request_id": "req-1"}


def counted() -> RoutingService:
    return RoutingService("main", build_policy("round_robin"), lambda size: None,
                          metrics=RouterMetrics(CollectorRegistry()))


def migrations(main: PoolDispatcher) -> dict[str, float]:
    counter = main.service._metrics.migrations
    return {sample.labels["outcome"]: sample.value for metric in counter.collect()
            for sample in metric.samples if sample.name.endswith("_total")}


BROKEN_AT_2 = streamed(b"data: a\n\n", b"data: b\n\n")[:3] + [Step("fail")]  # tokens 1, 2


@pytest.mark.parametrize("body", [BODY, BODY | {"echo": True, "prompt_logprobs": 2}])
def test_a_stream_whose_replica_fails_is_continued_on_another_from_the_tokens_sent(
        body: dict) -> None:
    """The client sees one stream: r1's tokens, then r2's continuation, which resumes from the
    ids of exactly the tokens the client got; the usage is the continuation's (one request)."""
    async def scenario() -> None:
        broken = await ScriptedReplica("r1", BROKEN_AT_2).start()
        rest = streamed(b"data: c\n\n", usage=Usage(500, 3, 0), first_id=3)
        healthy = await ScriptedReplica("r2", rest).start()
        main = pool("main", broken, healthy, retries=1, service=counted())
        await connected(main)
        request = call(body)
        assert await serve(UnifiedFlow(main), request) == Usage(500, 3, 0)
        status, headers, sent = request.responder._connection.response()
        assert (status, headers["x-tokenfab-replica"], request.stream_error) == (200, "r1", None)
        assert sent == b"data: a\n\ndata: b\n\ndata: c\n\ndata: [DONE]\n\n"
        first, = broken.received
        continued, = healthy.received
        assert first.track_tokens and first.resume is None
        assert continued.track_tokens and continued.resume == (1, 2)
        original = json.loads(first.body)
        assert original["request_id"] == "req-1"  # the chunk ids stay the same on r2
        assert json.loads(continued.body) == {key: value for key, value in original.items()
                                              if key not in ("echo", "prompt_logprobs")}
        assert len(request.gaps) == 2 and request.first_token_s is not None  # one clock
        assert migrations(main) == {"resumed": 1}
    run(scenario())


def test_a_continuation_that_fails_too_continues_from_all_tokens_sent_so_far() -> None:
    async def scenario() -> None:
        r1 = await ScriptedReplica("r1", BROKEN_AT_2).start()
        # whichever of r2 and r3 gets the first continuation fails after one more token
        r2, r3 = ScriptedReplica("r2", streamed(b"data: c\n\n", first_id=3)[:2] + [Step("fail")],
                                 streamed(b"data: d\n\n", usage=Usage(500, 4, 0), first_id=4)
                                 ), ScriptedReplica("r3")
        r3.scripts = r2.scripts
        await r2.start(), await r3.start()
        main = pool("main", r1, r2, r3, retries=2)
        await connected(main)
        request = call(BODY)
        assert await serve(UnifiedFlow(main), request) == Usage(500, 4, 0)
        assert request.responder._connection.response()[2] == (
            b"data: a\n\ndata: b\n\ndata: c\n\ndata: d\n\ndata: [DONE]\n\n")
        assert r1.received[0].resume is None
        assert sorted(r.resume for r in r2.received + r3.received) == [(1, 2), (1, 2, 3)]
    run(scenario())


def test_a_stream_cut_before_any_token_text_is_continued_from_no_tokens() -> None:
    """The client has bytes but no token whose text is whole (a chat's role chunk, part of a
    character): still a continuation (the replica leaves out the role chunk), from no tokens."""
    async def scenario() -> None:
        r1 = await ScriptedReplica("r1", [Step("head", 200, streaming=True),
                                          Step("token", payload=b"data: role\n\n"),
                                          Step("fail")]).start()
        r2 = await ScriptedReplica("r2", streamed(b"data: a\n\n")).start()
        main = pool("main", r1, r2, retries=1)
        await connected(main)
        request = call(BODY)
        await serve(UnifiedFlow(main), request)
        assert request.responder._connection.response()[2] == (
            b"data: role\n\ndata: a\n\ndata: [DONE]\n\n")
        assert r2.received[0].resume == ()
    run(scenario())


@pytest.mark.parametrize("retries, continuation, outcome", [
    (1, None, "exhausted"),  # r2 fails the continuation too, and no retry is left
    (2, [Step("head", 400), Step("data", payload=b'{"error": "no"}'), Step("end")], "failed"),
], ids=["no_retry_left", "continuation_refused"])
def test_a_stream_that_could_not_be_continued_ends_in_band(
        retries: int, continuation: list[Step] | None, outcome: str) -> None:
    async def scenario() -> None:
        r1 = await ScriptedReplica("r1", BROKEN_AT_2).start()
        r2 = await ScriptedReplica("r2", continuation or BROKEN_AT_2).start()
        main = pool("main", r1, r2, retries=retries, service=counted())
        await connected(main)
        request = call(BODY)
        assert await serve(UnifiedFlow(main), request) is None
        status, _, sent = request.responder._connection.response()
        assert status == 200 and sent.startswith(b"data: a\n\ndata: b\n\n")
        assert b'data: {"error"' in sent and request.stream_error in (400, 503)
        assert migrations(main) == {"resumed": 1, outcome: 1}
    run(scenario())


def test_a_replica_the_registry_stops_listing_finishes_the_replies_it_has() -> None:
    """The registry stops listing a replica (it drains, or the registry itself restarted and has
    not heard from it yet): it gets no new request, but the stream on it is not cut; its link
    closes once that stream ended."""
    async def scenario() -> None:
        slow = streamed(b"data: a\n\n", b"data: b\n\n")
        slow.insert(2, Step("sleep", payload=b"0.3"))
        r1 = await ScriptedReplica("r1", slow).start()
        main = pool("main", r1)
        await connected(main)
        request = call(BODY)
        serving = asyncio.create_task(serve(UnifiedFlow(main), request))
        while not request.responder.started:
            await asyncio.sleep(0.01)
        main.update([])  # r1 is not listed any more
        assert main.ready_replicas() == 0 and not main._links
        await serving
        assert request.responder._connection.response()[2] == (
            b"data: a\n\ndata: b\n\ndata: [DONE]\n\n")
        link = main._retiring["r1"]
        assert link.state == "ready"
        main.update([])
        assert not main._retiring  # let go of once idle: a socket is closed
        while LINKS["kind"] == "tcp" and link.state != "closed":
            await asyncio.sleep(0.01)
        with pytest.raises(GatewayError) as info:  # and nothing new goes there
            await serve(UnifiedFlow(main), call(BODY, timeout_s=0.3))
        assert info.value.status == 503 and len(r1.requests) == 1
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
        assert decode.requests == [("completions", BODY | {"kv_transfer_params": PARAMS,
                                                           "request_id": "req-1"})]
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
        assert prefill.requests == [] and decode.requests == [("completions", with_id(body))]
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
        assert decode.requests == [("completions", with_id(BODY))]  # no kv_transfer_params
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


def test_prompt_another_tenant_sent_to_decode_still_takes_the_prefill_pool() -> None:
    # decode's engine caches each tenant's blocks under its salt: tenant b's copy of a prompt
    # tenant a just sent is not there, and b's path must not reveal what a sent
    async def scenario() -> None:
        flow, prefill, _ = await pd([whole(200, {"kv_transfer_params": PARAMS})] * 2)
        for salt in ("a", "b", "a"):
            await serve(flow, call(BODY | {"prompt": "x", "cache_salt": salt}))
        assert [body["cache_salt"] for _, body in prefill.requests] == ["a", "b"]
        assert dict(flow.metrics.tally) == {
            "requests_disaggregated": 2, "skipped_cached_on_decode": 1, "requests_decode_only": 1}
    run(scenario())


def test_decode_block_map_decides_what_skips_the_prefill_pool() -> None:
    # decode's router follows its engines' events (kv_aware): a prompt sent to decode counts as
    # there until decode reports evicting it; then it takes the prefill leg again, where the
    # gateway's memory of what it sent (RecentPrefixes) would count it for its whole TTL
    async def scenario() -> None:
        prefill = await ScriptedReplica("p1", *[whole(200, {"kv_transfer_params": PARAMS})] * 2
                                        ).start()
        decode = await ScriptedReplica("d1", DECODED, DECODED, DECODED).start()
        service = RoutingService("decode", build_policy("kv_aware"),
                                 lambda size: PrefixBlockHasher(size, "sha256"))
        pools = (pool("prefill", prefill), pool("decode", decode, service=service))
        pools[1].update([msgspec.structs.replace(decode.report("decode"), block_size=16,
                                                 kv_blocks=1000)])
        await connected(*pools)
        spec = DisaggregationSpec(min_prompt_tokens=100)
        flow = DisaggregatedFlow(*pools, spec, TransferMetrics(CollectorRegistry()))
        request = call(BODY)
        hashes = flow.keys("req-1", request.tokens, None)["decode"].block_hashes
        assert len(hashes) == 31  # 500 tokens
        await serve(flow, request)  # nothing on decode: prefilled, then sent to decode
        service.apply_events("d1", KVEventBatch(1.0, [BlockStored(hashes, None, [], 16, None, None, None)]))
        await serve(flow, call(BODY))  # decode holds it: decode alone
        service.apply_events("d1", KVEventBatch(2.0, [BlockRemoved(hashes[20:], None)]))
        await serve(flow, call(BODY))  # 320 of 500 tokens left there: 180 to compute, prefilled
        assert len(prefill.requests) == 2 and len(decode.requests) == 3
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
        while (decode.outcomes, decode.in_flight) != (["cancelled"], 0):  # else run() times out
            await asyncio.sleep(0.01)
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


def test_side_channel_of_data_parallel_ranks_is_consecutive_free_ports() -> None:
    """vLLM gives rank R the configured port + R: all must be free."""
    channel = reserve_side_channel("127.0.0.1", random.Random(1), ranks=3)
    assert list(channel.ports) == [channel.port, channel.port + 1, channel.port + 2]
    for port in channel.ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


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
