"""What a reply cost and where its tokens are, read from the engine's own OpenAI output.

Streams always ask the engine for a final usage chunk (`stream_options.include_usage`); when the
client did not ask for it, the replica drops that chunk before it leaves, so the client sees what
it asked for and the gateway still learns the usage.

A resumed stream (a request continued here after another replica failed mid-stream) is read the
same way, with two corrections that make it look like one uninterrupted reply: a chat stream's
opening role chunk is dropped (the client has it), and the tokens generated before, which the
engine counted as prompt, are counted as completion.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from channel.frames import Usage


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None

    def wire(self, resumed: int = 0) -> Usage:
        details = self.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details is not None else 0
        prompt = self.prompt_tokens - resumed
        return Usage(prompt, self.completion_tokens + resumed, min(cached, prompt))


class _Delta(msgspec.Struct):
    role: str | None | UnsetType = UNSET
    content: str | None | UnsetType = UNSET


class _Choice(msgspec.Struct):
    text: str | None | UnsetType = UNSET
    delta: _Delta | None | UnsetType = UNSET


class _Reply(msgspec.Struct):
    usage: _Usage | None = None
    choices: list[_Choice] | None = None


_decoder = msgspec.json.Decoder(_Reply)


def usage_of(payload: bytes) -> Usage:
    """The usage of a whole (non-streamed) reply; zeros for an error or an unreadable body."""
    try:
        usage = _decoder.decode(payload).usage
    except msgspec.DecodeError:
        return Usage()
    return usage.wire() if usage is not None else Usage()


def with_stream_usage(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body to give the engine, and whether the client wants the usage chunk itself."""
    options = body.get("stream_options")
    wanted = isinstance(options, dict) and options.get("include_usage") is True
    if not body.get("stream") or wanted or (options is not None and not isinstance(options, dict)):
        return body, wanted  # not a stream, already asking, or malformed: the engine says so
    return body | {"stream_options": {**(options or {}), "include_usage": True}}, False


class StreamMeter:
    """Reads one stream's server-sent events as they pass: which carry tokens, and the usage.
    `resumed`: for a resumed stream, the number of tokens its engine took as prompt (see above);
    None for any other."""

    __slots__ = ("_keep_usage", "_continued", "_resumed", "usage")

    def __init__(self, keep_usage: bool, resumed: int | None = None) -> None:
        self._keep_usage, self._continued = keep_usage, resumed is not None
        self._resumed = resumed or 0
        self.usage = Usage()

    def feed(self, item: bytes) -> tuple[bytes, bool]:
        """(the bytes to relay, possibly empty; whether they carry generated tokens) for what
        the engine's stream yielded: one event `data: ...\\n\\n`, or several."""
        if item.count(b"\n\n") <= 1:
            return self.event(item)
        relayed, tokens = [], False
        for part in item.split(b"\n\n"):
            if part.strip():
                chunk, token = self.event(part + b"\n\n")
                relayed.append(chunk)
                tokens = tokens or token
        return b"".join(relayed), tokens

    def event(self, event: bytes) -> tuple[bytes, bool]:
        """The same for one event."""
        data = event[6:] if event.startswith(b"data: ") else event
        if data.startswith(b"[DONE]"):
            return event, False
        try:
            reply = _decoder.decode(data)
        except msgspec.DecodeError:
            return event, False  # not ours to judge: relay as is
        choices = reply.choices or ()
        if reply.usage is not None:
            self.usage = reply.usage.wire(self._resumed)
            if not choices:  # the final usage chunk
                return (self._relayed_usage(event, data) if self._keep_usage else b""), False
            event = self._relayed_usage(event, data)  # continuous usage stats
        if self._continued and any(_opens_chat(choice) for choice in choices):
            return b"", False
        return event, any(_has_token(choice) for choice in choices)

    def _relayed_usage(self, event: bytes, data: bytes) -> bytes:
        if not self._resumed:
            return event
        reply = msgspec.json.decode(data)
        usage = reply["usage"]
        usage["prompt_tokens"] -= self._resumed
        usage["completion_tokens"] += self._resumed
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and details.get("cached_tokens"):
            details["cached_tokens"] = min(details["cached_tokens"], usage["prompt_tokens"])
        return b"data: " + msgspec.json.encode(reply) + b"\n\n"


def _opens_chat(choice: _Choice) -> bool:
    """A chat stream's first chunk: the role, and no content."""
    delta = choice.delta
    return isinstance(delta, _Delta) and isinstance(delta.role, str) and not delta.content


def _has_token(choice: _Choice) -> bool:
    """A chunk carrying generated tokens: a completion choice, or a chat delta other than the
    role-only first chunk of a chat stream. (Its text may be empty: a token can be part of a
    character that the next token completes.)"""
    if choice.text is not UNSET:
        return True
    delta = choice.delta
    return isinstance(delta, _Delta) and delta.role is UNSET
