"""The parts of mid-stream migration below the gateway's flow (tests/unit/test_flows.py has the
flow; tests/integration/test_migration.py kills real engines): which requests can be continued,
the continuation's body, the replica's reading of a resumed stream, and the engine adapter's
resumed prompt and token trace."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from vllm import SamplingParams

from channel.flow import Pausable
from channel.frames import Request, Usage
from orchestrator.gateway.migration import continuation_body, not_resumable
from pools.engine import ReplyHead, TokenTrace
from pools.usage import StreamMeter
from pools.tiny_model import _hf_tokenizer
from pools.vllm_compat import (_resumed, continue_detokenizer, continue_on_add_request,
                               trace_generate)
from tokenfab.errors import EngineDeadError

STREAM = {"model": "tiny", "prompt": "x", "stream": True}


@pytest.mark.parametrize("endpoint, body, reason", [
    ("completions", STREAM, None),
    ("completions", STREAM | {"prompt": [1, 2, 3], "temperature": 0.7, "seed": 3}, None),
    ("completions", STREAM | {"prompt": ["only one"]}, None),
    ("chat", {"messages": [], "stream": True, "tools": [{}], "tool_choice": "none"}, None),
    ("completions", STREAM | {"stream": False}, "not a stream"),
    ("completions", STREAM | {"n": 2}, "several choices"),
    ("completions", STREAM | {"best_of": 3}, "several choices"),
    ("completions", STREAM | {"use_beam_search": True}, "beam search"),
    ("completions", STREAM | {"stop": "."}, "stop strings"),
    ("chat", {"messages": [], "stream": True, "stop": ["\n"]}, "stop strings"),
    ("completions", STREAM | {"prompt": ["a", "b"]}, "several prompts"),
    ("completions", STREAM | {"prompt_embeds": "..."}, "prompt embeddings"),
    ("chat", {"messages": [], "stream": True, "tools": [{}]}, "tools"),
])
def test_which_streams_can_be_continued(endpoint: str, body: dict, reason: str | None) -> None:
    assert not_resumable(endpoint, body) == reason


def test_a_continuation_does_not_send_again_what_the_client_has() -> None:
    body = STREAM | {"echo": True, "prompt_logprobs": 1, "logprobs": 2,
                     "kv_transfer_params": {"do_remote_prefill": True}, "max_tokens": 9}
    assert continuation_body(body) == STREAM | {"logprobs": 2, "max_tokens": 9}


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


USAGE = {"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35,
         "prompt_tokens_details": {"cached_tokens": 28}}


def test_a_resumed_chat_stream_drops_its_role_chunk_and_counts_usage_as_one_request() -> None:
    """The engine took the 20 tokens generated before as prompt: 30 prompt tokens are 10 of the
    request's own and 20 of completion, and of its 28 cached, only the 10 are the prompt's."""
    meter = StreamMeter(keep_usage=True, resumed=20)
    role = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert meter.feed(role) == (b"", False)
    content = _event({"choices": [{"index": 0, "delta": {"content": "hi"}}]})
    assert meter.feed(content) == (content, True)
    chunk, token = meter.feed(_event({"choices": [], "usage": USAGE}))
    assert not token and json.loads(chunk.removeprefix(b"data: "))["usage"] == {
        "prompt_tokens": 10, "completion_tokens": 25, "total_tokens": 35,
        "prompt_tokens_details": {"cached_tokens": 10}}
    assert meter.usage == Usage(10, 25, 10)


def test_a_stream_continued_from_no_tokens_still_drops_its_role_chunk() -> None:
    meter = StreamMeter(keep_usage=False, resumed=0)
    role = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert meter.feed(role) == (b"", False)
    meter.feed(_event({"choices": [], "usage": USAGE}))
    assert meter.usage == Usage(30, 5, 28)  # nothing to shift


def test_a_resumed_stream_shifts_continuous_usage_and_hidden_usage_too() -> None:
    meter = StreamMeter(keep_usage=False, resumed=20)
    chunk, token = meter.feed(_event({"choices": [{"index": 0, "text": "a"}], "usage": USAGE}))
    assert token and json.loads(chunk.removeprefix(b"data: "))["usage"]["completion_tokens"] == 25
    assert meter.feed(_event({"choices": [], "usage": USAGE})) == (b"", False)  # not asked for
    assert meter.usage == Usage(10, 25, 10)


def test_a_stream_that_is_not_resumed_is_relayed_byte_for_byte() -> None:
    meter = StreamMeter(keep_usage=True)
    role = _event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    final = _event({"choices": [], "usage": USAGE})
    assert meter.feed(role) == (role, False) and meter.feed(final) == (final, False)
    assert meter.usage == Usage(30, 5, 28)


def test_a_resumed_prompt_is_the_rendered_prompt_then_the_tokens_generated_before() -> None:
    prompt = {"type": "token", "prompt_token_ids": [1, 2, 3], "prompt": "a b c",
              "prompt_token_offsets": [(0, 1)], "cache_salt": "tenant"}
    params = SamplingParams(max_tokens=10, min_tokens=4, temperature=0)
    resumed, left = _resumed(prompt, params, (7, 8, 9))
    assert resumed == {"type": "token", "prompt_token_ids": [1, 2, 3, 7, 8, 9],
                       "cache_salt": "tenant"}
    assert (left.max_tokens, left.min_tokens, left.temperature) == (7, 1, 0)
    assert (params.max_tokens, prompt["prompt_token_ids"]) == (10, [1, 2, 3])  # not changed


@pytest.mark.parametrize("prompt, max_tokens, message", [
    ({"type": "embeds", "prompt_embeds": None}, 10, "only a prompt of token ids"),
    ({"type": "token", "prompt_token_ids": [1]}, 3, "no tokens left"),
])
def test_a_prompt_that_cannot_be_resumed_is_refused(prompt: dict, max_tokens: int,
                                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _resumed(prompt, SamplingParams(max_tokens=max_tokens), (7, 8, 9))


def test_the_trace_sees_each_output_before_the_serving_layer() -> None:
    calls, closed = [], []

    def generate(prompt, params, request_id, **kwargs):
        calls.append((prompt, params.max_tokens, request_id, kwargs))

        async def outputs():
            try:
                for ids, text in (([5], "a"), ([6], ""), ([7, 9], "b"), ([8], "")):
                    yield SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, text=text)])
            finally:
                closed.append(True)
        return outputs()

    traced = trace_generate(generate)

    async def scenario() -> None:
        from pools import vllm_compat

        plain = generate({"type": "token", "prompt_token_ids": [1]}, SamplingParams(), "a")
        assert type(traced({}, SamplingParams(), "a")) is type(plain)  # untraced: the engine's own
        trace = TokenTrace(resume=(3, 4))
        vllm_compat.TRACE.set(trace)
        outputs = traced({"type": "token", "prompt_token_ids": [1, 2]},
                         SamplingParams(max_tokens=9), "b", priority=1)
        seen = []
        async for _ in outputs:
            seen.append(trace.take())
            if len(seen) == 3:
                break
        await outputs.aclose()
        # every token as it comes, with its text or not (6 is part of a character 7 completes)
        assert seen == [[5], [6], [7, 9]]
        assert closed == [True]  # the engine's generator closed
        assert calls[-1] == ({"type": "token", "prompt_token_ids": [1, 2, 3, 4]}, 7, "b",
                             {"priority": 1})

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def tokenizer():
    return _hf_tokenizer(seed=0)  # the tiny model's byte-level BPE


def _detokenizer(kind: str, tokenizer, prompt: list[int]):
    """vLLM's own detokenizer of a request with this prompt, as its output processor makes it."""
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, SlowIncrementalDetokenizer

    request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, prompt_embeds=None,
                              sampling_params=SamplingParams(max_tokens=64))
    if kind == "fast":
        return FastIncrementalDetokenizer(tokenizer, request)
    return SlowIncrementalDetokenizer(tokenizer, request)


