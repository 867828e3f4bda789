"""The key gateways and replicas prove to each other on the data channel (frames.py), and the
other keys of an application (the cache-salt key of gateway.tenancy, the CURVE keys of the KV
event relays): random, made once per application, kept in Ray's GCS key-value store, which only
processes of the Ray cluster can read.

It never travels in a topology, a Serve config, a log or a label; it survives restarts of
gateways and replicas (the GCS outlives them) and dies with the cluster.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from channel.frames import SECRET_BYTES

NAMESPACE = "tokenfab"


def channel_secret(app: str) -> bytes:
    """The application's channel key, made on first use. Blocking (a GCS round trip): call it
    once at start-up, off any event loop."""
    return cluster_secret(f"channel-secret/{app}")


def cluster_secret(name: str) -> bytes:
    """A random key kept in the GCS under `name`, made by whoever asks first; the same for every
    process of the cluster after that. Blocking (a GCS round trip)."""
    from ray.experimental import internal_kv

    key = name.encode()
    # put-if-absent: whoever comes first decides; everyone then reads the same value
    internal_kv._internal_kv_put(key, secrets.token_bytes(SECRET_BYTES), overwrite=False,
                                 namespace=NAMESPACE)
    value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
    if not value or len(value) != SECRET_BYTES:
        raise RuntimeError(f"secret {name!r} is missing from the GCS")
    return value


@dataclass(frozen=True)
class CurveKeys:
    """ZMQ CURVE keys (Z85) of an application's KV event relays: the relays' server pair, and the
    one client pair their authenticators admit. Whoever can read the GCS can derive them; no one
    else can."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def derive(cls, secret: bytes) -> CurveKeys:
        server = z85.encode(hmac.digest(secret, b"kv-events/server", hashlib.sha256))
        client = z85.encode(hmac.digest(secret, b"kv-events/client", hashlib.sha256))
        return cls(zmq.curve_public(server), server, zmq.curve_public(client), client)


def event_keys(app: str) -> CurveKeys:
    """The application's KV event keys. Blocking (a GCS round trip), like `channel_secret`."""
    return CurveKeys.derive(cluster_secret(f"kv-events/{app}"))
