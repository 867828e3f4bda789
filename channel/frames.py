"""The channel's wire format: length-prefixed frames, each for one stream of one connection.

    frame   = header payload
    header  = payload length (u32) | stream id (u32) | kind (u8)      network byte order, 9 bytes

Stream 0 is the connection itself (OPEN, CHALLENGE, HELLO, HELD, STATE, ADAPTERS). Each end
proves the application's secret to the other, without sending it, over nonces new for each
connection:

    gateway -> OPEN       its nonce
    replica -> CHALLENGE  its nonce, and `replica_proof` (an HMAC of both nonces and its name)
    gateway -> HELLO      `hello_proof` (an HMAC of both nonces and the gateway's name)

The gateway sends nothing more (no request) to a peer whose proof fails: a process that took a
replica's address, or another replica answering for it, learns no prompt. A proof recorded on one
connection opens no other. Every frame after each end's part of the handshake (the replica's
after its CHALLENGE, the gateway's after its HELLO) travels sealed, under keys of this connection
made from the secret and both nonces (seal.py): no prompt, answer or token id crosses the wire
in the clear, and a changed, replayed or reordered byte closes the connection.

A request's stream id is chosen by the gateway, unique on its connection. Per request, the
replica sends exactly one of:

    REFUSED                            not taken (draining, full): the gateway tries elsewhere
    HEAD (DATA | TOKEN | TOKENS)* (END | FAILED)

While its client reads nothing, the gateway sends PAUSE for a stream, and RESUME when it reads
again: the replica holds the reply meanwhile (channel.flow). DATA and TOKEN payloads are the
reply's bytes exactly as the client gets them (a JSON body, or
whole server-sent events); TOKEN marks bytes that carry generated tokens, so the gateway can time
first tokens and gaps without parsing them. A request that asked to `track_tokens` gets TOKENS
instead of TOKEN: the same bytes together with the ids of the tokens they carry, so that the
gateway knows, at any moment, exactly which tokens its client has (what a migration resumes
from). The other payloads are msgpack arrays (the structs below).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import struct
from collections.abc import Iterator
from enum import IntEnum
from typing import Literal, overload

import msgspec

from channel.seal import Opener, Sealer
from tokenfab.errors import ProtocolError as ProtocolError  # raised as frames.ProtocolError

HEADER = struct.Struct("!IIB")
MAX_PAYLOAD = 64 << 20  # a frame larger than this is a protocol error (request bodies are capped)
MAX_HELLO_PAYLOAD = 4096  # before a peer proves the secret: HELLO is well under this
SECRET_BYTES = 32
NONCE_BYTES = 16
VERSION = 4  # of the handshake: a gateway and a replica of different versions do not talk


class Kind(IntEnum):
    HELLO = 1  # gateway -> replica, stream 0: Hello; the gateway's second frame
    REQUEST = 2  # gateway -> replica: Request
    CANCEL = 3  # gateway -> replica: abort the request (the client went away)
    HELD = 4  # gateway -> replica, stream 0: Held
    HEAD = 5  # replica -> gateway: Head
    DATA = 6  # replica -> gateway: reply bytes
    TOKEN = 7  # replica -> gateway: reply bytes that carry generated tokens
    END = 8  # replica -> gateway: Usage; the reply is complete
    REFUSED = 9  # replica -> gateway: Refused; nothing was started
    FAILED = 10  # replica -> gateway: Failed; the reply broke off (engine failure)
    STATE = 11  # replica -> gateway, stream 0: State
    TOKENS = 12  # replica -> gateway: Tokens (TOKEN with the token ids, for track_tokens)
    CHALLENGE = 13  # replica -> gateway, stream 0: Challenge; the replica's first frame
    OPEN = 14  # gateway -> replica, stream 0: Open; the gateway's first frame
    ADAPTERS = 15  # replica -> gateway, stream 0: Adapters; whenever they change
    PAUSE = 16  # gateway -> replica: hold the reply, its client is not reading (channel.flow)
    RESUME = 17  # gateway -> replica: go on with the reply, its client reads again


class Open(msgspec.Struct, array_like=True, frozen=True):
    nonce: bytes  # the gateway's: NONCE_BYTES random bytes, new for each connection
    version: int = VERSION


class Challenge(msgspec.Struct, array_like=True, frozen=True):
    nonce: bytes  # the replica's: NONCE_BYTES random bytes, new for each connection
    proof: bytes  # replica_proof(secret, the gateway's nonce, nonce, the replica's name)
    version: int = VERSION


class Hello(msgspec.Struct, array_like=True, frozen=True):
    proof: bytes  # hello_proof(secret, the replica's nonce, the gateway's nonce, gateway)
    gateway: str  # who connects, for the replica's logs


def replica_proof(secret: bytes, gateway_nonce: bytes, replica_nonce: bytes,
                  replica: str) -> bytes:
    """What a replica shows for the application's secret on one connection: an HMAC-SHA256 of
    both nonces and the name the gateway knows it by. Nonces are NONCE_BYTES long (`nonce`)."""
    return hmac.digest(secret, b"tokenfab/channel/replica\0" + gateway_nonce + replica_nonce
                       + replica.encode(), hashlib.sha256)


def hello_proof(secret: bytes, replica_nonce: bytes, gateway_nonce: bytes, gateway: str) -> bytes:
    """What a gateway shows for the application's secret on one connection: an HMAC-SHA256 of
    both nonces and its name (under another label than the replica's: neither proof is the
    other's)."""
    return hmac.digest(secret, b"tokenfab/channel/hello\0" + replica_nonce + gateway_nonce
                       + gateway.encode(), hashlib.sha256)


def same_version(said: Open | Challenge, peer: str) -> None:
    """A peer of another handshake version (another tokenfab release) is refused by name: both
    ends of a channel run one release (redeploy the application to upgrade it)."""
    if said.version != VERSION:
        raise ProtocolError(f"the {peer} speaks channel version {said.version}, this end {VERSION}")


def nonce(value: bytes) -> bytes:
    """A peer's nonce, checked: exactly NONCE_BYTES (the proofs join nonces without separators)."""
    if len(value) != NONCE_BYTES:
        raise ProtocolError(f"a nonce of {len(value)} bytes")
    return value


class AdapterRef(msgspec.Struct, array_like=True, frozen=True):
    """A LoRA adapter as engines load it: its name (what the body's `model` says) and its path.
    Engines hash both into the KV blocks' hashes, so a path is one exact string everywhere."""

    name: str
    path: str


class Request(msgspec.Struct, array_like=True, frozen=True):
    endpoint: str  # "completions" or "chat"
    body: bytes  # the OpenAI request body, JSON
    usage_to_client: bool = True  # False: drop the stream's usage chunk, report it in END only
    track_tokens: bool = False  # send TOKENS, not TOKEN: the ids with the bytes that carry them
    # A continuation (None: not one): the tokens this request already generated elsewhere, whose
    # text its client has (possibly none yet). The engine takes them as part of the prompt and
    # generates the rest; the reply leaves out what was already sent (a chat stream's role
    # chunk) and counts usage as one request would.
    resume: tuple[int, ...] | None = None
    rank: int | None = None  # the engine's data-parallel rank to run on (None: it picks)
    adapter: AdapterRef | None = None  # the LoRA adapter the body's `model` names (None: base)


class Head(msgspec.Struct, array_like=True, frozen=True):
    status: int
    streaming: bool
    replica_id: str


class Usage(msgspec.Struct, array_like=True, frozen=True):
    """What a reply cost, from the engine's own usage (zeros for an error reply)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Tokens(msgspec.Struct, array_like=True, frozen=True):
    chunk: bytes  # as in TOKEN
    ids: list[int]  # the generated tokens it carries (possibly several, or none yet displayed)


class Refused(msgspec.Struct, array_like=True, frozen=True):
    reason: str  # "draining", "full", "starting"


class Failed(msgspec.Struct, array_like=True, frozen=True):
    message: str


class Held(msgspec.Struct, array_like=True, frozen=True):
    """Requests this gateway holds for the replica's pool (no replica could take them yet)."""

    count: int


class State(msgspec.Struct, array_like=True, frozen=True):
    state: str  # "ready" or "draining"


class Adapters(msgspec.Struct, array_like=True, frozen=True):
    """The LoRA adapters a replica's engine holds and runs, sent to every gateway as they change
    (a request starts or ends with one, one is loaded), so that each gateway routes by what all
    gateways sent there, not by its own requests alone."""

    held: list[str]  # loaded in the engine, least recently used first
    running: list[dict[str, int]]  # per data-parallel rank (one for one rank): requests in
    # flight per adapter


encode = msgspec.msgpack.Encoder().encode
_decoders = {kind: msgspec.msgpack.Decoder(struct) for kind, struct in (
    (Kind.HELLO, Hello), (Kind.REQUEST, Request), (Kind.HELD, Held), (Kind.HEAD, Head),
    (Kind.END, Usage), (Kind.TOKENS, Tokens), (Kind.REFUSED, Refused), (Kind.FAILED, Failed),
    (Kind.STATE, State), (Kind.CHALLENGE, Challenge), (Kind.OPEN, Open),
    (Kind.ADAPTERS, Adapters))}


@overload
def decode(kind: Literal[Kind.HELLO], payload: bytes) -> Hello: ...
@overload
def decode(kind: Literal[Kind.REQUEST], payload: bytes) -> Request: ...
@overload
def decode(kind: Literal[Kind.HELD], payload: bytes) -> Held: ...
@overload
def decode(kind: Literal[Kind.HEAD], payload: bytes) -> Head: ...
@overload
def decode(kind: Literal[Kind.END], payload: bytes) -> Usage: ...
@overload
def decode(kind: Literal[Kind.TOKENS], payload: bytes) -> Tokens: ...
@overload
def decode(kind: Literal[Kind.REFUSED], payload: bytes) -> Refused: ...
@overload
def decode(kind: Literal[Kind.FAILED], payload: bytes) -> Failed: ...
@overload
def decode(kind: Literal[Kind.STATE], payload: bytes) -> State: ...
@overload
def decode(kind: Literal[Kind.CHALLENGE], payload: bytes) -> Challenge: ...
@overload
def decode(kind: Literal[Kind.OPEN], payload: bytes) -> Open: ...
@overload
def decode(kind: Literal[Kind.ADAPTERS], payload: bytes) -> Adapters: ...
def decode(kind: Kind, payload: bytes) -> msgspec.Struct:
    """The payload of a frame of `kind`, as its struct; ProtocolError if it is not one."""
    try:
        decoded: msgspec.Struct = _decoders[kind].decode(payload)
        return decoded
    except (KeyError, msgspec.DecodeError) as exc:
        raise ProtocolError(f"bad {kind!r} payload: {exc}") from exc


def frame(kind: Kind, stream: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), stream, kind) + payload