def _steps(detokenizer, ids: list[int]) -> str:
    """The text a streaming client gets for `ids`, one step each, the stream not finished."""
    text = ""
    for token in ids:
        detokenizer.update([token], stop_terminated=False)
        text += detokenizer.get_next_output_text(finished=False, delta=True)
    return text


def _texts(detokenizer, ids: list[int]) -> str:
    """The same, then the stream's end."""
    return _steps(detokenizer, ids) + detokenizer.get_next_output_text(finished=True, delta=True)


def _generated(tokenizer) -> list[int]:
    """Tokens a byte-level model can generate: a 3-byte character split over 3 tokens, bytes
    that make no character (0xC5 0xC5: vLLM sends their ids with no text), plain words."""
    euro = tokenizer.encode(" \u20ac5", add_special_tokens=False)
    c5 = tokenizer.convert_tokens_to_ids("\u00c5")
    assert len(euro) >= 4 and "\ufffd" in tokenizer.decode(euro[:2])
    return tokenizer.encode(" price", add_special_tokens=False) + euro + [c5, c5] + \
        tokenizer.encode(" ok then", add_special_tokens=False)


@pytest.mark.parametrize("kind", ["fast", "slow"])
def test_a_continued_detokenizer_gives_the_text_an_uninterrupted_one_gives(tokenizer,
                                                                          kind: str) -> None:
    """Cut after every token, inside characters too: the text sent before the cut, then the
    continuation's (its prompt the client's then the tokens it has), is the uninterrupted
    stream's text."""
    prompt, generated = tokenizer.encode("The cost", add_special_tokens=False), \
        _generated(tokenizer)
    whole = _texts(_detokenizer(kind, tokenizer, prompt), generated)
    assert whole == tokenizer.decode(generated) and "\u20ac" in whole
    for cut in range(1, len(generated)):
        before = _detokenizer(kind, tokenizer, prompt)
        sent = _steps(before, generated[:cut])
        resumed = _detokenizer(kind, tokenizer, prompt + generated[:cut])
        continue_detokenizer(resumed, prompt + generated[:cut], generated[:cut])
        assert sent + _texts(resumed, generated[cut:]) == whole, cut


