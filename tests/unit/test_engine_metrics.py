"""vLLM's Ray stat logger, buffered (pools.engine_metrics): the series written are the ones
vLLM's own logger writes, at most FLUSH_S later."""

from __future__ import annotations

import asyncio

import msgspec

from pools import engine_metrics
from pools.engine_metrics import BufferedCounter, BufferedGauge


class Recorded:
    """Stands in for a ray.util.metrics metric: what reached Ray's agent."""

    def __init__(self, real) -> None:
        self._tag_keys = real._tag_keys
        self.calls: list[tuple[str, float, dict[str, str]]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("set", value, tags))

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.calls.append(("inc", value, tags))


def test_gauges_keep_their_last_value_and_counters_their_sum_until_the_flush() -> None:
    gauge = BufferedGauge("vllm:num_requests_running", "d", ["model_name", "engine"])
    counter = BufferedCounter("vllm:prompt_tokens_cached", "d", ["model_name", "source"])
    gauge.metric, counter.metric = Recorded(gauge.metric), Recorded(counter.metric)

    async def steps() -> None:
        running = gauge.labels("tiny", "0")
        assert gauge.labels("tiny", "0") is running  # labelled once, not per step
        for value in (3, 1, 0):
            running.set(value)
        counter.labels("tiny", "device").inc(2)
        counter.labels("tiny", "device").inc(0)
        counter.labels("tiny", "device").inc(3)
        counter.labels("tiny", "remote").inc(4)
        assert gauge.metric.calls == counter.metric.calls == []  # nothing written per step
        await asyncio.sleep(engine_metrics.FLUSH_S + 0.2)  # then within FLUSH_S, unprompted

    asyncio.run(steps())
    assert [(op, value, tags["model_name"], tags["engine"]) for op, value, tags
            in gauge.metric.calls] == [("set", 0, "tiny", "0")]
    assert sorted((op, value, tags["source"]) for op, value, tags in counter.metric.calls) == \
        [("inc", 4, "remote"), ("inc", 5, "device")]
    assert all("ReplicaId" in tags for _, _, tags in counter.metric.calls)


def test_outside_an_event_loop_values_are_written_at_once() -> None:
    gauge = BufferedGauge("vllm:cache_config_info", "d", ["model_name"])
    gauge.metric = Recorded(gauge.metric)
    gauge.labels("tiny").set(1)
    assert [op for op, _, _ in gauge.metric.calls] == ["set"]


def test_a_loop_that_ended_before_its_flush_does_not_hold_back_the_next() -> None:
    gauge = BufferedGauge("vllm:kv_cache_usage_perc", "d", ["model_name"])
    gauge.metric = Recorded(gauge.metric)

    async def step(value: float) -> None:
        gauge.labels("tiny").set(value)

    asyncio.run(step(0.5))  # ends before its flush was due

    async def next_loop() -> None:
        gauge.labels("tiny").set(0.75)
        await asyncio.sleep(engine_metrics.FLUSH_S + 0.2)

    asyncio.run(next_loop())
    assert [value for _, value, _ in gauge.metric.calls] == [0.75]


def test_experts_each_finished_request_was_routed_to_are_counted_and_exported() -> None:
    """An MoE engine with enable_return_routed_experts reports, with each finished request, the
    expert indices of its tokens (token x layer x top-k); the replica counts them per expert and
    the gateway exports the counts. Requests without a trace are followed for it too."""
    from types import SimpleNamespace

    import numpy as np

    from orchestrator.gateway.pool_metrics import render
    from pools.engine import LoadSnapshot
    from pools.registry import ReplicaReport
    from pools.vllm_compat import trace_generate
    from pools.vllm_engine import ExpertLoad

    def output(finished: bool, routed=None):
        choice = SimpleNamespace(token_ids=[7], text="x", routed_experts=routed)
        return SimpleNamespace(outputs=[choice], finished=finished)

    async def generate(prompt, params, request_id, **kwargs):
        yield output(False)
        yield output(True, np.array([[[0, 3], [1, 3]], [[3, 2], [0, 1]]]))  # 2 tokens, 2 layers

    experts = ExpertLoad()
    traced = trace_generate(generate, experts)

    async def drain() -> None:
        async for _ in traced({"prompt_token_ids": [1]}, None, "r1"):
            pass

    asyncio.run(drain())
    asyncio.run(drain())
    assert experts.tokens == [4, 4, 2, 6]
    report = ReplicaReport(app="t", pool="main", role="unified", replica_id="r1",
                           node_ip="127.0.0.1", pid=1, cores=[], state="ready",
                           load=LoadSnapshot(), expert_tokens=experts.tokens)
    text = render([report]).decode()
    assert 'tokenfab_replica_expert_routed_tokens_total{ReplicaId="r1",expert="3",pool="main"} 6.0' \
        in text
    assert 'expert="' not in render([msgspec.structs.replace(report, expert_tokens=[])]).decode()