class FrameReader:
    """Cuts a byte stream into frames; feed it whatever the socket delivered. Once `opener` is
    set (between frames, when the handshake is done) the bytes after that frame are sealed
    records (seal.py), opened before they are cut."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self._buffer = bytearray()
        self.max_payload = max_payload  # may be raised between frames (after a HELLO)
        self.opener: Opener | None = None

    def feed(self, data: bytes) -> Iterator[tuple[int, int, bytes]]:
        """(kind, stream, payload) of every frame completed by `data`, in order."""
        buffer, opener = self._buffer, self.opener
        buffer += data if opener is None else opener.open(data)
        offset, size = 0, len(buffer)
        try:
            while size - offset >= HEADER.size:
                length, stream, kind = HEADER.unpack_from(buffer, offset)
                if length > self.max_payload:
                    raise ProtocolError(f"frame of {length} bytes")
                end = offset + HEADER.size + length
                if end > size:
                    break
                yield kind, stream, bytes(buffer[offset + HEADER.size:end])
                offset = end
                if opener is not self.opener:  # that frame ended the handshake: sealed from here
                    opener = self.opener
                    assert opener is not None  # set once, never unset
                    rest = bytes(buffer[offset:])
                    del buffer[:]
                    buffer += opener.open(rest)
                    offset, size = 0, len(buffer)
        finally:
            del buffer[:offset]


class FrameWriter:
    """Frames sent during one turn of the event loop leave in one write: the engine answers every
    running request in the same step, so a step of N streams costs one system call, not N (and
    one sealed record, once `seal` was called). Frames sent before there is a transport, or
    after it closed, are dropped."""

    __slots__ = ("transport", "_out", "_scheduled", "_sealer")

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._out = bytearray()
        self._scheduled = False
        self._sealer: Sealer | None = None

    def seal(self, sealer: Sealer) -> None:
        """Seal every frame sent from now on; those sent before leave first, as they are."""
        self._flush()
        self._sealer = sealer

    def send(self, kind: int, stream: int, payload: bytes = b"") -> None:
        self._out += HEADER.pack(len(payload), stream, kind)
        self._out += payload
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        out, self._out = self._out, bytearray()
        if out and self.transport is not None and not self.transport.is_closing():
            self.transport.write(out if self._sealer is None else self._sealer.seal(out))