def test_vllm_alone_answers_a_prompt_ending_inside_a_character_with_the_prompt(tokenizer) -> None:
    """Why continue_detokenizer exists (vllm-project/vllm#48853): primed with a prompt that ends
    inside a character, the first text is the prompt's text too. When this fails, vLLM fixed it."""
    prompt, generated = tokenizer.encode("The cost", add_special_tokens=False), \
        _generated(tokenizer)
    cut = next(i for i in range(1, len(generated))
               if tokenizer.decode(generated[:i]).endswith("\ufffd"))
    resumed = _detokenizer("fast", tokenizer, prompt + generated[:cut])
    assert _texts(resumed, generated[cut:]).startswith("The cost")


def test_only_a_resumed_request_gets_its_detokenizer_continued(tokenizer) -> None:
    from pools import vllm_compat

    states, added = {}, []

    def add_request(request, prompt, *args):
        added.append(request.request_id)
        states[request.request_id] = SimpleNamespace(
            detokenizer=_detokenizer("fast", tokenizer, request.prompt_token_ids))

    add = continue_on_add_request(add_request, states)
    prompt, generated = tokenizer.encode("The cost", add_special_tokens=False), \
        _generated(tokenizer)
    cut = next(i for i in range(1, len(generated))
               if tokenizer.decode(generated[:i]).endswith("\ufffd"))

    async def scenario() -> tuple[str, str]:
        vllm_compat.TRACE.set(TokenTrace(resume=tuple(generated[:cut])))
        add(SimpleNamespace(request_id="resumed", prompt_token_ids=prompt + generated[:cut]), None)
        vllm_compat.TRACE.set(None)
        add(SimpleNamespace(request_id="new", prompt_token_ids=prompt), None)
        return (_texts(states["resumed"].detokenizer, generated[cut:]),
                _texts(states["new"].detokenizer, generated))

    resumed, new = asyncio.run(scenario())
    assert added == ["resumed", "new"]
    assert new == tokenizer.decode(generated)  # not primed again: vLLM's own, uninterrupted
    sent = _steps(_detokenizer("fast", tokenizer, prompt), generated[:cut])
    assert sent + resumed == new  # primed again: goes on from what the client has


