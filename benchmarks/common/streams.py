"""Streamed requests as a client sees them, and greedy outputs compared up to near-ties.

Used by the soak (benchmarks/soak.py) and the migration tests: a stream's text, usage, chunk ids
and, with `greedy`, each token's id and top-2 logprobs; `divergence` says why two runs of the same
greedy request differ, or None where they agree up to a near-tie.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


# --- One streamed request, as a client sees it ------------------------------------------------

@dataclass
class Stream:
    """What the client got for one streamed request."""

    endpoint: str
    status: int = 0
    text: str = ""
    usage: dict[str, Any] | None = None
    chunk_ids: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    done: bool = False  # the stream ended with `data: [DONE]`
    replica: str = ""
    sent: float = 0.0
    first_token: float | None = None
    finished: float = 0.0
    tokens: list[int] = field(default_factory=list)  # with logprobs asked (see `greedy`)
    top: list[dict[int, float]] = field(default_factory=list)  # each token's top logprobs

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.errors

    def answer(self) -> tuple[str, int | None, int | None]:
        """The text and the token counts."""
        usage = self.usage or {}
        return self.text, usage.get("prompt_tokens"), usage.get("completion_tokens")

    def _logprobs(self, choice: dict[str, Any]) -> None:
        logprobs = choice.get("logprobs") or {}
        if self.endpoint == "completions":
            pairs = zip(logprobs.get("tokens") or (), logprobs.get("top_logprobs") or ())
        else:
            pairs = ((c["token"], {t["token"]: t["logprob"] for t in c["top_logprobs"]})
                     for c in logprobs.get("content") or ())
        for token, top in pairs:
            self.tokens.append(_token_id(token))
            self.top.append({_token_id(t): logprob for t, logprob in top.items()})


# Greedy decoding is defined up to the engine's arithmetic: a prompt computed at once, a cached
# prefix, another batch, all change the last bits of the logits, and where two tokens' logprobs
# are that close either may be picked (the random tiny model has such near-ties, even in
# float32: benchmarks/resume_identity.py). Measured between such paths in float32: under 1e-6.
NEAR_TIE = 1e-3


def greedy(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """`body` asking for each token's id and top-2 logprobs, which `divergence` compares."""
    asked = {"logprobs": 2} if endpoint == "completions" else {"logprobs": True, "top_logprobs": 2}
    return body | asked | {"return_tokens_as_token_ids": True}


def divergence(got: Stream, want: Stream, tolerance: float = NEAR_TIE) -> str | None:
    """Why `got` is not what `want` (the same greedy request, uninterrupted) gave; None if it is.

    The same token counts; the same tokens up to the first that differs, where the two tokens
    must be a near-tie in both runs (each within `tolerance` of the other in the other's top
    logprobs), after which greedy decoding follows another path; and with no such token, the
    same text. Without logprobs (not asked with `greedy`), the same text.
    """
    if got.answer()[1:] != want.answer()[1:]:
        return f"usage {got.answer()[1:]}, want {want.answer()[1:]}"
    if len(got.tokens) != len(want.tokens):
        return f"{len(got.tokens)} tokens with logprobs, want {len(want.tokens)}"
    for i, (mine, theirs) in enumerate(zip(got.tokens, want.tokens)):
        if mine != theirs:
            gap = (want.top[i].get(theirs, math.inf) - want.top[i].get(mine, -math.inf),
                   got.top[i].get(mine, math.inf) - got.top[i].get(theirs, -math.inf))
            if max(gap) <= tolerance:
                return None
            return (f"token {i}: {mine}, want {theirs}, not a near-tie "
                    f"(logprob gaps {gap[0]:.3g} there, {gap[1]:.3g} here)")
    if got.text == want.text:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got.text, want.text)) if a != b),
              min(len(got.text), len(want.text)))
    return (f"text differs at character {at} of {len(got.text)} (want {len(want.text)}): "
            f"{got.text[max(0, at - 30):at + 50]!r}, want {want.text[max(0, at - 30):at + 50]!r}")


def _token_id(token: str) -> int:
    """A token as vLLM names it with `return_tokens_as_token_ids`: "token_id:42"."""
    return int(token.removeprefix("token_id:"))


async def stream(client: httpx.AsyncClient, endpoint: str, body: dict[str, Any]) -> Stream:
    """Send one streamed request and read it to its end."""
    out = Stream(endpoint, sent=time.monotonic())
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    try:
        async with client.stream("POST", path, json=body) as response:
            out.status, out.replica = response.status_code, response.headers.get(
                "x-tokenfab-replica", "")
            if out.status != 200:
                out.errors.append((await response.aread()).decode(errors="replace")[:300])
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.errors.append(json.dumps(chunk["error"])[:300])
                    continue
                out.chunk_ids.add(chunk.get("id", ""))
                if chunk.get("usage"):
                    out.usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    out._logprobs(choice)
                    piece = choice.get("text") if endpoint == "completions" \
                        else (choice.get("delta") or {}).get("content")
                    if piece is None:
                        continue
                    if out.first_token is None:
                        out.first_token = time.monotonic()
                    out.text += piece
    except httpx.HTTPError as exc:
        out.errors.append(repr(exc))
    finally:
        out.finished = time.monotonic()
    return out
