"""The vLLM adapter: an in-process `AsyncLLM` behind vLLM's own OpenAI serving layer.

Requests are parsed, tokenised, templated and answered by the same code as `vllm serve`, so our
endpoint is exactly as compatible as vLLM's; this module only translates at the boundary.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
from pydantic import BaseModel, ValidationError

from autoscaler.signals import SIGNAL_WINDOW_S, ReplicaSignals, Window
from tokenfab.errors import EngineDeadError, EngineError, openai_error
from channel.frames import AdapterRef
from pools.engine import Endpoint, EngineSpec, Latency, LoadSnapshot, ReplyHead, TokenTrace
from pools.vllm_compat import RANK, TRACE, continue_on_add_request, trace_generate
from pools.vllm_lora import VllmLora


logger = logging.getLogger(__name__)

# Settings we choose for every engine unless the topology overrides them: prefix caching on,
# per-request cached-token counts in `usage`, and stats on (they feed LoadSnapshot).
_ENGINE_DEFAULTS: dict[str, Any] = {"enable_prefix_caching": True, "disable_log_stats": False}


def engine_arg_names() -> frozenset[str]:
    """Every keyword `AsyncEngineArgs` accepts, to validate `engine_args` before deploying."""
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    return frozenset(field.name for field in dataclasses.fields(AsyncEngineArgs))


def build_engine_args(spec: EngineSpec) -> Any:
    """Translate an EngineSpec into vLLM's `AsyncEngineArgs`."""
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = _ENGINE_DEFAULTS | dict(spec.engine_args)
    kwargs |= {
        "model": spec.model_path,
        "served_model_name": [spec.model_name],
        "dtype": spec.dtype,
        "max_model_len": spec.max_model_len,
    }
    if spec.kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = spec.kv_cache_bytes
    if spec.tensor > 1:
        kwargs["tensor_parallel_size"] = spec.tensor
    if spec.data > 1:
        kwargs["data_parallel_size"] = spec.data
        kwargs["data_parallel_backend"] = spec.parallel_backend
    if spec.expert:
        kwargs["enable_expert_parallel"] = True
    if spec.kv_events_endpoint is not None:
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=spec.kv_events_endpoint,
            replay_endpoint=spec.kv_events_replay_endpoint,
            topic="kv-events",
        )
    if spec.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(**spec.kv_transfer_config)
    if spec.lora is not None:
        kwargs |= {"enable_lora": True, "max_loras": spec.lora.max_loras,
                   "max_cpu_loras": spec.lora.max_cpu_loras, "max_lora_rank": spec.lora.max_rank}
    return AsyncEngineArgs(**kwargs)