class _Recorder(Pausable):
    """A channel reply that keeps what the replica sent."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, bytes, list[int] | None]] = []

    def head(self, status: int, streaming: bool, replica_id: str) -> None:
        self.sent.append(("head", b"", None))

    def data(self, chunk: bytes, token: bool = False) -> None:
        self.sent.append(("data", chunk, None))

    def tokens(self, chunk: bytes, ids: list[int]) -> None:
        self.sent.append(("tokens", chunk, ids))

    def end(self, usage) -> None:
        self.sent.append(("end", b"", None))


def _chunk(token: int, text: str) -> bytes:
    return (b'data: {"id":"c","choices":[{"index":0,"text":"%s","logprobs":{"tokens":'
            b'["token_id:%d"]}}]}\n\n' % (text.encode(), token))


class _Engine:
    """Streams one chunk per step, adding each step to the trace first, as vllm_engine does;
    `fail_after` steps, it dies."""

    def __init__(self, steps: list[tuple[int, str]], fail_after: int | None = None) -> None:
        self.steps, self.fail_after = steps, fail_after

    async def reply(self, endpoint, body, trace, rank, adapter=None):
        yield ReplyHead(200, streaming=True)
        for n, (token, text) in enumerate(self.steps):
            if n == self.fail_after:
                raise EngineDeadError("engine died")
            trace.add([token])
            yield _chunk(token, text)
        yield b"data: [DONE]\n\n"


def _serve(engine: _Engine, body: bytes = b'{"prompt": [1], "stream": true, "logprobs": 0}'
           ) -> tuple[list, BaseException | None]:
    from pools.deployment import PoolReplica

    class Bare(PoolReplica):  # no engine started, none to stop
        def __del__(self) -> None:
            pass

    replica = Bare.__new__(Bare)
    replica._engine, replica._replica_id, replica._rank_in_flight = engine, "r1", []
    replica._board = None
    reply, error = _Recorder(), None
    request = Request("completions", body, track_tokens=True)
    try:
        asyncio.run(replica.serve(request, reply))
    except EngineDeadError as exc:
        error = exc
    return [(kind, ids) if kind == "tokens" else kind for kind, _, ids in reply.sent], error


def test_a_tokens_chunk_goes_out_at_once_with_its_ids_text_or_not() -> None:
    """6 and 7 are parts of a character that 8 completes: their chunks (their logprobs, no text)
    reach the gateway as they come, as vLLM's own server sends them, with their ids."""
    steps = [(5, "a"), (6, ""), (7, ""), (8, "b")]
    for body in (b'{"prompt": [1], "stream": true, "logprobs": 0}',
                 b'{"prompt": [1], "stream": true}'):
        sent, error = _serve(_Engine(steps), body)
        assert error is None
        assert sent == ["head", ("tokens", [5]), ("tokens", [6]), ("tokens", [7]),
                        ("tokens", [8]), "data", "end"]


def test_the_client_has_a_part_character_token_sent_before_the_engine_died() -> None:
    """The engine dies after 6 (part of a character): the gateway counts 5 and 6 as the
    client's, so the continuation starts after 6 and repeats none of them."""
    sent, error = _serve(_Engine([(5, "a"), (6, ""), (7, "b")], fail_after=2))
    assert isinstance(error, EngineDeadError)
    assert sent == ["head", ("tokens", [5]), ("tokens", [6])]
