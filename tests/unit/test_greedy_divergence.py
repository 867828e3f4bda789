"""benchmarks/common/streams.py's comparison of a greedy stream with its uninterrupted reference: a token
may differ only at a near-tie of both runs' logprobs, and nothing else may."""

from __future__ import annotations

from benchmarks.common.streams import NEAR_TIE, Stream, divergence, greedy

USAGE = {"prompt_tokens": 5, "completion_tokens": 3}


def _stream(tokens: list[int], top: list[dict[int, float]], text: str = "abc",
            usage: dict | None = None) -> Stream:
    out = Stream("completions", status=200, text=text, usage=usage or USAGE, done=True)
    out.tokens, out.top = tokens, top
    return out


WANT = _stream([7, 8, 9], [{7: -0.1, 2: -2.0}, {8: -0.5, 4: -0.5 - 1e-7}, {9: -0.2, 3: -1.0}])


def test_the_same_stream_matches() -> None:
    assert divergence(_stream(WANT.tokens, WANT.top), WANT) is None


def test_a_near_tie_may_go_either_way_and_ends_the_comparison() -> None:
    # position 1 is tied to 1e-7 in the reference; here the other token won by as little
    got = _stream([7, 4, 5], [WANT.top[0], {4: -0.5, 8: -0.5 - 2e-7}, {5: -0.3, 9: -0.9}],
                  text="a different text")
    assert divergence(got, WANT) is None


def test_a_token_that_was_not_near_the_top_is_a_divergence() -> None:
    got = _stream([2, 8, 9], [{2: -0.1, 7: -2.0}, *WANT.top[1:]])
    assert divergence(got, WANT) == ("token 0: 2, want 7, not a near-tie "
                                     "(logprob gaps 1.9 there, 1.9 here)")
    # a token missing from the other run's top logprobs is never a near-tie
    got = _stream([5, 8, 9], [{5: -0.1, 7: -0.1 - NEAR_TIE / 2}, *WANT.top[1:]])
    assert divergence(got, WANT).startswith("token 0: 5, want 7, not a near-tie")


def test_a_near_tie_must_hold_in_both_runs() -> None:
    got = _stream([7, 4, 9], [WANT.top[0], {4: -0.1, 8: -0.6}, WANT.top[2]])
    assert "not a near-tie" in divergence(got, WANT)


def test_counts_tokens_and_text_must_agree() -> None:
    assert divergence(_stream(WANT.tokens, WANT.top, usage={**USAGE, "completion_tokens": 4}),
                      WANT).startswith("usage")
    assert divergence(_stream(WANT.tokens[:2], WANT.top[:2]), WANT) == \
        "2 tokens with logprobs, want 3"
    assert divergence(_stream(WANT.tokens, WANT.top, text="abd"), WANT).startswith("text")


def test_greedy_asks_each_endpoint_for_ids_and_top_two() -> None:
    assert greedy("completions", {"prompt": "x"}) == {
        "prompt": "x", "logprobs": 2, "return_tokens_as_token_ids": True}
    assert greedy("chat", {"messages": []}) == {
        "messages": [], "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}


def test_streamed_logprobs_are_read_per_endpoint() -> None:
    completion = Stream("completions")
    completion._logprobs({"logprobs": {"tokens": ["token_id:7", "token_id:8"], "top_logprobs": [
        {"token_id:7": -0.1, "token_id:2": -2.0}, {"token_id:8": -0.5}]}})
    chat = Stream("chat")
    chat._logprobs({"logprobs": {"content": [{"token": "token_id:7", "logprob": -0.1,
                                              "top_logprobs": [{"token": "token_id:7",
                                                                "logprob": -0.1}]}]}})
    chat._logprobs({"delta": {"content": ""}})  # a chunk without logprobs adds nothing
    assert (completion.tokens, completion.top) == ([7, 8], [{7: -0.1, 2: -2.0}, {8: -0.5}])
    assert (chat.tokens, chat.top) == ([7], [{7: -0.1}])
