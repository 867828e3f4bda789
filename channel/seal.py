"""The channel's encryption: after the handshake (frames.py), each end's bytes travel as sealed
records, AES-256-GCM (the `cryptography` package, over OpenSSL), one key per direction.

    record = ciphertext length (u32, network byte order) | AES-GCM(frames) with its 16-byte tag

- Keys (`keys`): HMAC-SHA256 of the application's secret over a label naming the direction and
  both ends' nonces. Each connection has keys of its own, and the secret never leaves the GCS.
- Nonces: a record's number on its connection and direction (0, 1, 2, ...), never sent. Both
  ends count, so a record dropped, repeated, reordered or moved from another connection fails to
  open, as does any changed byte; the length is authenticated too (the AAD).
- A record holds whatever frames left in one write (frames.FrameWriter), so a step's tokens for
  every stream cost one seal, not one per frame. At most RECORD_BYTES of frames each.

A record that fails to open is a ProtocolError: the connection closes, as for a garbled frame.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tokenfab.errors import ProtocolError

LENGTH = struct.Struct("!I")
NONCE = struct.Struct("!4xQ")  # 12 bytes: 4 zeros, then the record's number
TAG_BYTES = 16
RECORD_BYTES = 1 << 20  # frames per record at most (a larger write is cut into several)


def keys(secret: bytes, gateway_nonce: bytes, replica_nonce: bytes) -> tuple[bytes, bytes]:
    """(gateway to replica, replica to gateway): one connection's 32-byte keys.

    Example: two connections with any nonce different have unrelated keys; the two directions'
    keys differ by their labels."""
    nonces = gateway_nonce + replica_nonce
    return (hmac.digest(secret, b"tokenfab/channel/key/to-replica\0" + nonces, hashlib.sha256),
            hmac.digest(secret, b"tokenfab/channel/key/to-gateway\0" + nonces, hashlib.sha256))


class Sealer:
    """One direction's sending end: frames in, records out."""

    __slots__ = ("_aead", "_sent")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._sent = 0

    def seal(self, plain: bytes | bytearray) -> bytes:
        if len(plain) <= RECORD_BYTES:  # a write is one record, unless it is a large body
            return self._record(plain)
        return b"".join(self._record(plain[start:start + RECORD_BYTES])
                        for start in range(0, len(plain), RECORD_BYTES))

    def _record(self, chunk: bytes | bytearray) -> bytes:
        length = LENGTH.pack(len(chunk) + TAG_BYTES)
        sealed = self._aead.encrypt(NONCE.pack(self._sent), chunk, length)
        self._sent += 1
        return length + sealed


class Opener:
    """One direction's receiving end: bytes as the socket delivers them in, frames' bytes out."""

    __slots__ = ("_aead", "_opened", "_buffer")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._opened = 0
        self._buffer = bytearray()

    def open(self, data: bytes) -> bytes:
        """The plaintext of every record `data` completes, in order (b"" while none is whole)."""
        buffer = self._buffer
        if buffer:
            buffer += data
            data = bytes(buffer)
            del buffer[:]
        view, out, offset = memoryview(data), [], 0
        while len(data) - offset >= LENGTH.size:
            (length,) = LENGTH.unpack_from(data, offset)
            if not TAG_BYTES <= length <= RECORD_BYTES + TAG_BYTES:
                raise ProtocolError(f"a sealed record of {length} bytes")
            end = offset + LENGTH.size + length
            if end > len(data):
                break
            try:
                out.append(self._aead.decrypt(NONCE.pack(self._opened),
                                              view[offset + LENGTH.size:end],
                                              view[offset:offset + LENGTH.size]))
            except InvalidTag:
                raise ProtocolError(f"record {self._opened} failed to open") from None
            self._opened += 1
            offset = end
        buffer += view[offset:]
        return out[0] if len(out) == 1 else b"".join(out)