class _LoadRecorder:
    """Keeps the latest scheduler stats of each data-parallel rank (vLLM calls `record` once per
    step of each rank's engine); windows of latencies and rates are the replica's, all ranks'."""

    def __init__(self, window_s: float = SIGNAL_WINDOW_S) -> None:
        self.ranks: dict[int, LoadSnapshot] = {0: LoadSnapshot()}  # engine index -> its load
        self._ttft, self._itl = Window(window_s), Window(window_s)
        self._prompt, self._generated = Window(window_s), Window(window_s)
        self._prefill_rate = Window(window_s)  # prompt tokens / step time, of steps that prefilled
        self._last_step: dict[int, float] = {}
        self._busy: dict[int, bool] = {}  # whether a rank still had requests after its last step

    @property
    def snapshot(self) -> LoadSnapshot:
        """The replica's load: every rank's requests and counters summed, KV usage averaged."""
        if len(self.ranks) == 1:
            return next(iter(self.ranks.values()))
        loads = list(self.ranks.values())
        total = {field: sum(getattr(load, field) for load in loads)
                 for field in LoadSnapshot.__struct_fields__}
        total["kv_cache_usage"] /= len(loads)
        return LoadSnapshot(**total)

    def signals(self, queued_prompt_tokens: int = 0) -> ReplicaSignals:
        """The autoscaler's view of this engine: load now, latencies and rates of the window."""
        snap = self.snapshot
        return ReplicaSignals(
            running=float(snap.running), waiting=float(snap.waiting),
            kv_cache_usage=snap.kv_cache_usage, ttft_p90_s=self._ttft.p90(),
            itl_p90_s=self._itl.p90(), prompt_tokens_per_s=self._prompt.rate(),
            generation_tokens_per_s=self._generated.rate(),
            queued_prompt_tokens=float(queued_prompt_tokens),
            # ranks prefill side by side: the replica's capacity is theirs together
            prefill_capacity_tokens_per_s=self._prefill_rate.p90() * len(self.ranks))

    def latency(self) -> Latency:
        ttft, itl = self._ttft, self._itl
        return Latency(ttft_p50_s=ttft.quantile(0.5), ttft_p90_s=ttft.quantile(0.9),
                       itl_p50_s=itl.quantile(0.5), itl_p90_s=itl.quantile(0.9),
                       generation_tokens_per_s=self._generated.rate())

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        recorder = self
        recorder.ranks.setdefault(engine_index, LoadSnapshot())

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any,
                       **kw: Any) -> None:
                if scheduler_stats is not None:
                    recorder.update(scheduler_stats, engine_index)
                if iteration_stats is not None:
                    recorder.count_tokens(iteration_stats, engine_index)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger(vllm_config, engine_index)

    def update(self, stats: Any, rank: int = 0) -> None:
        prefix, old = stats.prefix_cache_stats, self.ranks.get(rank, LoadSnapshot())
        transfers = _connector_counts(stats.kv_connector_stats)
        self.ranks[rank] = msgspec.structs.replace(
            old,
            running=stats.num_running_reqs,
            waiting=stats.num_waiting_reqs + stats.num_skipped_waiting_reqs,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_queries=old.prefix_cache_queries + prefix.queries,
            prefix_cache_hits=old.prefix_cache_hits + prefix.hits,
            kv_transfers=old.kv_transfers + transfers["transfers"],
            kv_transfer_bytes=old.kv_transfer_bytes + transfers["bytes"],
            kv_transfer_seconds=old.kv_transfer_seconds + transfers["seconds"],
            kv_transfer_failures=old.kv_transfer_failures + transfers["failures"],
        )

    def count_tokens(self, iteration: Any, rank: int = 0) -> None:
        old, prompt = self.ranks.get(rank, LoadSnapshot()), iteration.prompt_token_stats
        for seconds in iteration.time_to_first_tokens_iter:
            self._ttft.add(seconds)
        for finished in iteration.finished_requests:  # each request's mean gap between tokens
            if finished.num_generation_tokens > 1:
                self._itl.add(finished.mean_time_per_output_token)
        self._prompt.add(prompt.computed)
        # While the rank has requests, steps follow each other, so the time since the previous
        # step's output is this step's duration. After a step that left it empty, the rank
        # idled until the next request: no sample.
        step_end, previous = iteration.iteration_timestamp, self._last_step.get(rank)
        busy_before = self._busy.get(rank, False)
        self._busy[rank] = old.running + old.waiting > 0
        self._last_step[rank] = step_end
        if prompt.computed and busy_before and previous is not None and step_end > previous:
            self._prefill_rate.add(prompt.computed / (step_end - previous))
        self._generated.add(iteration.num_generation_tokens)
        self.ranks[rank] = msgspec.structs.replace(
            old,
            generation_tokens=old.generation_tokens + iteration.num_generation_tokens,
            prompt_tokens_computed=old.prompt_tokens_computed + prompt.computed,
            prompt_tokens_local_hit=old.prompt_tokens_local_hit + prompt.local_cache_hit,
            prompt_tokens_transferred=old.prompt_tokens_transferred + prompt.external_kv_transfer,
        )


def _connector_counts(stats: Any) -> dict[str, float]:
    """Totals of one step's NixlConnector stats (lists of per-transfer values, keyed by name)."""
    data = getattr(stats, "data", stats) or {}
    failures = sum(len(data.get(key, ())) for key in (
        "num_failed_transfers", "num_failed_handshakes", "num_failed_notifications"))
    return {"transfers": len(data.get("transfer_duration", ())),
            "bytes": int(sum(data.get("bytes_transferred", ()))),
            "seconds": float(sum(data.get("transfer_duration", ()))), "failures": failures}


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """Name each bad field once; a union type's per-branch errors collapse into one line."""
    by_field: dict[str, list[Mapping[str, Any]]] = {}  # pydantic's ErrorDetails
    for error in exc.errors():
        by_field.setdefault(str(error["loc"][0]) if error["loc"] else "body", []).append(error)
    parts = []
    for field, errors in by_field.items():
        if len(errors) == 1:
            parts.append(f"{field}: {errors[0]['msg'].removeprefix('Value error, ')}")
        else:
            parts.append(f"{field}: invalid value {errors[0]['input']!r:.60}")
    return "; ".join(parts), next(iter(by_field))


