"""What a reply cost: token usage read from the engine's own reply, and the timing of a stream.

Streams always ask the engine for a final usage chunk (`stream_options.include_usage`); when the
client did not ask for it, the gateway drops that chunk before relaying, so the client sees what
it asked for and the gateway still learns the usage.
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None

    @property
    def cached_tokens(self) -> int:
        details = self.prompt_tokens_details
        return (details.cached_tokens or 0) if details is not None else 0


class _Reply(msgspec.Struct):
    usage: Usage | None = None
    choices: list[Any] | None = None


_decoder = msgspec.json.Decoder(_Reply)


def usage_of(payload: bytes) -> Usage | None:
    """The usage of a non-streamed reply (None for an error or an unreadable body)."""
    try:
        return _decoder.decode(payload).usage
    except msgspec.DecodeError:
        return None


def request_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body to send for a streamed request, and whether the client asked for usage."""
    options = body.get("stream_options")
    wanted = isinstance(options, dict) and options.get("include_usage") is True
    if not body.get("stream") or wanted or (options is not None and not isinstance(options, dict)):
        return body, wanted  # not a stream, already asking, or malformed: the engine says so
    return body | {"stream_options": {**(options or {}), "include_usage": True}}, False


class StreamMeter:
    """Watches the server-sent events of one stream: first-token time, gaps between tokens, and
    the usage chunk (dropped unless the client asked for it)."""

    def __init__(self, started: float, client_wants_usage: bool) -> None:
        self.started, self._keep_usage = started, client_wants_usage
        self._last: float | None = None
        self.first_token_s: float | None = None
        self.gaps: list[float] = []
        self.usage: Usage | None = None

    def feed(self, item: bytes, now: float) -> bytes:
        """The bytes to relay for one item of the stream (possibly empty)."""
        out = []
        for event in item.split(b"\n\n"):
            if not event.strip():
                continue
            keep = self._event(event.removeprefix(b"data: ").strip(), now)
            if keep:
                out.append(event + b"\n\n")
        return b"".join(out)

    def _event(self, data: bytes, now: float) -> bool:
        if data == b"[DONE]":
            return True
        try:
            reply = _decoder.decode(data)
        except msgspec.DecodeError:
            return True  # not ours to judge: relay as is
        if reply.usage is not None and not reply.choices:
            self.usage = reply.usage
            return self._keep_usage
        if reply.usage is not None:
            self.usage = reply.usage
        if any(_has_token(choice) for choice in reply.choices or ()):
            if self._last is None:
                self.first_token_s = now - self.started
            else:
                self.gaps.append(now - self._last)
            self._last = now
        return True


def _has_token(choice: Any) -> bool:
    """A chunk carrying generated tokens: a completion choice, or a chat delta other than the
    role-only first chunk of a chat stream. (Its text may be empty: a token can be part of a
    character that the next token completes.)"""
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return "text" in choice or (isinstance(delta, dict) and "role" not in delta)
