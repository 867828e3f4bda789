"""Mid-stream migration: a stream whose replica failed after tokens reached the client goes on,
on another replica, from exactly the tokens the client has.

A stream that can be continued is sent with `track_tokens`: every frame that carries tokens
brings their ids (channel.frames.Tokens), so the gateway always knows which tokens its client
has. When the replica fails, the gateway sends a continuation to another replica: the same
body, with `resume` set to those ids. The engine there takes them as part of the prompt and
generates what is left of `max_tokens`; its reply leaves out what the client already has and
counts usage as one request would (pools.usage). The client sees one stream.

What the continuation cannot reproduce ends in-stream, as it would without migration:
- several choices (`n` or `best_of` over 1, several prompts), beam search: the ids are one
  choice's;
- stop strings: vLLM holds back text that could begin one, so the client has less text than its
  tokens carry, and the held text would be lost;
- tools: the tool-call parser is part-way through the reply.

Sampling continues with the same settings. Greedy requests continue with the tokens an
uninterrupted run gives, as far as the engine's arithmetic is the same for a prompt computed at
once and for tokens computed one by one. A seeded request continues with a new draw from its seed
(vLLM starts a request's generator at its seed), and frequency and presence penalties count only
the tokens generated after the migration.
"""

from __future__ import annotations

from typing import Any

_NOT_CONTINUED = ("echo", "prompt_logprobs", "kv_transfer_params")


def not_resumable(endpoint: str, body: dict[str, Any]) -> str | None:
    """Why the stream of this request could not be continued elsewhere; None if it can."""
    if not body.get("stream"):
        return "not a stream"
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        return "several choices"
    if body.get("use_beam_search"):
        return "beam search"
    if body.get("stop"):
        return "stop strings"
    prompt = body.get("prompt")
    if endpoint == "completions" and isinstance(prompt, list) and len(prompt) > 1 \
            and not isinstance(prompt[0], int):
        return "several prompts"
    if body.get("prompt_embeds") is not None:
        return "prompt embeddings"
    if endpoint == "chat" and body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    return None


def continuation_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body a continuation is sent with: what the client already got is not sent again (the
    echoed prompt, prompt logprobs), and a P/D prefill's KV is not pulled again (it may be gone:
    the decode replica recomputes)."""
    return {key: value for key, value in body.items() if key not in _NOT_CONTINUED}
