"""Follows one replica's KV event stream into the block map, in order, across gaps.

Batches carry the publisher's sequence numbers. A batch that skips ahead (the router joined late,
or the subscription dropped messages) is a gap: the missing batches are fetched from the replica's
replay endpoint and applied first. A batch that cannot be decoded is a gap of one: it may have
removed blocks, so it is fetched again the same way. When batches cannot be fetched, the
replica's entries are cleared: the map may then under-report what is cached there, never
over-report it.

Everything runs on the event loop that owns the map (zmq's asyncio sockets), so the map has one
writer and needs no lock.

Events carry every tenant's prompt token ids. A tcp endpoint is a replica's relay, which speaks
ZMQ CURVE and admits one client key: the stream presents `EventCredentials` there. An ipc endpoint
is node-local, guarded by its directory's permissions, and takes no keys.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from router.events import decode_batch, decode_seq
from router.index import KVBlockIndex, ReplicaId

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class EventCredentials:
    """CURVE keys (Z85) a subscriber presents to the replicas' event relays."""

    server_key: bytes
    public_key: bytes
    secret_key: bytes

    def apply(self, socket: zmq.Socket[Any], endpoint: str) -> None:
        if endpoint.startswith("tcp://"):
            socket.curve_serverkey = self.server_key
            socket.curve_publickey = self.public_key
            socket.curve_secretkey = self.secret_key


@dataclass
class StreamStats:
    batches: int = 0
    gaps_recovered: int = 0
    gaps_cleared: int = 0
    duplicates: int = 0
    malformed: int = 0  # batches that could not be decoded (skipped)
    caught_up: int = 0  # batches applied from the replay buffer when subscribing
    last_lag_s: float = 0.0  # how old the newest batch was when applied (publisher's clock)


class ReplicaEventStream:
    """One replica's subscription. `run` catches up, then applies batches until cancelled."""

    def __init__(self, replica: ReplicaId, endpoint: str, replay_endpoint: str | None,
                 index: KVBlockIndex, context: zmq.asyncio.Context,
                 replay_timeout_s: float = 2.0,
                 credentials: EventCredentials | None = None, rank: int | None = None) -> None:
        self.replica, self.endpoint, self.replay_endpoint = replica, endpoint, replay_endpoint
        self.rank = rank  # a data-parallel rank's stream: its batches must say that rank
        self.stats = StreamStats()
        self._index, self._context, self._replay_timeout_s = index, context, replay_timeout_s
        self._credentials = credentials
        self._next_seq = 0
        self._socket = self._subscribe()

    def _subscribe(self) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.setsockopt(zmq.LINGER, 0)
        if self._credentials is not None:
            self._credentials.apply(socket, self.endpoint)
        socket.connect(self.endpoint)
        return socket

    def resubscribe(self) -> None:
        """Drop the subscription and open a new one (the next batch tells what was missed)."""
        self._socket.close()
        self._socket = self._subscribe()

    def close(self) -> None:
        self._socket.close()

    async def run(self) -> None:
        """Catch up, then follow until cancelled. A bad batch is recovered or, failing that,
        clears the replica; it never stops the stream."""
        try:
            await self.catch_up()
            while True:
                frames = await self._socket.recv_multipart()
                if len(frames) != 3:
                    self.stats.malformed += 1
                    continue
                await self._receive(decode_seq(frames[1]), frames[2])
        finally:
            self.close()

    async def catch_up(self) -> int:
        """Apply what the replica still buffers from before we subscribed (a router that joins
        late, e.g. a new ingress replica). If the oldest batches are gone, the newer ones are
        still exact for the blocks they store. Returns how many batches were applied."""
        replayed = await self._replay(self._next_seq, 2**62) or []
        if not all(self._apply(seq, payload) for seq, payload in replayed):
            self._clear()
            return 0
        self.stats.caught_up += len(replayed)
        return len(replayed)

    async def poll(self, timeout_s: float = 0.0) -> int:
        """Apply every batch that arrives within `timeout_s`; returns how many were applied."""
        applied = 0
        while await self._socket.poll(int(1000 * timeout_s) if applied == 0 else 0):  # POLLIN
            _topic, seq_frame, payload = await self._socket.recv_multipart()
            applied += await self._receive(decode_seq(seq_frame), payload)
        return applied

    async def _receive(self, seq: int, payload: bytes) -> int:
        if seq < self._next_seq:
            self.stats.duplicates += 1
            return 0
        applied = 0
        if seq > self._next_seq:
            applied = await self._recover(self._next_seq, seq)
        if self._apply(seq, payload):
            return applied + 1
        return applied + await self._recover(seq, seq + 1)  # read it again from the replay

    def _apply(self, seq: int, payload: bytes) -> bool:
        """Apply one batch; False, with nothing applied, when it cannot be decoded."""
        try:
            batch = decode_batch(payload)
        except ValueError as exc:  # msgspec's DecodeError
            self.stats.malformed += 1
            logger.warning("replica %s: KV event batch %d cannot be decoded: %s", self.replica,
                           seq, exc)
            return False
        if self.rank is not None and batch.data_parallel_rank != self.rank:
            self.stats.malformed += 1  # the map keys blocks by (replica, rank): never mix them
            logger.warning("replica %s: batch %d is of data-parallel rank %s, not %d", self.replica,
                           seq, batch.data_parallel_rank, self.rank)
            return False
        self._next_seq = seq + 1
        self._index.apply(self.replica, batch)
        self.stats.batches += 1
        self.stats.last_lag_s = max(0.0, time.time() - batch.ts)
        return True

    async def _recover(self, start: int, stop: int) -> int:
        """Apply batches [start, stop) from the replay endpoint, or clear the replica."""
        replayed = await self._replay(start, stop)
        complete = replayed is not None and len(replayed) == stop - start and all(
            seq == start + i for i, (seq, _) in enumerate(replayed))
        if replayed is None or not complete or not all(self._apply(seq, payload)
                                                       for seq, payload in replayed):
            self._clear()
            self._next_seq = stop
            return 0
        self.stats.gaps_recovered += 1
        return len(replayed)

    def _clear(self) -> None:
        logger.warning("replica %s: KV events lost; its block map entries are cleared",
                       self.replica)
        self._index.clear(self.replica)
        self.stats.gaps_cleared += 1

    async def _replay(self, start: int, stop: int) -> list[tuple[int, bytes]] | None:
        if self.replay_endpoint is None:
            return None
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        timeout_ms = int(1000 * self._replay_timeout_s)
        if self._credentials is not None:
            self._credentials.apply(socket, self.replay_endpoint)
        try:
            socket.connect(self.replay_endpoint)
            await socket.send_multipart((b"", start.to_bytes(8, "big")))
            batches: list[tuple[int, bytes]] = []
            while await socket.poll(timeout_ms):  # POLLIN
                _empty, _topic, seq_frame, payload = await socket.recv_multipart()
                if seq_frame == END_SEQ:
                    return batches
                seq = decode_seq(seq_frame)
                if start <= seq < stop:
                    batches.append((seq, payload))
            return None  # no end marker in time: the replica is gone or slow
        finally:
            socket.close()