_FIELDS: dict[type[BaseModel], frozenset[str]] = {}


def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """A request model's field names and aliases."""
    if model not in _FIELDS:
        _FIELDS[model] = frozenset(name for field_name, field in model.model_fields.items()
                                   for name in (field_name, field.alias) if name)
    return _FIELDS[model]


_ERROR_EVENT = 'data: {"error"'  # how vLLM's serving layer ends a stream that failed

class ExpertLoad:
    """Routing decisions per expert of a mixture-of-experts engine, from the experts vLLM
    reports each finished request was routed to (`enable_return_routed_experts`: an array of
    token x MoE layer x top-k expert indices; vLLM's GPU model runner only). Counted per expert
    index over all layers: with expert parallelism (and no EPLB rebalancing) index e lives on the
    same rank in every layer, so the counts are also the all-to-all's load per rank.
    Example: 2 tokens, 1 layer, top-2 [[[0, 3]], [[3, 1]]] -> [1, 1, 0, 2]."""

    def __init__(self) -> None:
        self.tokens: list[int] = []

    def add(self, routed: Any) -> None:
        import numpy as np

        counts = np.bincount(np.asarray(routed).ravel(), minlength=len(self.tokens))
        counts[:len(self.tokens)] += np.asarray(self.tokens, dtype=counts.dtype)
        self.tokens = counts.tolist()


