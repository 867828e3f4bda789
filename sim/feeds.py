"""What a simulated replay sends: requests with arrival times set beforehand (`Fixed`, an open
loop), or chat users who send each turn after the answer it follows (`Closed`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from sim.engine import SimRequest
from sim.loop import EventLoop
from sim.users import Shape, Users


class Feed(Protocol):
    """What a replay sends: `start` hands requests to `submit` (now or later); `finished` hears
    of each that ends; `sent` lists every request sent so far; `rate_rps` is the load sent."""

    sent: list[SimRequest]

    def start(self, loop: EventLoop, submit: Callable[[list[SimRequest]], None]) -> None: ...

    def finished(self, request: SimRequest) -> None: ...

    @property
    def rate_rps(self) -> float: ...


class Fixed:
    """Requests whose arrival times are set before the replay (an open loop)."""

    def __init__(self, requests: list[SimRequest], rate_rps: float) -> None:
        self.sent, self.rate_rps = requests, rate_rps

    def start(self, loop: EventLoop, submit: Callable[[list[SimRequest]], None]) -> None:
        submit(self.sent)

    def finished(self, request: SimRequest) -> None:
        pass


class Closed:
    """`count` chat users (sim.users.Users): each turn sent after the answer it follows."""

    def __init__(self, count: int, shape: Shape, system_prompts: int, seed: int) -> None:
        self._count, self._shape, self._prompts, self._seed = count, shape, system_prompts, seed
        self._users: Users | None = None
        self.sent: list[SimRequest] = []

    def start(self, loop: EventLoop, submit: Callable[[list[SimRequest]], None]) -> None:
        self._users = Users(loop, self._count, self._shape, self._prompts,
                            lambda request: submit([request]), self._seed)
        self.sent = self._users.sent

    def finished(self, request: SimRequest) -> None:
        assert self._users is not None  # started before anything could finish
        self._users.finished(request)

    @property
    def rate_rps(self) -> float:
        return len(self.sent) / self._shape.window_s
