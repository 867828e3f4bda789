"""The P/D flow's decisions and fallbacks, with scripted pool handles (no engines).

The real legs, NIXL transfers and engine-side recompute are exercised in
tests/integration/test_pd.py; here each branch of the flow gets an exact expected outcome.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import ray
from prometheus_client import CollectorRegistry

from kvtransfer.metrics import TransferMetrics
from kvtransfer.nixl import SideChannel, connector_config
from kvtransfer.params import REMOTE_DECODE, decode_body, is_transferable, prefill_body
from orchestrator.config import DisaggregationSpec
from orchestrator.pd_flow import PDFlow
from pools.engine import ReplyHead

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p1", "remote_block_ids": [1, 2],
          "remote_host": "127.0.0.1", "remote_port": 5600}


class Stream:
    """A scripted reply stream: items, then an optional exception or a hang."""

    def __init__(self, items: list[Any], error: BaseException | None = None, hang: bool = False):
        self.items, self.error, self.hang, self.cancelled = list(items), error, hang, False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        if self.items:
            return self.items.pop(0)
        if self.hang:
            await asyncio.sleep(3600)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class Handle:
    """Stands in for a DeploymentHandle: records bodies, answers with the next scripted stream."""

    def __init__(self, *streams: Stream) -> None:
        self.streams, self.bodies = list(streams), []

    def options(self, stream: bool) -> Handle:
        return self

    @property
    def reply(self) -> Handle:
        return self

    def remote(self, endpoint: str, body: dict[str, Any], route: Any = None) -> Stream:
        self.bodies.append(body)
        return self.streams.pop(0)


class Counter:
    """Every prompt has `length` tokens; the ids depend on the prompt text."""

    def __init__(self, length: int | None) -> None:
        self.length = length

    def tokens(self, endpoint: str, body: dict[str, Any]) -> list[int] | None:
        if self.length is None:
            return None
        return [hash(body.get("prompt")) % 1000 + i for i in range(self.length)]


def ok(payload: dict[str, Any]) -> list[Any]:
    return [ReplyHead(200, streaming=False), json.dumps(payload).encode()]


DECODED = [ReplyHead(200, streaming=True), b"data: 1\n\n", b"data: [DONE]\n\n"]


def run(flow: PDFlow, body: dict[str, Any]) -> list[Any]:
    async def collect() -> list[Any]:
        return [item async for item in flow.reply("completions", body)]

    return asyncio.run(collect())


def make(prefill: Handle, decode: Handle, tokens: int | None = 500) -> PDFlow:
    spec = DisaggregationSpec(min_prompt_tokens=100, prefill_timeout_s=0.2)
    return PDFlow([("prefill", prefill)], [decode], spec, Counter(tokens), TransferMetrics(CollectorRegistry()))


BODY = {"model": "tiny", "prompt": "x", "max_tokens": 50, "stream": True,
        "stream_options": {"include_usage": True}}


def test_long_prompt_is_prefilled_then_decoded_with_the_params() -> None:
    prefill = Handle(Stream(ok({"kv_transfer_params": PARAMS})))
    decode = Handle(Stream(DECODED))
    flow = make(prefill, decode)
    assert run(flow, BODY) == DECODED
    assert prefill.bodies == [{"model": "tiny", "prompt": "x", "max_tokens": 1,
                               "kv_transfer_params": REMOTE_DECODE}]
    assert decode.bodies == [BODY | {"kv_transfer_params": PARAMS}]
    assert dict(flow.metrics.tally) == {"requests_disaggregated": 1}


@pytest.mark.parametrize(("tokens", "body", "reason"), [
    (99, BODY, "skipped_short_prompt"),
    (None, BODY, "skipped_unknown_prompt"),
    (500, BODY | {"n": 2}, "skipped_multiple_choices"),
], ids=["short", "unreadable", "n>1"])
def test_requests_that_skip_the_prefill_pool(tokens: int | None, body: dict, reason: str) -> None:
    prefill, decode = Handle(), Handle(Stream(DECODED))
    flow = make(prefill, decode, tokens)
    assert run(flow, body) == DECODED
    assert prefill.bodies == [] and decode.bodies == [body]
    assert dict(flow.metrics.tally) == {reason: 1, "requests_decode_only": 1}


@pytest.mark.parametrize(("stream", "reason"), [
    (Stream([], error=ray.exceptions.RayActorError()), "fallback_prefill_failed"),
    (Stream([], hang=True), "fallback_prefill_timeout"),
    (Stream([ReplyHead(503, streaming=False), b"{}"]), "fallback_prefill_error"),
    (Stream(ok({"kv_transfer_params": None})), "fallback_no_kv_params"),
    (Stream(ok({"kv_transfer_params": PARAMS | {"remote_block_ids": []}})),
     "fallback_no_kv_params"),
], ids=["replica-died", "deadline", "server-error", "no-params", "no-blocks"])
def test_failed_prefill_falls_back_to_decode_recompute(stream: Stream, reason: str) -> None:
    decode = Handle(Stream(DECODED))
    flow = make(Handle(stream), decode)
    assert run(flow, BODY) == DECODED
    assert decode.bodies == [BODY]  # no kv_transfer_params: decode computes the prompt
    assert stream.cancelled
    assert dict(flow.metrics.tally) == {reason: 1, "fallbacks": 1, "requests_decode_only": 1}


def test_prompt_recently_sent_to_decode_skips_the_prefill_pool() -> None:
    prefill = Handle(*(Stream(ok({"kv_transfer_params": PARAMS})) for _ in range(2)))
    decode = Handle(Stream(DECODED), Stream(DECODED), Stream(DECODED))
    flow = make(prefill, decode)
    for prompt in ("x", "x", "y"):
        run(flow, BODY | {"prompt": prompt})
    assert [b["prompt"] for b in prefill.bodies] == ["x", "y"]
    assert dict(flow.metrics.tally) == {
        "requests_disaggregated": 2, "skipped_cached_on_decode": 1, "requests_decode_only": 1}


def test_invalid_request_is_answered_by_prefill_error_not_sent_twice() -> None:
    error = [ReplyHead(400, streaming=False), b'{"error": {"message": "bad"}}']
    decode = Handle()
    flow = make(Handle(Stream(error)), decode)
    assert run(flow, BODY) == error
    assert decode.bodies == []


def test_closing_the_reply_cancels_the_decode_stream() -> None:
    decode_stream = Stream(DECODED, hang=True)
    flow = make(Handle(Stream(ok({"kv_transfer_params": PARAMS}))), Handle(decode_stream))

    async def first_then_close() -> None:
        replies = flow.reply("completions", BODY)
        assert await replies.__anext__() == DECODED[0]
        await replies.aclose()

    asyncio.run(first_then_close())
    assert decode_stream.cancelled


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