class VllmEngine:
    """Implements pools.engine.Engine with vLLM's AsyncLLM and its OpenAI serving classes."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self._recorder = _LoadRecorder()
        self.experts = ExpertLoad() if spec.engine_args.get("enable_return_routed_experts") \
            else None
        self._llm: Any = None
        self._serving: dict[Endpoint, Any] = {}
        self._requests: dict[Endpoint, Any] = {}
        self._error_type: type[Any] = type(None)  # vLLM's ErrorResponse, once started
        self._client_error: tuple[type[Exception], ...] = ()  # vLLM's, once started
        self.block_size = 0  # the KV cache block size, known once started
        self.kv_blocks = 0  # the KV cache's capacity in blocks, known once started
        self.max_num_seqs = 0  # requests one batch runs (each rank's), known once started
        self._lora = VllmLora(spec.lora.max_cpu_loras, self._raise_if_dead) if spec.lora else None
        self.adapters = self._lora.slots if self._lora is not None else None

    async def start(self) -> None:
        from starlette.datastructures import State
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as Chat
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.exceptions import VLLMClientError
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        from pools.engine_metrics import BufferedRayStatLogger

        engine_args = build_engine_args(self.spec)
        vllm_config = engine_args.create_engine_config(UsageContext.OPENAI_API_SERVER)
        self.block_size = vllm_config.cache_config.block_size
        self._llm = AsyncLLM.from_vllm_config(
            vllm_config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            # vLLM's own Prometheus series go through Ray's metrics agent on each node
            # (ray_vllm_*, labelled with the Serve ReplicaId; pools.engine_metrics); ours feed
            # routing and status.
            stat_loggers=[self._recorder.factory, BufferedRayStatLogger],
            disable_log_stats=False,
        )
        # what vLLM's serving layer calls, and where it makes each request's detokenizer
        self._llm.generate = trace_generate(self._llm.generate, self.experts)
        processor = self._llm.output_processor
        processor.add_request = continue_on_add_request(processor.add_request,
                                                        processor.request_states)
        frontend = FrontendArgs(enable_prompt_tokens_details=True)
        # set by the engine cores: with data-parallel ranks, vLLM sums their caches; each rank
        # (a routing target) has its own share
        self.kv_blocks = (vllm_config.cache_config.num_gpu_blocks or 0) // self.spec.data
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs  # per rank already
        args = Namespace(**(vars(frontend) | vars(engine_args)))
        state = State()
        tasks = await self._llm.get_supported_tasks()
        await init_app_state(self._llm, state, args, supported_tasks=tasks)
        self._serving = {"completions": state.openai_serving_completion,
                         "chat": state.openai_serving_chat}
        if self._lora is not None:
            self._lora.attach(self._llm, state.openai_serving_models, ErrorResponse)
        self._requests = {"completions": CompletionRequest, "chat": Chat}
        self._error_type = ErrorResponse
        self._client_error = (VLLMClientError,)

    async def reply(self, endpoint: Endpoint, body: dict[str, Any],
                    trace: TokenTrace | None = None, rank: int | None = None,
                    adapter: AdapterRef | None = None) -> AsyncIterator[ReplyHead | bytes]:
        # a rank that does not exist is a router's mistake, not the client's
        if rank is not None and not 0 <= rank < self.spec.data:
            raise EngineError(f"data-parallel rank {rank} does not exist: the engine has "
                              f"{self.spec.data}")
        if adapter is not None:
            if self._lora is None:
                raise EngineError(f"a request for adapter {adapter.name} reached an engine "
                                  "without LoRA (model.lora unset): the gateway routes adapters "
                                  "only to engines that run them")
            failed = await self._lora.use(adapter)
            if failed is not None:
                yield ReplyHead(failed.error.code, streaming=False)
                yield msgspec.json.encode(openai_error(
                    failed.error.code, failed.error.message, "model"))
                return
        unknown = sorted(body.keys() - _field_names(self._requests[endpoint]))
        try:
            if unknown:  # as OpenAI does; vLLM alone would ignore them silently
                message, param = f"Unrecognized request argument supplied: {unknown[0]}", unknown[0]
            else:
                message, param = "", None
                request = self._requests[endpoint].model_validate(body)
        except ValidationError as exc:
            message, param = _validation_message(exc)
        except self._client_error as exc:  # vLLM's own validators raise these past pydantic
            message, param = str(exc), getattr(exc, "parameter", None)
        if message:
            yield ReplyHead(400, streaming=False)
            yield msgspec.json.encode(openai_error(400, message, param))
            return
        serving = self._serving[endpoint]
        TRACE.set(trace)
        RANK.set(rank)
        create = serving.create_completion if endpoint == "completions" \
            else serving.create_chat_completion
        try:
            result = await create(request, raw_request=None)
        except Exception as exc:  # vLLM raises request errors; it maps them to status codes itself
            self._raise_if_dead(exc)
            result = serving.create_error_response(exc)
        async for item in self._translate(result):
            yield item

    async def loaded_adapters(self) -> list[str]:
        """The adapters the engine holds now, by name (a round trip to the engine)."""
        return await self._lora.loaded() if self._lora is not None else []

    async def _translate(self, result: Any) -> AsyncIterator[ReplyHead | bytes]:
        if hasattr(result, "__aiter__"):
            yield ReplyHead(200, streaming=True)
            async for chunk in result:
                if chunk.startswith(_ERROR_EVENT) and self.dead:
                    # vLLM's stream reports its dead engine as an event; the replica fails the
                    # request instead, so the gateway can continue it elsewhere
                    raise EngineDeadError(f"engine for {self.spec.model_name} died mid-stream")
                yield chunk.encode()
            return
        if isinstance(result, self._error_type):  # every error carries all four OpenAI keys
            error = result.error
            yield ReplyHead(error.code, streaming=False)
            yield msgspec.json.encode(openai_error(error.code, error.message, error.param))
            return
        yield ReplyHead(200, streaming=False)
        yield result.model_dump_json().encode()

    @property
    def dead(self) -> bool:
        """The engine process failed (it will not answer again; Serve replaces the replica)."""
        return self._llm is not None and self._llm.errored

    def _raise_if_dead(self, exc: Exception) -> None:
        if self._llm is None or self._llm.errored:
            raise EngineDeadError(f"engine for {self.spec.model_name} died: {exc}") from exc

    async def check_health(self) -> None:
        try:
            await self._llm.check_health()
        except Exception as exc:
            raise EngineDeadError(f"engine health check failed: {exc}") from exc

    def load(self) -> LoadSnapshot:
        return self._recorder.snapshot

    def rank_loads(self) -> list[LoadSnapshot]:
        """Each data-parallel rank's load, in rank order (one entry without data parallelism)."""
        return [load for _, load in sorted(self._recorder.ranks.items())]

    def signals(self) -> ReplicaSignals:
        queued = self._llm.get_num_queued_tokens() if self._llm is not None else 0
        return self._recorder.signals(queued)

    def latency(self) -> Latency:
        return self._recorder.latency()

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
