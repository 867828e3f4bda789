"""Backpressure on one reply: the gateway pauses a reply while its client reads nothing (the
client's HTTP connection holds more than its write buffer's mark) and resumes it when the client
reads again. A paused reply's handler waits in `resumed` instead of writing what nobody reads,
so the bytes stop growing everywhere between the client and the engine: the engine's newer
outputs wait in its own output queue, merged, until the reply resumes or is cancelled.
"""

from __future__ import annotations

import asyncio


class Pausable:
    """The replica's side of one reply's flow (`channel.server.Reply`, `channel.local.LocalReply`).
    Runs on one event loop."""

    __slots__ = ("paused", "_resumed")

    def __init__(self) -> None:
        self.paused = False
        self._resumed: asyncio.Future[None] | None = None

    def pause(self, paused: bool) -> None:
        """As the gateway says: its client stopped (True) or started again (False) reading."""
        self.paused = paused
        if not paused and self._resumed is not None:
            if not self._resumed.done():
                self._resumed.set_result(None)
            self._resumed = None

    async def resumed(self) -> None:
        """Return once the reply may be written again (at once unless it is paused)."""
        while self.paused:
            if self._resumed is None:
                self._resumed = asyncio.get_running_loop().create_future()
            await self._resumed
