"""Every patch tokenfab makes to vLLM's internals, and the vLLM versions they were written for.

- `trace_generate`: `AsyncLLM.generate` as the serving layer calls it, with each request's
  data-parallel rank and TokenTrace (migration resumes, usage, expert counts).
- `continue_on_add_request` / `continue_detokenizer`: a resumed request's detokenizer continued
  (`OutputProcessor.add_request`, vLLM's incremental detokenizers).
- `register_rank_event_endpoints`: a vLLM general plugin giving each data-parallel rank its own
  ipc KV event socket (`ZmqEventPublisher.offset_endpoint_port`).

Each is applied after `require` accepted the installed vLLM; tests/unit/test_compat.py checks the
shape of everything patched here in the installed version.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextvars import ContextVar
from functools import cache
from typing import TYPE_CHECKING, Any

from pools.engine import TokenTrace
from tokenfab.compat import require as _require_version

if TYPE_CHECKING:
    from pools.vllm_engine import ExpertLoad

VLLM_VERSIONS = ("0.32.0",)


@cache  # once per process and patch
def require(patch: str) -> None:
    import vllm

    _require_version("vLLM", vllm.__version__, VLLM_VERSIONS, patch)


# The trace and the data-parallel rank of the request being served, seen by `trace_generate`
# below the serving layer. Each request runs in a task of its own (the channel's, or Serve's),
# so a value set there is its own.
TRACE: ContextVar[TokenTrace | None] = ContextVar("tokenfab_token_trace", default=None)
RANK: ContextVar[int | None] = ContextVar("tokenfab_dp_rank", default=None)


def continue_detokenizer(detokenizer: Any, prompt_token_ids: Sequence[int],
                         resume: Sequence[int]) -> None:
    """Make the detokenizer of a resumed request (its prompt: the client's, then `resume`) the
    one the original request had after generating `resume`: primed with the client's prompt,
    then stepped through those tokens as if it had generated them. vLLM primes it with both as
    one prompt, and the client holds every token it was sent, the first bytes of a character
    among them; primed with ids that end inside a character, the `tokenizers` DecodeStream
    answers its first step with the whole prompt's text (vllm-project/vllm#48853) and vLLM's
    slow detokenizer drops the character. Example: prompt "price:", resume [" ", the first
    byte of "€"], then the engine generates the character's last bytes: the first text is "€",
    not "price: €"."""
    import tokenizers.decoders
    from vllm.tokenizers.detokenizer_utils import convert_prompt_ids_to_tokens
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, SlowIncrementalDetokenizer

    prompt = list(prompt_token_ids[:len(prompt_token_ids) - len(resume)])
    if isinstance(detokenizer, FastIncrementalDetokenizer):
        detokenizer.stream = tokenizers.decoders.DecodeStream(
            ids=prompt, skip_special_tokens=detokenizer.skip_special_tokens)
        for token in resume:
            detokenizer.decode_next(token)
    elif isinstance(detokenizer, SlowIncrementalDetokenizer):
        detokenizer.tokens, detokenizer.prefix_offset, detokenizer.read_offset = \
            convert_prompt_ids_to_tokens(detokenizer.tokenizer, prompt,
                                         skip_special_tokens=detokenizer.skip_special_tokens)
        del detokenizer.token_ids[len(prompt):]
        for token in resume:  # its update() adds each id before decoding it
            detokenizer.token_ids.append(token)
            detokenizer.decode_next(token)


def continue_on_add_request(add_request: Callable[..., None], states: dict[str, Any]
                ) -> Callable[..., None]:
    """`OutputProcessor.add_request`, which creates a request's detokenizer before the engine
    sees the request: a resumed one (its TokenTrace's `resume`) gets its detokenizer continued
    (continue_detokenizer)."""
    require("OutputProcessor.add_request, a resumed request's detokenizer continued")

    def add(request: Any, *args: Any, **kwargs: Any) -> None:
        add_request(request, *args, **kwargs)
        trace = TRACE.get()
        if trace is None or not trace.resume:
            return
        state = states.get(request.request_id)
        if state is not None and state.detokenizer is not None:
            continue_detokenizer(state.detokenizer, request.prompt_token_ids, trace.resume)

    return add


def trace_generate(generate: Callable[..., AsyncGenerator[Any, None]],
                   experts: ExpertLoad | None = None) -> Callable[..., AsyncIterator[Any]]:
    """`AsyncLLM.generate` as vLLM's serving layer calls it, on the request's data-parallel rank
    (the router's choice; None: the engine's own balancer picks) and with its TokenTrace, which
    sees every output before the serving layer turns it into bytes; `experts` counts the experts
    every request was routed to. Untraced requests of an engine that counts no experts get the
    engine's own generator."""
    require("AsyncLLM.generate, traced with each request's rank and TokenTrace")

    def generate_traced(prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any
                        ) -> AsyncIterator[Any]:
        trace, rank = TRACE.get(), RANK.get()
        if rank is not None:  # what vLLM's server takes from an X-data-parallel-rank header
            kwargs["data_parallel_rank"] = rank
        if trace is None and experts is None:
            return generate(prompt, params, request_id, *args, **kwargs)
        if trace is not None and trace.resume:
            prompt, params = _resumed(prompt, params, trace.resume)
        return _follow(generate(prompt, params, request_id, *args, **kwargs), trace, experts)

    return generate_traced


async def _follow(outputs: AsyncGenerator[Any, None], trace: TokenTrace | None,
                  experts: ExpertLoad | None = None) -> AsyncIterator[Any]:
    try:
        async for output in outputs:  # DELTA outputs: the tokens and text since the last one
            if trace is not None:
                trace.add(output.outputs[0].token_ids)
            if experts is not None and output.finished:
                for each in output.outputs:
                    if getattr(each, "routed_experts", None) is not None:
                        experts.add(each.routed_experts)
            yield output
    finally:
        await outputs.aclose()  # aborts the engine request if the client left


def _resumed(prompt: Any, params: Any, resume: tuple[int, ...]) -> tuple[Any, Any]:
    """The rendered prompt followed by the tokens generated before, and the sampling parameters
    for what is left: the same request, continued."""
    if not isinstance(prompt, dict) or prompt.get("type") != "token":
        raise ValueError("only a prompt of token ids can be resumed")
    params = params.clone()
    params.max_tokens -= len(resume)
    if params.max_tokens < 1:
        raise ValueError("a resumed request has no tokens left to generate")
    if params.min_tokens:
        params.min_tokens = max(0, params.min_tokens - len(resume))
    prompt = {key: value for key, value in prompt.items()
              if key not in ("prompt", "prompt_token_offsets")}  # text no longer matches the ids
    prompt["prompt_token_ids"] = [*prompt["prompt_token_ids"], *resume]
    return prompt, params


def rank_endpoint(endpoint: str, rank: int) -> str:
    """Where rank `rank` publishes when configured with the ipc `endpoint`."""
    return endpoint if rank == 0 else f"{endpoint}_dp{rank}"


def register_rank_event_endpoints() -> None:
    """A vLLM general plugin: KV events of every data-parallel rank on node-local ipc sockets.

    With `data_parallel_size` D, vLLM starts D engine processes and each publishes its own KV
    events; rank R derives its endpoints from the configured ones
    (`ZmqEventPublisher.offset_endpoint_port`): a tcp port + R, an inproc name + `_dp{R}`, and
    for ipc it raises ("must contain 'inproc' or 'tcp'"). tcp would put every tenant's prompt
    token ids on an unauthenticated listener, so tokenfab keeps events on ipc sockets in a
    directory only its user can enter (pools.kv_events), and this plugin gives rank R the ipc
    path + `_dp{R}`, as vLLM names inproc ones (`rank_endpoint` above is what the replica
    subscribes to). Rank 0 keeps the path itself, and tcp and inproc are unchanged. vLLM loads
    the plugin in every engine process (entry point `vllm.general_plugins`).

    Upstream, this would be `offset_endpoint_port` deriving an ipc path per rank, as it does
    for inproc names.
    """
    require("ZmqEventPublisher.offset_endpoint_port, ipc endpoints per data-parallel rank")
    from vllm.distributed.kv_events import ZmqEventPublisher

    original = ZmqEventPublisher.offset_endpoint_port
    if getattr(original, "_tokenfab", False):
        return

    def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
        if endpoint and endpoint.startswith("ipc://"):
            return rank_endpoint(endpoint, data_parallel_rank)
        return original(endpoint, data_parallel_rank)

    # setattr: mypy types neither a function's new attribute nor a class's patched method
    setattr(offset_endpoint_port, "_tokenfab", True)  # noqa: B010
    setattr(ZmqEventPublisher, "offset_endpoint_port",  # noqa: B010
            staticmethod(offset_endpoint_port))
