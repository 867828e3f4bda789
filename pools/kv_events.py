"""Where a replica's engine publishes its KV cache events, and where routers read them.

The engine always publishes, and answers replay requests, on node-local ipc sockets in a
directory only this user can enter. With the `tcp` transport the replica relays both onto its
node's address, and there it speaks ZMQ CURVE: the stream is encrypted, and its ZAP handler admits
only the application's client key (`channel.secret.event_keys`, derived from a secret in the
GCS). A subscriber without that key completes no handshake and receives nothing; the events carry
every tenant's prompt token ids. (vLLM would bind a tcp publisher only on a wildcard address and
without keys; the relay keeps the listener on the one address Ray uses for the node.)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import zmq
from zmq.auth.thread import ThreadAuthenticator

from channel.secret import CurveKeys

logger = logging.getLogger(__name__)

Transport = Literal["ipc", "tcp"]
REPLAY_TIMEOUT_S = 5.0  # an engine that has not finished a replay by then is not waited for
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventEndpoints:
    engine: str  # the engine's publisher (ipc)
    engine_replay: str  # the engine's replay ROUTER (ipc)
    public: str  # what routers subscribe to
    replay: str  # where routers ask for batches they missed


def socket_dir(path: Path) -> Path:
    """Make the ipc sockets' directory, entered by this user only (a socket file's own mode
    is not enough on every system)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user; set TOKENFAB_SOCKET_DIR")
    path.chmod(0o700)
    return path


def engine_endpoints(socket_base: Path) -> KVEventEndpoints:
    """The engine's own endpoints, which ipc routers on the node read directly."""
    engine, replay = f"ipc://{socket_base}.kv", f"ipc://{socket_base}.replay"
    return KVEventEndpoints(engine, replay, engine, replay)


class _OneClient:
    """ZAP credentials provider: the application's client key, nothing else."""

    def __init__(self, client_public: bytes) -> None:
        self._key = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._key


class EventRelay:
    """The engine's ipc stream and replay, served on the node address over CURVE, by one daemon
    thread that sleeps in poll until a batch or a request arrives."""

    def __init__(self, engine: KVEventEndpoints, node_ip: str, keys: CurveKeys) -> None:
        self._engine = engine
        self._context = zmq.Context()
        self._auth = ThreadAuthenticator(self._context, log=logger)
        self._auth.start()
        self._auth.configure_curve_callback("*", _OneClient(keys.client_public))
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(engine.engine)
        self._pub = self._serving(zmq.PUB, keys, node_ip)
        self._router = self._serving(zmq.ROUTER, keys, node_ip)
        self._control = self._context.socket(zmq.PAIR)
        self._control.bind(f"inproc://stop-{id(self)}")
        self._stop = self._context.socket(zmq.PAIR)
        self._stop.connect(f"inproc://stop-{id(self)}")
        self.endpoints = KVEventEndpoints(engine.engine, engine.engine_replay,
                                          self._pub.get_string(zmq.LAST_ENDPOINT),
                                          self._router.get_string(zmq.LAST_ENDPOINT))
        self._thread = threading.Thread(target=self._run, name="kv-event-relay", daemon=True)

    def _serving(self, kind: int, keys: CurveKeys, node_ip: str) -> zmq.Socket[bytes]:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.curve_server = True
        socket.curve_publickey = keys.server_public
        socket.curve_secretkey = keys.server_secret
        if ":" in node_ip:
            socket.setsockopt(zmq.IPV6, 1)
            node_ip = f"[{node_ip}]"
        socket.bind(f"tcp://{node_ip}:*")
        return socket

    def start(self) -> EventRelay:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and close every socket (the replica's process exit does it too)."""
        if self._thread.is_alive():
            self._stop.send(b"")
            self._thread.join(5)
        self._stop.close(linger=0)
        self._auth.stop()
        self._context.destroy(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        for socket in (self._sub, self._router, self._control):
            poller.register(socket, zmq.POLLIN)
        # engine dealer -> (client, deadline)
        replays: dict[zmq.Socket[bytes], tuple[bytes, float]] = {}
        while True:
            timeout = int(1000 * REPLAY_TIMEOUT_S) if replays else None
            ready = dict(poller.poll(timeout))
            if self._control in ready:
                break
            if self._sub in ready:
                for frames in _drain(self._sub):
                    self._pub.send_multipart(frames)
            if self._router in ready:
                for request in _drain(self._router):
                    if len(request) != 3:  # [client, b"", start seq], as the engine expects
                        continue
                    dealer = self._context.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.connect(self._engine.engine_replay)
                    dealer.send_multipart((b"", request[2]))
                    poller.register(dealer, zmq.POLLIN)
                    replays[dealer] = (request[0], time.monotonic() + REPLAY_TIMEOUT_S)
            now = time.monotonic()
            for dealer, (client, deadline) in list(replays.items()):
                done = now > deadline
                if dealer in ready:
                    for reply in _drain(dealer):
                        self._router.send_multipart((client, *reply))
                        done = done or (len(reply) > 2 and reply[2] == END_SEQ)
                if done:
                    poller.unregister(dealer)
                    dealer.close()
                    del replays[dealer]
        for dealer in replays:
            dealer.close()
        for socket in (self._sub, self._pub, self._router, self._control):
            socket.close()


def _drain(socket: zmq.Socket[bytes]) -> list[list[bytes]]:
    messages = []
    while True:
        try:
            messages.append(socket.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return messages
